"""Converting one attention module into another kind, weights carried over: what :func:`mgk.swap_attention` does
at each place it replaces, and what :mod:`mgk.integrations.hf` calls for the attention modules of Hugging Face
models. The source is read into an :class:`AttentionSource` (its configuration and its projections as a multi-head
layer's); for fewer heads a rule of :mod:`mgk.convert.regroup` merges, pools or keeps heads, then the new kind's
own conversion rule (its module's ``load_projections``, in the kind's file) makes the new parameters."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..attention.base import AttentionBase, positive_int
from ..attention.registry import build_attention, check_options, get_kind
from ..attention.softmax import from_torch_state_dict
from ..seeds import check_seed
from .head_measures import calibrate
from .regroup import RULES, apply_plan, choose_rule, plan_heads

__all__ = ["AttentionSource", "CONVERSION_KEY_SCALE", "check_shape", "convert_module", "convert_source",
           "load_conversion", "measure", "refuse_adapters", "swap_plan", "with_key_scale"]

# The key_scale c (MGKOptions) of a layer converted into an MGK-family kind from dot-product attention: the key-norm
# term -c^2 |k|^2 / (2 sigma^2) that the conversion cannot carry shrinks by c^2 (2^-24 = 6e-8: 4e-6 at SmolLM2-135M's
# largest keys, |k| = 25, sigma^2 = 8), and a power of two makes q / c and c k exact, so the dot product is the
# source's bit for bit. Its cost: queries 4096 times their size, beyond float16's range (65504) for |q| > 16;
# bfloat16 and float32 hold them (docs/retrofit.md).
CONVERSION_KEY_SCALE = 2.0 ** -12


@dataclass
class AttentionSource:
    """What swap_attention reads from one attention module (torch's, mgk's, or a Hugging Face one read by
    :mod:`mgk.integrations.hf`): its configuration and its projections as a multi-head layer's."""

    embed_dim: int
    num_heads: int
    head_dim: int
    dropout: float
    bias: bool
    batch_first: bool
    kdim: int
    vdim: int
    weights: dict[str, Tensor]  # q_proj.*, v_proj.*, out_proj.* and the key projection as k_proj.*
    parameters: dict[str, Tensor]  # the module's own parameters by name (mgk modules only; else empty)
    device: torch.device
    dtype: torch.dtype
    training: bool
    trainable: bool = True  # whether any of the old module's parameters required grad (a frozen layer stays frozen)
    rotary_dim: int | None = None  # the head size the model's rotary embeddings fix (Llama family), else None


def swap_plan(kind: str, num_heads: int | None, seed: int, options: dict, *, head_dim: int | None = None,
              heads: str | None = None, calibration=None, loss_fn=None) -> dict:
    """What every replacement of one swap_attention call is built from (kind, heads, head size, the rule for fewer
    heads, seed, options, the measures of a calibration batch (:func:`measure`) and the memo of modules already
    replaced); ValueError naming a bad option, ``num_heads``, ``head_dim``, ``heads``, or a ``calibration`` /
    ``loss_fn`` no rule would use."""
    check_options(kind, options)
    for value, name in ((num_heads, "num_heads"), (head_dim, "head_dim")):
        if value is not None:
            positive_int(value, name)
    if heads is not None and heads not in RULES:
        raise ValueError(f"heads must be one of {', '.join(RULES)}, got {heads!r}")
    if loss_fn is not None and calibration is None:
        raise ValueError("loss_fn= ranks heads on the calibration= batch: give calibration= too")
    if calibration is not None and (heads == "slice" or (num_heads is None and head_dim is None)):
        raise ValueError("calibration= chooses which heads to merge, pool or keep when num_heads is fewer than the "
                         "model's; this call keeps every head (give num_heads, or drop calibration)")
    if loss_fn is not None and heads in ("merge", "pool"):
        raise ValueError(f"loss_fn= ranks heads for heads='prune'; heads={heads!r} groups them by their attention "
                         "maps on calibration= alone")
    seed = check_seed(seed, "swap_attention: seed")  # torch's own error names nothing a caller can change
    return {"kind": kind, "num_heads": num_heads, "head_dim": head_dim, "heads": heads, "seed": seed,
            "options": options, "memo": {}, "measured": {}}


def with_key_scale(kind: str, options: dict, sources) -> dict:
    """``options`` with the key_scale of an exact conversion filled in when ``kind`` takes one and the caller gave
    none: the scale of the MGK-family modules among ``sources`` (the attention modules to be replaced; a module
    with a ``key_scale`` attribute is one, the first one's is taken), else :data:`CONVERSION_KEY_SCALE` for
    dot-product layers. Variances a key_scale cannot take (learned, or unequal ones) keep 1."""
    names = get_kind(kind).options.names()
    if "key_scale" not in names or "key_scale" in options:
        return options
    s2 = options.get("sigma2")
    if s2 == "learned" or (isinstance(s2, (tuple, list)) and len({float(x) for x in s2}) > 1):
        return {**options, "key_scale": 1.0}  # written out, so that a saved config reloads to the same record
    scales = [m.key_scale for m in sources if isinstance(getattr(m, "key_scale", None), float)]
    return {**options, "key_scale": scales[0] if scales else CONVERSION_KEY_SCALE}


def measure(build: dict, model: nn.Module, calibration, loss_fn=None) -> None:
    """Measure the heads of ``model``'s mgk attention modules on the ``calibration`` batch
    (:func:`mgk.convert.head_measures.calibrate`) into ``build``, by module path: their maps' divergence unless the
    rule is "prune", their importance when ``loss_fn`` is given."""
    build["measured"] = calibrate(model, calibration, loss_fn, maps=build["heads"] != "prune")


def convert_module(old: nn.Module, path: str, build: dict, *, rotary_dim: int | None = None) -> AttentionBase:
    """The new module of the plan ``build`` (:func:`swap_plan`) for the torch or mgk attention module ``old`` found at
    ``path`` (``rotary_dim``: the head size rotary embeddings applied around it fix); ValueError naming ``path`` for
    what cannot be carried."""
    return convert_source(dataclasses.replace(_read(old, path), rotary_dim=rotary_dim), path, build)


def convert_source(src: AttentionSource, path: str, build: dict) -> AttentionBase:
    """The new module of ``build``'s kind for what was read from the module at ``path`` (also the entry point of
    :mod:`mgk.integrations.hf`, which reads Hugging Face attention modules into a :class:`AttentionSource`). Its
    attribute ``conversion`` records the rule and the heads chosen (:func:`mgk.convert.regroup.plan_heads`).
    ValueError in one line for a shape no rule converts (:func:`check_shape`)."""
    heads, head_dim = check_shape(src, build, path)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(build["seed"])
        new = build_attention(build["kind"], src.embed_dim, heads, head_dim=head_dim, dropout=src.dropout,
                              bias=src.bias, batch_first=src.batch_first, kdim=src.kdim, vdim=src.vdim,
                              **build["options"])
        rule = choose_rule(src.num_heads, src.head_dim, new, build["heads"])  # accepted by check_shape
        measured = build["measured"].get(path, {})
        plan = plan_heads(rule, src.weights, heads, src.head_dim, divergence=measured.get("divergence"),
                          importance=measured.get("importance"))
        # the source's own parameters of the same name and shape (mgk -> mgk keeps every key component and the
        # learned weights) only where its heads are the new ones: a merge or pruning re-orders them
        own = src.parameters if rule in ("same", "slice") else {}
        load_conversion(new, src.weights, rule, plan, src.head_dim, own)  # the kind's rule, in its own file
    new.to(src.device)
    if new.q_proj.weight.dtype != src.dtype:
        new.to(src.dtype)
    new.conversion = {"rule": rule, "source_heads": src.num_heads, "source_head_dim": src.head_dim, **plan}
    return new.requires_grad_(src.trainable).train(src.training)


def check_shape(src: AttentionSource, build: dict, path: str) -> tuple[int, int]:
    """(heads, head_dim) of the new module of ``build`` for ``src``, the module at ``path``; ValueError in one line
    when no rule converts that shape (:func:`mgk.convert.regroup.choose_rule`), the kind's options refuse it, or
    it changes the head size that a model's rotary embeddings fix. The message ends with another call that these
    same checks accept, when one of a few (another rule, the width re-cut, the model's head size or heads) is."""
    try:
        return _shape(src, build, path)
    except ValueError as e:
        for change in _alternatives(src, build):
            try:
                _shape(src, {**build, **change}, path)
            except ValueError:
                continue
            raise ValueError(f"{e}; instead: {', '.join(f'{k}={v!r}' for k, v in change.items())}") from None
        raise


def _shape(src: AttentionSource, build: dict, path: str) -> tuple[int, int]:
    """:func:`check_shape` without the alternative: the one set of checks every call and every hint goes through."""
    heads = build["num_heads"] or src.num_heads
    head_dim = _head_dim(src, heads, build, path)
    # its sizes only: on the meta device (no memory), the global RNG untouched, whatever device a caller's context
    # sets (from_pretrained builds under a meta context, where the options' own checks could not read values)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        new = build_attention(build["kind"], src.embed_dim, heads, head_dim=head_dim, kdim=src.kdim, vdim=src.vdim,
                              device="meta", **build["options"])
    try:
        choose_rule(src.num_heads, src.head_dim, new, build["heads"])
    except ValueError as e:
        raise ValueError(f"swap_attention: {path}: {e}") from None
    if src.rotary_dim is not None and head_dim != src.rotary_dim:
        raise ValueError(f"swap_attention: num_heads={heads} gives head_dim {head_dim} in {path}, but the model's "
                         f"rotary embeddings are {src.rotary_dim} wide")
    return heads, head_dim


def _alternatives(src: AttentionSource, build: dict) -> list[dict]:
    """Calls near ``build``'s, as the keywords they change, most alike first: another rule for the heads, the width
    re-cut into the heads asked for, the source's head size, its heads."""
    heads, width = build["num_heads"] or src.num_heads, src.num_heads * src.head_dim
    near = [{"heads": "prune"}, {"heads": None}, {"head_dim": None}, {"head_dim": None, "heads": None},
            {"head_dim": width // heads, "heads": "slice"} if width % heads == 0 else {},
            {"num_heads": src.num_heads, "head_dim": None, "heads": None}]
    changes = []
    for change in near:
        change = {k: v for k, v in change.items() if build[k] != v}
        if change and change not in changes:
            changes.append(change)
    return changes


def _head_dim(src: AttentionSource, heads: int, build: dict, path: str) -> int:
    """The new head size: ``build``'s, else the width re-cut for heads="slice", else the source's."""
    width = src.num_heads * src.head_dim
    if build["head_dim"] is not None:
        return build["head_dim"]
    if build["heads"] != "slice":
        return src.head_dim
    if width % heads:
        raise ValueError(f"swap_attention: num_heads={heads} does not divide the attention width {width} of {path}")
    return width // heads


def load_conversion(new: AttentionBase, weights: dict[str, Tensor], rule: str, plan: dict, head_dim: int,
                    own: dict[str, Tensor] | None = None) -> set[str]:
    """Set ``new``'s parameters from a source layer's per-head projections ``weights`` (heads of ``head_dim``) by
    ``rule`` and ``plan`` (:func:`mgk.convert.regroup.plan_heads`), then the new kind's ``load_projections``;
    ``own``: source parameters copied where ``new`` has one of the same name and shape. Returns the names set."""
    values = new.load_projections(apply_plan(weights, plan, rule, head_dim))
    params = dict(new.named_parameters())
    values.update({n: t for n, t in (own or {}).items() if n in params and params[n].shape == t.shape})
    with torch.no_grad():
        for name, value in values.items():
            if value is not None:
                params[name].copy_(value)
    return {n for n, v in values.items() if v is not None}


def refuse_adapters(model: nn.Module, path: str) -> None:
    """ValueError in one line when the attention module at ``path`` in ``model`` holds, or sits inside, a peft
    adapter layer (LoRA, ...): the new module is built from the base weights, so the adapter would vanish without a
    word. Told from the class's module name: mgk never imports peft."""
    module = model.get_submodule(path)
    parts = path.split(".") if path else []
    around = [(".".join(parts[:i]), model.get_submodule(".".join(parts[:i]))) for i in range(1, len(parts))]
    inside = [(f"{path}.{name}" if name else path, m) for name, m in module.named_modules()]
    for where, m in around + inside:
        if type(m).__module__.split(".")[0] == "peft":
            raise ValueError(f"swap_attention: {where or type(model).__name__} is peft's {type(m).__name__} (an "
                             "adapter), which the new attention would drop: swap the model before get_peft_model "
                             "(Hugging Face models: LoRA targets from mgk.integrations.hf.lora_target_modules), or "
                             "save the adapter, swap the model without it (PeftModel.unload()) and convert the "
                             "adapter (mgk.integrations.hf.convert_lora_adapter)")


# The tensors nn.MultiheadAttention itself holds; anything else belongs to a subclass or wrapper whose use mgk cannot
# know. Parametrized ones (torch.nn.utils.parametrize) are read through their attribute, the effective tensor.
_TORCH_TENSORS = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                  "out_proj.weight", "out_proj.bias", "bias_k", "bias_v")


def _read(old: nn.Module, path: str) -> AttentionSource:
    """The configuration and projections of ``old``; ValueError naming ``path`` for what cannot be carried."""
    if isinstance(old, nn.MultiheadAttention):
        _check_torch_module(old, path)
        weights = {}
        for name in _TORCH_TENSORS:  # the effective tensors, also under a parametrization
            owner, _, attr = name.rpartition(".")
            value = getattr(old.get_submodule(owner) if owner else old, attr, None)
            if isinstance(value, Tensor):
                weights[name] = value.detach().cpu()
        from_torch_state_dict(weights)
        config = dict(embed_dim=old.embed_dim, num_heads=old.num_heads, head_dim=old.head_dim, dropout=old.dropout,
                      bias=old.in_proj_bias is not None, batch_first=old.batch_first, kdim=old.kdim, vdim=old.vdim)
        own = {}
    else:
        try:
            weights = {k: v.cpu() for k, v in old.per_head_projections().items()}
        except ValueError as e:
            raise ValueError(f"swap_attention: {path} ({type(old).__name__}): {e}") from None
        config = dict(embed_dim=old.embed_dim, num_heads=old.num_heads, head_dim=old.head_dim, dropout=old.dropout,
                      bias=old.q_proj.bias is not None, batch_first=old.batch_first, kdim=old.kdim, vdim=old.vdim)
        own = {k: v.detach().cpu() for k, v in old.named_parameters()}
    first = next(old.parameters())
    return AttentionSource(**config, weights=weights, parameters=own, device=first.device, dtype=first.dtype,
                           training=old.training, trainable=any(p.requires_grad for p in old.parameters()))


def _check_torch_module(old: nn.MultiheadAttention, path: str) -> None:
    """ValueError in one line naming ``path`` when ``old`` holds what mgk's modules cannot represent: the extra
    key/value rows of add_bias_kv / add_zero_attn, a subclass's own ``forward`` (whose computation would be lost
    silently), or parameters and buffers of its own (or of wrappers put around its projections, e.g. by
    parametrizations)."""
    for flag, value in (("add_bias_kv", old.bias_k is not None), ("add_zero_attn", old.add_zero_attn)):
        if value:
            raise ValueError(f"swap_attention: {path} is nn.MultiheadAttention({flag}=True), which mgk's "
                             "attention modules cannot represent (no extra key/value rows)")
    cls = type(old)
    if cls.forward is not nn.MultiheadAttention.forward:
        raise ValueError(f"swap_attention: {path} is {cls.__name__}, a subclass of nn.MultiheadAttention with its own "
                         "forward, which replacing it would silently drop; swap its attention yourself or remove the "
                         "override")
    if not isinstance(old.out_proj, nn.Linear):
        raise ValueError(f"swap_attention: {path}.out_proj is {type(old.out_proj).__name__}, not nn.Linear: mgk cannot "
                         "tell which weights it applies")
    own = [n for n, _ in old.named_parameters()] + [n for n, _ in old.named_buffers()]
    extra = sorted({n for n in own if _parametrized_name(n) not in _TORCH_TENSORS})
    if extra:
        raise ValueError(f"swap_attention: {path} ({cls.__name__}) holds {', '.join(extra)}, which "
                         "nn.MultiheadAttention does not have and mgk's attention modules cannot carry over")


def _parametrized_name(name: str) -> str:
    """The tensor a parameter of torch.nn.utils.parametrize stands for (``out_proj.parametrizations.weight.original``
    -> ``out_proj.weight``); other names unchanged."""
    match = re.fullmatch(r"(?:(.*)\.)?parametrizations\.([^.]+)\.original\d*", name)
    if match is None:
        return name
    return f"{match.group(1)}.{match.group(2)}" if match.group(1) else match.group(2)
