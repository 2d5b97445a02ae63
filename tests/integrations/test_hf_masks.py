"""Every mask a transformers model hands its attention, on a swapped model: sequences packed in one row (a
block-diagonal 4D mask, bool or float, or position_ids that restart at 0) give each sequence what it gives alone,
for every kind, forward and gradients, and softmax gives what the original model gives; per-position mixture
weights count a left-padded row's positions from its first real token; rotary embeddings rotate what a wrapped
projection (peft's LoRA, a hand-made wrapper) returns; output_attentions returns the maps; a training forward builds
no decoding cache."""
import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402
from mgk.attention.registry import attention_kinds  # noqa: E402
from mgk.integrations.hf import HFAttention, MGKCacheLayer  # noqa: E402

KINDS = attention_kinds()
DECODERS = ("llama", "mistral", "qwen2", "gpt2")
LENGTHS = (4, 6)  # two sequences packed in one row of 10 tokens


def _packed_ids(vocab: int = 40):
    g = torch.Generator().manual_seed(5)
    return torch.randint(3, vocab, (1, sum(LENGTHS)), generator=g)


def _restarting_positions():
    return torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)


def _block_mask(form: str):
    """(1, 1, L, L) causal block-diagonal mask of the packed sequences: bool True = may attend, or float (0 / the
    dtype's min, transformers' form)."""
    seq = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(len(seq), len(seq), dtype=torch.bool).tril()
    if form == "float":
        return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    return allowed[None, None]


def _packed_call(model, ids, how: str, **kw):
    positions = _restarting_positions()
    if how == "position_ids":  # what padding-free collators and Trainer pass: transformers builds the block mask
        return model(input_ids=ids, position_ids=positions, use_cache=False, **kw).logits
    return model(input_ids=ids, attention_mask=_block_mask(how), position_ids=positions, use_cache=False,
                 **kw).logits


def _alone(model, ids):
    """The logits of each packed sequence called alone, concatenated."""
    out, start = [], 0
    for n in LENGTHS:
        out.append(model(input_ids=ids[:, start:start + n], use_cache=False).logits)
        start += n
    return torch.cat(out, dim=1)


def _check_packed(arch, kind, how, hf_model):
    model = mgk.swap_attention(hf_model(arch), kind)
    ids = _packed_ids()
    packed = _packed_call(model, ids, how)
    torch.testing.assert_close(packed, _alone(model, ids), atol=2e-5, rtol=0)
    # gradients: the packed logits are the sequences' own, so their sum has the gradient of the sums alone
    params = [p for p in model.parameters() if p.requires_grad]
    g_packed = torch.autograd.grad(_packed_call(model, ids, how).square().sum(), params, allow_unused=True)
    g_alone = torch.autograd.grad(_alone(model, ids).square().sum(), params, allow_unused=True)
    for a, b in zip(g_packed, g_alone):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch, kind, how", [
    ("llama", "mgk", "position_ids"), ("gpt2", "softmax", "position_ids"), ("qwen2", "mlk", "bool"),
    ("mistral", "linear", "float"), ("llama", "smgk", "float"), ("gpt2", "gqa", "bool"),
])
def test_each_packed_sequence_gives_what_it_gives_alone(hf_model, arch, kind, how):
    """Before, the adapter read one row of the block mask as key padding: every sequence but the last was wrong."""
    _check_packed(arch, kind, how, hf_model)


@pytest.mark.slow
@pytest.mark.parametrize("how", ("position_ids", "bool", "float"))
@pytest.mark.parametrize("arch", DECODERS)
@pytest.mark.parametrize("kind", KINDS)
def test_each_packed_sequence_gives_what_it_gives_alone_everywhere(hf_model, arch, kind, how):
    _check_packed(arch, kind, how, hf_model)


@pytest.mark.parametrize("use_cache", (False, True))
@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_softmax_gives_what_the_original_gives_for_packed_rows(hf_model, arch, use_cache):
    """The swapped softmax model gives what the original gives for packed rows, a 4D float mask given by the caller
    included, except where the original is wrong: with a cache and no mask transformers builds no block mask from the
    restarting position_ids and mixes the sequences; the swapped model reads them and attends each sequence alone
    (TEST_CASES R30: never a silent mix)."""
    model = hf_model(arch)
    swapped = mgk.swap_attention(copy.deepcopy(model), "softmax")
    ids, positions = _packed_ids(), _restarting_positions()
    for mask in (None, _block_mask("float")):
        with torch.no_grad():
            ref = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=use_cache).logits
            got = swapped(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=use_cache).logits
            alone = _alone(swapped, ids)
        if use_cache and mask is None:
            assert (ref - alone).abs().max() > 1e-3  # the original mixes them
            ref = alone
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ("mgk", "linear"))
def test_a_packed_prefill_in_eval_mode_with_the_default_cache(hf_model, kind):
    """Eval mode, use_cache=True (the configs' default): the first call on a cache attends per sequence too."""
    model = mgk.swap_attention(hf_model("llama"), kind)
    ids = _packed_ids()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=_block_mask("bool"), position_ids=_restarting_positions()).logits
        torch.testing.assert_close(got, _alone(model, ids), atol=2e-5, rtol=0)


def test_a_query_dependent_mask_the_kind_cannot_take_is_refused_in_one_line(hf_model):
    """A sliding window is neither padding nor packing: softmax takes it as the original does, linear refuses."""
    L = 8
    window = torch.ones(L, L, dtype=torch.bool).tril() & ~torch.ones(L, L, dtype=torch.bool).tril(-3)
    ids = _packed_ids()[:, :L]
    model = hf_model("llama")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=window[None, None], use_cache=False).logits
        got = mgk.swap_attention(copy.deepcopy(model), "softmax")(input_ids=ids, attention_mask=window[None, None],
                                                                  use_cache=False).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    linear = mgk.swap_attention(model, "linear")
    with pytest.raises(ValueError) as err, torch.no_grad():
        linear(input_ids=ids, attention_mask=window[None, None], use_cache=False)
    assert "\n" not in str(err.value)


# -- per-position mixture weights under left padding --------------------------------------------------------------
PRIORS = [("mgk", {"pi_shape": "position", "max_len": 64}), ("mgk", {"pi": "soft_e", "max_len": 64}),
          ("mlk", {"pi_shape": "position", "max_len": 64})]


def _random_priors(model):
    """Per-position weights that differ by position (a fresh module's are uniform, which hides the position)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, HFAttention):
                mix = m.attn.mixture
                if mix.pi_mode == "soft_e":
                    pi = torch.rand(mix.pi.shape, generator=g) + 0.1
                    mix.pi.copy_(pi / pi.sum(1, keepdim=True))
                else:
                    mix.pi_logits.copy_(torch.randn(mix.pi_logits.shape, generator=g))
    return model


@pytest.mark.parametrize("kind, options", PRIORS, ids=("position", "soft_e", "mlk_position"))
def test_a_left_padded_row_reads_the_weights_of_its_own_positions(hf_model, batch, kind, options):
    """Uncached (what training uses) as alone, and cached generation equals uncached."""
    model = _random_priors(mgk.swap_attention(hf_model("gpt2"), kind, **options))
    ids, mask = batch
    positions = (mask.cumsum(1) - 1).clamp_min(0)  # GPT-2's own position embeddings: the row's too, as generate's
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[1, 3:]
        alone = model(input_ids=ids[1:, 3:], use_cache=False).logits[0]
    torch.testing.assert_close(padded, alone, atol=2e-5, rtol=0)
    kw = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))


# -- rotary embeddings of wrapped projections -----------------------------------------------------------------------
class _Wrapped(nn.Module):
    """A hand-made adapter: the wrapped projection (held under the same name) plus a low-rank term."""

    def __init__(self, inner: nn.Linear, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.q_proj = inner  # the same name as the projection: only the outermost module may be rotated
        self.down = nn.Parameter(torch.randn(2, inner.in_features, generator=g) * 0.3)
        self.up = nn.Parameter(torch.randn(inner.out_features, 2, generator=g) * 0.3)

    def forward(self, x):
        return self.q_proj(x) + x @ self.down.t() @ self.up.t()


def test_rotary_applies_to_what_a_wrapped_projection_returns(hf_model, batch):
    ids, mask = batch
    model = hf_model("llama", num_key_value_heads=4)  # key projections of the same shape in both
    swapped = mgk.swap_attention(copy.deepcopy(model), "softmax")
    for i, layer in enumerate(model.model.layers):
        for name in ("q_proj", "k_proj"):
            setattr(layer.self_attn, name, _Wrapped(getattr(layer.self_attn, name), seed=10 * i + len(name)))
            attn = swapped.model.layers[i].self_attn.attn
            setattr(attn, name, _Wrapped(getattr(attn, name), seed=10 * i + len(name)))
    with torch.no_grad():
        ref, got = model(input_ids=ids, attention_mask=mask).logits, swapped(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=0)


def test_rotary_applies_to_peft_lora_adapters(hf_model, batch):
    peft = pytest.importorskip("peft")
    ids, mask = batch
    model = hf_model("llama", num_key_value_heads=4)
    swapped = mgk.swap_attention(copy.deepcopy(model), "softmax")
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], init_lora_weights=False)
    torch.manual_seed(3)
    ref_model = peft.get_peft_model(model, peft.LoraConfig(**config))
    got_model = peft.get_peft_model(swapped, peft.LoraConfig(**config))
    lora = {n: p for n, p in ref_model.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for n, p in got_model.named_parameters():
            if "lora_" in n:
                p.copy_(lora[n.replace("self_attn.attn.", "self_attn.")])
    assert len(lora) == 8
    with torch.no_grad():
        ref, got = ref_model(input_ids=ids, attention_mask=mask).logits, got_model(input_ids=ids,
                                                                                    attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=0)


# -- output_attentions ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ("llama", "qwen2", "gpt2", "bert"))
def test_output_attentions_returns_the_maps(hf_model, batch, arch):
    """softmax: the original's maps (its eager attention) on the real queries; every kind: per-head maps. GPT-2
    does not pass output_attentions on to its layers: the model tells mgk's modules itself."""
    ids, mask = batch
    model = hf_model(arch)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    swapped = mgk.swap_attention(copy.deepcopy(model), "softmax")
    with torch.no_grad():
        got = swapped(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == len(ref) == 2
    real = mask.bool()
    for a, b in zip(got, ref):
        assert a.shape == b.shape == (2, 4, 9, 9)
        torch.testing.assert_close(a.permute(0, 2, 1, 3)[real], b.permute(0, 2, 1, 3)[real], atol=1e-5, rtol=0)
    for kind in KINDS:
        with torch.no_grad():
            maps = mgk.swap_attention(copy.deepcopy(model), kind)(input_ids=ids, attention_mask=mask,
                                                                  output_attentions=True).attentions
        assert len(maps) == 2 and all(m.shape == (2, 4, 9, 9) for m in maps), kind


@pytest.mark.parametrize("arch", ("llama", "gpt2", "bert"))
def test_output_attentions_reaches_every_route_in(hf_model, batch, arch):
    """A swapped base model (its class kept), config.output_attentions, generate's output_attentions: maps each
    time, and a call that does not ask gets none (the model stops telling the modules)."""
    ids, mask = batch
    model = mgk.swap_attention(hf_model(arch), "mgk")
    base = mgk.swap_attention(hf_model(arch).base_model, "mgk")
    with torch.no_grad():
        maps = base(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        assert len(maps) == 2 and all(m.shape == (2, 4, 9, 9) for m in maps)
        assert model(input_ids=ids, attention_mask=mask).attentions is None
        model.config._attn_implementation = "eager"  # transformers refuses config.output_attentions under sdpa
        model.config.output_attentions = True
        assert len(model(input_ids=ids, attention_mask=mask).attentions) == 2
        model.config.output_attentions = False
        assert model(input_ids=ids, attention_mask=mask).attentions is None
        if arch != "bert":
            out = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, use_cache=False,
                                 output_attentions=True, return_dict_in_generate=True)
            assert [len(step) for step in out.attentions] == [2, 2]
            assert out.attentions[1][0].shape == (2, 4, 10, 10)


def test_output_attentions_without_maps_is_refused_in_one_line(hf_model, batch, monkeypatch):
    ids, mask = batch
    model = mgk.swap_attention(hf_model("llama"), "mgk")
    attn = model.model.layers[0].self_attn.attn
    monkeypatch.setattr(attn, "_core", lambda *a, **k: (type(attn)._core(attn, *a, **k)[0], None))
    with pytest.raises(ValueError, match="output_attentions") as err, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert "\n" not in str(err.value)


# -- training builds no decoding cache ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_a_training_forward_builds_no_decoding_cache(hf_model, batch, arch):
    ids, mask = batch
    model = mgk.swap_attention(hf_model(arch), "mgk").train()
    cache = transformers.DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=True, past_key_values=cache)
    out.loss.backward()
    assert not any(isinstance(layer, MGKCacheLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 0
    with torch.no_grad():  # decoding still builds it
        model.eval()(input_ids=ids, attention_mask=mask, use_cache=True, past_key_values=cache)
    assert all(isinstance(layer, MGKCacheLayer) for layer in cache.layers) and cache.get_seq_length() == 9
    with pytest.raises(ValueError, match="training") as err:
        model.train()(input_ids=ids[:, :1], use_cache=True, past_key_values=cache)
    assert "\n" not in str(err.value)
