"""Replace the attention modules of an existing model (``torch.nn.MultiheadAttention`` or mgk's own) by an mgk
attention kind, carrying over the layout, the sizes and the weights.

Fewer heads (``num_heads`` below the old module's) keep each head's size, as the paper's MGK-4 against softmax-8
(0.625x the attention weights at one head_dim), and are converted by a named rule (:mod:`mgk.convert.regroup`,
the code path of ``mgk train --init-from`` too):

* "merge" (default for separate mixture keys, as mgk, mlk and gmgk have, with ``num_heads * num_keys`` = the old
  heads): groups of ``num_keys`` old heads become the key components of one head: query and value projections the
  group's mean, output columns its sum, key component r the r-th head's key, pi uniform.
* "pool" (default for gqa): groups of old heads mean-pooled in every projection (Ainslie et al. 2023 pool the
  key/value heads so), output columns summed; then GQA's own key/value pooling.
* "prune" (default for the other kinds: softmax, linear, shifted keys, ...; any kind when named): the most
  important heads kept, in their order, the others dropped (exact for softmax: the old layer with those heads
  switched off).
* "slice": the projections kept whole and re-cut into ``num_heads`` heads of width / ``num_heads`` (the behaviour
  before head sizes were kept; the function changes, exact only with the old heads). Also what ``head_dim`` with
  ``num_heads * head_dim`` = the old width gives.

Groups are of similar heads (greedy matching; adjacent heads merged worse in the retro-fit of
results/cpu/kv-budget.md). Without data, similarity is the cosine of the heads' bilinear forms ``W_q,h^T W_k,h``
(two heads with proportional forms give the same attention map up to a temperature on every input; comparing query
or key projections alone would separate heads that differ by a rotation inside the head, which changes no logit),
and importance the norm ``|W_o,h W_v,h|_F`` of what a head can write (:mod:`mgk.convert.head_measures`). With a
``calibration`` batch, similarity is the mean Jensen-Shannon divergence of the heads' attention maps and, with a
``loss_fn``, importance is Michel et al.'s ``E_x |dL(x)/dxi_h|``: the measures ``--init-from`` takes on validation
examples.
"""
from __future__ import annotations

from torch import nn

from .attention.base import AttentionBase
from .attention.mixture_keys import KEY_SPREAD
from .convert.layers import convert_module, measure, refuse_adapters, swap_plan, with_key_scale
from .convert.rollback import unchanged_on_error

__all__ = ["swap_attention", "KEY_SPREAD"]


def swap_attention(model: nn.Module, kind: str = "mgk", *, num_heads: int | None = None,
                   head_dim: int | None = None, heads: str | None = None, calibration=None, loss_fn=None,
                   seed: int = 0, **options) -> nn.Module:
    """Replace every ``nn.MultiheadAttention`` and every mgk attention module in ``model`` (in place) by ``kind``.

    Args:
        model: any module; its attention modules may sit at any depth (``nn.TransformerEncoder``, ``nn.Transformer``,
            a ViT, ...). A module shared by several parents is replaced by one shared module. A Hugging Face
            transformers model (Llama family, GPT-2, BERT) is handed to :func:`mgk.integrations.hf.swap_attention`
            (extra ``hf``; docs/hf.md), which reads its attention modules and converts them by the rules below.
        kind: the new attention kind, any name :func:`mgk.attention_kinds` lists (as :func:`mgk.build_attention`).
        num_heads: H of the new modules; default each old module's own. Each head keeps its size (head_dim D)
            unless ``head_dim`` is given: fewer heads make a narrower attention (the paper's MGK-4 against
            softmax-8, and the only choice a rotary model allows), converted by the rule ``heads``.
        head_dim: D of the new modules; default the old one's. With ``num_heads * head_dim`` = the old width the
            projections are re-cut into heads of another size ("slice"); other widths are refused.
        heads: the rule for fewer heads of the same size (module docstring): "merge", "pool", "prune" or "slice";
            default "merge" for separate mixture keys (mgk, mlk, gmgk; ``num_heads * num_keys`` = the old heads),
            "pool" for gqa, "prune" for the other kinds. Heads are chosen from the weights, or on ``calibration``.
        calibration: a batch to choose heads on (a Tensor, a tuple of positional or a dict of keyword inputs of
            ``model``), run in eval mode after torch / Hugging Face attention became mgk softmax (the same function).
        loss_fn: with ``calibration``, ``loss_fn(model output)`` -> a scalar loss over the batch (summed or
            averaged), whose per-example gradients rank heads for "prune" (e.g. ``lambda out: out.loss``).
        seed: seeds every random number the new modules draw (the global RNG is left as it was).
        options: the kind's own options, as :func:`mgk.build_attention` (num_keys, pi, sigma2, ...).

    Carried over from each old module: embed_dim, num_heads and head_dim (unless given), dropout, bias, batch_first,
    kdim / vdim, device, dtype, train/eval mode, and whether it is frozen (a module none of whose parameters requires
    grad gives a new module none of whose parameters does; forward hooks on the old module are not carried).
    Weights, with the old key projection K (for an mgk mixture source: its components' mean):

    * softmax and linear: the query, key, value and output projections are copied exactly. ``nn.MultiheadAttention``
      -> "softmax" with the same heads then gives the same outputs (to rounding), masks included; its packed
      ``in_proj_weight`` is split as :func:`mgk.attention.softmax.from_torch_state_dict` does.
    * mgk / mlk (separate keys): query, value and output projections copied; the components are K plus a spread
      that sums to zero over them, ``KEY_SPREAD * std(K)`` times centred Gaussian noise (biases copied), so that
      training can separate them at a cost of second order. Mixture weights pi start uniform (learned logits equal;
      Soft-E buffer 1/M). An MGK-family target takes the conversion's ``key_scale`` (2^-12, unless given; an MGK
      source's own; 1 for learned or unequal variances), which removes MGK's key-norm term: a conversion that keeps
      every head and group is then exact (docs/convert.md). MLK starts at linear attention with key projection K.
    * gqa with ``num_kv_heads`` G: query and output projections copied; each group's key and value projections the
      mean of its H / G heads' (Ainslie et al. 2023, Section 2.1): exact for G = H. A gqa source is read as the
      multi-head layer it computes (each key/value head repeated), so gqa -> softmax is exact.
    * gmgk: gqa's pooling into ``num_kv_heads`` groups, then mgk's or smgk's rule (``keys``) for each group's keys;
      from a grouped source of M times the new groups (separate keys), each new group keeps its M source groups'
      keys as components and their mean value (:meth:`mgk.GroupedMGKAttention.load_projections`).
    * smgk / smlk (shifted keys): the key projection is K with every shift 0, pi uniform.
    * an mgk source: after the above, every parameter of the old module whose name and shape the new one also has
      is copied (mgk -> mgk with Hard-E keeps all M key projections and the learned pi). Buffers (sigma2, the
      Soft-E pi) are the new module's.

    ``nn.TransformerEncoder``'s nested-tensor fast path (``enable_nested_tensor``) is switched off: it needs
    ``nn.MultiheadAttention``'s packed weights. The layers' own fast path declines by itself.

    Each new module's attribute ``conversion`` records ``{"rule", "source_heads", "source_head_dim", "groups" or
    "keep", "by": what chose them, the measures}``.

    Returns:
        ``model`` (the new module when ``model`` itself is an attention module).
    Raises:
        ValueError in one line naming the module's path for what cannot be carried: ``nn.MultiheadAttention`` with
        ``add_bias_kv=True`` or ``add_zero_attn=True``, a subclass of it with its own ``forward`` or its own
        parameters or buffers, an ``out_proj`` that is not an ``nn.Linear`` (a parametrized projection is carried as
        its effective weight), an mgk module without a key projection, more heads of one size, a head size keeping
        neither the old one nor the width, a ``heads`` rule that does not fit (or none for mgk / mlk heads that
        cannot merge); an unknown kind or option; ``calibration`` where no head is chosen, ``loss_fn`` without it,
        a ``calibration`` batch the model's forward (or ``loss_fn``) fails on; when ``model`` holds no attention
        module. Every refusal leaves ``model`` exactly as it was (:mod:`mgk.convert.rollback`): its classes,
        children, attributes, parameters and, for a Hugging Face model, its config.
    """
    conversion = dict(head_dim=head_dim, heads=heads, calibration=calibration, loss_fn=loss_fn)
    if _from_transformers(model):  # the import inside: mgk never imports transformers unless given its model
        from .integrations import hf
        return hf.swap_attention(model, kind, num_heads=num_heads, seed=seed, **conversion, **options)
    options = with_key_scale(kind, options, [m for m in model.modules() if _is_attention(m)])
    build = swap_plan(kind, num_heads, seed, options, **conversion)
    with unchanged_on_error(model):  # a refusal at any step (a layer that cannot convert, a failing calibration
        # batch) leaves the model as it was, not half converted
        return _swap(model, build, calibration, loss_fn)


def _swap(model: nn.Module, build: dict, calibration, loss_fn) -> nn.Module:
    """swap_attention's work once its arguments are checked; leaves the model half swapped when it raises (the
    caller puts it back)."""
    if _is_attention(model):
        refuse_adapters(model, "")
    if calibration is not None:
        model = _measured(model, build, calibration, loss_fn)
    if _is_attention(model):
        return _replacement(model, type(model).__name__, build)
    if not _swap_children(model, build):
        raise ValueError(f"swap_attention: {type(model).__name__} holds no nn.MultiheadAttention or mgk attention "
                         "module")
    _no_nested_tensors(model)
    return model


def _no_nested_tensors(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder):
            # Its eval-mode nested-tensor path (enable_nested_tensor, decided at construction) reads the packed
            # weights of nn.MultiheadAttention and feeds nested tensors to the layers: neither exists here.
            module.use_nested_tensor = False


def _measured(model: nn.Module, build: dict, calibration, loss_fn) -> nn.Module:
    """``model`` with its ``nn.MultiheadAttention`` modules as mgk softmax modules of the same heads (exactly the
    same function: head gates and per-head maps are mgk's), its heads measured on ``calibration`` into ``build``."""
    exact = swap_plan("softmax", None, build["seed"], {})
    if isinstance(model, nn.MultiheadAttention):
        model = _replacement(model, type(model).__name__, exact)
    else:
        _swap_children(model, exact, only=nn.MultiheadAttention)
        _no_nested_tensors(model)
    measure(build, model, calibration, loss_fn)
    if _is_attention(model) and "" in build["measured"]:
        build["measured"][type(model).__name__] = build["measured"].pop("")
    return model


def _from_transformers(model: nn.Module) -> bool:
    """Whether ``model`` is (a subclass of) a Hugging Face transformers class: told from the class's module name, so
    that nothing here imports transformers."""
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def _is_attention(module: nn.Module) -> bool:
    return isinstance(module, (nn.MultiheadAttention, AttentionBase))


def _swap_children(model: nn.Module, build: dict, only: type = nn.Module) -> int:
    """Replace the attention modules below ``model`` (those of type ``only``); returns how many places were replaced.
    Every place is visited, also a module held twice by one parent (``named_children`` lists it once, so its second
    name kept the old module); attention modules nested inside another are left to their owner."""
    places = [(path, m) for path, m in model.named_modules(remove_duplicate=False) if path and _is_attention(m)]
    places = [(path, m) for path, m in places if not any(path.startswith(f"{p}.") for p, _ in places)
              and isinstance(m, only)]
    for path, _ in places:
        refuse_adapters(model, path)
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
