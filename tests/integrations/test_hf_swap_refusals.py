"""Every refusal of swap_attention on a Hugging Face model leaves it exactly as it was (classes, config, state_dict),
also when the refusal comes half way (a calibration batch the model fails on, after its attention became mgk
softmax); a refusal that names another call names one that is accepted; adapters are never dropped silently."""
from __future__ import annotations

import ast
import re

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402

VOCAB = 40


def _state(model) -> tuple:
    """Every module's path and class, the config's class and fields, every tensor of the state_dict (the same
    objects, and their values)."""
    modules = [(n, type(m)) for n, m in model.named_modules(remove_duplicate=False)]
    tensors = {k: (v, v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
    return modules, type(model.config), model.config.to_dict(), tensors


def _assert_unchanged(model, before: tuple) -> None:
    modules, config_class, config, tensors = _state(model)
    assert modules == before[0] and config_class is before[1] and config == before[2]
    assert tensors.keys() == before[3].keys()
    for name, (value, _) in tensors.items():
        was, copy_ = before[3][name]
        assert value is was and torch.equal(value, copy_), name


def _hint(message: str) -> dict | None:
    """The keywords of the other call a refusal names (``...; instead: num_heads=4``), or None."""
    match = re.search(r"; instead: (.*)$", message)
    if match is None:
        return None
    return {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in match[1].split(", "))}


def _loss_fails(out):
    raise RuntimeError("loss_fn failed")


OUT_OF_VOCABULARY = torch.tensor([[3, VOCAB + 5, 4]])
REFUSALS = [  # (arch, kind, keywords, a hint is expected)
    ("llama", "mgk", {"num_heads": 2, "calibration": OUT_OF_VOCABULARY}, False),  # token ids past the vocabulary
    ("llama", "softmax", {"num_heads": 2, "heads": "prune", "calibration": torch.tensor([[3, 4, 5]]),
                          "loss_fn": _loss_fails}, False),
    ("llama", "mgk", {"num_heads": 8}, True),  # more heads: re-cutting the width would change the rotary width
    ("llama", "mgk", {"num_heads": 3}, True),
    ("llama", "mgk", {"head_dim": 4}, True),
    ("llama", "softmax", {"num_heads": 2, "heads": "slice"}, True),
    ("llama", "gqa", {"num_kv_heads": 3}, False),
    ("llama", "mgkk", {}, False),
    ("llama", "softmax", {"num_keys": 2}, False),
    ("llama", "mgk", {"calibration": OUT_OF_VOCABULARY}, False),
    ("gpt2", "mgk", {"num_heads": 2, "calibration": OUT_OF_VOCABULARY}, False),
    ("gpt2", "softmax", {"num_heads": 8}, True),
    ("gpt2", "mgk", {"num_heads": 3, "heads": "merge"}, True),
    ("bert", "mgk", {"num_heads": 2, "calibration": {"input_ids": OUT_OF_VOCABULARY}}, False),
]


@pytest.mark.parametrize("swapped", [False, True], ids=["original", "swapped-before"])
@pytest.mark.parametrize("arch, kind, keywords, hinted", REFUSALS,
                         ids=[f"{a}-{k}-{'-'.join(kw)}" for a, k, kw, _ in REFUSALS])
def test_a_refused_swap_changes_nothing_and_its_hint_is_accepted(hf_model, arch, kind, keywords, hinted, swapped):
    """On the original model and on one swapped before (to mgk: its HFAttention modules are converted in place)."""
    def build():
        model = hf_model(arch)
        return mgk.swap_attention(model, "mgk") if swapped else model

    model = build()
    before = _state(model)
    with pytest.raises(ValueError) as err:
        mgk.swap_attention(model, kind, **keywords)
    message = str(err.value)
    assert "\n" not in message
    _assert_unchanged(model, before)
    hint = _hint(message)
    assert (hint is not None) == hinted, message
    if hint is not None:  # the call it names goes through
        mgk.swap_attention(build(), kind, **{**keywords, **hint})


def test_the_refusal_of_more_heads_on_a_rotary_model_suggests_a_call_it_accepts(hf_model):
    """16 heads on an 8-head rotary Llama suggested head_dim=4 (heads='slice'), which the next call refused."""
    model = hf_model("llama", num_attention_heads=8, num_key_value_heads=8, head_dim=4)
    with pytest.raises(ValueError, match="more heads of one size") as err:
        mgk.swap_attention(model, "mgk", num_heads=16)
    hint = _hint(str(err.value))
    assert hint is not None and "heads" not in hint, str(err.value)
    attn = mgk.swap_attention(model, "mgk", **{"num_heads": 16, **hint}).model.layers[0].self_attn.attn
    assert attn.head_dim == 4


def test_a_peft_adapter_in_the_attention_is_refused_before_anything_changes(hf_model):
    """Swapping the base model of a PeftModel (as the refusal of the PeftModel said) dropped every LoRA tensor."""
    peft = pytest.importorskip("peft", reason="the LoRA tests need peft")
    adapted = peft.get_peft_model(hf_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                                     init_lora_weights=False))
    with pytest.raises(ValueError, match="PeftModel.*get_peft_model") as err:
        mgk.swap_attention(adapted, "softmax")
    assert "\n" not in str(err.value)
    base = adapted.get_base_model()
    for keywords in ({}, {"num_heads": 2, "calibration": torch.tensor([[3, 4, 5]])}):
        before = _state(base)
        with pytest.raises(ValueError, match=r"q_proj is peft's Linear \(an adapter\).*convert_lora_adapter") as err:
            mgk.swap_attention(base, "softmax", **keywords)
        assert "\n" not in str(err.value)
        _assert_unchanged(base, before)
    # adapters outside the attention (an MLP's) are not the swap's: the swap goes through and keeps them
    mlp = peft.get_peft_model(hf_model("llama"), peft.LoraConfig(r=2, target_modules=["up_proj"]))
    mgk.swap_attention(mlp.get_base_model(), "softmax")
    assert sum("lora_A" in n for n, _ in mlp.named_parameters()) == 2
