"""A tiny Llama (4 query heads over 2 key/value heads) swapped to grouped mixture keys (gmgk, 2 groups) generates
with its cache what it generates without, for both key modes, left-padded; the cache holds the 2 groups."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402
from mgk.attention.registry import get_kind, make_options  # noqa: E402


@pytest.mark.parametrize("keys", ["separate", "shifted"])
def test_swapped_llama_generates_the_same_tokens_with_and_without_the_cache(hf_model, batch, keys):
    model = mgk.swap_attention(hf_model("llama"), "gmgk", num_kv_heads=2, keys=keys)
    ids, mask = batch
    kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, use_cache=True, **kw)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kw))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        # the cache argument's name in the installed transformers ("cache" in late 5.x, "past_key_values")
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{name: cache})
    layer = cache.layers[0].mgk_cache
    assert layer._buffers["values"].shape[:2] == (2, 2)  # B rows of G = 2 groups, not the 4 query heads
    assert layer.nbytes() == 2 * get_kind("gmgk").cache.cache_bytes(make_options("gmgk", num_kv_heads=2, keys=keys),
                                                                     num_heads=4, head_dim=8, length=9)
