"""A model's decoding cache must be that model's: ``past_key_values`` of another layer count or of another type is a
ValueError naming the argument, before anything is written (a cache of more layers was taken silently, with the
extra layers' entries left stale; one of fewer layers failed with an IndexError)."""
from __future__ import annotations

import pytest
import torch

from mgk.models import AttentionConfig, LMConfig, TransformerLM


def _lm(layers, kind="mgk"):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=30, d_model=16, num_layers=layers, ffn_dim=32, dropout=0.0, cutoffs=(10,),
                   attention=AttentionConfig(kind=kind, num_heads=2, head_dim=8))
    return TransformerLM(cfg).eval()


@pytest.mark.parametrize("kind", ["softmax", "mgk", "mlk"])
@pytest.mark.parametrize("cache_layers", [1, 3])
def test_a_cache_of_another_layer_count_is_refused_and_left_as_it_was(kind, cache_layers):
    model, other = _lm(2, kind), _lm(cache_layers, kind)
    idx = torch.randint(0, 30, (2, 5), generator=torch.Generator().manual_seed(1))
    cache = other.new_cache()
    with torch.no_grad():
        other.next_log_probs(idx, past_key_values=cache)
        with pytest.raises(ValueError, match=rf"^past_key_values must be a DecodingCache of this model's 2 layers "
                                             rf".*got a DecodingCache of {cache_layers} layers$"):
            model.next_log_probs(idx[:, :1], past_key_values=cache)
    assert [layer.length for layer in cache] == [5] * cache_layers


@pytest.mark.parametrize("bad", [[None, None], (), "cache"])
def test_a_cache_that_is_not_a_decoding_cache_is_refused(bad):
    with pytest.raises(ValueError, match="^past_key_values must be a DecodingCache"):
        _lm(2).next_log_probs(torch.zeros(1, 3, dtype=torch.int64), past_key_values=bad)
