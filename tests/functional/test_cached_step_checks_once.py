"""A cached softmax / GQA step checks its operands once: softmax_cache_step checks them before the state is written
(a refused call leaves it as it was), and the attention over the state's entries runs on those checks instead of
repeating them through softmax_attention_cached's public entry (a few microseconds of a decoding step's budget)."""
import pytest
import torch

import mgk.functional.softmax as softmax_module
from mgk.functional import KVCacheState, softmax_attention_cached, softmax_cache_step


@pytest.mark.parametrize("kv_heads", (4, 2))
def test_each_step_checks_its_operands_once_and_equals_the_public_cached_call(monkeypatch, kv_heads):
    calls = []
    check = softmax_module.check_qkv
    monkeypatch.setattr(softmax_module, "check_qkv", lambda *a, **k: calls.append(1) or check(*a, **k))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g) for h in (4, kv_heads, kv_heads))
    state = KVCacheState({"keys": 2, "values": 2})
    valid = torch.tensor([[False, True, True, True, True], [True] * 5])
    for sl, val in ((slice(0, 3), valid[:, :3]), (slice(3, 4), valid[:, 3:4]), (slice(4, 5), valid[:, 4:5])):
        calls.clear()
        out = softmax_cache_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state, valid=val)
        assert len(calls) == 1
        entries = state.entries()
        want = softmax_attention_cached(q[:, :, sl], entries["keys"], entries["values"], attn_mask=state.attn_mask())
        torch.testing.assert_close(out, want, rtol=0, atol=0)
