"""The per-token decoding state alone (KVCacheState, no module) and softmax / GQA's cached call over it
(softmax_cache_step): appends in pieces equal one append, a fixed capacity writes at its slot tensor, rows move and
the last tokens drop with their counts, the state is saved as plain tensors, and a prefill plus single-token steps
give the float64 formula over the whole sequence (a left-padded row as that row alone); bad input is refused in one
line naming the argument.
"""
from __future__ import annotations

import io

import pytest
import torch

from mgk.functional import KVCacheState, softmax_attention_reference, softmax_cache_step

F64 = torch.float64
SLOTS = {"keys": 2, "values": 2}


def _kv(B=3, H=2, T=6, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g, dtype=F64), torch.randn(B, H, T, D, generator=g, dtype=F64)


def _filled(pieces, valid=None, capacity=None, B=3):
    """A state of B rows after appending the keys/values of _kv in ``pieces`` (lengths), ``valid`` (B, T) or None."""
    k, v = _kv(B=B)
    state = KVCacheState(SLOTS, capacity, layout="test")
    state.start(B, k.device)
    at = 0
    for n in pieces:
        piece = None if valid is None else valid[:, at:at + n]
        state.append(piece, keys=k[:, :, at:at + n], values=v[:, :, at:at + n])
        at += n
    return state


def test_appending_in_pieces_and_growing_equals_one_append():
    valid = torch.ones(3, 6, dtype=torch.bool)
    valid[1, :2] = False  # left padding: stored as zeros, not counted
    one = _filled([6], valid)
    pieces = _filled([2, 1, 3], valid, capacity=1)  # grows twice
    assert pieces.capacity >= 6 and pieces.length == one.length == 6
    for name in SLOTS:
        torch.testing.assert_close(pieces.entries()[name], one.entries()[name], rtol=0, atol=0)
    assert torch.equal(pieces.seen, torch.tensor([6, 4, 6])) and torch.equal(pieces.seen, one.seen)
    assert torch.equal(pieces.key_valid(), valid) and pieces.padded
    assert not pieces.entries()["keys"][1, :, :2].any()
    assert pieces.nbytes() == one.nbytes() == 2 * 3 * 2 * 6 * 4 * 8
    assert pieces.positions(None, 2).tolist() == [[6, 7], [4, 5], [6, 7]]


def test_a_fixed_capacity_writes_one_token_at_its_slot_tensor_and_reads_the_whole_capacity():
    k, v = _kv()
    state = _filled([3])
    state.fix_capacity(5)
    assert state.fixed and int(state.slot) == 3 and state.room() == 2
    for t in (3, 4):
        entries = state.append(None, keys=k[:, :, t:t + 1], values=v[:, :, t:t + 1])
        state.advance(1)
        assert entries["keys"].shape[2] == 5  # the whole capacity, the slots ahead masked
    torch.testing.assert_close(state.entries()["values"], v[:, :, :5], rtol=0, atol=0)
    assert int(state.slot) == 5 and state.length == 5 and state.room() == 0
    assert state.attn_mask().shape == (3, 1, 1, 5) and bool(state.attn_mask().all())
    with pytest.raises(ValueError, match=r"fixed capacity \(5 tokens\) is used up"):
        state.append(None, keys=k[:, :, 5:6], values=v[:, :, 5:6])
    with pytest.raises(ValueError, match="one real token per call"):
        state.append(None, keys=k[:, :, :2], values=v[:, :, :2])


def test_rows_move_and_crop_drops_the_last_tokens_with_their_counts():
    valid = torch.ones(3, 6, dtype=torch.bool)
    valid[2, :3] = False
    state = _filled([4, 2], valid)
    keys = state.entries()["keys"].clone()
    state.reorder(torch.tensor([2, 0, 0]))
    torch.testing.assert_close(state.entries()["keys"], keys[[2, 0, 0]], rtol=0, atol=0)
    assert state.seen.tolist() == [3, 6, 6] and state.key_valid()[0].tolist() == valid[2].tolist()
    state.select(torch.tensor([1, 0]))
    assert state.batch_size == 2 and state.seen.tolist() == [6, 3]
    state.crop(-2)
    assert state.length == 4 and state.seen.tolist() == [4, 1]
    assert not state.buffers["keys"][:, :, 4:6].any()  # the dropped slots zeroed
    with pytest.raises(ValueError, match="^length must keep between 0 and the 4 tokens"):
        state.crop(9)
    with pytest.raises(ValueError, match=r"^index must hold rows in \[0, 2\)"):
        state.reorder(torch.tensor([0, 2]))


@pytest.mark.parametrize("fixed", [False, True], ids=["growing", "fixed"])
def test_state_dict_round_trips_through_torch_load_weights_only_and_decodes_on(fixed):
    k, v = _kv(T=8)
    state = _filled([5])
    if fixed:
        state.fix_capacity(8)
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    loaded = KVCacheState(SLOTS, layout="test")
    loaded.load_state_dict(torch.load(buf, weights_only=True))
    for s in (state, loaded):
        s.append(None, keys=k[:, :, 5:6], values=v[:, :, 5:6])
        if fixed:
            s.advance(1)
    assert loaded.fixed == fixed and loaded.capacity == state.capacity and loaded.length == 6
    for name in SLOTS:
        torch.testing.assert_close(loaded.entries()[name], state.entries()[name], rtol=0, atol=0)
    assert torch.equal(loaded.seen, state.seen) and torch.equal(loaded.key_valid(), state.key_valid())
    with pytest.raises(ValueError, match="^state_dict is loaded into a new state"):
        loaded.load_state_dict(state.state_dict())


@pytest.mark.parametrize("G,fixed", [(4, False), (2, False), (2, True)], ids=["mha", "gqa", "gqa-fixed"])
def test_softmax_cache_step_over_a_prefill_and_three_steps_is_the_causal_formula(G, fixed):
    B, H, T, D, P = 2, 4, 8, 8, 5
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, T, D, generator=g, dtype=F64)
    k, v = (torch.randn(B, G, T, D, generator=g, dtype=F64) for _ in range(2))
    valid = torch.ones(B, P, dtype=torch.bool)
    valid[1, :2] = False  # row 1 left-padded by 2 tokens
    state = KVCacheState(SLOTS)
    outs = [softmax_cache_step(q[:, :, :P], k[:, :, :P], v[:, :, :P], state, valid=valid)]
    if fixed:
        state.fix_capacity(T)
    for t in range(P, T):
        outs.append(softmax_cache_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state))
        if fixed:
            state.advance(1)
    out = torch.cat(outs, dim=2)
    torch.testing.assert_close(out[:1], softmax_attention_reference(q[:1], k[:1], v[:1], is_causal=True))
    alone = softmax_attention_reference(q[1:, :, 2:], k[1:, :, 2:], v[1:, :, 2:], is_causal=True)
    torch.testing.assert_close(out[1:, :, 2:], alone)
    assert not out[1, :, :2].any()  # padded queries see no real key: zeros
    assert state.seen.tolist() == [T, T - 2]


@pytest.mark.parametrize("bad,match", [
    (dict(query=torch.zeros(2, 4, 8)), "^query must be"),
    (dict(key=torch.zeros(3, 4, 1, 8)), "^key must have query's batch"),
    (dict(value=torch.zeros(2, 4, 2, 8)), "^value must have query's batch"),
    (dict(valid=torch.ones(2, 3, dtype=torch.bool)), r"^valid must be \(B, L\)"),
    (dict(state_rows=3), "^state holds 3 rows"),
], ids=["query-rank", "key-batch", "value-length", "valid-shape", "state-batch"])
def test_softmax_cache_step_refuses_bad_input_in_one_line_naming_it(bad, match):
    args = dict(query=torch.zeros(2, 4, 1, 8), key=torch.zeros(2, 4, 1, 8), value=torch.zeros(2, 4, 1, 8))
    args.update({name: t for name, t in bad.items() if name != "state_rows" and name != "valid"})
    state = KVCacheState(SLOTS)
    if "state_rows" in bad:
        state.start(bad["state_rows"], "cpu")
    with pytest.raises(ValueError, match=match) as raised:
        softmax_cache_step(args["query"], args["key"], args["value"], state, valid=bad.get("valid"))
    assert "\n" not in str(raised.value)
