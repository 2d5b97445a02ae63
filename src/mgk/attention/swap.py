"""Replace the attention modules of an existing model (``torch.nn.MultiheadAttention`` or mgk's own) by an mgk
attention kind, carrying over the layout, the sizes and the weights."""
from __future__ import annotations

from torch import nn

from .base import AttentionBase
from .convert import convert_module, swap_plan
from .mixture_keys import KEY_SPREAD

__all__ = ["swap_attention", "KEY_SPREAD"]


def swap_attention(model: nn.Module, kind: str = "mgk", *, num_heads: int | None = None, seed: int = 0,
                   **options) -> nn.Module:
    """Replace every ``nn.MultiheadAttention`` and every mgk attention module in ``model`` (in place) by the
    attention ``kind`` of :func:`mgk.build_attention` ("softmax", "mgk", "smgk", "linear", "mlk", "smlk", "gqa").

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
    kdim / vdim, device, dtype, train/eval mode, and whether it is frozen (a module none of whose parameters requires
    grad gives a new module none of whose parameters does; forward hooks on the old module are not carried).
    Weights, with the old key projection K (for an mgk mixture source: its first component):

    * softmax and linear: the query, key, value and output projections are copied exactly. ``nn.MultiheadAttention``
      -> "softmax" with the same heads then gives the same outputs (to rounding), masks included; its packed
      ``in_proj_weight`` is split as :func:`mgk.attention.softmax.from_torch_state_dict` does.
    * mgk / mlk (separate keys): query, value and output projections copied; component 1 of the keys is K, and
      components 2..M are K plus Gaussian noise of standard deviation ``KEY_SPREAD * std(K)`` (biases copied).
      Mixture weights pi start uniform (learned logits equal; Soft-E buffer 1/M). With all components near K, MGK
      starts near softmax attention with an extra per-key logit ``-|k_j|^2 / (2 sigma^2)`` (paper eq. 9-10), and
      MLK near linear attention with key projection K; neither equals the softmax original exactly.
    * gqa with ``num_kv_heads`` G: query and output projections copied; each group's key and value projections the
      mean of its H / G heads' (Ainslie et al. 2023, Section 2.1): exact for G = H. A gqa source is read as the
      multi-head layer it computes (each key/value head repeated), so gqa -> softmax is exact.
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
        ``add_bias_kv=True`` or ``add_zero_attn=True``, a subclass of it with its own ``forward`` or its own
        parameters or buffers, an ``out_proj`` that is not an ``nn.Linear`` (a parametrized projection is carried as
        its effective weight), a ``num_heads`` that does not divide the width, an mgk module without a key
        projection; for an unknown kind or an option it does not take; when ``model`` holds
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
