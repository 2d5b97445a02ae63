"""mgk.swap_attention on Hugging Face models: softmax keeps a tiny Llama's, Qwen2's, GPT-2's and BERT's
outputs; every registered kind runs forward and backward and trains; unsupported models are refused in one line."""
import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402
from mgk.attention.registry import attention_kinds  # noqa: E402
from mgk.integrations.hf import REQUIREMENT, HFAttention  # noqa: E402

ARCHS = ("llama", "qwen2", "mistral", "gpt2", "bert")


def _outputs(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits


def _reference(model, ids, mask):
    """The model's outputs under its eager attention, transformers' reference formula: in 4.56 and 5.0 GPT-2's SDPA path
    skipped scale_attn_by_inverse_layer_idx, which only its eager path applied (5.24 applies it in both)."""
    model.config._attn_implementation = "eager"
    try:
        return _outputs(model, ids, mask).detach()
    finally:
        model.config._attn_implementation = "sdpa"


@pytest.mark.parametrize("arch", ARCHS)
def test_softmax_keeps_the_outputs(hf_model, batch, arch):
    """With padding, with gradients on (the uncached path) and off (the cached prefill path)."""
    model = hf_model(arch)
    ids, mask = batch
    ref = _reference(model, ids, mask)
    swapped = mgk.swap_attention(copy.deepcopy(model), "softmax")
    assert any(isinstance(m, HFAttention) for m in swapped.modules())
    assert not any(type(m).__name__ in ("LlamaAttention", "Qwen2Attention", "MistralAttention", "GPT2Attention",
                                           "BertSelfAttention")
                   for m in swapped.modules())
    real = mask.bool()
    torch.testing.assert_close(_outputs(swapped, ids, mask)[real], ref[real], atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(_outputs(swapped, ids, mask)[real], ref[real], atol=1e-5, rtol=0)


def test_a_copy_of_a_swapped_rotary_model_rotates_with_its_own_modules(hf_model, batch):
    """The rotation hooks of a deep copy are the copy's (a hook left on the original would not rotate)."""
    ids, mask = batch
    swapped = mgk.swap_attention(hf_model("llama"), "softmax")
    torch.testing.assert_close(_outputs(copy.deepcopy(swapped), ids, mask), _outputs(swapped, ids, mask))


@pytest.mark.parametrize("arch", ("llama", "gpt2", "bert"))
def test_a_swapped_model_swaps_again_from_its_mgk_modules(hf_model, batch, arch):
    """softmax -> mgk -> softmax: the mgk -> mgk rules carry the query, value and output projections and the first
    key component, so the model's outputs come back."""
    ids, mask = batch
    model = hf_model(arch)
    ref = _reference(model, ids, mask)
    twice = mgk.swap_attention(mgk.swap_attention(copy.deepcopy(model), "mgk"), "softmax")
    torch.testing.assert_close(_outputs(twice, ids, mask)[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=0)
    wrappers = [m for m in twice.modules() if isinstance(m, HFAttention)]
    assert len(wrappers) == 2 and all(type(m.attn) is mgk.MultiheadAttention for m in wrappers)


def test_a_second_swap_that_changes_the_rotary_width_is_refused(hf_model):
    model = mgk.swap_attention(hf_model("llama"), "mgk")
    with pytest.raises(ValueError, match="rotary"):
        mgk.swap_attention(model, "softmax", num_heads=2, heads="slice")


def _toy_batch(arch):
    """A toy task: periodic sequences (next-token prediction) / their own tokens (BERT, masked LM)."""
    g = torch.Generator().manual_seed(2)
    start = torch.randint(3, 9, (8, 1), generator=g)
    ids = 3 + (start + torch.arange(16)) % 6
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("arch", ("llama", "gpt2", "bert"))
@pytest.mark.parametrize("kind", [k for k in attention_kinds() if k != "softmax"])
def test_every_kind_runs_backward_and_trains(hf_model, arch, kind):
    model = mgk.swap_attention(hf_model(arch), kind).train()
    ids, mask = _toy_batch(arch)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    no_cache = {} if arch == "bert" else {"use_cache": False}
    losses = []
    for step in range(50):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids, **no_cache).loss
        opt.zero_grad()
        loss.backward()
        if step == 0:
            attn = next(m for m in model.modules() if isinstance(m, HFAttention)).attn
            grads = [p.grad for p in attn.parameters() if p.requires_grad]
            assert grads and all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses[::10]


@pytest.mark.parametrize("kind", ("softmax", "mgk"))
def test_a_training_forward_with_the_default_cache_reaches_every_key(hf_model, batch, kind):
    """use_cache=True (the configs' default) in training: gradients as without a cache."""
    ids, mask = batch
    grads = []
    for use_cache in (False, True):
        model = mgk.swap_attention(hf_model("gpt2"), kind).train()
        model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=use_cache).loss.backward()
        grads.append(model.transformer.h[0].attn.attn.v_proj.weight.grad)
    torch.testing.assert_close(grads[1], grads[0])


def test_an_unsupported_model_is_refused_in_one_line(hf_model):
    config = transformers.OPTConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                    num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16)
    with pytest.raises(ValueError) as err:
        mgk.swap_attention(transformers.OPTForCausalLM(config), "mgk")
    text = str(err.value)
    assert "\n" not in text and "OPTForCausalLM" in text and "llama" in text and "gpt2" in text and "bert" in text


@pytest.mark.parametrize("arch, change, words", [
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
    ("llama", {"sliding_window": 4}, "sliding_window"),
    ("bert", {"is_decoder": True}, "is_decoder"),
])
def test_what_cannot_be_carried_is_refused_in_one_line(hf_model, arch, change, words):
    with pytest.raises(ValueError, match=words) as err:
        mgk.swap_attention(hf_model(arch, **change), "mgk")
    assert "\n" not in str(err.value)


def test_a_head_count_that_changes_the_rotary_width_is_refused(hf_model):
    with pytest.raises(ValueError, match="rotary") as err:
        mgk.swap_attention(hf_model("llama"), "mgk", num_heads=2, heads="slice")
    assert "\n" not in str(err.value)


def test_bad_options_are_refused_as_for_torch_models(hf_model):
    with pytest.raises(ValueError, match="num_keys"):
        mgk.swap_attention(hf_model("gpt2"), "softmax", num_keys=2)


def test_mgk_itself_never_imports_transformers():
    code = ("import sys, torch, mgk; mgk.swap_attention(torch.nn.MultiheadAttention(8, 2), 'mgk'); "
            "assert 'transformers' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_transformers_outside_the_supported_range_is_refused_in_one_line(hf_model, monkeypatch):
    """4.55 has no per-layer cache slots (Cache.layers), which mgk's cache layers take. The version is set on the
    module the integration reads: transformers replaces its own module in sys.modules when a model class is first
    imported (processing_utils' direct_transformers_import), which registering mgk's Auto classes does."""
    from mgk.integrations.hf import swap

    monkeypatch.setattr(swap.transformers, "__version__", "4.55.4")
    with pytest.raises(ImportError, match=r"transformers>=4\.56,<6") as err:
        mgk.swap_attention(hf_model("gpt2"), "mgk")
    assert "\n" not in str(err.value)


def test_the_integration_without_transformers_names_the_extra():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import mgk.integrations.hf\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "mgk.integrations.hf needs Hugging Face transformers: pip install -e '.[hf]' " \
                          "(transformers>=4.56,<6)"


def _extra(text: str, name: str) -> list[str]:
    """The requirements of optional dependency ``name`` in pyproject.toml's text (one line; tomllib is 3.11+)."""
    return re.findall(r'"([^"]+)"', re.search(rf"^{name} = \[(.*)\]$", text, re.M).group(1))


def test_pyproject_declares_the_range_the_integration_checks_and_what_trainer_needs():
    """The hf extra is the range the integration checks, and accelerate: transformers.Trainer refuses to start
    without it, and README's set-up lines install the hf extra only; peft (the LoRA tests) stays in hf-test."""
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    hf = _extra(text, "hf")
    assert hf[0] == REQUIREMENT
    assert [r for r in hf if re.match(r"accelerate\b", r)], hf
    assert [r for r in _extra(text, "hf-test") if re.match(r"peft\b", r)]
