"""Pure statistics of attention maps (no model, no files): numerical rank, head redundancy, summaries.

Every function takes row-stochastic attention maps cut to real tokens, ``(H, L, S)`` float tensors, and computes in
float64. These are the measurements of the paper's head-redundancy analysis (Nguyen et al., "Improving Transformers
with Probabilistic Attention Keys", ICML 2022: attention maps per head, and the rank of attention matrices by SVD with
singular values below 1e-6 dropped), plus distances between heads.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..convert.head_measures import js_divergence, js_matrix  # noqa: F401  (the measure swap_attention pairs heads by)

__all__ = ["numerical_rank", "numerical_ranks", "js_divergence", "pairwise_js", "pairwise_l2", "effective_heads",
           "summary", "RANK_MODES"]

RANK_MODES = ("absolute", "relative")


def numerical_rank(maps: Tensor, tol: float = 1e-6, mode: str = "absolute") -> Tensor:
    """Numerical rank of each matrix of ``maps`` (..., L, S): the number of singular values kept.

    ``mode="absolute"`` keeps singular values ``s > tol`` (the paper's rule: values below 1e-6 dropped);
    ``mode="relative"`` keeps ``s > tol * s_max`` (scale-free; the rule of ``numpy.linalg.matrix_rank(A,
    rtol=tol)``). A row-stochastic L x S map satisfies ``A 1_S = 1_L``, so ``s_max >= sqrt(L / S)`` (1 for
    self-attention): the two rules then differ little, but only the relative one is invariant to scaling.

    Singular values come from :func:`torch.linalg.svdvals` in float64. Returns int64 ranks of shape (...).
    Raises ValueError for a bad mode, a negative tol or fewer than 2 dimensions.
    """
    if mode not in RANK_MODES:
        raise ValueError(f"rank mode must be one of {RANK_MODES}, got {mode!r}")
    return numerical_ranks(maps, tol)[mode]


def numerical_ranks(maps: Tensor, tol: float = 1e-6) -> dict[str, Tensor]:
    """:func:`numerical_rank` under every mode of ``RANK_MODES`` from one SVD: ``{mode: ranks (...)}``."""
    if not tol >= 0:
        raise ValueError(f"rank tolerance must be >= 0, got {tol}")
    if maps.dim() < 2:
        raise ValueError(f"maps must have shape (..., L, S), got {tuple(maps.shape)}")
    s = torch.linalg.svdvals(maps.detach().to(torch.float64))
    cuts = {"absolute": torch.tensor(tol, dtype=torch.float64), "relative": tol * s[..., :1]}
    return {mode: (s > cuts[mode]).sum(dim=-1) for mode in RANK_MODES}


def _pairs(H: int) -> tuple[Tensor, Tensor]:
    i, j = torch.triu_indices(H, H, offset=1)
    return i, j


def pairwise_js(maps: Tensor) -> float:
    """Mean Jensen-Shannon divergence (bits) between the heads' attention rows: the mean over head pairs h < h' and
    over query rows i of ``JS(A_h[i], A_h'[i])``. maps (H, L, S); NaN for H = 1 (no pair)."""
    H = maps.shape[0]
    if H < 2:
        return float("nan")
    i, j = _pairs(H)
    return float(js_divergence(maps[i], maps[j]).mean())


def pairwise_l2(maps: Tensor) -> float:
    """Mean L2 distance between the heads' maps: the mean over head pairs h < h' of ``|A_h - A_h'|_F / sqrt(L)``,
    the root mean square over query rows of the Euclidean distance between the rows (so sequences of different
    lengths are on one scale; each row distance is at most sqrt(2)). maps (H, L, S); NaN for H = 1."""
    H, L = maps.shape[0], maps.shape[1]
    if H < 2:
        return float("nan")
    i, j = _pairs(H)
    m = maps.detach().to(torch.float64)
    return float((torch.linalg.matrix_norm(m[i] - m[j]) / math.sqrt(L)).mean())


def effective_heads(maps: Tensor) -> float:
    """Effective number of distinct heads, in [1, H]: the effective rank (Roy and Vetterli 2007) of the heads'
    cosine-similarity matrix.

    With ``a_h`` the map of head h flattened to a vector, ``K[h, h'] = <a_h, a_h'> / (|a_h| |a_h'|)`` is an H x H
    positive semi-definite matrix with trace H; with its eigenvalues ``lambda`` and ``p = lambda / H`` (they sum to
    1), the value is ``exp(-sum_h p_h log p_h)``. Heads that are exact copies give 1 (K is all ones: one eigenvalue
    H); heads with disjoint supports (orthogonal maps) give H (K = I); in between it counts how many independent
    directions the heads span, weighted by how much of the total similarity each carries. maps (H, L, S)."""
    H = maps.shape[0]
    a = maps.detach().reshape(H, -1).to(torch.float64)
    a = a / torch.linalg.vector_norm(a, dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    lam = torch.linalg.eigvalsh(a @ a.T).clamp_min(0.0)
    p = lam / lam.sum()
    entropy = -(torch.where(p > 0, p * torch.log(torch.where(p > 0, p, torch.ones_like(p))), torch.zeros_like(p)))
    return float(torch.exp(entropy.sum()))


def summary(values) -> dict:
    """``{"n", "mean", "std", "min", "median" (the lower one for an even n), "max"}`` of a sequence of numbers
    (NaNs dropped; std with n - 1, 0 for one value); ``{"n": 0}`` when empty."""
    x = torch.as_tensor(list(values), dtype=torch.float64)
    x = x[~torch.isnan(x)]
    if x.numel() == 0:
        return {"n": 0}
    return {"n": int(x.numel()), "mean": float(x.mean()), "std": float(x.std()) if x.numel() > 1 else 0.0,
            "min": float(x.min()), "median": float(x.median()), "max": float(x.max())}
