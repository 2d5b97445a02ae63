""":func:`mgk.swap_attention` for Hugging Face transformers models: read each architecture's attention module into
the form :mod:`mgk.swap` converts, and put the new module where the old one was."""
from __future__ import annotations

import dataclasses
import math
import sys

import torch
import transformers
from packaging.version import Version
from torch import Tensor, nn
from transformers import PreTrainedModel

from ...attention.registry import attention_options
from ...convert.layers import (
    AttentionSource,
    convert_module,
    convert_source,
    measure,
    refuse_adapters,
    swap_plan,
    with_key_scale,
)
from ...convert.rollback import unchanged_on_error
from .attention import HFAttention
from .auto import RECORD, adopt, base_model_type, record_of
from .versions import REQUIREMENT, TRANSFORMERS_RANGE

__all__ = ["SUPPORTED", "swap_attention", "swap_from_config"]

# model_type -> (layout, attention class): Llama, Mistral and Qwen2 share Llama's q/k/v/o projections and rotary
SUPPORTED = {"llama": ("llama", "LlamaAttention"), "mistral": ("llama", "MistralAttention"),
             "qwen2": ("llama", "Qwen2Attention"), "gpt2": ("gpt2", "GPT2Attention"),
             "bert": ("bert", "BertAttention")}
_SUPPORTED_TEXT = "llama, mistral, qwen2 (Llama family), gpt2, bert"


def swap_attention(model: PreTrainedModel, kind: str = "mgk", *, num_heads: int | None = None,
                   head_dim: int | None = None, heads: str | None = None, calibration=None, loss_fn=None,
                   seed: int = 0, **options) -> PreTrainedModel:
    """Replace, in place, every self-attention module of the transformers ``model`` (model types of
    :data:`SUPPORTED`) by an :class:`~mgk.integrations.hf.HFAttention` holding attention ``kind`` (any registered
    kind, with its ``options``), as :func:`mgk.swap_attention` does for torch models (which calls this).

    Carried over: the width, heads (unless ``num_heads``), head_dim (unless ``head_dim``; fewer heads keep it, by
    the rule ``heads``), attention dropout, device, dtype, train/eval mode and the weights by
    :func:`mgk.swap_attention`'s rules (softmax exact; ``calibration`` / ``loss_fn`` as there), read as:

    * Llama family: ``q/k/v_proj``, ``o_proj`` -> ``out_proj``. Grouped keys and values (num_key_value_heads <
      num_attention_heads) are repeated to every query head, as the model's attention repeats them, so softmax
      is exact; a kind with key/value groups (gqa, gmgk) takes the model's own groups unless ``num_kv_heads`` is
      given (with fewer heads, the most groups that divide both), so its cache stays as small as the model's.
      Rotary embeddings are applied to the query and keys (:class:`~mgk.integrations.hf.HFAttention`). Missing
      biases (Qwen2's o_proj) start at zero.
    * GPT-2: the packed ``c_attn`` (Conv1D, (E, 3E)) split into q/k/v, ``c_proj`` -> ``out_proj``; its residual
      dropout is kept.
    * BERT: ``query/key/value``, and the output ``dense`` of ``BertSelfOutput`` becomes ``out_proj`` (the dense
      layer is replaced by an identity; dropout and LayerNorm stay).

    A model scale other than 1 / sqrt(head_dim) (GPT-2's ``scale_attn_by_inverse_layer_idx`` or
    ``scale_attn_weights=False``) is folded into the query projection. A model swapped before is swapped again
    from its mgk modules (mgk -> mgk rules).

    The model and its config become mgk's classes (:mod:`mgk.integrations.hf.auto`: ``LlamaForCausalLM`` ->
    ``MGKLlamaForCausalLM``, ``LlamaConfig`` -> ``MGKLlamaConfig`` of model_type ``"mgk_llama"``), and the config
    records the swap (``config.mgk_attention``: kind, num_heads, head_dim, seed, options), so ``save_pretrained``
    then ``transformers.AutoModelForCausalLM.from_pretrained`` (after ``import mgk.integrations.hf``) gives this
    model back. The config's own fields state the heads the modules hold: a Llama-family config's
    ``num_attention_heads``, ``num_key_value_heads`` (the groups) and ``head_dim``; GPT-2's ``n_head`` and BERT's
    ``num_attention_heads`` where the heads keep the width (their head size is the width over the heads).

    Raises:
        ValueError in one line: a model type not in :data:`SUPPORTED` (naming the class and the supported ones),
        a PeftModel or an attention module holding peft adapter layers (the swap would drop them), cross-attention,
        a sliding window, BERT as a decoder, a ``head_dim`` (or heads="slice") that changes a rotary model's; an
        unknown kind or option, a shape no rule converts, a calibration batch the model fails on (as
        :func:`mgk.swap_attention`). ImportError for transformers outside :data:`TRANSFORMERS_RANGE`. Every
        refusal leaves the model as it was: its classes, config and state_dict.
    """
    _check_version()
    layout, attention_class = _family(model)
    options = _own_groups(model, layout, kind, num_heads, options)
    options = with_key_scale(kind, options, [m.attn if isinstance(m, HFAttention) else m for m in model.modules()
                                             if isinstance(m, HFAttention) or type(m).__name__ == attention_class])
    build = swap_plan(kind, num_heads, seed, options, head_dim=head_dim, heads=heads, calibration=calibration,
                      loss_fn=loss_fn)
    with unchanged_on_error(model):  # any refusal below leaves the model, its classes and config as they were
        _swap(model, layout, attention_class, build, calibration, loss_fn)
    return model


def _swap(model: PreTrainedModel, layout: str, attention_class: str, build: dict, calibration, loss_fn) -> None:
    """swap_attention's work once its arguments are checked; leaves the model half swapped when it raises (the
    caller puts it back)."""
    if calibration is not None:  # heads are measured in mgk's modules: first the same function as softmax ones
        if not any(isinstance(m, HFAttention) for m in model.modules()):
            _refuse_adapters(model, _places(model, attention_class))
            swap_attention(model, "softmax", seed=build["seed"])
        measure(build, model, calibration, loss_fn)
    places = _places(model, attention_class)
    if not places:
        raise ValueError(f"swap_attention: {type(model).__name__} holds no {attention_class} module")
    _refuse_adapters(model, places)
    for path, old in places:
        if isinstance(old, HFAttention):
            rotary_dim = old.attn.head_dim if old.rotary else None
            old.set_module(convert_module(old.attn, f"{path}.attn", build, rotary_dim=rotary_dim))
        else:
            _replace(model, path, old, layout, build)
    attn = next(m for m in model.modules() if isinstance(m, HFAttention)).attn
    options = build["options"]
    adopt(model, {"kind": build["kind"], "num_heads": attn.num_heads, "head_dim": attn.head_dim,
                  "seed": build["seed"],
                  "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}})
    _state_heads(model.config, layout, attn)


def _places(model: PreTrainedModel, attention_class: str) -> list[tuple[str, nn.Module]]:
    """(path, module) of every attention module to convert: the architecture's, or an HFAttention of a model
    swapped before (a BertAttention swapped before keeps its class; its .self is the HFAttention, met on its
    own)."""
    return [(path, m) for path, m in model.named_modules() if isinstance(m, HFAttention)
            or (type(m).__name__ == attention_class and not isinstance(getattr(m, "self", None), HFAttention))]


def _refuse_adapters(model: PreTrainedModel, places: list[tuple[str, nn.Module]]) -> None:
    for path, _ in places:
        refuse_adapters(model, path)


def _own_groups(model: PreTrainedModel, layout: str, kind: str, num_heads: int | None, options: dict) -> dict:
    """``options`` with ``num_kv_heads`` set to the model's own key/value groups (``num_key_value_heads``, or the
    largest number of groups that divides ``num_heads`` and theirs) for a kind that takes it and a Llama-family
    model that groups its keys, when the caller gave none: GQA onto such a model keeps its smaller cache instead of
    repeating its key/value heads to every query head."""
    if "num_kv_heads" in options or layout != "llama" or "num_kv_heads" not in attention_options(kind):
        return options
    config = model.config
    groups, query_heads = getattr(config, "num_key_value_heads", None), config.num_attention_heads
    if groups is None or groups == query_heads:
        return options
    return {**options, "num_kv_heads": math.gcd(num_heads or query_heads, groups)}


def _state_heads(config, layout: str, attn: nn.Module) -> None:
    """Make ``config`` state the heads the new modules hold: a Llama-family config its query heads, key/value
    heads (the groups of a grouped kind, else one per query head) and head size; GPT-2's and BERT's, whose head
    size is the width over the heads, their heads where the modules keep that width (heads of another size have no
    field there: ``config.mgk_attention`` records them)."""
    if layout == "llama":
        config.num_attention_heads, config.head_dim = attn.num_heads, attn.head_dim
        config.num_key_value_heads = getattr(attn, "num_kv_heads", attn.num_heads)
    elif attn.num_heads * attn.head_dim == config.hidden_size:
        config.num_attention_heads = attn.num_heads


def swap_from_config(model: PreTrainedModel) -> None:
    """Swap the freshly built ``model`` (an mgk class of :mod:`mgk.integrations.hf.auto`) as its config's
    ``mgk_attention`` record says: what those classes' ``__init__`` calls, before ``from_pretrained`` loads the
    weights. ValueError in one line when the record is missing or the swap it names gives another head_dim than
    the one recorded (an mgk version whose rules changed)."""
    record = record_of(model.config)
    # a head whose __init__ builds its base model through AutoModel.from_config (transformers 5's generic
    # classifiers) gets an mgk base model already swapped from this config: swapping it again would convert it
    if not any(isinstance(m, HFAttention) for m in model.modules()):
        options = dict(record.get("options", {}))
        if "num_kv_heads" in attention_options(record["kind"]):
            # a record without it was written before swaps defaulted to the model's groups: one group per head
            options.setdefault("num_kv_heads", None)
        if "key_scale" in attention_options(record["kind"]):
            # a record without it was written before conversions took a scale: its modules had c = 1
            options.setdefault("key_scale", 1.0)
        swap_attention(model, record["kind"], num_heads=record.get("num_heads"), head_dim=record.get("head_dim"),
                       seed=record.get("seed", 0), **options)
    built = next(m for m in model.modules() if isinstance(m, HFAttention)).attn.head_dim
    if record.get("head_dim") not in (None, built):
        raise ValueError(f"{type(model).__name__}: config.{RECORD} records head_dim {record['head_dim']}, but its "
                         f"swap builds head_dim {built}: the folder was saved by another mgk version")


def _check_version() -> None:
    low, high = (Version(bound.lstrip("<>=")) for bound in TRANSFORMERS_RANGE)
    if not low <= Version(transformers.__version__) < high:
        raise ImportError(f"mgk.integrations.hf supports {REQUIREMENT}, found transformers "
                          f"{transformers.__version__}: pip install '{REQUIREMENT}'")


def _family(model) -> tuple[str, str]:
    """(layout, attention class name) of ``model``; ValueError in one line for what cannot be swapped."""
    name = type(model).__name__
    if type(model).__module__.split(".")[0] == "peft":
        raise ValueError(f"swap_attention: {name} is peft's wrapper of a model with adapters: swap the model before "
                         "get_peft_model (LoRA targets: mgk.integrations.hf.lora_target_modules), or swap its "
                         "get_base_model() when no adapter sits in its attention modules")
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"swap_attention: {name} is a transformers class but not a PreTrainedModel: pass the model "
                         "(e.g. LlamaForCausalLM)")
    config = model.config
    model_type = base_model_type(getattr(config, "model_type", None))
    if model_type not in SUPPORTED:
        raise ValueError(f"swap_attention: {name} (model_type {model_type!r}) is not supported; supported model "
                         f"types: {_SUPPORTED_TEXT}")
    if getattr(config, "add_cross_attention", False) or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"swap_attention: {name} has cross-attention (config.add_cross_attention), which mgk's "
                         "integration does not replace; build it with add_cross_attention=False")
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError(f"swap_attention: {name} uses a sliding attention window (config.sliding_window="
                         f"{window}), which mgk's kinds do not apply; set config.sliding_window=None")
    if model_type == "bert" and config.is_decoder:
        raise ValueError(f"swap_attention: {name} is BERT as a decoder (config.is_decoder=True); mgk's integration "
                         "swaps BERT encoders only")
    return SUPPORTED[model_type]


def _replace(model: nn.Module, path: str, old: nn.Module, layout: str, build: dict) -> None:
    """Put the new module at ``path`` (BERT: in ``old.self``, the output's dense layer moved into it)."""
    parent, _, name = path.rpartition(".")
    config = model.config
    if layout == "llama":
        rotary = sys.modules[type(old).__module__].apply_rotary_pos_emb
        new = convert_source(_llama_source(old, config), path, build)
        wrapper = HFAttention(new, layer_idx=old.layer_idx, causal=True, rotary=rotary).train(old.training)
    elif layout == "gpt2":
        src = _gpt2_source(old, config)
        wrapper = HFAttention(convert_source(src, path, build), layer_idx=old.layer_idx, causal=True,
                              resid_dropout=old.resid_dropout).train(old.training)
    else:
        src = _bert_source(old, config)
        new = convert_source(src, path, build)
        # the wrapper takes the replaced module's mode: a new module is in training mode, and the adapter reads
        # the wrapper's mode to tell a training forward (uncached) from a decoding call
        old.self = HFAttention(new, layer_idx=getattr(old.self, "layer_idx", None), causal=False).train(
            old.self.training)
        old.output.dense = nn.Identity().train(old.output.dense.training)
        return
    setattr(model.get_submodule(parent), name, wrapper)


def _linear(weight: Tensor, bias: Tensor | None, scale: float = 1.0) -> dict[str, Tensor | None]:
    return {"weight": weight.detach() * scale, "bias": None if bias is None else bias.detach() * scale}


def _source(old: nn.Module, projections: dict[str, dict], *, embed_dim: int, num_heads: int, head_dim: int,
            dropout: float, scaling: float) -> AttentionSource:
    """A :class:`mgk.convert.layers.AttentionSource` of q/k/v/out projections (weight (out, in), bias or None): the
    model's scale folded into q (mgk's kinds scale by 1 / sqrt(head_dim)); a missing bias is zero when any projection
    has one (mgk's modules have one bias flag)."""
    factor = scaling * head_dim ** 0.5
    if factor != 1.0:
        projections["q_proj"] = {k: None if v is None else v * factor for k, v in projections["q_proj"].items()}
    bias = any(p["bias"] is not None for p in projections.values())
    first = next(old.parameters())
    if first.device.type == "meta":
        # a model being built by from_pretrained (on the meta device): only the shapes matter, the weights are
        # loaded over the new modules' after; the conversion rules read values (e.g. std), so give them zeros
        projections = {n: {k: None if t is None else torch.zeros(t.shape, dtype=t.dtype, device="cpu")
                           for k, t in p.items()}
                       for n, p in projections.items()}
    weights = {}
    for name, p in projections.items():
        weights[f"{name}.weight"] = p["weight"]
        if bias:
            zero = p["weight"].new_zeros(p["weight"].shape[0])
            weights[f"{name}.bias"] = p["bias"] if p["bias"] is not None else zero
    return AttentionSource(embed_dim=embed_dim, num_heads=num_heads, head_dim=head_dim, dropout=float(dropout),
                           bias=bias, batch_first=True, kdim=embed_dim, vdim=embed_dim, weights=weights, parameters={},
                           device=first.device, dtype=first.dtype, training=old.training,
                           trainable=any(p.requires_grad for p in old.parameters()))


def _llama_source(old: nn.Module, config) -> AttentionSource:
    H, D = config.num_attention_heads, old.head_dim

    def all_heads(proj: nn.Linear) -> dict:
        """Grouped key/value heads repeated to the H query heads (head h reads group h // (H / groups), as
        transformers' repeat_kv)."""
        groups = proj.weight.shape[0] // D
        w = proj.weight.detach().view(groups, D, -1).repeat_interleave(H // groups, dim=0).reshape(H * D, -1)
        b = None if proj.bias is None else proj.bias.detach().view(groups, D).repeat_interleave(H // groups, 0)
        return {"weight": w, "bias": None if b is None else b.reshape(-1)}

    projections = {"q_proj": _linear(old.q_proj.weight, old.q_proj.bias), "k_proj": all_heads(old.k_proj),
                   "v_proj": all_heads(old.v_proj), "out_proj": _linear(old.o_proj.weight, old.o_proj.bias)}
    src = _source(old, projections, embed_dim=config.hidden_size, num_heads=H, head_dim=D,
                  dropout=getattr(config, "attention_dropout", 0.0), scaling=old.scaling)
    return dataclasses.replace(src, rotary_dim=D)  # the rotary embeddings are D wide: every new head must be


def _gpt2_source(old: nn.Module, config) -> AttentionSource:
    E, H = old.embed_dim, old.num_heads
    D = E // H
    # Conv1D computes x @ W + b with W (in, out): nn.Linear's weight is its transpose
    w, b = old.c_attn.weight.detach(), old.c_attn.bias.detach()
    projections = {f"{p}_proj": _linear(w[:, i * E:(i + 1) * E].t(), b[i * E:(i + 1) * E])
                   for i, p in enumerate("qkv")}
    projections["out_proj"] = _linear(old.c_proj.weight.t(), old.c_proj.bias)
    scaling = (D ** -0.5 if old.scale_attn_weights else 1.0)
    if old.scale_attn_by_inverse_layer_idx:
        scaling /= float(old.layer_idx + 1)
    return _source(old, projections, embed_dim=E, num_heads=H, head_dim=D, dropout=config.attn_pdrop,
                   scaling=scaling)


def _bert_source(old: nn.Module, config) -> AttentionSource:
    attn = old.self
    H, D = attn.num_attention_heads, attn.attention_head_size
    projections = {"q_proj": _linear(attn.query.weight, attn.query.bias),
                   "k_proj": _linear(attn.key.weight, attn.key.bias),
                   "v_proj": _linear(attn.value.weight, attn.value.bias),
                   "out_proj": _linear(old.output.dense.weight, old.output.dense.bias)}
    return _source(old, projections, embed_dim=config.hidden_size, num_heads=H, head_dim=D,
                   dropout=config.attention_probs_dropout_prob, scaling=getattr(attn, "scaling", D ** -0.5))

