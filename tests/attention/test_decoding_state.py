"""Each kind's decoding state does the whole cached call: a layer's cached call is one call into it (gMGK's included,
whose steady steps take MGK's fused step and its C++ kernel), a centre the caller fixes is kept as it is from the
prefill on, and a cache saved in the format of the code before the states existed (built by hand here, as that code
wrote it) loads and decodes on, while a dict of another form is refused in one line naming the format."""
from __future__ import annotations

import pytest
import torch

from attention.conftest import E, H, build_kind
from mgk.functional import (
    KVCacheState,
    LinearCacheState,
    MGKDecodeState,
    _mixture_flash,
    linear_attention,
    mgk_attention,
    mgk_cache_centre,
    mgk_cache_entries,
)
from mgk.functional.mgk_cache import MGKStepTerms

STATES = {"softmax": KVCacheState, "gqa": KVCacheState, "mgk": MGKDecodeState, "smgk": MGKDecodeState,
          "gmgk": MGKDecodeState, "linear": LinearCacheState, "mlk": LinearCacheState, "smlk": LinearCacheState}


def _call(m, x, cache, pad=None):
    with torch.no_grad():
        return m(x, past_key_values=cache, is_causal=True, need_weights=False, key_padding_mask=pad)[0]


def _uncached(m, x):
    with torch.no_grad():
        return m(x, need_weights=False, is_causal=True)[0]


@pytest.mark.parametrize("kind", list(STATES))
def test_every_kind_decodes_through_its_own_state(kind):
    m = build_kind(kind)
    cache = m.new_cache()
    assert type(cache.state) is STATES[kind]
    _call(m, torch.randn(2, 3, E), cache)
    assert cache.seen.tolist() == [3, 3] and cache.state.seen is cache.seen


class _Counting:
    """The C++ extension module with its calls of ``name`` counted."""

    def __init__(self, module, name, calls):
        self._module, self._name, self._calls = module, name, calls

    def __getattr__(self, attr):
        if attr == self._name:
            real = getattr(self._module, attr)
            return lambda *a: self._calls.append(attr) or real(*a)
        return getattr(self._module, attr)


@pytest.mark.parametrize("kind,options", [("gmgk", {"num_kv_heads": 1}),
                                          ("gmgk", {"num_kv_heads": 1, "keys": "shifted"}), ("mgk", {})])
def test_steady_steps_of_every_mgk_kind_take_the_fused_step_and_its_kernel(kind, options, monkeypatch):
    """gMGK decoded through a second driver of its own (entries appended, then the explicit attention with a
    hand-built causal mask): no fused step and no kernel step. Its steady steps now take MGK's (one call that writes
    the entries and attends), equal to the uncached forward."""
    if _mixture_flash._load() is None:
        pytest.skip(f"the CPU kernel could not be built here: {_mixture_flash.build_error()}")
    m = build_kind(kind, options)
    fused, kernel = [], []
    step = MGKStepTerms.step
    monkeypatch.setattr(MGKStepTerms, "step", lambda self, *a, **k: fused.append(1) or step(self, *a, **k))
    monkeypatch.setattr(_mixture_flash, "_module", _Counting(_mixture_flash._module, "decode_step", kernel))
    x = torch.randn(2, 9, E, generator=torch.Generator().manual_seed(1))
    cache = m.new_cache()
    outs = [_call(m, x[:, :5], cache)] + [_call(m, x[:, t:t + 1], cache) for t in range(5, 9)]
    assert len(fused) == 4 and len(kernel) == 4
    torch.testing.assert_close(torch.cat(outs, 1), _uncached(m, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keys", ["separate", "shifted"])
def test_a_centre_the_caller_fixes_is_kept_from_the_prefill_on(keys):
    """``step(..., centre=zeros)`` (the exact-conversion parameterisation's fixed centre): the prefill and every step
    use it, the state never chooses or moves it (settled after a one-token prefill, nothing kept), and the outputs are
    MGK's at that centre."""
    m = build_kind("gmgk", {"num_kv_heads": 1, "keys": keys})
    x = torch.randn(2, 6, E, generator=torch.Generator().manual_seed(2))
    q, base, v = m._split(m.q_proj(x)), m.mixture.project(x), m._values(x)
    shifts = m.mixture.shifts() if keys == "shifted" else None
    state = MGKDecodeState(m.cache_slots, groups=1)
    zero = torch.zeros(1, 1, m.head_dim)
    with torch.no_grad():
        outs = [state.step(q[:, :, t:t + 1], base[..., t:t + 1, :], v[:, :, t:t + 1], sigma2=m.group_variances,
                           shifts=shifts, prior=m.mixture.log_weights(1), centre=zero) for t in range(6)]
        assert state.ready_to_fix and state.provisional is False and state.raw_key is None
        k = base if shifts is None else m.mixture.shift(base)
        want = mgk_attention(q, k.expand(-1, H, *k.shape[2:]), v.expand(-1, H, -1, -1),
                             log_pi=m.mixture.log_weights(1), sigma2=m.sigma2, is_causal=True,
                             centre=torch.zeros(2, H, m.head_dim))
    assert torch.equal(state.centre, torch.zeros(2, 1, m.head_dim))
    torch.testing.assert_close(torch.cat(outs, 2), want, atol=1e-6, rtol=1e-6)


# -- a cache saved by the code before the decoding states ------------------------------------------------------------
def _old_format(m, x, valid, centre, buffers, state=None, extra=None) -> dict:
    """A LayerCache.state_dict() as the code before the decoding states wrote it: its keys, in its order."""
    B, T = valid.shape
    return {"layout": m.cache_layout, "slots": dict(m.cache_slots), "capacity": T, "length": T, "max_seen": T,
            "padded": not bool(valid.all()), "owner": m._cache_owner(), "seen": valid.sum(1), "valid": valid.clone(),
            "slot": None, "buffers": buffers, "state": state, "extra": {} if extra is None else extra}


def _saved_mgk(m, x, valid):
    """MGK's cache of the prompt x (B, T, E), as that code saved it: entries made by the public op at the causal
    centre, padding stored as zeros, and for a row with one real token its kept raw key (extra's raw_*)."""
    q, base, v = m._split(m.q_proj(x)), m.mixture.project(x), m._values(x)
    B, T = valid.shape
    prior = m.mixture.log_weights(1)
    centre, _ = mgk_cache_centre(q, None, key_valid=torch.zeros(B, 0, dtype=torch.bool), valid=valid)
    keys, key_bias = mgk_cache_entries(base, centre=centre, log_pi=prior, sigma2=m.sigma2)
    keep = valid[:, None, None, :]
    buffers = {"keys": keys * keep[..., None], "key_bias": key_bias * keep, "values": v * valid[:, None, :, None]}
    first = valid.to(torch.int64).argmax(1)
    lone = valid.sum(1) == 1  # a provisional row: its one real token kept
    raw = base.movedim(3, 1)[torch.arange(B), first].unsqueeze(3) * lone.view(B, 1, 1, 1, 1)
    extra = {"centre": centre, "provisional": bool(lone.any()), "raw_key": raw,
             "raw_log_pi": prior.expand(B, H, -1, 1) * lone.view(B, 1, 1, 1),
             "raw_slot": torch.where(lone, first, 0), "raw_has": lone}
    return _old_format(m, x, valid, centre, buffers, extra=extra)


def _saved_linear(m, x, valid):
    q, k, v = m._split(m.q_proj(x)), m._keys(x), m._values(x)
    _, sums = linear_attention(q, k, v, attn_mask=valid[:, None, None, :], is_causal=True, output_final_state=True)
    state = {"kv": sums.kv, "k_sum": sums.k_sum, "length": sums.length}
    return _old_format(m, x, valid, None, {}, state=state)


def _saved_softmax(m, x, valid):
    k, v = m._keys(x) * valid[:, None, :, None], m._values(x) * valid[:, None, :, None]
    return _old_format(m, x, valid, None, {"keys": k, "values": v})


SAVED = {"mgk": _saved_mgk, "linear": _saved_linear, "softmax": _saved_softmax}


@pytest.mark.parametrize("kind", list(SAVED))
def test_a_cache_saved_in_the_format_before_the_states_loads_and_decodes_on(kind):
    """Row 1's prompt is one real token after padding (MGK: a provisional centre and its kept raw key, remade by the
    next token); every row then decodes as that row alone."""
    m = build_kind(kind)
    x = torch.randn(2, 9, E, generator=torch.Generator().manual_seed(3))
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1, :4] = False
    with torch.no_grad():
        saved = SAVED[kind](m, x[:, :5], valid)
    cache = m.new_cache()
    cache.load_state_dict(saved)
    outs = [_call(m, x[:, t:t + 1], cache) for t in range(5, 9)]
    for b, start in ((0, 0), (1, 4)):
        want = _uncached(m, x[b:b + 1, start:])[:, -4:]
        torch.testing.assert_close(torch.cat(outs, 1)[b:b + 1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change,match", [
    (lambda sd: {k: v for k, v in sd.items() if k != "extra"}, r"LayerCache.state_dict\(\) with keys .*saved format"),
    (lambda sd: {**sd, "format": 2}, r"LayerCache.state_dict\(\) with keys .*saved format"),
    (lambda sd: {**sd, "extra": {**sd["extra"], "summary": torch.zeros(2)}}, r"extra holds \['summary'\]"),
    (lambda sd: {**sd, "state": {"kv": torch.zeros(1)}}, "recurrent"),
])
def test_a_dict_of_another_form_is_refused_in_one_line_naming_the_format(change, match):
    m = build_kind("mgk")
    x = torch.randn(2, 5, E, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        saved = _saved_mgk(m, x, torch.ones(2, 5, dtype=torch.bool))
    cache = m.new_cache()
    with pytest.raises(ValueError, match=match) as info:
        cache.load_state_dict(change(saved))
    assert "\n" not in str(info.value) and cache.seen is None
