"""PEFT LoRA on swapped models: an adapter saved on the original model, converted, gives the softmax swap the
original's outputs (Llama with grouped keys, GPT-2's packed projection and per-layer scale, BERT); a projection a
kind does not keep is refused in one line; LoRA trains on a swapped model through the targets mgk names and its
adapter reloads on the model loaded from its folder."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")
peft = pytest.importorskip("peft", reason="the LoRA tests need peft")

import mgk  # noqa: E402
from mgk.integrations.hf.adapters import convert_lora_adapter, lora_target_modules  # noqa: E402

ORIGINAL_TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"], "gpt2": ["c_attn", "c_proj"],
                    "bert": ["query", "key", "value", "dense"]}


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _adapter(model, targets, out):
    """A LoRA adapter of random A and B (peft's zero B would add nothing) saved to ``out``; the adapted model."""
    torch.manual_seed(4)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets,
                                                         init_lora_weights=False))
    adapted.save_pretrained(out)
    return adapted


@pytest.mark.filterwarnings("ignore:fan_in_fan_out")
@pytest.mark.parametrize("arch", ("llama", "gpt2", "bert"))
def test_an_adapter_of_the_original_model_converted_keeps_its_outputs_on_the_softmax_swap(hf_model, batch, tmp_path,
                                                                                           arch):
    ids, mask = batch
    ref = _logits(_adapter(hf_model(arch), ORIGINAL_TARGETS[arch], tmp_path / "original").eval(), ids, mask)
    swapped = mgk.swap_attention(hf_model(arch), "softmax")
    convert_lora_adapter(tmp_path / "original", swapped, tmp_path / "converted")
    got = _logits(peft.PeftModel.from_pretrained(swapped, tmp_path / "converted").eval(), ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)


def test_a_projection_the_kind_does_not_keep_is_refused_in_one_line(hf_model, tmp_path):
    """MGK's key projection holds M components: a key adapter has no counterpart; query and value adapters do."""
    _adapter(hf_model("llama"), ["k_proj"], tmp_path / "keys")
    with pytest.raises(ValueError, match="k_proj.*target_modules") as err:
        convert_lora_adapter(tmp_path / "keys", mgk.swap_attention(hf_model("llama"), "mgk"), tmp_path / "out")
    assert "\n" not in str(err.value)
    _adapter(hf_model("llama"), ["q_proj", "v_proj"], tmp_path / "qv")
    convert_lora_adapter(tmp_path / "qv", mgk.swap_attention(hf_model("llama"), "mgk"), tmp_path / "out")


def test_lora_trains_on_a_swapped_model_and_reloads_on_its_saved_folder(hf_model, batch, tmp_path):
    ids, mask = batch
    model = mgk.swap_attention(hf_model("llama"), "mgk")
    with pytest.raises(ValueError, match="target_modules"):  # peft's defaults are keyed by model_type
        peft.get_peft_model(mgk.swap_attention(hf_model("llama"), "mgk"), peft.LoraConfig(r=2))
    model.save_pretrained(tmp_path / "base")
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=lora_target_modules(model)))
    opt = torch.optim.SGD([p for p in adapted.parameters() if p.requires_grad], lr=0.5)
    adapted.train()(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    opt.step()
    adapted.save_pretrained(tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(reloaded, ids, mask), _logits(adapted.eval(), ids, mask))
