"""Fixtures for the attention-module tests: every registered kind, and the pi variants of the MGK kinds."""
import pytest
import torch

import mgk

E, H, D, MAX_LEN = 16, 2, 8, 64


def _variants():
    out = []
    for kind in mgk.attention_kinds():
        if kind in ("mgk", "smgk"):
            out += [(kind, pi) for pi in ("learned", "soft_e", "hard_e")]
        else:
            out.append((kind, "learned"))
    return out


VARIANTS = _variants()


def build_kind(kind, pi="learned", *, dropout=0.0, seed=0, batch_first=True):
    """The module ``kind`` with E=16, H=2, D=8, in eval mode; mixture weights made non-uniform so they matter."""
    torch.manual_seed(seed)
    options = {"pi": pi, "max_len": MAX_LEN} if kind in ("mgk", "smgk") else {}  # only options the kind takes
    m = mgk.build_attention(kind, E, H, head_dim=D, dropout=dropout, batch_first=batch_first, **options)
    with torch.no_grad():
        if hasattr(m, "pi_logits"):
            m.pi_logits.normal_()
        if getattr(m, "pi_mode", None) == "soft_e":
            m.pi.copy_(torch.softmax(torch.randn_like(m.pi), dim=1))
    return m.eval()


@pytest.fixture(params=VARIANTS, ids=[f"{k}-{p}" for k, p in VARIANTS])
def variant(request):
    """(kind, pi) for every registered attention kind; mgk/smgk with pi learned, soft_e and hard_e."""
    return request.param


@pytest.fixture
def build():
    """``build(kind, pi="learned", *, dropout=0.0, seed=0, batch_first=True)``: the module with E=16, H=2, D=8, in
    eval mode."""
    return build_kind
