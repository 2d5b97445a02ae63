"""PEFT LoRA adapters and swapped models.

A swap moves each attention projection one level down (Llama's ``self_attn.q_proj`` is ``self_attn.attn.q_proj``,
GPT-2's packed ``c_attn`` becomes ``attn.attn.q_proj / k_proj / v_proj``, BERT's ``attention.self.query`` is
``attention.self.attn.q_proj`` and ``attention.output.dense`` ``attention.self.attn.out_proj``) and the mgk model
types are not in peft's table of default LoRA targets. :func:`lora_target_modules` gives the targets to pass
``LoraConfig``; :func:`convert_lora_adapter` rewrites an adapter saved on the original model for the swapped one.
peft itself is imported by neither (they read and write its files).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from torch import Tensor, nn
from transformers import PreTrainedModel

from ...atomic import write_bytes_atomic, write_text_atomic
from .attention import HFAttention
from .auto import base_model_type

__all__ = ["convert_lora_adapter", "lora_target_modules"]

# peft's default LoRA targets of each base type, as the swapped model names those projections
_DEFAULT_TARGETS = {"llama": ["q_proj", "v_proj"], "mistral": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"],
                    "gpt2": ["q_proj", "k_proj", "v_proj"], "bert": ["q_proj", "v_proj"]}
_PREFIX = "base_model.model."
_LORA = re.compile(r"^(?P<module>.+)\.(?P<part>lora_[AB])\.weight$")


def lora_target_modules(model: PreTrainedModel) -> list[str]:
    """The ``target_modules`` for ``peft.LoraConfig`` on the swapped ``model`` that match what peft targets by
    default on the original architecture (Llama family and BERT: the query and value projections; GPT-2's packed
    ``c_attn``: query, key and value), by the names the mgk modules give them. peft cannot find a default itself:
    its table is keyed by model_type, and a swapped model's is ``mgk_llama``, ... ValueError for a model that was
    not swapped."""
    if not any(isinstance(m, HFAttention) for m in model.modules()):
        raise ValueError(f"lora_target_modules: {type(model).__name__} holds no mgk attention: call "
                         "mgk.swap_attention first (an unswapped model takes peft's defaults)")
    return list(_DEFAULT_TARGETS[base_model_type(model.config.model_type)])


def convert_lora_adapter(adapter_dir, model: PreTrainedModel, out_dir) -> Path:
    """Write to ``out_dir`` the LoRA adapter in ``adapter_dir`` (saved by peft on the original, unswapped model)
    rewritten for the swapped ``model``, so that ``peft.PeftModel.from_pretrained(model, out_dir)`` loads it.

    Each attention projection's ``lora_A`` / ``lora_B`` go to the projection that replaced it, in the form the swap
    carried the weight: GPT-2's ``c_attn`` adapter is split into the query, key and value ones (``lora_A`` shared,
    ``lora_B``'s rows split), grouped key/value heads (Llama's ``num_key_value_heads``) have ``lora_B``'s rows
    repeated to every query head, a scale folded into the query projection (GPT-2's per-layer scale) scales its
    ``lora_B``. With the softmax kind the model with the converted adapter computes what the original did with its
    adapter. Other modules' adapters (MLP, ...) are kept as they are. ``target_modules`` becomes the list of the
    adapted modules' names.

    Args:
        adapter_dir: a folder with ``adapter_config.json`` and ``adapter_model.safetensors``.
        model: the swapped model (``mgk.swap_attention``, or loaded through the Auto classes).
        out_dir: the folder to write (created).
    Returns:
        ``out_dir`` as a Path.
    Raises:
        ValueError in one line: a model that was not swapped; an adapter other than LoRA, or one using DoRA,
        ``rank_pattern`` / ``alpha_pattern`` or ``layers_to_transform``; an attention projection whose swapped
        counterpart has another shape (a kind that does not keep it: MGK's and MLK's M key components, GQA's
        fewer key/value heads, fewer heads): drop it from ``target_modules`` and train that adapter anew.
    """
    from safetensors.torch import load_file, save

    if not any(isinstance(m, HFAttention) for m in model.modules()):
        raise ValueError(f"convert_lora_adapter: {type(model).__name__} holds no mgk attention: call "
                         "mgk.swap_attention first")
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    _check_adapter_config(config)
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, value in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
        match = _LORA.match(key)
        if not key.startswith(_PREFIX) or match is None:
            raise ValueError(f"convert_lora_adapter: {key} is not a LoRA weight of a peft adapter (expected "
                             f"{_PREFIX}<module>.lora_A.weight / lora_B.weight)")
        pairs.setdefault(match["module"][len(_PREFIX):], {})[match["part"]] = value
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[str, Tensor] = {}
    for path, lora in pairs.items():
        for new_path, b in _mapped(model, path, lora["lora_B"]):
            real = names[id(_linear_at(model, new_path, lora["lora_A"], b))]
            out[f"{_PREFIX}{real}.lora_A.weight"] = lora["lora_A"].clone()  # GPT-2: q, k and v share A
            out[f"{_PREFIX}{real}.lora_B.weight"] = b.contiguous()
    config.update(target_modules=sorted({k[len(_PREFIX):].rsplit(".", 2)[0] for k in out}), fan_in_fan_out=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "adapter_config.json", json.dumps(config, indent=2, sort_keys=True))
    write_bytes_atomic(out_dir / "adapter_model.safetensors", save(out))
    return out_dir


def _check_adapter_config(config: dict) -> None:
    if config.get("peft_type") != "LORA":
        raise ValueError(f"convert_lora_adapter: only LoRA adapters are converted, got peft_type "
                         f"{config.get('peft_type')!r}")
    for field in ("use_dora", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if config.get(field):
            raise ValueError(f"convert_lora_adapter: the adapter uses {field}={config[field]!r}, which names the "
                             "original modules; convert one without it")


def _mapped(model: PreTrainedModel, path: str, b: Tensor) -> list[tuple[str, Tensor]]:
    """(path in the swapped model, lora_B there) of the adapter of the original module at ``path``."""
    config = model.config
    layout = base_model_type(config.model_type)
    if layout == "gpt2":
        if (m := re.fullmatch(r"(.*\.h\.(\d+)\.attn)\.c_attn", path)) is not None:
            q, k, v = b.chunk(3, dim=0)
            return [(f"{m[1]}.attn.q_proj", q * _gpt2_q_factor(config, int(m[2]))), (f"{m[1]}.attn.k_proj", k),
                    (f"{m[1]}.attn.v_proj", v)]
        if (m := re.fullmatch(r"(.*\.attn)\.c_proj", path)) is not None:
            return [(f"{m[1]}.attn.out_proj", b)]
    elif layout == "bert":
        if (m := re.fullmatch(r"(.*\.attention)\.self\.(query|key|value)", path)) is not None:
            return [(f"{m[1]}.self.attn.{m[2][0]}_proj", b)]
        if (m := re.fullmatch(r"(.*\.attention)\.output\.dense", path)) is not None:
            return [(f"{m[1]}.self.attn.out_proj", b)]
    elif (m := re.fullmatch(r"(.*\.self_attn)\.([qkvo])_proj", path)) is not None:  # the Llama family
        name = "out" if m[2] == "o" else m[2]
        return [(f"{m[1]}.attn.{name}_proj", _all_heads(b, config) if m[2] in "kv" else b)]
    return [(path, b)]


def _all_heads(b: Tensor, config) -> Tensor:
    """lora_B (G * D, r) of grouped key/value heads repeated to the H query heads, as the swap repeats the weight."""
    H = config.num_attention_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    groups = b.shape[0] // D
    return b.view(groups, D, -1).repeat_interleave(H // groups, dim=0).reshape(H * D, -1)


def _gpt2_q_factor(config, layer: int) -> float:
    """GPT-2's attention scale of ``layer`` times sqrt(head_dim): what the swap folds into the query projection."""
    D = config.n_embd // config.n_head
    scaling = D ** -0.5 if config.scale_attn_weights else 1.0
    if config.scale_attn_by_inverse_layer_idx:
        scaling /= float(layer + 1)
    return scaling * D ** 0.5


def _linear_at(model: nn.Module, path: str, a: Tensor, b: Tensor) -> nn.Linear:
    """The nn.Linear at ``path`` of the swapped model, checked to take an adapter of ``a`` (r, in) and ``b``
    (out, r)."""
    try:
        module = model.get_submodule(path)
    except AttributeError:
        module = None
    if not isinstance(module, nn.Linear) and not type(module).__name__ == "Conv1D":
        raise ValueError(f"convert_lora_adapter: the swapped model has no projection {path} for the adapter's module "
                         "there: drop it from target_modules")
    shape = tuple(module.weight.shape) if isinstance(module, nn.Linear) else tuple(module.weight.shape[::-1])
    if shape != (b.shape[0], a.shape[1]):
        raise ValueError(f"convert_lora_adapter: {path} is {shape[0]} x {shape[1]} in the swapped model but the "
                         f"adapter's is {b.shape[0]} x {a.shape[1]} (the kind does not keep that projection): drop it "
                         "from target_modules and train that adapter anew")
    return module

