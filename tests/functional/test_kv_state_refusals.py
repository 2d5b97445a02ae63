"""Refused calls on the per-token decoding state (KVCacheState) and softmax / GQA's cached call (softmax_cache_step):
every mistake is a one-line ValueError naming the argument and leaves the state as it was, so a corrected retry
gives what a clean state gives; states restored from one state dict are independent.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mgk.functional import KVCacheState, softmax_cache_step

SLOTS = {"keys": 2, "values": 2}
B, H, G, D = 2, 4, 2, 4


def _chunk(L, seed, heads=G, dim=D, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g).to(dtype), torch.randn(B, heads, L, dim, generator=g).to(dtype),
            torch.randn(B, heads, L, dim, generator=g).to(dtype))


def _prefilled():
    state = KVCacheState(SLOTS, layout="softmax")
    softmax_cache_step(*_chunk(3, seed=0), state)
    return state


# (what is wrong, the call's arguments after the prefill, the name the message must hold)
REFUSED = [
    ("scale", lambda: (_chunk(1, 1), {"scale": 0.0}), "scale"),
    ("dropout_p", lambda: (_chunk(1, 1), {"dropout_p": 2.0}), "dropout_p"),
    ("mixed dtypes", lambda: ((_chunk(1, 1)[0], *_chunk(1, 1, dtype=torch.float64)[1:]), {}), "key"),
    ("heads not dividing", lambda: ((_chunk(1, 1)[0], *_chunk(1, 1, heads=3)[1:]), {}), "key"),
    ("key heads changed", lambda: ((_chunk(1, 1)[0], *_chunk(1, 1, heads=H)[1:]), {}), "keys"),
    ("head size changed", lambda: ((_chunk(1, 1)[0], *_chunk(1, 1, dim=2)[1:]), {}), "key"),
    ("valid not bool", lambda: (_chunk(1, 1), {"valid": torch.ones(B, 1, dtype=torch.long)}), "valid"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_refused_cached_call_leaves_the_state_as_it_was(case):
    _, make, name = case
    state = _prefilled()
    args, kwargs = make()
    with pytest.raises(ValueError, match=name) as err:
        softmax_cache_step(*args, state, **kwargs)
    assert "\n" not in str(err.value)
    assert state.length == 3 and state.seen.tolist() == [3, 3]
    retried, clean = softmax_cache_step(*_chunk(1, 1), state), softmax_cache_step(*_chunk(1, 1), _prefilled())
    torch.testing.assert_close(retried, clean, rtol=0, atol=0)


@pytest.mark.parametrize("state", [None, KVCacheState({"k": 2, "v": 2}), KVCacheState({"keys": 1, "values": 1})],
                         ids=["not a state", "other names", "other slot dims"])
def test_a_state_of_other_slots_is_refused_before_anything_is_written(state):
    with pytest.raises(ValueError, match="state must be a KVCacheState"):
        softmax_cache_step(*_chunk(3, 0), state)
    assert state is None or state.seen is None


def test_states_restored_from_one_state_dict_do_not_share_the_fixed_slot():
    state = _prefilled()
    state.fix_capacity(5)
    saved = state.state_dict()
    first, second = KVCacheState(SLOTS), KVCacheState(SLOTS)
    first.load_state_dict(saved)
    second.load_state_dict(saved)
    for _ in range(2):  # the first fills its capacity; the second must still have its own two slots
        softmax_cache_step(*_chunk(1, 1), first)
        first.advance(1)
    assert int(second.slot) == 3 and int(saved["slot"]) == 3
    softmax_cache_step(*_chunk(1, 1), second)
    second.advance(1)
    assert second.room() == 1


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "float"], ids=str)
def test_a_cast_to_anything_but_a_floating_dtype_is_refused_and_keeps_the_entries(dtype):
    state = _prefilled()
    before = state.buffers["keys"].clone()
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        state.cast(dtype)
    assert torch.equal(state.buffers["keys"], before)


@pytest.mark.parametrize("L", [-1, 0, True, 2.5, "1", 4], ids=repr)
def test_advance_takes_a_positive_int_within_the_room_left(L):
    """advance() counts the tokens of a fixed state's steps: anything but a positive int within the room left (3 of
    6 slots here) left the host counts wrong (a negative length, a float) for later calls to fail far from it."""
    state = _prefilled()
    state.fix_capacity(6)
    softmax_cache_step(*_chunk(1, 1), state)
    with pytest.raises(ValueError, match=r"^L must be a positive int at most the room left \(3 of 6") as err:
        state.advance(L)
    assert "\n" not in str(err.value) and state.length == 3 and state.room() == 3
    state.advance(1)
    assert state.length == 4


@pytest.mark.parametrize("count", [np.int64(1), torch.tensor(1)], ids=["numpy", "tensor"])
def test_advance_takes_an_integer_of_any_kind(count):
    state = _prefilled()
    state.fix_capacity(6)
    softmax_cache_step(*_chunk(1, 1), state)
    state.advance(count)
    assert state.length == 4 and type(state.length) is int


# (the argument moved to another device, how append is called with it)
ELSEWHERE = {
    "keys": lambda s, k, v: s.append(None, keys=k.to("meta"), values=v),
    "values": lambda s, k, v: s.append(None, keys=k, values=v.to("meta")),
    "valid": lambda s, k, v: s.append(torch.ones(B, 1, dtype=torch.bool, device="meta"), keys=k, values=v),
}


@pytest.mark.parametrize("fixed", [False, True], ids=["growing", "fixed"])
@pytest.mark.parametrize("name", ELSEWHERE)
def test_entries_on_another_device_are_refused_before_anything_is_written(name, fixed):
    """copy_ failed deep in torch ("Cannot copy out of meta tensor"), or carried the tokens across devices."""
    state = _prefilled()
    if fixed:
        state.fix_capacity(5)
    before = {n: t.clone() for n, t in state.buffers.items()}
    _, k, v = _chunk(1, 1)
    with pytest.raises(ValueError, match=f"^{name} is on meta but this softmax cache lives on cpu") as err:
        ELSEWHERE[name](state, k, v)
    assert "\n" not in str(err.value) and state.length == 3 and state.seen.tolist() == [3, 3]
    assert all(torch.equal(state.buffers[n], t) for n, t in before.items())
    if fixed:
        assert int(state.slot) == 3
