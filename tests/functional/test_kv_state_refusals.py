"""Refused calls on the per-token decoding state (KVCacheState) and softmax / GQA's cached call (softmax_cache_step):
every mistake is a one-line ValueError naming the argument and leaves the state as it was, so a corrected retry
gives what a clean state gives; states restored from one state dict are independent.
"""
from __future__ import annotations

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
