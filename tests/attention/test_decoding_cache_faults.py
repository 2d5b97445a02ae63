"""Decoding-cache faults of every kind, each a case here: a fixed cache never loses the tokens it accepted when it
is resized; an empty chunk (a chunked prefill's (B, 0, E)) changes nothing; a model cast between two calls of one
cache casts the cache (every kind alike); a cache is saved as plain tensors (``state_dict``), never pickled; and an
MGK row whose centre is still provisional (an empty slot of a batch fed padding) keeps the batch on the fused step."""
from __future__ import annotations

import copy
import io

import pytest
import torch

from attention.conftest import E, build_kind
from mgk.attention.cache import DecodingCache
from mgk.attention.registry import get_kind, kind_variants, variant_name
from mgk.functional import MGKDecodeState

VARIANTS = [*kind_variants(), ("mgk", {"pi_shape": "position"})]
IDS = [variant_name(k, v) for k, v in VARIANTS]
SLOT_KINDS = ["softmax", "gqa", "mgk", "smgk"]


def _module(kind, options=None):
    options = dict(options or {})
    return build_kind(kind, {"max_len": 64, **options} if "max_len" in get_kind(kind).options.names() else options)


def _call(m, x, cache, pad=None):
    return m(x, past_key_values=cache, is_causal=True, need_weights=False, key_padding_mask=pad)[0]


def _uncached(m, x):
    with torch.no_grad():
        return m(x, need_weights=False, is_causal=True)[0]


def _chunked(m, x, chunks, cache=None):
    cache = m.new_cache() if cache is None else cache
    outs, t = [], 0
    with torch.no_grad():
        for k in chunks:
            outs.append(_call(m, x[:, t:t + k], cache))
            t += k
    return outs, cache


def _sums(cache):
    """A recurrent state's running sums (linear attention, MLK), or None for a cache of per-token entries."""
    return getattr(cache.state, "sums", None)


def _snapshot(cache):
    """What a cache holds, through its public attributes: counts, entries over the slots in use, recurrent sums,
    bookkeeping."""
    sums = _sums(cache)
    state = None if sums is None else {"kv": sums.kv, "k_sum": sums.k_sum}
    return {"length": cache.length, "seen": cache.seen, "entries": {n: t.clone() for n, t in cache.entries().items()},
            "state": state, "extra": dict(cache.extra)}


def _same(a, b):
    """Two caches' state dicts hold the same numbers (tensors exactly, NaN where NaN)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(
            a.nan_to_num(), b.nan_to_num())
    return a == b


# -- a fixed cache never loses a token --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", SLOT_KINDS)
def test_resizing_a_fixed_cache_ahead_of_advance_is_refused_and_no_token_is_lost(kind):
    """Eager steps on a fixed cache without advance(), then fix_capacity(larger): the buffers were copied up to the
    host count and the slot restarted there, dropping the steps' tokens (outputs 0.35-0.66 off). Refused in one line
    (naming the advance() that catches up); after it, the resize keeps every token."""
    m = _module(kind)
    x = torch.randn(2, 10, E, generator=torch.Generator().manual_seed(1))
    cache = m.new_cache()
    with torch.no_grad():
        outs = [_call(m, x[:, :4], cache)]
        cache.fix_capacity(7)
        outs += [_call(m, x[:, t:t + 1], cache) for t in (4, 5)]  # no advance()
        for resize in (lambda: cache.fix_capacity(12), lambda: cache.reserve(12)):
            with pytest.raises(ValueError, match=r"holds 6 tokens but advance\(\) has counted 4.*advance\(2\) now"):
                resize()
        cache.advance(3)  # one too many
        with pytest.raises(ValueError, match=r"advance\(\) has counted 7 tokens but .* holds 6"):
            cache.fix_capacity(12)
        cache.length -= 1  # as if advance(2) had been called
        cache.fix_capacity(12)
        for t in range(6, 10):
            outs.append(_call(m, x[:, t:t + 1], cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(outs, 1), _uncached(m, x), atol=1e-5, rtol=1e-5)


# -- an empty chunk ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,options", VARIANTS, ids=IDS)
def test_an_empty_chunk_returns_nothing_and_leaves_the_cache_as_it_was(kind, options):
    """Chunk sizes 0, 4, 1, 5 and 1, 0, 0, 9: the empty chunk first, and while MGK's centre is provisional (it
    raised IndexError there). Each empty call gives (B, 0, E) and leaves the cache's state as it was; the other
    chunks equal a decoding without the empty calls."""
    m = _module(kind, options)
    x = torch.randn(2, 10, E, generator=torch.Generator().manual_seed(2))
    for chunks in ((0, 4, 1, 5), (1, 0, 0, 9)):
        cache, outs, t = m.new_cache(), [], 0
        with torch.no_grad():
            for k in chunks:
                before = _snapshot(cache)
                out = _call(m, x[:, t:t + k], cache)
                assert out.shape == (2, k, E) and out.dtype == x.dtype
                if k == 0:
                    assert _same(_snapshot(cache), before), f"chunks {chunks}: the empty call changed the cache"
                outs.append(out)
                t += k
        want, _ = _chunked(m, x, [k for k in chunks if k])
        torch.testing.assert_close(torch.cat(outs, 1), torch.cat(want, 1), atol=1e-6, rtol=1e-6)


# -- a model cast between calls ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,options", VARIANTS, ids=IDS)
def test_a_model_cast_to_float64_between_calls_casts_the_cache(kind, options):
    """After model.double() between two calls of one cache, every kind goes on (softmax and GQA refused, blaming
    the caller) with a cache of the dtypes a cache filled in float64 has, and equals the float64 forward."""
    m = _module(kind, options)
    x = torch.randn(2, 8, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    _, cache = _chunked(m, x.float(), (5, 1))
    m.double()
    with torch.no_grad():
        out = _call(m, x[:, 6:8], cache)
    fresh = _chunked(m, x, (6,))[1]
    assert {n: b.dtype for n, b in cache._buffers.items()} == {n: b.dtype for n, b in fresh._buffers.items()}
    assert (_sums(cache) is None) == (_sums(fresh) is None)
    assert _sums(cache) is None or _sums(cache).kv.dtype == _sums(fresh).kv.dtype == torch.float64
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, _uncached(m, x)[:, 6:8], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["softmax", "gqa", "mgk", "smgk", "linear", "mlk"])
def test_a_model_cast_to_bfloat16_between_calls_casts_the_cache(kind):
    m = _module(kind)
    x = torch.randn(2, 8, E, generator=torch.Generator().manual_seed(4))
    _, cache = _chunked(m, x, (5, 1))
    m.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        out = _call(m, xb[:, 6:7], cache)
    fresh = _chunked(m, xb, (6,))[1]
    assert {n: b.dtype for n, b in cache._buffers.items()} == {n: b.dtype for n, b in fresh._buffers.items()}
    assert _sums(cache) is None or _sums(cache).kv.dtype == _sums(fresh).kv.dtype
    torch.testing.assert_close(out.float(), _uncached(m, xb)[:, 6:7].float(), atol=0.05, rtol=0.05)


# -- saving a cache ---------------------------------------------------------------------------------------------------
def _saved(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("kind,options", VARIANTS, ids=IDS)
def test_a_cache_saves_as_plain_tensors_and_loads_into_a_new_one(kind, options):
    """state_dict -> torch.save -> torch.load(weights_only=True) -> load_state_dict on a new cache: the loaded cache
    continues exactly as the original, after a left-padded prefill in which one row has a single real token (MGK's
    provisional centre and kept key are saved too)."""
    m = _module(kind, options)
    x = torch.randn(3, 9, E, generator=torch.Generator().manual_seed(5))
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, :2], pad[2, :4] = True, True  # rows of 5, 3 and 1 real tokens
    cache = m.new_cache()
    with torch.no_grad():
        _call(m, x[:, :5], cache, pad)
        loaded = m.new_cache()
        loaded.load_state_dict(_saved(cache.state_dict()))
        assert _same(loaded.state_dict(), cache.state_dict())
        for t in (5, 6, 7):
            torch.testing.assert_close(_call(m, x[:, t:t + 1], loaded), _call(m, x[:, t:t + 1], cache),
                                       atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["softmax", "mgk", "linear"])
def test_a_fixed_cache_and_a_model_cache_save_and_load(kind):
    """A cache of fixed capacity keeps its capacity and slot; DecodingCache saves its layers in order."""
    m, m2 = _module(kind), _module(kind)
    x = torch.randn(2, 9, E, generator=torch.Generator().manual_seed(6))
    cache = DecodingCache([m.new_cache(), m2.new_cache()])
    with torch.no_grad():
        _call(m, x[:, :5], cache[0])
        _call(m2, x[:, :3], cache[1])
        cache[0].fix_capacity(9)
        _call(m, x[:, 5:6], cache[0])
        cache[0].advance(1)
        loaded = DecodingCache([m.new_cache(), m2.new_cache()])
        loaded.load_state_dict(_saved(cache.state_dict()))
        assert loaded[0].fixed and loaded[0].room() == cache[0].room() and loaded[1].length == 3
        for t in (6, 7):
            torch.testing.assert_close(_call(m, x[:, t:t + 1], loaded[0]), _call(m, x[:, t:t + 1], cache[0]),
                                       atol=0, rtol=0)
            loaded[0].advance(1)
            cache[0].advance(1)


# (why the second layer's state dict is refused: another kind's cache, not a cache's state dict)
SECOND_REFUSED = {"another kind": lambda sd: _module("softmax").new_cache().state_dict(), "not a state dict": dict}


@pytest.mark.parametrize("why", SECOND_REFUSED)
def test_a_refused_model_cache_load_loads_no_layer(why):
    """A DecodingCache load refused at layer 1 left layer 0 loaded, and the retry with the right state dict was refused
    ("this one has had a call", falsely): every layer is checked before any is loaded."""
    layers = [_module("mgk"), _module("mgk")]
    x = torch.randn(2, 4, E, generator=torch.Generator().manual_seed(9))
    filled = DecodingCache([m.new_cache() for m in layers])
    with torch.no_grad():
        for m, c in zip(layers, filled):
            _call(m, x, c)
    good = filled.state_dict()
    fresh = DecodingCache([m.new_cache() for m in layers])
    with pytest.raises(ValueError, match="state_dict"):
        fresh.load_state_dict({"layers": [good["layers"][0], SECOND_REFUSED[why](good)]})
    assert all(c.seen is None and c.length == 0 and not c.extra for c in fresh)
    fresh.load_state_dict(good)
    assert all(_same(c.state_dict(), sd) for c, sd in zip(fresh, good["layers"]))


def test_pickling_a_cache_is_refused_in_one_line_and_copies_still_work():
    m = _module("mgk")
    x = torch.randn(2, 6, E, generator=torch.Generator().manual_seed(7))
    _, cache = _chunked(m, x, (4,))
    for obj, name in ((cache, "LayerCache"), (DecodingCache([cache]), "DecodingCache")):
        with pytest.raises(TypeError, match=f"a {name} is not pickled .* state_dict") as info:
            torch.save(obj, io.BytesIO())
        assert "\n" not in str(info.value)
    twin = copy.deepcopy(cache)
    with torch.no_grad():
        torch.testing.assert_close(_call(m, x[:, 4:5], twin), _call(m, x[:, 4:5], cache), atol=0, rtol=0)
    assert copy.copy(cache).state is cache.state
    other = _module("softmax").new_cache()
    with pytest.raises(ValueError, match="state_dict holds a MGKAttention"):
        other.load_state_dict(cache.state_dict())
    with pytest.raises(ValueError, match="has had a call"):
        cache.load_state_dict(cache.state_dict())
    with pytest.raises(ValueError, match="state_dict must be a LayerCache.state_dict"):
        other.load_state_dict({"keys": torch.zeros(1)})


# -- a provisional row keeps the batch on the fused step ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mgk", "smgk"])
def test_a_provisional_row_fed_padding_keeps_the_batch_on_the_fused_step(kind, monkeypatch):
    """Row 2 is an empty slot (padding only, NaN inputs) for the prefill and four steps, then its own tokens come;
    row 1 has one real token. While the provisional rows get padding, no step takes the per-call centre protocol
    (it sent the whole batch off the fused step: 1.7-2x slower per step); every row still decodes as that row alone."""
    m = _module(kind)
    x = torch.randn(3, 12, E, generator=torch.Generator().manual_seed(8))
    pad = torch.zeros(3, 12, dtype=torch.bool)
    pad[1, :4] = True  # one real prompt token, then padding for four steps
    pad[1, 5:9] = True
    pad[2, :9] = True  # an empty slot until step 9
    x[pad] = float("nan")
    slow = []
    update = MGKDecodeState.update
    monkeypatch.setattr(MGKDecodeState, "update", lambda self, *a: slow.append(1) or update(self, *a))
    cache = m.new_cache()
    outs = []
    with torch.no_grad():
        outs.append(_call(m, x[:, :5], cache, pad[:, :5]))
        for t in range(5, 12):
            before = len(slow)
            outs.append(_call(m, x[:, t:t + 1], cache, pad[:, t:t + 1]))
            assert (len(slow) > before) == (t in (9, 10)), f"step {t}"  # row 1's second token, row 2's first two
    out = torch.cat(outs, 1)
    for b in range(3):
        real = ~pad[b]
        want = _uncached(m, x[b:b + 1, real])
        torch.testing.assert_close(out[b:b + 1, real], want, atol=1e-5, rtol=1e-5, msg=lambda s, b=b: f"row {b}: {s}")
