"""MGK's decoding step terms (variances, shifts, prior: mgk.functional.mgk_cache.MGKStepTerms) are made once per cache
and kept while the tensors they come from stay the same: steady steps make none (a step's cost is its tokens'), and
a parameter changed between two steps (in place, replaced, or the model cast) is seen at the next step, exactly as by
a cache that never kept any."""
from __future__ import annotations

import copy

import pytest
import torch

from mgk import build_attention
from mgk.attention.mgk import MGKAttention
from mgk.functional import MGKDecodeState, _mixture_terms

E, H = 16, 2  # head_dim 8, M = 2: tiny


def _layer(keys="separate", **options):
    torch.manual_seed(0)
    return MGKAttention(E, H, keys=keys, num_keys=2, batch_first=True, **options).eval()


def _step(layer, x, cache):
    return layer(x, past_key_values=cache, is_causal=True, need_weights=False)[0]


def _settled(layer, B=2):
    """A cache whose centre is settled (the steady state), and the next token."""
    g = torch.Generator().manual_seed(1)
    cache = layer.new_cache(16)
    with torch.no_grad():
        _step(layer, torch.randn(B, 4, E, generator=g), cache)
        _step(layer, torch.randn(B, 1, E, generator=g), cache)
    return cache, torch.randn(B, 1, E, generator=g)


@pytest.mark.parametrize("keys", ["separate", "shifted"])
def test_steady_steps_make_no_terms(keys, monkeypatch):
    """After the first steady step, further steps call none of the terms' functions (the variances' checks, the
    prior): they cost their tokens only."""
    layer = _layer(keys)
    cache, x = _settled(layer)
    calls = []
    for name in ("variances", "log_prior"):
        real = getattr(_mixture_terms, name)
        monkeypatch.setattr(_mixture_terms, name, lambda *a, _real=real, _name=name, **k: calls.append(_name)
                            or _real(*a, **k))
    with torch.no_grad():
        _step(layer, x, cache)
        calls.clear()
        for _ in range(3):
            _step(layer, x, cache)
    assert calls == []


def _change(layer, how):
    """Change what the step terms come from, as a user or an optimiser would."""
    with torch.no_grad():
        if how == "sigma2 in place":
            layer.sigma2.mul_(1.7)
        elif how == "sigma2 learned":
            layer.log_sigma2.add_(torch.tensor([[0.4, -0.3]]))
        elif how == "shift in place":
            layer.mixture.key_shift.add_(0.8)
        elif how == "pi in place":
            layer.mixture.pi_logits[:, 0] += 1.5
        elif how == "gate":
            layer.mixture.component_gate = torch.tensor([[1.0, 0.25], [0.5, 1.0]])
        elif how == "state dict":
            state = copy.deepcopy(layer.state_dict())
            state["mixture.pi_logits"] = state["mixture.pi_logits"] + torch.tensor([[0.9, -0.4]])
            layer.load_state_dict(state)


@pytest.mark.parametrize("how,keys,options", [
    ("sigma2 in place", "separate", {}),
    ("sigma2 learned", "separate", {"sigma2": "learned"}),
    ("shift in place", "shifted", {}),
    ("pi in place", "separate", {}),
    ("gate", "shifted", {}),
    ("state dict", "separate", {}),
])
def test_a_changed_parameter_is_seen_at_the_next_step(how, keys, options):
    """The step after a change equals the same step through a copy of the cache, which keeps no terms (made anew
    from the changed parameters); and it differs from the step before the change."""
    layer = _layer(keys, **options)
    cache, x = _settled(layer)
    with torch.no_grad():
        _step(layer, x, cache)  # the terms are kept now
        before = _step(layer, x, copy.deepcopy(cache))
        _change(layer, how)
        fresh = copy.deepcopy(cache)
        got, want = _step(layer, x, cache), _step(layer, x, fresh)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.allclose(got, before)


def test_a_model_cast_between_steps_takes_terms_of_the_new_dtype():
    layer = _layer()
    cache, x = _settled(layer)
    with torch.no_grad():
        _step(layer, x, cache)
        layer.double()
        fresh = copy.deepcopy(cache)
        got, want = _step(layer, x.double(), cache), _step(layer, x.double(), fresh)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["mgk", "smgk", "gmgk"])
def test_every_mgk_kind_keeps_its_centre_in_one_state(kind, monkeypatch):
    """MGK, sMGK and grouped MGK take and keep their causal centres through the one decoding state
    (:class:`mgk.functional.MGKDecodeState`): a prefill of one token and a step both go through its ``update``, and
    the centre it keeps is the cache's, one per key group."""
    calls = []
    update = MGKDecodeState.update
    monkeypatch.setattr(MGKDecodeState, "update", lambda self, *a: calls.append(1) or update(self, *a))
    torch.manual_seed(0)
    layer = build_attention(kind, E, H, head_dim=8, batch_first=True).eval()
    cache = layer.new_cache(8)
    with torch.no_grad():
        _step(layer, torch.randn(2, 1, E), cache)
        _step(layer, torch.randn(2, 1, E), cache)
    assert len(calls) == 2 and type(cache.state) is MGKDecodeState
    assert cache.state.centre.shape == (2, layer.kv_heads, 8) and cache.extra["centre"] is cache.state.centre
    assert layer.cache_ready_to_fix(cache) == cache.state.ready_to_fix
