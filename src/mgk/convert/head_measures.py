"""Measuring the heads of an attention layer, to choose which to merge or keep when a layer gets fewer heads
(:mod:`mgk.convert.regroup`, used by :func:`mgk.swap_attention` and ``mgk train --init-from``).

From the weights alone (what :func:`mgk.swap_attention` has without data):

* :func:`bilinear_divergence`: how differently two heads score query-key pairs, ``1 - cos(W_q,h^T W_k,h,
  W_q,g^T W_k,g)``. The logit of head h is ``x_i^T W_q,h^T W_k,h x_j / sqrt(D)`` (biases aside), so two heads with
  proportional bilinear forms give the same attention map up to a temperature, on every input: it is the data-free
  stand-in for the divergence of their maps. (Comparing the query or key projections alone would call two heads
  different that differ by a rotation inside the head, W_q -> R W_q, W_k -> R W_k, which leaves every logit as it
  was.) With rotary position embeddings the form at relative position 0 is compared; the rotation is the same for
  every head.
* :func:`output_importance`: ``|W_o,h W_v,h|_F``, the size of what head h writes: its output is that map applied to
  a convex combination of the inputs, so a head with a small value-output product changes the layer's output little
  whatever it attends to.

From a calibration batch (:func:`calibrate`, and the task-level drivers of :mod:`mgk.analyze` with their splits):
the mean Jensen-Shannon divergence between the heads' attention maps (:func:`js_matrix`) and Michel et al.'s
importance ``E_x |dL(x)/dxi_h|`` of each head's gate (:func:`gate_importance`).
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..attention.base import AttentionBase

__all__ = ["js_divergence", "js_matrix", "greedy_groups", "adjacent_groups", "bilinear_divergence",
           "output_importance", "has_components", "gated", "gate_importance", "calibrate"]


def js_divergence(p: Tensor, q: Tensor) -> Tensor:
    """Jensen-Shannon divergence in bits (log base 2, so it lies in [0, 1]) between distributions along the last
    dimension: ``JS(p, q) = KL(p | m) / 2 + KL(q | m) / 2`` with ``m = (p + q) / 2`` (Lin 1991). Terms with
    ``p = 0`` contribute 0 (the limit ``0 log 0 = 0``). p, q (..., S) broadcastable; returns (...) float64."""
    p, q = p.detach().to(torch.float64), q.detach().to(torch.float64)
    m = (p + q) / 2

    def kl(a: Tensor) -> Tensor:
        """KL(a || m) in bits along the last dimension (terms with a = 0 contribute 0)."""
        ratio = torch.where(a > 0, a / torch.where(m > 0, m, torch.ones_like(m)), torch.ones_like(a))
        return (a * torch.log2(ratio)).sum(dim=-1)

    return ((kl(p) + kl(q)) / 2).clamp_min(0.0)


def js_matrix(maps: Tensor) -> Tensor:
    """(H, H) float64: entry (h, h') the mean over query rows of ``JS(A_h[i], A_h'[i])`` in bits (0 on the
    diagonal). maps (H, L, S), rows stochastic."""
    H = maps.shape[0]
    out = torch.zeros(H, H, dtype=torch.float64)
    if H > 1:
        i, j = torch.triu_indices(H, H, offset=1)
        js = js_divergence(maps[i], maps[j]).mean(dim=-1)
        out[i, j] = js
        out[j, i] = js
    return out


def greedy_groups(divergence: Tensor, size: int) -> list[list[int]]:
    """Split the H heads of one layer into groups of ``size`` by greedy matching on ``divergence`` (H, H): the
    pair of unmatched heads with the smallest divergence starts a group (ties: the lowest indices), then the
    unmatched head with the smallest mean divergence to the group joins it until it has ``size`` heads. Groups are
    returned in the order they were formed, each sorted. ValueError when ``size`` does not divide H."""
    H = divergence.shape[0]
    if size < 1 or H % size:
        raise ValueError(f"greedy_groups: groups of {size} do not split {H} heads")
    if size == 1:
        return [[h] for h in range(H)]
    free, groups = list(range(H)), []
    while free:
        pairs = [(float(divergence[a, b]), a, b) for i, a in enumerate(free) for b in free[i + 1:]]
        _, a, b = min(pairs)
        group = [a, b]
        while len(group) < size:
            rest = [h for h in free if h not in group]
            group.append(min(rest, key=lambda h: (float(divergence[group, h].mean()), h)))
        groups.append(sorted(group))
        free = [h for h in free if h not in group]
    return groups


def adjacent_groups(heads: int, size: int) -> list[list[int]]:
    """Heads (0..size-1), (size..2 size-1), ...: the control of similar groups. ValueError when ``size`` does not
    divide ``heads``."""
    if size < 1 or heads % size:
        raise ValueError(f"adjacent_groups: groups of {size} do not split {heads} heads")
    return [list(range(g * size, (g + 1) * size)) for g in range(heads // size)]


def _per_head(t: Tensor, head_dim: int) -> Tensor:
    """A projection weight (H*D, in) as (H, D, in), in float32 at least (bfloat16 Gram matrices lose too much)."""
    return t.detach().reshape(-1, head_dim, t.shape[-1]).to(torch.promote_types(t.dtype, torch.float32))


def bilinear_divergence(weights: dict[str, Tensor], head_dim: int) -> Tensor:
    """(H, H) float64: ``1 - cos(A_h, A_g)`` for the heads' bilinear forms ``A_h = W_q,h^T W_k,h`` (E x kdim), from
    a layer's per-head projections (``q_proj.weight``, ``k_proj.weight``, (H*D, in)); 0 for heads that score alike up
    to a temperature, 2 for opposite ones (module docstring). Computed without forming A: ``<A_h, A_g>_F =
    sum((W_q,h W_q,g^T) * (W_k,h W_k,g^T))`` (D x D blocks). A head with a zero form is 1 from every other."""
    q, k = _per_head(weights["q_proj.weight"], head_dim), _per_head(weights["k_proj.weight"], head_dim)
    H = q.shape[0]
    qq = (q.reshape(H * head_dim, -1) @ q.reshape(H * head_dim, -1).T).reshape(H, head_dim, H, head_dim)
    kk = (k.reshape(H * head_dim, -1) @ k.reshape(H * head_dim, -1).T).reshape(H, head_dim, H, head_dim)
    gram = (qq * kk).sum(dim=(1, 3)).double()
    norm = gram.diagonal().clamp_min(0).sqrt()
    cos = gram / torch.outer(norm, norm).clamp_min(torch.finfo(torch.float64).tiny)
    return (1 - cos).fill_diagonal_(0.0)


def output_importance(weights: dict[str, Tensor], head_dim: int) -> Tensor:
    """(H,) float64: ``|W_o,h W_v,h|_F`` per head, from a layer's per-head projections (``v_proj.weight`` (H*D,
    vdim), ``out_proj.weight`` (E, H*D)), computed as ``sqrt(sum((W_o,h^T W_o,h) * (W_v,h W_v,h^T)))``."""
    v = _per_head(weights["v_proj.weight"], head_dim)
    o = _per_head(weights["out_proj.weight"].T, head_dim)  # (H, D, E): head h's output columns as rows
    oo, vv = o @ o.transpose(1, 2), v @ v.transpose(1, 2)
    return (oo * vv).sum(dim=(1, 2)).clamp_min(0).double().sqrt()


def has_components(layer: AttentionBase) -> bool:
    """Whether the layer has mixture weights to gate (MGK / sMGK / MLK with learned or Soft-E weights)."""
    mix = getattr(layer, "mixture", None)
    return mix is not None and mix.pi_mode != "hard_e"


@contextlib.contextmanager
def gated(layers, heads=None, components=None):
    """Set the head gates ``heads[i]`` ((H,) or (B, H), per query head) and component gates ``components[i]``
    ((H, M), (B, H, M) over the mixture's own heads, the G key groups of gmgk; or None) on ``layers[i]`` for the body
    of the ``with``; removed afterwards."""
    try:
        for i, layer in enumerate(layers):
            layer.head_gate = None if heads is None else heads[i]
            if has_components(layer):
                layer.mixture.component_gate = None if components is None else components[i]
        yield
    finally:
        for layer in layers:
            layer.head_gate = None
            if has_components(layer):
                layer.mixture.component_gate = None


def _query(module: nn.Module, args, kwargs) -> Tensor:
    return args[0] if args else kwargs["query"]


def _batch(module: AttentionBase, query: Tensor) -> int:
    """The batch size of a call (1 for an unbatched (L, E) query)."""
    return query.shape[0 if module.batch_first else 1] if query.dim() == 3 else 1


def gate_importance(layers: Sequence[AttentionBase], gates, loss: Callable[[], Tensor], *, unit: str = "head",
                    components=None) -> tuple[list[Tensor | None], int]:
    """Per layer, ``sum_x |dL(x) / dxi|`` over the examples x of one forward, and the number of examples.

    ``gates[i]``: layer i's gates of ``unit`` ("head": (H,), "component": (H, M); None to skip the layer) at their
    current values. Each call of a layer gets its own copy per example (B, ...) as a leaf, so one backward of
    ``loss()`` (a scalar summed, or averaged, over the examples of the batch; it runs the forward) gives every
    example's own derivative: the sum is of per-example absolute values, as Michel et al.'s ``E_x |dL/dxi|``
    defines, not the absolute value of a batch's gradient. A layer called twice in one forward (a shared module)
    adds its calls' derivatives per example before the absolute value. ``components``: component gates held fixed
    while head gates are differentiated. The parameters' ``.grad`` are not touched. float64 (H,) / (H, M)."""
    calls: list[list[Tensor]] = [[] for _ in layers]

    def hook(i):
        """The forward pre-hook of layer ``i`` (below)."""
        def set_gate(module, args, kwargs):
            """Forward pre-hook: layer i's gates for this call, one row per example, as a leaf that needs grad."""
            query = _query(module, args, kwargs)
            leaf = gates[i].to(query.device, query.dtype).expand(_batch(module, query), *gates[i].shape).clone()
            calls[i].append(leaf.requires_grad_())
            if unit == "head":
                module.head_gate = leaf
            else:
                module.mixture.component_gate = leaf
        return set_gate

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(layers)
               if gates[i] is not None]
    try:
        with torch.enable_grad(), gated(layers, None, components if unit == "head" else None):
            total = loss()
            leaves = [leaf for c in calls for leaf in c]
            grads = iter(torch.autograd.grad(total, leaves, allow_unused=True) if leaves else ())
    finally:
        for h in handles:
            h.remove()
    sums, examples = [], max([c[0].shape[0] for c in calls if c], default=0)
    for g, c in zip(gates, calls):
        per = [d for d in (next(grads) for _ in c) if d is not None]
        if g is None:
            sums.append(None)
            continue
        if per and all(d.shape == per[0].shape for d in per):
            per = [sum(per)]  # one example's derivative through every call of the layer
        sums.append(sum((d.detach().abs().sum(0).double().cpu() for d in per), torch.zeros(g.shape,
                                                                                             dtype=torch.float64)))
    return sums, examples


# AttentionBase.forward's arguments after (query, key, value, key_padding_mask), in order
_LATER_ARGUMENTS = ("need_weights", "attn_mask", "average_attn_weights", "is_causal")


@contextlib.contextmanager
def _maps(layers: Sequence[AttentionBase]):
    """Record, per layer, the sum over the calls' sequences of :func:`js_matrix` of their per-head maps and how many
    sequences: forces ``need_weights`` (per head) on every call that has no decoding cache, and returns the outputs
    the caller asked for (no weights when it asked for none)."""
    sums: list = [None] * len(layers)
    counts = [0] * len(layers)
    asked: list[bool] = []

    def want(module, args, kwargs):
        """Forward pre-hook: the call computes its per-head weights (positional flags included)."""
        if kwargs.get("past_key_values") is not None:
            return None
        kwargs.update(zip(_LATER_ARGUMENTS, args[4:]))  # forward's later positional arguments by name
        asked.append(bool(kwargs.get("need_weights", True)))
        kwargs.update(need_weights=True, average_attn_weights=False)
        return tuple(args[:4]), kwargs

    def keep(i):
        """The forward hook of layer ``i`` (below)."""
        def hook(module, args, kwargs, output):
            """Forward hook: add the JS matrix of every sequence of this call's (B, H, L, S) weights."""
            if kwargs.get("past_key_values") is not None:
                return None
            weights = output[1] if output[1].dim() == 4 else output[1].unsqueeze(0)
            for b in range(weights.shape[0]):
                m = js_matrix(weights[b])
                sums[i] = m if sums[i] is None else sums[i] + m
                counts[i] += 1
            return output if asked.pop() else (output[0], None)
        return hook

    handles = []
    try:
        for i, m in enumerate(layers):
            handles += [m.register_forward_pre_hook(want, with_kwargs=True),
                        m.register_forward_hook(keep(i), with_kwargs=True)]
        yield sums, counts
    finally:
        for h in handles:
            h.remove()


def _inputs(model: nn.Module, calibration) -> tuple[tuple, dict]:
    """``model``'s call of ``calibration`` (a tensor, a tuple of positional inputs or a dict of keyword inputs);
    a model whose forward takes ``use_cache`` (Hugging Face) is called with ``use_cache=False``, since a decoding
    cache would keep the layers from computing their maps."""
    if isinstance(calibration, Tensor):
        args, kwargs = (calibration,), {}
    elif isinstance(calibration, (tuple, list)):
        args, kwargs = tuple(calibration), {}
    elif isinstance(calibration, dict):
        args, kwargs = (), dict(calibration)
    else:
        raise ValueError(f"calibration must be a Tensor, a tuple of positional inputs or a dict of keyword inputs, "
                         f"got {type(calibration).__name__}")
    try:
        takes_cache = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_cache = False
    if takes_cache:
        kwargs.setdefault("use_cache", False)
    return args, kwargs


@contextlib.contextmanager
def _batch_fails(model: nn.Module, where: str):
    """An error of ``model``'s forward (or the loss) on the calibration batch as a one-line ValueError naming the
    batch: the wrong width, token ids out of the vocabulary, ... are the batch's fault, not the caller's code's."""
    try:
        yield
    except Exception as e:
        text = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"calibrate: the calibration batch fails in {type(model).__name__}'s {where}: "
                         f"{type(e).__name__}{': ' + text if text else ''}") from e


def calibrate(model: nn.Module, calibration, loss_fn: Callable | None = None, *, maps: bool = True) -> dict:
    """What one calibration batch says about the heads of every mgk attention module of ``model``: ``{path:
    {"divergence": (H, H) mean JS divergence (bits) of its heads' maps over every query row of the batch (when
    ``maps``), "importance": (H,) E_x |dL(x)/dxi_h| with L = ``loss_fn(model output)`` (when ``loss_fn`` is given)}}``,
    every path of a shared module listed. The model runs in eval mode (each module's mode restored after);
    float64 results. Raises ValueError for a calibration of another type, a model without mgk attention, a batch
    the model's forward (or ``loss_fn``) fails on (one line, its error's first line), or a layer the batch did not
    reach."""
    named = [(p, m) for p, m in model.named_modules(remove_duplicate=False) if isinstance(m, AttentionBase)]
    layers = list(dict.fromkeys(m for _, m in named))
    if not layers:
        raise ValueError(f"calibrate: {type(model).__name__} holds no mgk attention module")
    args, kwargs = _inputs(model, calibration)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    found: dict[int, dict] = {id(m): {} for m in layers}
    try:
        if maps:
            with torch.no_grad(), _maps(layers) as (sums, counts), _batch_fails(model, "forward"):
                model(*args, **kwargs)
            for m, s, c in zip(layers, sums, counts):
                found[id(m)]["divergence"] = None if s is None else s / c
        if loss_fn is not None:
            ones = [torch.ones(m.num_heads) for m in layers]
            with _batch_fails(model, "forward or loss_fn"):
                sums, examples = gate_importance(layers, ones, lambda: loss_fn(model(*args, **kwargs)))
            for m, s in zip(layers, sums):
                found[id(m)]["importance"] = s / max(examples, 1)
    finally:
        for m, mode in modes:
            m.training = mode
    missing = [p for p, m in named if maps and found[id(m)]["divergence"] is None]
    if missing:
        raise ValueError(f"calibrate: the calibration batch did not reach {missing[0]} (no attention map computed)")
    return {p: found[id(m)] for p, m in named}
