"""Changing the heads of a trained multi-head layer before it is converted to another kind: keep some of its heads
(pruning), or merge groups of its heads into the key components of fewer mixture heads. Both act on a layer's
projections as :meth:`mgk.attention.AttentionBase.per_head_projections` gives them (``q_proj``, ``k_proj``,
``v_proj``, ``out_proj`` weights and biases of a layer with H heads of size D), and return projections in the same
form, which the new kind's ``load_projections`` then takes (``mgk train --init-from``, :mod:`mgk.train.init_from`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["select_heads", "merge_heads", "check_heads"]

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
    """The projections of a mixture layer with one head per group of ``groups`` (all of size M), whose M key
    components are the keys of the group's heads: the rule by which ``mgk train --init-from`` turns softmax with
    M x h heads into MGK with h heads of M components (results/cpu/kv-budget.md, "Retro-fitting").

    Head i of the new layer (group ``g = groups[i]``) gets the mean of the group's query projections, the mean of its
    value projections, the sum of its output-projection columns (so that when the group's heads attend alike, the
    layer's output is the old one: ``sum_j W_o,j o_j = (sum_j W_o,j) o`` for equal ``o_j = o``) and key component r
    = the key projection of head ``g[r]``. The key projection returned has M x h x D rows, component-major (component
    r of every head, then r + 1), the layout of :class:`mgk.attention.MixtureKeys`' ``k_proj``: the mixture kinds
    with separate keys (mgk, mlk) load it as their M components.

    Raises:
        ValueError naming groups of different sizes, an empty group, a head out of range or used twice.
    """
    H = check_heads(weights, head_dim)
    sizes = {len(g) for g in groups}
    if not groups or sizes == {0} or len(sizes) != 1:
        raise ValueError(f"merge_heads: groups must be non-empty and of one size, got {[list(g) for g in groups]}")
    _check_indices([h for g in groups for h in g], H, "merge_heads")
    M = sizes.pop()
    out = {}
    for name, t in weights.items():
        proj = name.split(".")[0]
        if proj in ("q_proj", "v_proj"):
            out[name] = torch.stack([_rows(t, g, head_dim).reshape(M, head_dim, *t.shape[1:]).mean(0)
                                     for g in groups]).reshape(len(groups) * head_dim, *t.shape[1:])
        elif proj == "k_proj":
            out[name] = torch.cat([_rows(t, [g[r] for g in groups], head_dim) for r in range(M)])
        elif name == "out_proj.weight":
            out[name] = torch.cat([_columns(t, g, head_dim).reshape(t.shape[0], M, head_dim).sum(1)
                                   for g in groups], dim=1)
        else:
            out[name] = t
    return out
