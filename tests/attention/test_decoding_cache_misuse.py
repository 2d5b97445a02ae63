"""A decoding cache used where it cannot serve is a ValueError naming ``past_key_values``, before anything is written:
a call on another device than the one the cache was filled on (it failed deep inside torch, with nothing named), and
a model's cache whose layers have different lengths because a call through it was interrupted part-way (the next
step read positions from the first layer and mixed caches of different lengths silently)."""
from __future__ import annotations

import copy

import pytest
import torch

import mgk
from mgk.attention.registry import kind_variants, variant_name
from mgk.models import AttentionConfig, LMConfig, TransformerLM

E, H = 16, 2


@pytest.mark.parametrize("kind,options", kind_variants(), ids=[variant_name(k, v) for k, v in kind_variants()])
def test_a_cache_filled_on_one_device_is_refused_on_another(kind, options):
    options = {**options, **({"max_len": 8} if options.get("pi") == "soft_e" else {})}
    m = mgk.build_attention(kind, E, H, **options).eval()
    cache = m.new_cache()
    with torch.no_grad():
        m(torch.randn(1, 3, E), past_key_values=cache, is_causal=True, need_weights=False)
        moved = copy.deepcopy(m).to("meta")  # a second device that exists on every machine
        with pytest.raises(ValueError, match=r"^past_key_values lives on cpu but this call's inputs are on meta"):
            moved(torch.randn(1, 1, E, device="meta"), past_key_values=cache, is_causal=True, need_weights=False)
    assert cache.length == 3 and cache.seen.tolist() == [3]


@pytest.mark.parametrize("kind", ["softmax", "mgk", "mlk"])
def test_a_cache_left_uneven_by_an_interrupted_call_is_refused(kind, monkeypatch):
    torch.manual_seed(0)
    model = TransformerLM(LMConfig(vocab_size=30, d_model=E, num_layers=2, ffn_dim=32, dropout=0.0, cutoffs=(10,),
                                   attention=AttentionConfig(kind=kind, num_heads=H, head_dim=8))).eval()
    idx = torch.randint(0, 30, (2, 5), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache()
    with torch.no_grad():
        model.next_log_probs(idx, past_key_values=cache)
        second = model.blocks[1].attn

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(second, "forward", interrupted)
        with pytest.raises(KeyboardInterrupt):
            model.next_log_probs(idx[:, :1], past_key_values=cache)
        monkeypatch.undo()
        assert [layer.length for layer in cache] == [6, 5]
        with pytest.raises(ValueError, match=r"^past_key_values has layers of different lengths \[6, 5\]"):
            model.next_log_probs(idx[:, :1], past_key_values=cache)


@pytest.mark.parametrize("kind", mgk.attention_kinds())
@pytest.mark.parametrize("capacity", [0, -1, 2.5, True])
def test_every_kind_refuses_the_same_bad_capacity_when_made_and_when_reserving(kind, capacity):
    """A state-holding cache (linear, MLK) took any capacity, -1 included, where the slot caches refused it; and
    ``reserve`` took 0 or -1 on every kind."""
    m = mgk.build_attention(kind, E, H).eval()
    with pytest.raises(ValueError, match=r"^capacity must be None or a positive int"):
        m.new_cache(capacity)
    cache = m.new_cache()
    with torch.no_grad():
        m(torch.randn(1, 2, E), past_key_values=cache, is_causal=True, need_weights=False)
    with pytest.raises(ValueError, match=r"^capacity must be a positive int"):
        cache.reserve(capacity)
    with pytest.raises(ValueError, match=r"^capacity must be a positive int"):
        mgk.DecodingCache([cache]).reserve(capacity)


@pytest.mark.parametrize("kind", mgk.attention_kinds())
def test_a_float_padding_bias_while_decoding_is_refused_for_its_real_reason(kind):
    """A finite non-zero float key_padding_mask with a cache was refused because "linear attention forms no logits",
    for softmax and MGK too, which do take such a bias without a cache."""
    m = mgk.build_attention(kind, E, H).eval()
    bias = torch.zeros(1, 3)
    bias[0, 1] = -1.0
    cache = m.new_cache()
    with pytest.raises(mgk.functional.masks.MaskError, match=r"with past_key_values it only marks padding") as e:
        m(torch.randn(1, 3, E), key_padding_mask=bias, past_key_values=cache, is_causal=True, need_weights=False)
    assert "linear attention" not in str(e.value) and cache.length == 0


@pytest.mark.parametrize("kind,options", kind_variants(), ids=[variant_name(k, v) for k, v in kind_variants()])
def test_a_cache_shared_by_two_layers_of_the_same_sizes_is_refused(kind, options):
    """Two layers of one class and sizes (the layers of a stack) took one cache in turn without a word, each then
    attending to the other's keys; the layer that filled a cache is the only one it serves."""
    options = {**options, **({"max_len": 8} if options.get("pi") == "soft_e" else {})}
    first, second = (mgk.build_attention(kind, E, H, **options).eval() for _ in range(2))
    cache = first.new_cache()
    with torch.no_grad():
        first(torch.randn(1, 3, E), past_key_values=cache, is_causal=True, need_weights=False)
        with pytest.raises(ValueError, match=r"^past_key_values was filled by another \w+ layer"):
            second(torch.randn(1, 1, E), past_key_values=cache, is_causal=True, need_weights=False)
        first(torch.randn(1, 1, E), past_key_values=cache, is_causal=True, need_weights=False)  # its own layer
    assert cache.length == 4


_GRAD_REFUSED = (r"^past_key_values is for inference: this call would record gradients \(grad enabled and the input "
                 r"or a parameter requires grad\); decode under torch\.no_grad\(\) or torch\.inference_mode\(\), or "
                 r"call without past_key_values \(the uncached forward gives exact gradients\)$")


@pytest.mark.parametrize("kind,options", kind_variants(), ids=[variant_name(k, v) for k, v in kind_variants()])
def test_a_cached_call_that_would_record_gradients_is_refused_in_one_line(kind, options):
    """A backward through cached calls reached different parameters per kind (softmax's key projection
    nothing, MGK's log_sigma2 a third of its gradient) and crashed after a prefill plus steps ("modified by an
    inplace operation"). Caches are for inference: with grad enabled and the input or a parameter requiring grad,
    a prefill or a step is one ValueError, before anything is written; without anything to record (no_grad,
    inference_mode, or frozen parameters and input) it decodes as the uncached forward."""
    options = {**options, **({"max_len": 8} if options.get("pi") == "soft_e" else {})}
    torch.manual_seed(0)
    m = mgk.build_attention(kind, E, H, **options).eval()
    x = torch.randn(1, 5, E)
    call = dict(is_causal=True, need_weights=False)
    cache = m.new_cache()
    with pytest.raises(ValueError, match=_GRAD_REFUSED):  # a prefill, the parameters requiring grad
        m(x[:, :3], past_key_values=cache, **call)
    assert cache.length == 0 and cache.seen is None
    with torch.no_grad():
        want = m(x, **call)[0]
        first = m(x[:, :3], past_key_values=cache, **call)[0]
    with pytest.raises(ValueError, match=_GRAD_REFUSED):  # a step after a prefill
        m(x[:, 3:4], past_key_values=cache, **call)
    m.requires_grad_(False)
    with pytest.raises(ValueError, match=_GRAD_REFUSED):  # frozen parameters, the input requiring grad
        m(x[:, 3:4].clone().requires_grad_(), past_key_values=cache, **call)
    assert cache.length == 3 and cache.seen.tolist() == [3]
    step = m(x[:, 3:4], past_key_values=cache, **call)[0]  # nothing requires grad: no graph to record
    with torch.inference_mode():
        last = m(x[:, 4:], past_key_values=cache, **call)[0]
    assert not step.requires_grad
    torch.testing.assert_close(torch.cat([first, step, last], dim=1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["softmax", "mgk", "mlk"])
def test_a_model_decoding_with_gradients_enabled_is_refused_and_generate_runs_without(kind):
    """The LM's cached path is refused the same way, in its first layer before any layer's cache is written; generate
    decodes under no_grad."""
    torch.manual_seed(0)
    model = TransformerLM(LMConfig(vocab_size=30, d_model=E, num_layers=2, ffn_dim=32, dropout=0.0, cutoffs=(10,),
                                   attention=AttentionConfig(kind=kind, num_heads=H, head_dim=8))).eval()
    idx = torch.randint(0, 30, (2, 5), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache()
    with pytest.raises(ValueError, match=_GRAD_REFUSED):
        model.next_log_probs(idx, past_key_values=cache)
    assert [layer.length for layer in cache] == [0, 0]
    assert model.generate(idx, 3, temperature=0).shape == (2, 8)
