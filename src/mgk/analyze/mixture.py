"""Mixture statistics of MGK and MLK layers: the mixture weights pi, and each component's share of the attention.

- pi (paper eq. 9): learned (softmax of the logits), the Soft-E buffer, or none for Hard-E (pi unused).
- Shares: for MGK with a sum over components, the responsibility ``gamma_ijr = softmax_r(log pi_jr - |q_i -
  k_jr|^2 / (2 sigma_r^2))`` of :func:`mgk.functional.mgk_responsibilities`, summed over the valid (query, key)
  pairs and divided by their number; for Hard-E (the k-means limit) the share of valid pairs whose nearest
  component (largest Gaussian log-kernel) is r; for MLK (paper eq. 14) the share of component r in each
  unnormalised weight, ``pi_r phi(q_i).phi(k_jr) / sum_r' pi_r' phi(q_i).phi(k_jr')`` averaged the same way, with
  the module's own feature map phi (elu+1, elu_sum or a callable) and its pi (normalised or not; the ratio needs
  only pi >= 0). MLK with ``mix="keys"`` mixes the keys before the feature map (``phi(sum_r pi_r k_r)``), so its
  weight has no per-component parts: it has no shares (None).
Queries and keys are the module's own projections of the recorded layer input.

Kinds whose keys have fewer heads than their queries (gmgk's G key groups, as GQA's G key/value heads; the module's
``kv_heads``) are read per query head: query head h reads key head h // (H / G), so its keys and a group's pi are
repeated for the H / G query heads of the group (:func:`per_query_head`), and every statistic is (H, ...) as for
MGK. pi is then reported for each query head, equal within a group.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..attention import MGKAttention, MLKAttention
from ..functional import causal_mask, gaussian_log_kernel, mgk_responsibilities

__all__ = ["has_mixture", "per_query_head", "mixture_weights", "component_sums"]


def has_mixture(module) -> bool:
    """Whether ``module`` has mixture components (MGK or MLK attention)."""
    return isinstance(module, (MGKAttention, MLKAttention))


def per_query_head(module, t: Tensor, dim: int = 1) -> Tensor:
    """``t`` with its dimension ``dim`` of the module's ``kv_heads`` key heads (G) repeated for the H / G query heads
    each one serves (query head h reads key head h // (H / G), as GQA and gmgk do); returned as it is when that
    dimension already has H entries, or 1 (one set broadcast over the heads)."""
    H = module.num_heads
    G = getattr(module, "kv_heads", H)
    if G == H or t.shape[dim] != G:
        return t
    return t.repeat_interleave(H // G, dim=dim)


def mixture_weights(module, length: int) -> Tensor | None:
    """pi of ``module`` as float64 (H, M, P): P = 1 for per-head (or per-layer: repeated for each head) weights,
    else the first ``length`` key positions (per-position learned weights, or the Soft-E buffer). Un-normalised
    weights (``pi_norm="none"``) are reported as they are, ``exp`` of the free log-weights. None for Hard-E."""
    if getattr(module, "pi_mode", None) == "hard_e":
        return None
    if isinstance(module, MGKAttention) and module.pi_mode == "soft_e":  # the buffer (G, M, max_len) of the keys
        return per_query_head(module, module.pi[:, :, :length], dim=0).detach().to(torch.float64).cpu()
    pi = module.mixture_log_weights(length).detach().to(torch.float64).exp()[0]  # (H or 1, M, 1 or length)
    return pi.expand(module.num_heads, -1, -1).cpu()  # pi_shape="layer": one set, shared by every head


@torch.no_grad()
def component_sums(module, x: Tensor, is_causal: bool) -> tuple[Tensor, Tensor] | None:
    """Summed component shares over the valid (query, key) pairs of one sequence.

    Args:
        module: an MGKAttention or MLKAttention.
        x: the layer input of one sequence cut to its real tokens, (1, n, E).
        is_causal: whether the layer attends causally (pairs with j > i are not valid).
    Returns:
        ``(sums (H, M), pairs (H,))`` float64, H the query heads (keys shared by a group of them read per query
        head): dividing gives each head's share of each component; None for MLK with ``mix="keys"`` (no
        per-component parts).
    """
    if isinstance(module, MLKAttention) and module.mix == "keys":
        return None
    q = module._split(module.q_proj(x))  # (1, H, n, D): the module's own projections, no second implementation
    k = per_query_head(module, module._keys(x))  # (1, H, M, n, D): each query head's keys
    n = x.shape[1]
    valid = causal_mask(n, n, x.device) if is_causal else torch.ones(n, n, dtype=torch.bool, device=x.device)
    if isinstance(module, MLKAttention):
        log_pi = module.mixture_log_weights(n)  # (1, H, M, 1) or (1, H, M, n)
        phi = module.feature_map_fn
        fk = phi(k.to(torch.float64))  # (1, H, M, n, D)
        part = torch.einsum("bhld,bhmsd->bhlms", phi(q.to(torch.float64)), fk)
        part = part * log_pi.to(torch.float64).exp().unsqueeze(2)  # (1, H, n, M, n)
        share = part / part.sum(dim=3, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
        share = share * valid.view(1, 1, n, 1, n)
        return share.sum(dim=(0, 2, 4)), valid.sum().to(torch.float64).expand(q.shape[1]).clone()
    q, k, centre = module._at_scale(q, k)  # the score's own queries and keys (key_scale), and its centre
    if module.pi_mode == "hard_e":
        g = gaussian_log_kernel(q.to(torch.float64), k.to(torch.float64), module.sigma2.to(torch.float64))
        winners = torch.nn.functional.one_hot(g.argmax(dim=3), module.num_keys)  # (1, H, n, n, M)
        winners = winners * valid.view(1, 1, n, n, 1)
        return winners.sum(dim=(0, 2, 3)).to(torch.float64), valid.sum().to(torch.float64).expand(q.shape[1]).clone()
    resp, count = mgk_responsibilities(q.to(torch.float64), k.to(torch.float64),
                                       log_pi=module.mixture_log_weights(n).to(torch.float64),
                                       sigma2=module.sigma2.to(torch.float64), is_causal=is_causal,
                                       centre=centre)
    return resp.sum(dim=-1).to(torch.float64), count.sum(dim=-1).to(torch.float64)
