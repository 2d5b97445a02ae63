"""Every method transformers calls on a cache layer of a swapped model works or refuses in one line: reset gives an
empty cache of the same kind that generates as a fresh one; reordering, selecting, repeating and cropping move and
cut mgk's cache (a recurrent state refuses to crop); offloading is refused naming the method."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402
from mgk.attention.registry import attention_kinds  # noqa: E402
from mgk.integrations.hf import MGKCacheLayer  # noqa: E402

GENERATE = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)


def _cache_kw(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _filled(model, ids, mask):
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{_cache_kw(model): cache})
    return cache


@pytest.mark.parametrize("kind", attention_kinds())
def test_a_reset_cache_generates_as_a_fresh_one(hf_model, batch, kind):
    model = mgk.swap_attention(hf_model("llama"), kind)
    ids, mask = batch
    cache = transformers.DynamicCache(config=model.config)
    model.generate(ids, attention_mask=mask, **{_cache_kw(model): cache}, **GENERATE)
    kinds = [type(layer.mgk_cache) for layer in cache.layers]
    layouts = [layer.mgk_cache.layout for layer in cache.layers]
    cache.reset()
    assert cache.get_seq_length() == 0
    assert [type(layer.mgk_cache) for layer in cache.layers] == kinds
    assert [layer.mgk_cache.layout for layer in cache.layers] == layouts
    again = model.generate(ids, attention_mask=mask, **{_cache_kw(model): cache}, **GENERATE)
    fresh = model.generate(ids, attention_mask=mask, **GENERATE)
    assert torch.equal(again, fresh)
    assert cache.get_seq_length() == ids.shape[1] + 3  # the prompt and the tokens fed back


def test_offloading_is_refused_in_one_line(hf_model, batch):
    model = mgk.swap_attention(hf_model("gpt2"), "mgk")
    cache = _filled(model, *batch)
    with pytest.raises(NotImplementedError, match="^offload: ") as err:
        cache.offload(0)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ("smgk", "linear"))
def test_the_row_and_length_methods_move_and_cut_mgks_cache(hf_model, batch, kind):
    """transformers' names for them, delegated to mgk's cache: reorder_cache, batch_select_indices,
    batch_repeat_interleave, crop (negative: tokens to drop, 0: none, positive: the length kept, as older
    transformers passed it); a recurrent state says it cannot be cropped and refuses to drop tokens."""
    model = mgk.swap_attention(hf_model("gpt2"), kind)
    ids, mask = batch
    cache = _filled(model, ids, mask)
    mgk_cache = cache.layers[0].mgk_cache
    cache.reorder_cache(torch.tensor([1, 0]))
    assert mgk_cache.seen.tolist() == [6, 9]
    cache.batch_repeat_interleave(2)
    assert mgk_cache.seen.tolist() == [6, 6, 9, 9]
    cache.batch_select_indices(torch.tensor([2]))
    assert mgk_cache.seen.tolist() == [9] and cache.get_seq_length() == 9
    cache.crop(0)
    cache.crop(20)
    assert cache.get_seq_length() == 9
    assert cache.is_croppable == (kind == "smgk")
    if kind == "linear":
        with pytest.raises(ValueError, match="cannot be cropped") as err:
            cache.crop(-2)
        assert "\n" not in str(err.value)
        return
    cache.crop(-2)
    assert cache.get_seq_length() == 7 and mgk_cache.seen.tolist() == [7]
    cache.crop(5)
    assert cache.get_seq_length() == 5 and cache.get_mask_sizes(1, 0) == (6, 0)


def test_what_transformers_reads_of_a_cache_layer_comes_from_mgks_cache(hf_model, batch):
    model = mgk.swap_attention(hf_model("gpt2"), "smgk")
    ids, mask = batch
    cache = _filled(model, ids, mask)
    layer = cache.layers[0]
    assert isinstance(layer, MGKCacheLayer)
    assert cache.get_seq_length() == 9 and cache.get_mask_sizes(2, 0) == (11, 0) and cache.get_max_length() == -1
    assert not cache.is_compileable and cache.is_croppable and cache.is_sliding == [False, False]
    layer.prefetch()  # nothing was offloaded: nothing to fetch
    layer.lazy_initialization(None, None)
    with pytest.raises(RuntimeError, match="own forward"):
        layer.update(torch.zeros(1), torch.zeros(1))


def test_an_offloading_cache_is_refused_in_one_line(hf_model, batch):
    model = mgk.swap_attention(hf_model("gpt2"), "mgk")
    ids, mask = batch
    cache = transformers.DynamicCache(config=model.config, offloading=True)
    with pytest.raises(ValueError, match="offloading") as err, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{_cache_kw(model): cache})
    assert "\n" not in str(err.value)
