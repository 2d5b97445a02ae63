"""Swapped Hugging Face models stay causal and generate: a future token never changes earlier logits
(transformers PR #45811: a custom attention without a mask function silently got no causal mask); generate's
cached greedy output equals the uncached one for every kind, left-padded; the cache holds mgk's tensors, of the
registry's size."""
import copy
import dataclasses
import inspect
from functools import partial

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402
from mgk.attention import registry  # noqa: E402
from mgk.attention.cache import LayerCache  # noqa: E402
from mgk.attention.mgk import MGKAttention, MGKOptions  # noqa: E402
from mgk.attention.registry import AttentionKind, attention_kinds, get_kind, register  # noqa: E402
from mgk.fields import spec  # noqa: E402
from mgk.integrations.hf import MGKCacheLayer  # noqa: E402

KINDS = attention_kinds()


def _cache_kw(model) -> str:
    """The name the installed transformers gives the cache argument ("cache" in late 5.x, "past_key_values")."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@pytest.mark.parametrize("implementation", ("sdpa", "eager"))
@pytest.mark.parametrize("padded", (False, True), ids=("unpadded", "left_padded"))
@pytest.mark.parametrize("arch", ("llama", "gpt2"))
@pytest.mark.parametrize("kind", KINDS)
def test_a_future_token_leaves_earlier_logits_unchanged(hf_model, batch, arch, kind, padded, implementation):
    """Unpadded under SDPA the model passes no mask at all: causality must come from the architecture."""
    model = hf_model(arch)
    model.config._attn_implementation = implementation
    model = mgk.swap_attention(model, kind)
    ids, mask = batch
    if not padded:
        mask = torch.ones_like(mask)
    t = 6
    changed = ids.clone()
    changed[:, t:] = 3 + (changed[:, t:] - 2) % (model.config.vocab_size - 3)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        b = model(input_ids=changed, attention_mask=mask, use_cache=False).logits
    real = mask[:, :t].bool()
    torch.testing.assert_close(b[:, :t][real], a[:, :t][real], atol=1e-5, rtol=0)
    assert not torch.allclose(b[:, t:], a[:, t:], atol=1e-4)  # the change is seen where it may be


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
@pytest.mark.parametrize("kind", KINDS)
def test_cached_greedy_generation_equals_uncached_left_padded(hf_model, batch, arch, kind):
    model = mgk.swap_attention(hf_model(arch), kind)
    ids, mask = batch
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, use_cache=True, **kw)
    uncached = model.generate(ids, use_cache=False, **kw)
    assert cached.shape == (2, 15)
    assert torch.equal(cached, uncached)
    # the left-padded row generates what it generates alone
    alone = model.generate(ids[1:, 3:], attention_mask=mask[1:, 3:], max_new_tokens=6, min_new_tokens=6,
                           do_sample=False, pad_token_id=0)
    assert torch.equal(alone[0], cached[1, 3:])


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
@pytest.mark.parametrize("kind", KINDS)
def test_sampled_generation_with_and_without_cache(hf_model, batch, arch, kind):
    model = mgk.swap_attention(hf_model(arch), kind)
    ids, mask = batch
    out = []
    for use_cache in (True, False):
        torch.manual_seed(3)
        out.append(model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=True, top_k=0,
                                  pad_token_id=0, use_cache=use_cache))
    assert out[0].shape == (2, 15) and torch.equal(out[0][:, :9], ids)
    assert torch.equal(out[0], out[1])  # the same draws from the same distributions


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
@pytest.mark.parametrize("kind", KINDS)
def test_the_cache_holds_the_kinds_tensors_of_the_registrys_size(hf_model, batch, arch, kind):
    options = {"num_keys": 3} if "num_keys" in get_kind(kind).options.names() else {}
    model = mgk.swap_attention(hf_model(arch), kind, **options)
    ids, mask = batch
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{_cache_kw(model): cache})
        step = torch.full((2, 1), 5)
        model(input_ids=step, attention_mask=torch.cat([mask, torch.ones_like(step)], 1), use_cache=True,
              **{_cache_kw(model): cache})
    spec = get_kind(kind)
    B, H, D, T = 2, 4, 8, 10
    # the options the swap took: gqa and gmgk on the Llama (4 heads over 2 key/value heads) keep its 2 groups
    taken = model.config.mgk_attention["options"]
    assert taken.get("num_kv_heads") == (2 if arch == "llama" and "num_kv_heads" in taken else None)
    expected = B * spec.cache.cache_bytes(spec.make_options(**taken), num_heads=H, head_dim=D, length=T)
    assert len(cache.layers) == 2 and cache.get_seq_length() == T
    for layer in cache.layers:
        assert isinstance(layer, MGKCacheLayer) and type(layer.mgk_cache) is LayerCache
        assert layer.keys is None and layer.values is None  # no HF copy of keys and values
        assert layer.nbytes() == expected
    if kind == "mgk":
        assert cache.layers[0].mgk_cache._buffers["keys"].shape[:3] == (B, H, 3)


@pytest.mark.parametrize("arch", ("llama", "qwen2", "gpt2"))
@pytest.mark.parametrize("kind", KINDS)
def test_a_filled_cache_with_another_batch_size_is_refused_naming_both(hf_model, batch, arch, kind):
    """generate with a cache filled for 2 rows, then prompts of 1 or 3 rows longer than, as long as and shorter
    than what it holds (6 tokens), and a one-token step: each refused in one line naming the cache and both batch
    sizes, before any check on what the rows hold; after cache.reset() the new batch generates."""
    ids, _ = batch
    model = mgk.swap_attention(hf_model(arch), kind)
    cache = transformers.DynamicCache(config=model.config)
    kw = _cache_kw(model)
    model.generate(ids[:, :5], max_new_tokens=2, do_sample=False, **{kw: cache})
    assert cache.get_seq_length() == 6
    g = torch.Generator().manual_seed(2)
    # a prompt shorter than the cache reaches GPT-2's layers as no tokens, which GPT2Model itself fails on first
    for rows, length in ((1, 9), (1, 6), (3, 7)) + (((3, 3),) if arch != "gpt2" else ()):
        prompt = torch.randint(3, 40, (rows, length), generator=g)
        with pytest.raises(ValueError, match=rf"^past_key_values: layer 0's cache was filled for a batch of 2 rows, "
                                             rf"this call has batch size {rows};") as err:
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2, do_sample=False,
                           **{kw: cache})
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"batch of 2 rows, this call has batch size 1;"), torch.no_grad():
        model(input_ids=ids[:1, :1], use_cache=True, **{kw: cache})
    cache.reset()
    prompt = ids[:1, :5]
    expected = model.generate(prompt, max_new_tokens=2, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=2, do_sample=False, **{kw: cache}), expected)


def test_a_cache_already_holding_hf_keys_is_refused_in_one_line(hf_model, batch):
    ids, mask = batch
    model = hf_model("gpt2")
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{_cache_kw(model): cache})
    swapped = mgk.swap_attention(copy.deepcopy(model), "mgk")
    with pytest.raises(ValueError, match="DynamicCache") as err, torch.no_grad():
        swapped(input_ids=ids[:, :1], use_cache=True, **{_cache_kw(model): cache})
    assert "\n" not in str(err.value)


@dataclasses.dataclass(frozen=True)
class _GroupOptions(MGKOptions):
    """One option more than MGK's, as a kind registered after the paper's six would have (e.g. gqa's
    num_kv_heads)."""

    groups: int = spec(1, ge=1, doc="test option")


@pytest.fixture
def later_kind():
    """A kind registered for one test (and removed after it), which no code of the integration names."""
    def factory(embed_dim, num_heads, groups=1, **kw):
        return MGKAttention(embed_dim, num_heads, keys="shifted", **kw)

    kind = register(AttentionKind("mgk-later", "mixture", "MGK-L", _GroupOptions, factory,
                                  partial(get_kind("smgk").flops.func, separate=False),
                                  dataclasses.replace(get_kind("smgk").cache)))
    yield kind
    del registry._REGISTRY[kind.name]


def test_a_kind_registered_later_swaps_trains_and_generates_through_the_same_path(hf_model, batch, later_kind):
    model = mgk.swap_attention(hf_model("llama"), "mgk-later", groups=2, num_keys=3)
    ids, mask = batch
    model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    kw = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    cache = transformers.DynamicCache(config=model.config)
    cached = model.generate(ids, use_cache=True, **{_cache_kw(model): cache}, **kw)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kw))
    assert type(cache.layers[0].mgk_cache) is LayerCache
