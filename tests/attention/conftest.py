"""Fixtures for the attention-module tests: every registered kind with its registered option variants (the pi modes
of MGK / sMGK, where MLK mixes), from :func:`mgk.attention.registry.kind_variants`."""
import pytest
import torch

import mgk
from mgk.attention.registry import get_kind, kind_variants, variant_name

E, H, D, MAX_LEN = 16, 2, 8, 64

VARIANTS = kind_variants()


def build_kind(kind, options=None, *, dropout=0.0, seed=0, batch_first=True):
    """The module ``kind`` with option values ``options`` (a dict; a string is taken as the ``pi`` mode of a kind
    that takes one, "learned" for every other), E=16, H=2, D=8, in eval mode; ``max_len`` where the kind takes it;
    mixture weights made non-uniform so they matter."""
    torch.manual_seed(seed)
    if isinstance(options, str):
        options = {"pi": options} if "pi" in get_kind(kind).options.names() else {}
    options = dict(options or {})
    if "max_len" in get_kind(kind).options.names():
        options.setdefault("max_len", MAX_LEN)
    m = mgk.build_attention(kind, E, H, head_dim=D, dropout=dropout, batch_first=batch_first, **options)
    with torch.no_grad():
        if hasattr(m, "pi_logits"):
            m.pi_logits.normal_()
        if getattr(m, "pi_mode", None) == "soft_e":
            m.pi.copy_(torch.softmax(torch.randn_like(m.pi), dim=1))
    return m.eval()


@pytest.fixture(params=VARIANTS, ids=[variant_name(k, v) for k, v in VARIANTS])
def variant(request):
    """(kind, option values) for every registered kind and variant."""
    return request.param


@pytest.fixture
def build():
    """``build(kind, options=None, *, dropout=0.0, seed=0, batch_first=True)``: the module with E=16, H=2, D=8, in
    eval mode."""
    return build_kind
