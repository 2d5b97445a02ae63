"""Changing the heads of a trained multi-head layer before it is converted to another kind with fewer heads of the
same size: keep some of its heads (``"prune"``), merge groups of its heads into the key components of fewer mixture
heads (``"merge"``), or mean-pool groups of heads (``"pool"``); ``"slice"`` instead keeps the projections whole and
re-cuts the width into heads of another size. :func:`choose_rule` names the rule for a source and a target,
:func:`plan_heads` chooses the groups or kept heads (by the measures of :mod:`mgk.convert.head_measures`), and
:func:`apply_plan` makes the projections. The one code path of :func:`mgk.swap_attention` (torch and Hugging Face
models) and ``mgk train --init-from`` (:mod:`mgk.retrofit`).

The projections are a layer's as :meth:`mgk.attention.AttentionBase.per_head_projections` gives them (``q_proj``,
``k_proj``, ``v_proj``, ``out_proj`` weights and biases of a layer with H heads of size D), and the rules return
projections in the same form, which the new kind's ``load_projections`` then takes.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..attention.gqa import GroupedQueryAttention
from .head_measures import adjacent_groups, bilinear_divergence, greedy_groups, output_importance

__all__ = ["RULES", "PAIRINGS", "MERGE_KEY_SHRINK", "select_heads", "merge_heads", "pool_heads", "check_heads",
           "choose_rule", "plan_heads", "apply_plan"]

RULES = ("merge", "prune", "pool", "slice")
PAIRINGS = ("similar", "adjacent")

_IN = ("q_proj", "k_proj", "v_proj")


def check_heads(weights: dict[str, Tensor], head_dim: int) -> int:
    """H, the heads of the projections ``weights`` with heads of size ``head_dim``; ValueError when the query
    projection's rows are not a multiple of it or a projection is missing."""
    missing = [f"{p}.weight" for p in (*_IN, "out_proj") if f"{p}.weight" not in weights]
    if missing:
        raise ValueError(f"the layer's projections lack {', '.join(missing)}")
    rows = weights["q_proj.weight"].shape[0]
    if head_dim < 1 or rows % head_dim:
        raise ValueError(f"head_dim={head_dim} does not divide the layer's attention width {rows}")
    return rows // head_dim


def _rows(t: Tensor, heads: Sequence[int], head_dim: int) -> Tensor:
    """The rows of ``heads`` (in that order) of a projection weight (H*D, ...) or bias (H*D,)."""
    return t.reshape(-1, head_dim, *t.shape[1:])[list(heads)].reshape(len(heads) * head_dim, *t.shape[1:])


def _columns(t: Tensor, heads: Sequence[int], head_dim: int) -> Tensor:
    """The columns of ``heads`` of the output projection (E, H*D)."""
    return t.reshape(t.shape[0], -1, head_dim)[:, list(heads)].reshape(t.shape[0], len(heads) * head_dim)


def _check_indices(heads: Sequence[int], H: int, what: str) -> None:
    bad = [h for h in heads if not 0 <= h < H]
    if bad:
        raise ValueError(f"{what}: head {bad[0]} is not one of the layer's {H} heads")
    if len(set(heads)) != len(heads):
        raise ValueError(f"{what}: a head is named twice in {list(heads)}")


def select_heads(weights: dict[str, Tensor], heads: Sequence[int], head_dim: int) -> dict[str, Tensor]:
    """The projections of the layer that keeps only ``heads`` (in that order): the query, key and value rows and the
    output-projection columns of those heads; the output bias unchanged. For a softmax layer this is exactly the
    original layer with the other heads' outputs removed (Michel et al., NeurIPS 2019, head pruning).

    Args:
        weights: projections of a layer with H heads of size ``head_dim`` (see the module docstring).
        heads: distinct head indices in [0, H), at least one.
    Raises:
        ValueError naming a head out of range, a repeated head, an empty selection or a width ``head_dim`` does not
        divide.
    """
    H = check_heads(weights, head_dim)
    if not heads:
        raise ValueError("select_heads: keep at least one head")
    _check_indices(heads, H, "select_heads")
    out = {}
    for name, t in weights.items():
        proj = name.split(".")[0]
        if proj in _IN:
            out[name] = _rows(t, heads, head_dim)
        elif name == "out_proj.weight":
            out[name] = _columns(t, heads, head_dim)
        else:
            out[name] = t
    return out


def merge_heads(weights: dict[str, Tensor], groups: Sequence[Sequence[int]], head_dim: int) -> dict[str, Tensor]:
    """The projections of a mixture layer with one head per group of ``groups`` (all of size M) whose key component
    r scores as the group's r-th head did: the rule by which :func:`mgk.swap_attention` and ``mgk train
    --init-from`` turn softmax with M x h heads into MGK with h heads of M components (results/cpu/kv-budget.md,
    "Retro-fitting").

    A merged head has one query for M keys, and one value / output pair for M heads, so it keeps what it can, each
    part by a least-squares optimum computed in the group's (M D)-dimensional span (cheap for any width):

    * scores: head r's logit is ``x_i^T A_r y_j`` with ``A_r = W~_q,r^T W~_k,r`` (biases as an extra input 1).
      The merged query spans the top-D left singular subspace U of ``[A_1 ... A_M]`` and key component r is
      ``U^T A_r``, so component r's logit is head r's with the query projected on U (exact when the group's queries
      span D dimensions, e.g. equal query projections). The split between query and key is balanced by the
      singular values, then the keys are made ``MERGE_KEY_SHRINK`` times shorter and the query as much longer: the
      logits do not change, while MGK's key-norm term ``-|k|^2 / (2 sigma^2)``, which softmax lacks, falls by its
      square (on a trained toy softmax-8 model, step-0 loss 0.10-0.15 unshrunk, 0.03-0.05 shrunk by 2 against
      0.02-0.04 for the source).
    * outputs: the group's value-output product ``sum_r W_o,r W~_v,r`` by its best rank-D approximation (Eckart and
      Young), split evenly between the value and output projections: exact when the group's heads attend alike
      and their product has rank D (e.g. equal value projections).

    The output bias is kept. The key projection returned has M x h x D rows, component-major (component r of every
    head, then r + 1), the layout of :class:`mgk.attention.MixtureKeys`' ``k_proj``: the mixture kinds with
    separate keys (mgk, mlk) load it as their M components. Computed in float64, returned in the weights' dtype.

    Raises:
        ValueError naming groups of different sizes, an empty group, a head out of range or used twice.
    """
    H = check_heads(weights, head_dim)
    sizes = {len(g) for g in groups}
    if not groups or sizes == {0} or len(sizes) != 1:
        raise ValueError(f"merge_heads: groups must be non-empty and of one size, got {[list(g) for g in groups]}")
    _check_indices([h for g in groups for h in g], H, "merge_heads")
    heads = [_merged_head(weights, g, head_dim) for g in groups]
    M, dtype = sizes.pop(), weights["q_proj.weight"].dtype
    out = {}
    for proj, rows in (("q_proj", [h["q"] for h in heads]), ("v_proj", [h["v"] for h in heads]),
                       ("k_proj", [h["k"][r] for r in range(M) for h in heads])):
        full = torch.cat(rows)
        out[f"{proj}.weight"] = full[:, :-1].to(dtype)
        if f"{proj}.bias" in weights:
            out[f"{proj}.bias"] = full[:, -1].to(dtype)
    out["out_proj.weight"] = torch.cat([h["o"] for h in heads], dim=1).to(dtype)
    out.update({k: v for k, v in weights.items() if k.startswith("out_proj.") and k != "out_proj.weight"})
    return out


# How much shorter than a balanced split merged keys are made (queries as much longer): MGK's key-norm term falls by
# its square while every logit stays (merge_heads; 1 left step-0 losses 3-5x the source's on a trained toy model,
# 2 within 1.3x, 4 and 8 no better than 2).
MERGE_KEY_SHRINK = 2.0


def _augmented(weights: dict[str, Tensor], proj: str, head: int, head_dim: int) -> Tensor:
    """Head ``head``'s rows of ``proj`` with its bias as a last column (zeros without one), float64 (D, in + 1)."""
    w = weights[f"{proj}.weight"][head * head_dim:(head + 1) * head_dim].double()
    b = weights.get(f"{proj}.bias")
    b = w.new_zeros(head_dim) if b is None else b[head * head_dim:(head + 1) * head_dim].double()
    return torch.cat([w, b[:, None]], dim=1)


def _merged_head(weights: dict[str, Tensor], group: Sequence[int], D: int) -> dict:
    """One merged head of :func:`merge_heads`: query rows q (D, E + 1), key components k[r] (D, kdim + 1), value
    rows v (D, vdim + 1) and output columns o (E, D), float64."""
    q = [_augmented(weights, "q_proj", h, D) for h in group]
    k = [_augmented(weights, "k_proj", h, D) for h in group]
    basis = torch.linalg.qr(torch.cat(q).T)[0]  # (E + 1, M D): the span of the group's queries
    coords = [basis.T @ qr.T for qr in q]  # (M D, D): each head's query in that basis
    gram = sum(c @ (kr @ kr.T) @ c.T for c, kr in zip(coords, k))  # [A_1 ... A_M] [A_1 ... A_M]^T in the basis
    values, vectors = torch.linalg.eigh(gram)  # ascending
    top = vectors[:, -D:].flip(-1)
    scale = values[-D:].flip(-1).clamp_min(0).sqrt().sqrt().clamp_min(1e-12)  # sqrt of the singular values
    u = basis @ top  # (E + 1, D)
    new_q = MERGE_KEY_SHRINK * scale[:, None] * u.T
    new_k = [(u.T @ qr.T) @ kr / scale[:, None] / MERGE_KEY_SHRINK for qr, kr in zip(q, k)]
    outs = torch.cat([weights["out_proj.weight"][:, h * D:(h + 1) * D].double() for h in group], dim=1)
    vals = torch.cat([_augmented(weights, "v_proj", h, D) for h in group])  # (M D, vdim + 1)
    qo, ro = torch.linalg.qr(outs)
    qv, rv = torch.linalg.qr(vals.T)
    p, sigma, wt = torch.linalg.svd(ro @ rv.T)
    root = sigma[:D].sqrt()
    return {"q": new_q, "k": new_k, "o": (qo @ p[:, :D]) * root, "v": root[:, None] * (wt[:D] @ qv.T)}


def pool_heads(weights: dict[str, Tensor], groups: Sequence[Sequence[int]], head_dim: int) -> dict[str, Tensor]:
    """The projections of a layer with one head per group of ``groups`` (all of one size): its query, key and value
    projections the mean of the group's, its output-projection columns the sum of the group's (as
    :func:`merge_heads`: the old output when the group's heads attend alike). Ainslie et al.'s (2023) mean-pooling of
    key/value heads, applied to whole heads: the rule by which a kind with grouped key/value heads (GQA) gets fewer
    query heads. Raises ValueError as :func:`merge_heads`."""
    H = check_heads(weights, head_dim)
    sizes = {len(g) for g in groups}
    if not groups or sizes == {0} or len(sizes) != 1:
        raise ValueError(f"pool_heads: groups must be non-empty and of one size, got {[list(g) for g in groups]}")
    _check_indices([h for g in groups for h in g], H, "pool_heads")
    M = sizes.pop()
    out = {}
    for name, t in weights.items():
        if name.split(".")[0] in _IN:
            out[name] = torch.stack([_rows(t, g, head_dim).reshape(M, head_dim, *t.shape[1:]).mean(0)
                                     for g in groups]).reshape(len(groups) * head_dim, *t.shape[1:])
        elif name == "out_proj.weight":
            out[name] = torch.cat([_columns(t, g, head_dim).reshape(t.shape[0], M, head_dim).sum(1)
                                   for g in groups], dim=1)
        else:
            out[name] = t
    return out


def choose_rule(source_heads: int, source_head_dim: int, new, heads: str | None = None) -> str:
    """The rule converting a layer of ``source_heads`` heads of ``source_head_dim`` into the module ``new`` (an mgk
    attention module, already built): "same" (same heads and head size: the kind's own rule), "slice" (another head
    size, the same width), or for fewer heads of the same size ``heads`` when given, else the kind's default:
    "merge" for separate mixture keys (mgk, mlk) with ``num_heads * num_keys`` = the source's heads, "pool" for
    grouped key/value heads (gqa) whose heads divide the source's, "prune" for the others (softmax, linear, smgk,
    smlk, ...). Raises ValueError in one line for shapes no rule converts (more heads of the same size, another
    width), a ``heads`` rule that does not fit, and separate keys whose heads cannot merge the source's (no
    default: the groups would have to be of another size than num_keys). The messages state what does not fit,
    never another call: which call a caller can make instead depends on its own checks
    (:func:`mgk.convert.layers.check_shape` names one it verified)."""
    H, D, width = new.num_heads, new.head_dim, source_heads * source_head_dim
    if heads is not None and heads not in RULES:
        raise ValueError(f"heads must be one of {', '.join(RULES)}, got {heads!r}")
    if D != source_head_dim or heads == "slice":
        if H * D != width:
            raise ValueError(f"{H} heads of head_dim {D} keep neither the source's head size {source_head_dim} "
                             f"nor its attention width {width}")
        if heads not in (None, "slice"):
            raise ValueError(f"heads={heads!r} keeps the head size {source_head_dim}, but {H} heads of head_dim {D} "
                             "re-cut the width")
        return "same" if H == source_heads else "slice"
    if H == source_heads:
        return "same"
    if H > source_heads:
        raise ValueError(f"{H} heads of head_dim {D} from {source_heads}: no weights for more heads of one size")
    mix = getattr(new, "mixture", None)
    separate = mix is not None and mix.keys == "separate"
    merges = separate and H * mix.num_keys == source_heads
    pools = source_heads % H == 0
    rule = heads or ("merge" if merges else "pool" if isinstance(new, GroupedQueryAttention) and pools else
                     None if separate else "prune")
    if rule is None or (rule == "merge" and not merges):
        keys = f"num_keys={mix.num_keys}" if mix is not None else "one key per head"
        raise ValueError(f"merging {source_heads} heads into {H} needs separate mixture keys with num_heads * "
                         f"num_keys = {source_heads} ({type(new).__name__} has {keys})")
    if rule == "pool" and not pools:
        raise ValueError(f"heads='pool' needs num_heads={H} to divide the source's {source_heads} heads")
    return rule


def plan_heads(rule: str, weights: dict[str, Tensor], new_heads: int, head_dim: int, *,
               divergence: Tensor | None = None, importance: Tensor | None = None,
               pairs: str = "similar") -> dict:
    """Which heads ``rule`` (:func:`choose_rule`) merges or pools (``{"groups": [[...], ...]}``, groups of source
    heads / ``new_heads``) or keeps (``{"keep": [...]}``, the ``new_heads`` of largest importance, in their order),
    with ``"by"`` naming how, and the measures chosen by; ``{}`` for "same" and "slice".

    Groups: ``pairs="adjacent"`` takes heads (0, 1), (2, 3), ...; "similar" (default) is greedy matching
    (:func:`mgk.convert.head_measures.greedy_groups`) on ``divergence`` (H, H), the heads' attention-map divergence on
    data when given, else :func:`mgk.convert.head_measures.bilinear_divergence` of the weights. Kept heads: by
    ``importance`` (H,) when given (E|dL/dxi_h| on data), else :func:`mgk.convert.head_measures.output_importance`.
    ``weights`` are the source layer's per-head projections. ValueError for an unknown ``pairs``."""
    if pairs not in PAIRINGS:
        raise ValueError(f"pairs must be one of {', '.join(PAIRINGS)}, got {pairs!r}")
    H = check_heads(weights, head_dim)
    if rule in ("merge", "pool"):
        if pairs == "adjacent":
            return {"groups": adjacent_groups(H, H // new_heads), "pairs": pairs, "by": "adjacent heads"}
        by = "similar heads: greedy matching on the mean JS divergence of their attention maps (data)"
        if divergence is None:
            divergence = bilinear_divergence(weights, head_dim)
            by = "similar heads: greedy matching on 1 - cos of their bilinear forms W_q^T W_k (weights)"
        groups = greedy_groups(divergence, H // new_heads)
        spread = [float(divergence[g][:, g].sum()) / (len(g) * (len(g) - 1)) if len(g) > 1 else 0.0 for g in groups]
        return {"groups": groups, "pairs": pairs, "by": by, "divergence": spread}
    if rule == "prune":
        by = "largest E|dL/dxi_h| (Michel et al. 2019; data)"
        if importance is None:
            importance, by = output_importance(weights, head_dim), "largest |W_o,h W_v,h|_F (weights)"
        order = sorted(range(H), key=lambda h: (-float(importance[h]), h))
        return {"keep": sorted(order[:new_heads]), "importance": [float(v) for v in importance], "by": by}
    return {}


def apply_plan(weights: dict[str, Tensor], plan: dict, rule: str, head_dim: int) -> dict[str, Tensor]:
    """The projections ``rule`` makes of ``weights`` by ``plan`` (:func:`plan_heads`): :func:`merge_heads`,
    :func:`pool_heads` or :func:`select_heads`; ``weights`` themselves for "same" and "slice"."""
    if rule == "merge":
        return merge_heads(weights, plan["groups"], head_dim)
    if rule == "pool":
        return pool_heads(weights, plan["groups"], head_dim)
    if rule == "prune":
        return select_heads(weights, plan["keep"], head_dim)
    return weights
