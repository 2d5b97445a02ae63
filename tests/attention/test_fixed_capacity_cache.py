"""Caches of fixed capacity (:meth:`mgk.attention.cache.LayerCache.fix_capacity`, the static cache that
``generate(..., compile=True)`` traces): one-token steps that write at a slot tensor and read the whole capacity with
the valid-slot mask equal the uncached causal forward for every kind and option set, after plain and left-padded
prefills; slots never filled are read but never attended (gpt-fast#233's kind: here they hold NaN before the
capacity is fixed, which must not reach an output); the same step traced by torch.compile (fullgraph, no
recompilation from one token to the next) equals eager; misuse is refused in one line."""
from __future__ import annotations

import pytest
import torch

from attention.conftest import E, build_kind
from mgk.attention.registry import attention_kinds, get_kind, kind_variants, variant_name

CASES = [*kind_variants(), ("mgk", {"pi_shape": "position"}), ("smgk", {"pi_shape": "position"}),
         ("mlk", {"pi_shape": "position"}), ("linear", {"normalize": "none"}),
         ("mlk", {"feature_map": "elu_sum", "output_scale": 8 ** -0.5, "eps": 1e-5, "eps_mode": "add"})]
IDS = [variant_name(k, v) for k, v in CASES]
P, T = 5, 13  # prefill and total tokens


def _module(kind, options):
    return build_kind(kind, {"max_len": 64, **options} if "max_len" in get_kind(kind).options.names() else options)


def _call(m, x, cache, **kw):
    return m(x, past_key_values=cache, is_causal=True, need_weights=False, **kw)[0]


def _fixed_decode(m, x, pad=None, capacity=T, step=None):
    """Outputs of the prefill (growing cache) and of one-token steps after fix_capacity(capacity), and the cache."""
    cache = m.new_cache()
    step = step or (lambda token: _call(m, token, cache))
    with torch.no_grad():
        outs = [_call(m, x[:, :P], cache, key_padding_mask=None if pad is None else pad[:, :P])]
        cache.fix_capacity(capacity)
        for t in range(P, x.shape[1]):
            outs.append(step(x[:, t:t + 1]))
            cache.advance(1)
    return torch.cat(outs, dim=1), cache


def _growing_decode(m, x, pad=None):
    cache = m.new_cache()
    with torch.no_grad():
        outs = [_call(m, x[:, :P], cache, key_padding_mask=None if pad is None else pad[:, :P])]
        outs += [_call(m, x[:, t:t + 1], cache) for t in range(P, x.shape[1])]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("kind,options", CASES, ids=IDS)
def test_fixed_steps_equal_the_uncached_forward(kind, options):
    m = _module(kind, options)
    x = torch.randn(2, T, E, generator=torch.Generator().manual_seed(1))
    got, cache = _fixed_decode(m, x, capacity=T + 7)  # 7 slots never filled, read at every step
    with torch.no_grad():
        want = m(x, need_weights=False, is_causal=True)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cache.length == T and int(cache.seen.min()) == T and cache.capacity in (None, T + 7)


@pytest.mark.parametrize("kind,options", CASES, ids=IDS)
def test_fixed_steps_after_a_left_padded_prefill_equal_growing_ones(kind, options):
    m = _module(kind, options)
    x = torch.randn(3, T, E, generator=torch.Generator().manual_seed(2))
    pad = torch.zeros(3, T, dtype=torch.bool)
    pad[1, :2] = True  # rows of 5, 3 and 4 real prompt tokens, padded on the left
    pad[2, :1] = True
    got, _ = _fixed_decode(m, x, pad)
    want = _growing_decode(m, x, pad)
    real = ~pad
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["softmax", "gqa", "mgk", "smgk"])
def test_slots_past_the_tokens_seen_are_zeroed_and_never_attended(kind):
    """gpt-fast#233's kind: a fixed cache reads every slot, so the slots not yet filled must not reach an output
    (they held NaN before fix_capacity, which makes new buffers of zeros)."""
    m = _module(kind, {})
    x = torch.randn(2, T, E, generator=torch.Generator().manual_seed(3))
    cache = m.new_cache(capacity=40)
    with torch.no_grad():
        first = _call(m, x[:, :P], cache)
        for name, buf in cache._buffers.items():
            buf.narrow(cache.slots[name], P, 40 - P).fill_(float("nan"))
        cache.fix_capacity(T + 3)
        outs = [first]
        for t in range(P, T):
            outs.append(_call(m, x[:, t:t + 1], cache))
            cache.advance(1)
        want = m(x, need_weights=False, is_causal=True)[0]
    torch.testing.assert_close(torch.cat(outs, 1), want, atol=1e-5, rtol=1e-5)
    assert cache.capacity == T + 3 and all(buf.shape[cache.slots[n]] == T + 3 for n, buf in cache._buffers.items())


@pytest.mark.parametrize("kind", ["softmax", "gqa", "mgk", "smgk", "linear", "mlk"])
def test_a_traced_step_equals_eager_and_is_not_recompiled_from_token_to_token(kind):
    torch._dynamo.reset()
    m = _module(kind, {})
    x = torch.randn(2, T, E, generator=torch.Generator().manual_seed(4))
    step = torch.compile(lambda token, cache: _call(m, token, cache), backend="aot_eager", fullgraph=True,
                         dynamic=False)
    holder = {}

    def traced(token):
        return step(token, holder["cache"])

    cache = m.new_cache()
    holder["cache"] = cache
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        outs = [_call(m, x[:, :P], cache)]
        cache.fix_capacity(T)
        for t in range(P, T):
            outs.append(traced(x[:, t:t + 1]))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(outs, 1), _growing_decode(m, x), atol=1e-5, rtol=1e-5)


def test_misuse_of_a_fixed_capacity_is_refused_in_one_line():
    m = _module("mgk", {})
    x = torch.randn(1, 8, E)
    cache = m.new_cache()
    with pytest.raises(ValueError, match="first call"):
        cache.fix_capacity(8)
    with pytest.raises(ValueError, match="fixed capacity"):
        cache.advance(1)
    with torch.no_grad():
        _call(m, x[:, :4], cache)
        with pytest.raises(ValueError, match="capacity must hold the 4 tokens"):
            cache.fix_capacity(3)
        with pytest.raises(ValueError, match="capacity must be a positive int"):
            cache.fix_capacity(4.5)
        cache.fix_capacity(5)
        assert cache.fixed and cache.room() == 1
        with pytest.raises(ValueError, match="one real token per call, got 2"):
            _call(m, x[:, 4:6], cache)
        with pytest.raises(ValueError, match="key_padding_mask"):
            _call(m, x[:, 4:5], cache, key_padding_mask=torch.zeros(1, 1, dtype=torch.bool))
        with pytest.raises(ValueError, match="one real token per call, got 2"):
            cache.claim(2)
        _call(m, x[:, 4:5], cache)
        cache.advance(1)
        assert cache.room() == 0
        with pytest.raises(ValueError, match=r"fixed capacity \(5 tokens\) is used up"):
            _call(m, x[:, 5:6], cache)


def test_a_recurrent_state_cache_fixes_without_slots():
    m = _module("linear", {})
    x = torch.randn(2, T, E, generator=torch.Generator().manual_seed(5))
    got, cache = _fixed_decode(m, x)
    assert cache.room() is None and cache.fixed
    torch.testing.assert_close(got, _growing_decode(m, x), atol=1e-5, rtol=1e-5)


def test_eager_calls_without_advance_are_still_checked_against_the_slot():
    """The room check of an eager call reads the slot tensor, not the host count that only advance() moves (a
    helper's report: a raw IndexError before)."""
    m = _module("mgk", {})
    x = torch.randn(1, 8, E)
    cache = m.new_cache()
    with torch.no_grad():
        _call(m, x[:, :4], cache)
        cache.fix_capacity(6)
        _call(m, x[:, 4:5], cache)
        _call(m, x[:, 5:6], cache)
        with pytest.raises(ValueError, match=r"fixed capacity \(6 tokens\) is used up"):
            _call(m, x[:, 6:7], cache)


@pytest.mark.parametrize("kind", [k for k in attention_kinds() if "pi_shape" in get_kind(k).options.names()])
def test_eager_fixed_steps_without_advance_are_refused_past_max_len_in_one_line(kind):
    """The host counts of a fixed cache are the caller's (advance); eager steps without it read the device count for
    the per-position check, so position 8 of max_len=8 is the one-line ValueError, not an IndexError deep in the
    mixture's weights (the stale host bound let it through)."""
    m = _module(kind, {"pi_shape": "position", "max_len": 8})
    x = torch.randn(2, 9, E, generator=torch.Generator().manual_seed(3))
    cache = m.new_cache()
    with torch.no_grad():
        _call(m, x[:, :4], cache)
        cache.fix_capacity(12)
        for t in range(4, 8):  # no advance()
            _call(m, x[:, t:t + 1], cache)
        with pytest.raises(ValueError, match=r"max_len=8 .*position 8 is past them") as err:
            _call(m, x[:, 8:9], cache)
    assert "\n" not in str(err.value) and cache.seen.tolist() == [8, 8]
