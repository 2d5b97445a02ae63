"""``generate(..., compile=...)`` asks each layer's kind when its cache may be fixed (``cache_ready_to_fix``) instead of
applying MGK's centre rule to every kind: softmax's compiled steps start right after a one-token prompt, MGK's once
every row has seen two real tokens; a CompiledStep over a provisional MGK cache is refused in one line."""
from __future__ import annotations

import pytest
import torch

from mgk.models import generation
from mgk.models.compiled_decode import CompiledStep
from models.test_generate import V, _lm


@pytest.mark.parametrize("kind,seen_at_fix", [("softmax", 1), ("mgk", 2)])
def test_compiled_steps_start_when_the_kind_lets_its_cache_be_fixed(kind, seen_at_fix, monkeypatch):
    model = _lm(kind, layers=1)
    made, real = [], generation.CompiledStep

    def spy(model, cache, capacity, backend):
        made.append(int(cache.seen.min()))  # the real tokens each row had when the compiled steps took over
        return real(model, cache, capacity, backend)

    monkeypatch.setattr(generation, "CompiledStep", spy)
    idx = torch.randint(0, V, (2, 1), generator=torch.Generator().manual_seed(7))
    torch._dynamo.reset()
    got = model.generate(idx, 5, temperature=0, compile="eager")
    assert made == [seen_at_fix]
    assert torch.equal(got, model.generate(idx, 5, temperature=0))


def test_a_provisional_mgk_cache_is_not_fixed():
    model = _lm("mgk", layers=1).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model.next_log_probs(torch.zeros(2, 1, dtype=torch.long), past_key_values=cache)
    assert not model.blocks[0].attn.cache_ready_to_fix(cache[0])
    with pytest.raises(ValueError, match="cache: layer 0's MGKAttention does not let its cache be fixed") as info:
        CompiledStep(model, cache, 8, "eager")
    assert "\n" not in str(info.value)
