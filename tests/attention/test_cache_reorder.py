"""Every kind's decoding cache moves, repeats and drops rows and drops tokens (beam search, assisted decoding): a cache
reordered by a permutation, by rows chosen with repeats (more rows than before), or repeated, then stepped, equals
the cache built from the reordered inputs, for every registered kind and variant (kinds registered later included);
a cache of per-token entries cropped, then fed the tokens it dropped or others in their place, steps as the cache of
the kept tokens and the new ones, MGK's provisional centres included (a row cut back below two real tokens); a
recurrent state refuses to crop in one line; caches of fixed capacity reorder and crop; a model's DecodingCache does
it for every layer; bad arguments are refused in one line naming them."""
from __future__ import annotations

import copy

import pytest
import torch

from attention.conftest import E, H, build_kind
from mgk.attention.registry import attention_kinds, get_kind, kind_variants, variant_name
from mgk.models import AttentionConfig, LMConfig, TransformerLM

# Beyond the registry's variants: positions read from each row's count (per-position weights, normalize="length").
CASES = [*kind_variants(), ("mgk", {"pi_shape": "position"}), ("mlk", {"pi_shape": "position"}),
         ("linear", {"normalize": "length"})]
IDS = [variant_name(k, v) for k, v in CASES]
FIRST = {k: v for k, v in reversed(CASES)}  # each kind's first variant: the default run's representative
SLOTTED = [k for k in attention_kinds() if not get_kind(k).cache.recurrent]
RECURRENT = [k for k in attention_kinds() if get_kind(k).cache.recurrent]
CHUNKS = ((0, 5), (5, 6), (6, 7), (7, 9))  # a prefill, two one-token steps and a two-token step
T = 10  # tokens of the inputs: the chunks, then one more step


def _module(kind, options=None):
    return build_kind(kind, options or {})


def _inputs():
    """(x (3, T, E), padding (3, T) bool True = padding): row 0 all real; row 1 left-padded to two real tokens in the
    prefill; row 2 one real token in the prefill and padding at the next step (an MGK row kept provisional, its raw
    key held, across a reorder and a crop)."""
    x = torch.randn(3, T, E, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(3, T, dtype=torch.bool)
    pad[1, :3] = True
    pad[2, :4] = True
    pad[2, 5] = True
    x[pad] = float("nan")  # padding is inert: any value it holds must not reach an output
    return x, pad


def _call(m, cache, x, pad, start, end):
    p = pad[:, start:end]
    with torch.no_grad():
        return m(x[:, start:end], past_key_values=cache, key_padding_mask=p if bool(p.any()) else None,
                 is_causal=True, need_weights=False)[0]


def _feed(m, cache, x, pad, chunks):
    return [_call(m, cache, x, pad, a, b) for a, b in chunks]


def _real(out, pad, start, end):
    """The outputs at real tokens (padded positions are meaningless)."""
    return out[~pad[:, start:end]]


def _same_cache(got, want):
    assert got.length == want.length and torch.equal(got.seen, want.seen)
    assert torch.equal(got.key_valid(), want.key_valid())
    for name, entry in want.entries().items():
        valid = want.key_valid()
        dim = want.slots[name]
        mask = valid.view(valid.shape[0], *[1] * (dim - 1), valid.shape[1], *[1] * (entry.dim() - dim - 1))
        real = torch.where(mask, entry, 0)  # padded slots hold finite numbers that nothing reads
        torch.testing.assert_close(torch.where(mask, got.entries()[name], 0), real, atol=1e-5, rtol=1e-5)
    if getattr(want.state, "sums", None) is not None:  # a recurrent state's running sums
        torch.testing.assert_close(got.state.sums.kv, want.state.sums.kv, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.state.sums.k_sum, want.state.sums.k_sum, atol=1e-5, rtol=1e-5)


ROW_MOVES = {
    "permutation": (lambda c: c.reorder(torch.tensor([2, 0, 1])), torch.tensor([2, 0, 1])),
    "beam_idx": (lambda c: c.reorder(torch.tensor([2, 2, 0])), torch.tensor([2, 2, 0])),
    "select_more_rows": (lambda c: c.select(torch.tensor([1, 2, 2, 0])), torch.tensor([1, 2, 2, 0])),
    "repeat_interleave": (lambda c: c.repeat_interleave(2), torch.arange(3).repeat_interleave(2)),
}


def _grid(cases, settings, everywhere):
    """(kind, options, setting) for every case and setting; slow unless the setting is in ``everywhere`` or the
    case is its kind's first variant (the default run keeps every kind and every setting, and every variant once)."""
    return [pytest.param(kind, options, name, id=f"{variant_name(kind, options)}-{name}",
                         marks=() if name in everywhere or FIRST[kind] == options else pytest.mark.slow)
            for kind, options in cases for name in settings]


@pytest.mark.parametrize("kind,options,move", _grid(CASES, ROW_MOVES, ("beam_idx",)))
def test_moved_rows_step_as_the_cache_of_the_moved_inputs(kind, options, move):
    """Rows moved after the prefill and one step (row 2 then provisional for MGK), then two more steps."""
    m = _module(kind, options)
    x, pad = _inputs()
    apply, rows = ROW_MOVES[move]
    cache = m.new_cache()
    _feed(m, cache, x, pad, CHUNKS[:2])
    apply(cache)
    got = _feed(m, cache, x[rows], pad[rows], CHUNKS[2:] + ((9, 10),))
    fresh = m.new_cache()
    want = _feed(m, fresh, x[rows], pad[rows], CHUNKS + ((9, 10),))[2:]
    for (a, b), g, w in zip(CHUNKS[2:] + ((9, 10),), got, want):
        torch.testing.assert_close(_real(g, pad[rows], a, b), _real(w, pad[rows], a, b), atol=1e-5, rtol=1e-5)
    _same_cache(cache, fresh)
    assert cache.batch_size == len(rows)


CUTS = {  # (tokens held when cropped, crop's argument)
    "drop_last_two": (9, -2),
    "provisional_row_kept": (6, -1),  # MGK: row 2 keeps its one real token and its raw key
    "row_back_to_one_token": (9, 4),  # rows 0 and 1 keep 4 and 1 real tokens, row 2 none
    # MGK: row 2 provisional (its raw key kept) while row 1 falls back to one real token, whose raw key is not kept
    "row_back_to_one_token_beside_a_provisional_row": (6, 4),
    "every_row_emptied": (9, 0),
}
# the dropped tokens fed again ("same"), or others in their place (assisted decoding's rejected drafts replaced)
CROPS = {f"{cut}-{tokens}": (*CUTS[cut], tokens) for cut in CUTS for tokens in ("same", "other")}


@pytest.mark.parametrize("kind,options,crop", _grid([c for c in CASES if c[0] in SLOTTED], CROPS,
                                                    ("row_back_to_one_token_beside_a_provisional_row-other",)))
def test_a_cropped_cache_steps_as_the_cache_of_the_kept_tokens_and_the_new_ones(kind, options, crop):
    """Crop, feed the tokens from the cut to where the cache was (in one call), then the remaining steps: the outputs
    are those of a cache that only ever saw the kept tokens and the new ones."""
    m = _module(kind, options)
    x, pad = _inputs()
    held, length, tokens = CROPS[crop]
    keep = held + length if length < 0 else length
    new = x.clone()
    if tokens == "other":
        new[:, keep:] = torch.randn(3, T - keep, E, generator=torch.Generator().manual_seed(4))
        new[pad] = float("nan")
    cache = m.new_cache()
    _feed(m, cache, x, pad, [c for c in CHUNKS if c[1] <= held])
    cache.crop(length)
    assert cache.length == keep and cache.seen.tolist() == (~pad[:, :keep]).sum(dim=1).tolist()
    assert int(cache.key_valid()[:, keep:].sum()) == 0
    got = [_call(m, cache, new, pad, keep, held)] + _feed(m, cache, new, pad, [c for c in CHUNKS if c[0] >= held])
    got.append(_call(m, cache, new, pad, 9, 10))
    fresh = m.new_cache()
    want = torch.cat(_feed(m, fresh, new, pad, CHUNKS + ((9, 10),)), dim=1)[:, keep:]
    real = ~pad[:, keep:]
    torch.testing.assert_close(torch.cat(got, dim=1)[real], want[real], atol=1e-5, rtol=1e-5)
    assert cache.length == fresh.length and torch.equal(cache.seen, fresh.seen)
    assert torch.equal(cache.key_valid(), fresh.key_valid())


@pytest.mark.parametrize("kind", RECURRENT)
def test_a_recurrent_state_refuses_to_crop_in_one_line_naming_its_kind(kind):
    m = _module(kind)
    x, pad = _inputs()
    cache = m.new_cache()
    _feed(m, cache, x, pad, CHUNKS[:2])
    kv = cache.state.sums.kv.clone()
    with pytest.raises(ValueError, match="cannot be cropped") as err:
        cache.crop(-1)
    assert "\n" not in str(err.value) and cache.layout in str(err.value)
    cache.crop(cache.length)  # keeping every token drops nothing: allowed for every kind
    assert cache.length == 6 and torch.equal(cache.state.sums.kv, kv)


@pytest.mark.parametrize("kind", SLOTTED)
def test_a_cache_of_fixed_capacity_reorders_and_crops(kind):
    """One real token per step at the slot tensor: reorder, crop (the slot moves back), re-feed, step on."""
    m = _module(kind)
    x = torch.randn(3, T, E, generator=torch.Generator().manual_seed(2))
    no_pad = torch.zeros(3, T, dtype=torch.bool)
    rows = torch.tensor([1, 1, 0])

    def fixed(inputs):
        cache = m.new_cache()
        _call(m, cache, inputs, no_pad, 0, 4)
        cache.fix_capacity(T)
        return cache

    def step(cache, inputs, t):
        out = _call(m, cache, inputs, no_pad, t, t + 1)
        cache.advance(1)
        return out

    cache, want = fixed(x), fixed(x[rows])
    for t in range(4, 7):
        step(cache, x, t)
        step(want, x[rows], t)
    cache.reorder(rows)
    cache.crop(-2)
    assert cache.length == 5 and int(cache._slot) == 5 and cache.capacity == T and cache.fixed
    for t in range(5, 9):
        got = step(cache, x[rows], t)
        if t >= 7:
            torch.testing.assert_close(got, step(want, x[rows], t), atol=1e-5, rtol=1e-5)
    _same_cache(cache, want)


POSITIONAL = [k for k in attention_kinds() if "pi_shape" in get_kind(k).options.names()]
# the rows kept, by the call that keeps them
DROPPING_ROW_0 = {"select": (lambda c, i: c.select(i), torch.tensor([1])),
                  "reorder": (lambda c, i: c.reorder(i), torch.tensor([1, 1]))}


@pytest.mark.parametrize("move", DROPPING_ROW_0)
@pytest.mark.parametrize("kind", POSITIONAL)
def test_dropping_the_longest_row_lets_the_others_reach_max_len(kind, move):
    """Row 0 has seen 6 tokens, row 1 two (left padding), max_len=8. Once row 0 is dropped, row 1 steps to position 7
    as it would alone, and position 8 is refused: the dropped row's host bound (seen.max()) refused it at position 4
    ("position 8 is past them")."""
    m = _module(kind, {"pi_shape": "position", "max_len": 8})
    x = torch.randn(2, 12, E, generator=torch.Generator().manual_seed(4))
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, :4] = True
    cache = m.new_cache()
    _call(m, cache, x, pad, 0, 6)
    keep, rows = DROPPING_ROW_0[move]
    keep(cache, rows)
    x, pad = x[rows], pad[rows]
    for t in range(6, 12):  # row 1's positions 2 .. 7
        _call(m, cache, x, pad, t, t + 1)
    with pytest.raises(ValueError, match="position 8 is past them"):
        _call(m, cache, x, pad, 11, 12)


@pytest.mark.parametrize("kind", ["softmax", "mgk", "mlk"])
def test_a_models_decoding_cache_moves_every_layer(kind):
    model = TransformerLM(LMConfig(vocab_size=30, d_model=E, num_layers=2, ffn_dim=32, dropout=0.0, cutoffs=(10,),
                                   attention=AttentionConfig(kind=kind, num_heads=H, head_dim=8))).eval()
    idx = torch.randint(0, 30, (2, 7), generator=torch.Generator().manual_seed(3))
    rows = torch.tensor([1, 1, 0])
    with torch.no_grad():
        cache = model.new_cache()
        model.next_log_probs(idx[:, :5], past_key_values=cache)
        cache.select(rows)
        got = model.next_log_probs(idx[rows, 5:], past_key_values=cache)
        want = model.next_log_probs(idx[rows], past_key_values=model.new_cache())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if get_kind(kind).cache.recurrent:
            with pytest.raises(ValueError, match="cannot be cropped"):
                cache.crop(-2)
            assert [layer.length for layer in cache] == [7, 7]  # refused before any layer was cut
            return
        cache.crop(-2)
        assert [layer.length for layer in cache] == [5, 5] and cache.seen.tolist() == [5, 5, 5]
        again = model.next_log_probs(idx[rows, 5:], past_key_values=cache)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)


BAD = [
    (lambda c: c.select(torch.tensor([0.0, 1.0])), "index"),
    (lambda c: c.select(torch.tensor([[0, 1]])), "index"),
    (lambda c: c.select(torch.tensor([], dtype=torch.int64)), "index"),
    (lambda c: c.select([0, 1]), "index"),
    (lambda c: c.select(torch.tensor([0, 2])), "index"),
    (lambda c: c.select(torch.tensor([-1, 0])), "index"),
    (lambda c: c.reorder(torch.tensor([0])), "index"),
    (lambda c: c.repeat_interleave(0), "repeats"),
    (lambda c: c.repeat_interleave(2.0), "repeats"),
    (lambda c: c.crop(6), "length"),
    (lambda c: c.crop(-6), "length"),
    (lambda c: c.crop(1.5), "length"),
]


@pytest.mark.parametrize("call,name", BAD, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD)])
def test_bad_arguments_are_refused_in_one_line_naming_them(call, name):
    m = _module("mgk")
    x, pad = (t[:2] for t in _inputs())
    cache = m.new_cache()
    _feed(m, cache, x, pad, CHUNKS[:1])
    before = copy.deepcopy(cache.state_dict())
    with pytest.raises(ValueError, match=name) as err:
        call(cache)
    assert "\n" not in str(err.value)
    after = cache.state_dict()
    assert all(torch.equal(after["buffers"][n], b) for n, b in before["buffers"].items())
    assert torch.equal(after["seen"], before["seen"]) and after["length"] == before["length"]


def test_bookkeeping_without_the_rows_as_dim_0_is_refused_naming_extra():
    """The contract that lets a state move its bookkeeping (saved as extra): each of its tensors is per row. MGK's
    centre broken by hand is refused by the move, in one line, and the cache is left as it was."""
    m = _module("mgk")
    x, pad = (t[:2] for t in _inputs())
    cache = m.new_cache()
    _feed(m, cache, x, pad, CHUNKS[:1])
    cache.state.centre = torch.zeros(5)
    before = cache.seen.clone()
    with pytest.raises(ValueError, match=r"bookkeeping \(extra\) \['centre'\]") as err:
        cache.reorder(torch.tensor([1, 0]))
    assert "\n" not in str(err.value) and torch.equal(cache.seen, before)
