"""Replace the attention modules of an existing model (``torch.nn.MultiheadAttention`` or mgk's own) by an mgk
attention kind, carrying over the layout, the sizes and the weights."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import AttentionBase, _positive_int
from .mixture_keys import KEY_SPREAD
from .registry import build_attention, check_options
from .softmax import from_torch_state_dict

__all__ = ["swap_attention", "KEY_SPREAD"]



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


def swap_attention(model: nn.Module, kind: str = "mgk", *, num_heads: int | None = None, seed: int = 0,
                   **options) -> nn.Module:
    """Replace every ``nn.MultiheadAttention`` and every mgk attention module in ``model`` (in place) by the
    attention ``kind`` of :func:`mgk.build_attention` ("softmax", "mgk", "smgk", "linear", "mlk", "smlk").

    Args:
        model: any module; its attention modules may sit at any depth (``nn.TransformerEncoder``, ``nn.Transformer``,
            a ViT, ...). A module shared by several parents is replaced by one shared module. A Hugging Face
            transformers model (Llama family, GPT-2, BERT) is handed to :func:`mgk.integrations.hf.swap_attention`
            (extra ``hf``; docs/hf.md), which reads its attention modules and converts them by the rules below.
        kind: the new attention kind.
        num_heads: H of the new modules; default each old module's own. The attention width H * D stays the old
            one (E for ``nn.MultiheadAttention``), so D becomes width / H.
        seed: seeds every random number the new modules draw (the global RNG is left as it was).
        options: the kind's own options, as :func:`mgk.build_attention` (num_keys, pi, sigma2, ...).

    Carried over from each old module: embed_dim, num_heads (unless given), head_dim, dropout, bias, batch_first,
    kdim / vdim, device, dtype and train/eval mode. Weights, with the old key projection K (for an mgk mixture
    source: its first component):

    * softmax and linear: the query, key, value and output projections are copied exactly. ``nn.MultiheadAttention``
      -> "softmax" with the same heads then gives the same outputs (to rounding), masks included; its packed
      ``in_proj_weight`` is split as :func:`mgk.attention.softmax.from_torch_state_dict` does.
    * mgk / mlk (separate keys): query, value and output projections copied; component 1 of the keys is K, and
      components 2..M are K plus Gaussian noise of standard deviation ``KEY_SPREAD * std(K)`` (biases copied).
      Mixture weights pi start uniform (learned logits equal; Soft-E buffer 1/M). With all components near K, MGK
      starts near softmax attention with an extra per-key logit ``-|k_j|^2 / (2 sigma^2)`` (paper eq. 9-10), and
      MLK near linear attention with key projection K; neither equals the softmax original exactly.
    * smgk / smlk (shifted keys): the key projection is K; the shifts mu_2..mu_M are drawn as sMGK initialises them
      (N(0, 0.5^2)), pi uniform.
    * an mgk source: after the above, every parameter of the old module whose name and shape the new one also has
      is copied (mgk -> mgk with Hard-E keeps all M key projections and the learned pi). Buffers (sigma2, the
      Soft-E pi) are the new module's.

    ``nn.TransformerEncoder``'s nested-tensor fast path (``enable_nested_tensor``) is switched off: it needs
    ``nn.MultiheadAttention``'s packed weights. The layers' own fast path declines by itself.

    A different ``num_heads`` keeps the projection matrices whole: each new head reads another slice of the same
    width, so the function changes (it is exact only with the original heads).

    Returns:
        ``model`` (the new module when ``model`` itself is an attention module).
    Raises:
        ValueError in one line naming the module's path for what cannot be carried: ``nn.MultiheadAttention`` with
        ``add_bias_kv=True`` or ``add_zero_attn=True``, a ``num_heads`` that does not divide the width, an mgk
        module without a key projection; for an unknown kind or an option it does not take; when ``model`` holds
        no attention module.
    """
    if _from_transformers(model):
        # imported here so that mgk never imports transformers unless it is given a transformers model
        from ..integrations import hf
        return hf.swap_attention(model, kind, num_heads=num_heads, seed=seed, **options)
    build = swap_plan(kind, num_heads, seed, options)
    if _is_attention(model):
        return _replacement(model, type(model).__name__, build)
    if not _swap_children(model, build):
        raise ValueError(f"swap_attention: {type(model).__name__} holds no nn.MultiheadAttention or mgk attention "
                         "module")
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder):
            # Its eval-mode nested-tensor path (enable_nested_tensor, decided at construction) reads the packed
            # weights of nn.MultiheadAttention and feeds nested tensors to the layers: neither exists here.
            module.use_nested_tensor = False
    return model


def _from_transformers(model: nn.Module) -> bool:
    """Whether ``model`` is (a subclass of) a Hugging Face transformers class: told from the class's module name, so
    that nothing here imports transformers."""
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def swap_plan(kind: str, num_heads: int | None, seed: int, options: dict) -> dict:
    """What every replacement of one swap_attention call is built from (kind, heads, seed, options, and the memo of
    modules already replaced); ValueError naming a bad option or ``num_heads``."""
    check_options(kind, options)
    if num_heads is not None:
        _positive_int(num_heads, "num_heads")
    return {"kind": kind, "num_heads": num_heads, "seed": seed, "options": options, "memo": {}}


def _is_attention(module: nn.Module) -> bool:
    return isinstance(module, (nn.MultiheadAttention, AttentionBase))


def _swap_children(model: nn.Module, build: dict) -> int:
    """Replace the attention modules below ``model``; returns how many places were replaced. Every place is visited,
    also a module held twice by one parent (``named_children`` lists it once, so its second name kept the old
    module); attention modules nested inside another are left to their owner."""
    places = [(path, m) for path, m in model.named_modules(remove_duplicate=False) if path and _is_attention(m)]
    places = [(path, m) for path, m in places if not any(path.startswith(f"{p}.") for p, _ in places)]
    for path, old in places:
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, _replacement(old, path, build))
    return len(places)


def _replacement(old: nn.Module, path: str, build: dict) -> AttentionBase:
    """The new module for ``old`` (the same one again for a module met before)."""
    memo = build["memo"]
    if id(old) not in memo:
        memo[id(old)] = (old, convert_module(old, path, build))  # keeps old alive, so its id stays unique
    return memo[id(old)][1]


def convert_module(old: nn.Module, path: str, build: dict) -> AttentionBase:
    """The new module of the plan ``build`` (:func:`swap_plan`) for the torch or mgk attention module ``old`` found at
    ``path``; ValueError naming ``path`` for what cannot be carried."""
    return convert_source(_read(old, path), path, build)


def convert_source(src: AttentionSource, path: str, build: dict) -> AttentionBase:
    """The new module of ``build``'s kind for what was read from the module at ``path`` (also the entry point of
    :mod:`mgk.integrations.hf`, which reads Hugging Face attention modules into a :class:`AttentionSource`)."""
    width = src.num_heads * src.head_dim
    heads = build["num_heads"] or src.num_heads
    if width % heads:
        raise ValueError(f"swap_attention: num_heads={heads} does not divide the attention width {width} of {path}")
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(build["seed"])
        new = build_attention(build["kind"], src.embed_dim, heads, head_dim=width // heads, dropout=src.dropout,
                              bias=src.bias, batch_first=src.batch_first, kdim=src.kdim, vdim=src.vdim,
                              **build["options"])
        weights = new.load_projections(src.weights)  # the new kind's conversion rule, in its own file
    shapes = {n: p.shape for n, p in new.named_parameters()}
    weights.update({n: t for n, t in src.parameters.items() if n in shapes and shapes[n] == t.shape})
    new.to(src.device)
    if new.q_proj.weight.dtype != src.dtype:
        new.to(src.dtype)
    params = dict(new.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            if value is not None:
                params[name].copy_(value)
    return new.train(src.training)


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
                   training=old.training)


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
