"""Attention with a mixture of Gaussian keys (MGK), Nguyen et al., ICML 2022, eq. 9-10.

For query i, key position j with M components k_{j,r}, priors pi_{j,r} and variances sigma_r^2::

    s_ijr = log pi_jr - |q_i - k_jr|^2 / (2 sigma_r^2)           (Gaussian log-kernel plus log prior)
    A_ij  = softmax_j( logsumexp_r s_ijr + b_ij )     mixture="sum"  (learned pi, Soft-E)
    A_ij  = softmax_j( max_r  s'_ijr + b_ij )         mixture="max"  (Hard-E, the k-means limit; pi unused)

with ``b`` an optional additive bias (ALiBi, relative positions, a module's float mask; 0 by default).
Everything is computed in log space, so queries far from every key (every exp underflowing) still give a proper
distribution concentrated on the nearest key. The scores depend only on q - k, so every path first subtracts one
shared vector per (batch, head) from queries and keys, chosen from the queries (:mod:`._centre` says why and how):
the expanded distance ``|q|^2 - 2 q.k + |k|^2`` would otherwise cancel catastrophically under a large common
offset (the fault of the matrix-multiplication form of ``torch.cdist``, pytorch/pytorch#42479).

Four implementations compute the same numbers (:mod:`._mgk_backends`): "kernel" (our C++ CPU kernel), "triton",
"sdpa" (the bias folded into extra head dimensions of dot-product attention) and "explicit" (the log-kernel in
query chunks, the twin the tests compare the others with). :func:`select_backend` is the one place that decides
which serves a call (attention or the Soft-E statistics); ``backend=NAME`` asks for one by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _mgk_backends, _mixture_flash, _mixture_triton
from . import _mixture_terms as mixture_terms
from . import masks as _masks
from ._centre import apply_centre, check_centre, choose_centre
from ._checks import check_arguments, check_qkv, compute_dtype, full_precision
from ._dispatch import BackendError, is_transformed, pick
from ._mixture_terms import (
    check_log_pi,
    check_mixture,
    check_mixture_args,
    check_shifts,
    gaussian_log_kernel,
    key_bias,
    needs_qnorm,
    row_bias,
    scaled_keys,
    shifted_keys,
    to_heads,
)

__all__ = ["BACKENDS", "BackendError", "STATISTICS_BACKENDS", "gaussian_log_kernel", "mgk_attention", "mgk_centre",
           "mgk_responsibilities", "select_backend"]

BACKENDS = ("triton", "kernel", "sdpa", "explicit")  # select_backend's order of preference
STATISTICS_BACKENDS = ("kernel", "explicit")  # those that compute the Soft-E statistics


def _fused_unserved(backend, q, v, s2, mask, bias, mixture, dropout_p, automatic) -> str | None:
    """Why the fused kernel ``backend`` ("kernel" or "triton") cannot serve a call (None when it can)."""
    if not dropout_p < 1.0:
        return f"dropout_p={dropout_p}: the fused kernels (C++ and Triton) take 0 <= dropout_p < 1"
    if bias is not None and bias.shape[-2] != 1:  # first: its -inf entries have become a mask of its shape
        return "bias depends on the query: the fused kernels take at most a per-key bias (B, H, 1, S)"
    if mask is not None and mask.shape[-2] != 1:
        return "attn_mask depends on the query: the fused kernels take at most key padding plus is_causal"
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        return "head_dim or the value size is 0"
    if backend == "kernel":
        if q.device.type != "cpu":
            return f"the C++ kernel runs on CPU tensors, got {q.device.type}"
        if not _mixture_flash.available(q, dropout_p):
            return f"the C++ kernel is unavailable ({_mixture_flash.build_error() or 'not loaded'})"
        return None
    if mixture == "max":
        return "mixture='max' (Hard-E) is not implemented in the Triton kernels"
    why = _mixture_triton.unavailable(q, automatic=automatic)
    if why is None and (s2.requires_grad or torch.compiler.is_compiling() or not bool(torch.all(s2 == s2[:, :1]))):
        why = ("the Triton kernels take variances fixed and equal within each head (no per-row |q|^2 term, and no "
               "gradient for sigma2)")
    return why


def _unserved(backend, q, v, s2, mask, bias, mixture, dropout_p, return_weights, transformed,
              automatic) -> str | None:
    """Why ``backend`` cannot serve an attention call (None when it can)."""
    if backend == "explicit":
        return None
    if return_weights:
        return "return_weights=True needs the (B, H, L, S) weights, which only backend='explicit' builds"
    if transformed:
        return "forward-mode AD and torch.func transforms need backend='explicit' (the fused paths have no such rule)"
    if backend == "sdpa":
        return "mixture='max' (Hard-E) has no dot-product form" if mixture == "max" else None
    return _fused_unserved(backend, q, v, s2, mask, bias, mixture, dropout_p, automatic)


def _choose(backend, q, k, v, s2, log_prior, mask, bias, mixture, dropout_p, return_weights) -> str:
    transformed = is_transformed(q, k, v, s2, log_prior, *(() if bias is None else (bias,)))
    return pick(backend, BACKENDS, lambda b, automatic: _unserved(
        b, q, v, s2, mask, bias, mixture, dropout_p, return_weights, transformed, automatic))


def _choose_statistics(backend, q, k, s2, log_prior, mask) -> str:
    """The backend of :func:`mgk_responsibilities`: "kernel" under the attention kernel's conditions (at most key
    padding, CPU, built), for M > 1 and outside a torch.compile trace; "explicit" always."""
    transformed = is_transformed(q, k, s2, log_prior)

    def why_not(name, automatic):
        """Why statistics backend ``name`` cannot serve this call (None when it can), for :func:`pick`."""
        if name != "kernel":
            return None
        if k.shape[2] == 1:
            return "one component takes all the responsibility (M = 1): the explicit path returns the counts"
        if torch.compiler.is_compiling():
            return "the statistics kernel is not traced by torch.compile"
        if transformed:
            return "torch.func transforms need backend='explicit'"
        return _fused_unserved("kernel", q, k[:, :, 0], s2, mask, None, "sum", 0.0, automatic)

    return pick(backend, STATISTICS_BACKENDS, why_not)


def _inputs(query, key, value, log_pi, sigma2, H, M, D):
    """q, k, v in the compute dtype (float32 for 16-bit inputs), the (H', M) variances and the 4-dim log prior."""
    dt = compute_dtype(*(t for t in (query, key, value) if t is not None))
    s2 = mixture_terms.variances(sigma2, H, M, D, dt, query.device)
    v = None if value is None else value.to(dt)
    return query.to(dt), key.to(dt), v, s2, mixture_terms.log_prior(log_pi, M, dt, query.device)


def _bias(bias, mask, B, H, L, S):
    """Checked (mask, bias): the bias finite, its -inf entries moved into the mask."""
    return _masks.fold_bias(mask, _masks.check_bias(bias, "bias", B, H, L, S))


def _centre_of(centre, q, mask, is_causal, S, query_ok=None):
    B, H, _, D = q.shape
    if centre is None:
        return choose_centre(q, mask, is_causal, S, query_ok)
    return check_centre(centre, B, H, D, q.dtype, q.device)


def select_backend(query: Tensor, key: Tensor, value: Tensor, *, log_pi: Tensor | None = None,
                   sigma2: float | Tensor | None = None, mixture: str = "sum", attn_mask: Tensor | None = None,
                   bias: Tensor | None = None, dropout_p: float = 0.0, return_weights: bool = False) -> str:
    """The implementation :func:`mgk_attention` runs for these inputs when ``backend`` is None: the first of
    ``BACKENDS`` that can serve them, in this order:

    * "triton": CUDA tensors with ``MGK_TRITON=1``, mixture "sum", variances fixed and equal within each head;
      attention dropout runs inside it, with the C++ kernel's mask;
    * "kernel": CPU tensors, once our C++ kernel is built (``MGK_CPU_KERNEL=0`` switches it off); attention
      dropout runs inside it (a counter-based mask regenerated in backward);
    * "sdpa": mixture "sum", anything else the above refuse (masks or biases that depend on the query, which it
      takes as a float ``attn_mask``);
    * "explicit": always (``return_weights``, Hard-E without the kernel, forward-mode AD and torch.func).

    The fused ones ("triton", "kernel") need masks that are at most key padding (plus ``is_causal``, which every
    backend takes), a bias that is at most per key (B, H, 1, S), ``dropout_p < 1`` and head sizes >= 1. Arguments
    as :func:`mgk_attention`; raises as it does."""
    check_arguments(dropout_p=dropout_p, return_weights=return_weights)
    B, H, L, S, M, D, mask = check_mixture(query, key, value, log_pi, mixture, attn_mask)
    mask, bias = _bias(bias, mask, B, H, L, S)
    with full_precision(query.device):
        q, k, v, s2, log_prior = _inputs(query, key, value, log_pi, sigma2, H, M, D)
        return _choose(None, q, k, v, s2, log_prior, mask, bias, mixture, dropout_p, return_weights)


def mgk_attention(query: Tensor, key: Tensor, value: Tensor, *, log_pi: Tensor | None = None,
                  sigma2: float | Tensor | None = None, mixture: str = "sum", attn_mask: Tensor | None = None,
                  bias: Tensor | None = None, is_causal: bool = False, dropout_p: float = 0.0,
                  return_weights: bool = False, backend: str | None = None, chunk_size: int = 512,
                  centre: Tensor | None = None, shifts: Tensor | None = None):
    """Mixture-of-Gaussian-keys attention (paper eq. 9-10; the Hard-E ablation for mixture="max").

    Args:
        query: (B, H, L, D) floating; key: (B, H, M, S, D), M mixture components per key position; value:
            (B, H, S, Dv). One dtype for all three. Compact keys are taken too, and the C++ kernel reads them in
            place (nothing repeated): G key groups dividing H (gMGK, GQA's grouping: key (B, G, M, S, D), value
            (B, G, S, Dv), query head h reading group h // (H / G); ``log_pi`` then broadcastable to (B, G, M, S),
            ``sigma2`` per group, ``centre`` (B, G, D)), and with ``shifts`` sMGK's one unshifted key.
        log_pi: log prior of each component, broadcastable to (B, H, M, S); default uniform ``-log M``. Should
            satisfy ``logsumexp_r log_pi = 0`` (not checked: un-normalised priors only rescale a key's mass). -inf
            switches a component off exactly (value and gradient); a key with every component off is a masked
            key. Must be None for mixture="max".
        sigma2: variances: a float, or a tensor of one value, (M,) per component or (H, M) per head and component,
            which may require grad; default sqrt(D) for every component. Positive.
        mixture: "sum" (logsumexp over components) or "max" (Hard-E).
        attn_mask: bool broadcastable to (B, H, L, S), True = may attend (float masks are refused: see ``bias``).
        bias: float broadcastable to (B, H, L, S), added to each key's logit (it multiplies key j's mixture weight
            by ``exp(bias_ij)``: ALiBi, relative positions); -inf = may not attend; differentiable.
        is_causal: causal masking aligned bottom-right (query i sees keys j <= i + S - L).
        dropout_p: dropout on attention weights, in [0, 1]: "kernel", "triton" and "explicit" drop each key's mixed
            weight, "sdpa" each (key, component) pair; all keep the expectation.
        return_weights: also return the (B, H, L, S) attention weights (served by "explicit" only).
        backend: None (:func:`select_backend` picks) or one of "kernel", "triton", "sdpa", "explicit".
        chunk_size: queries per chunk of "explicit", >= 1 (memory O(chunk * M * S) per head; one chunk inside a
            torch.compile trace, where a loop over a dynamic length would recompile per length).
        centre: None (chosen from the queries, :func:`mgk_centre`; with key groups, from the mean of each group's
            query heads), or the (B, H, D) vector to subtract from queries and keys, e.g. the prefill's centre reused
            by every decoding step (:mod:`._centre`).
        shifts: None, or (M, G, D) the offsets mu_r of shifted keys (sMGK): key is then the one unshifted key
            (B, G, S, D) and its components are ``key - shifts[r]`` (:func:`._mixture_terms.shifted_keys`).
    Returns:
        (B, H, L, Dv) in query's dtype, and the (B, H, L, S) weights when ``return_weights``. Rows that may attend
        to no key are exactly zero. 16-bit inputs or autocast are computed in float32.
    Raises:
        ValueError naming the argument for wrong ranks, sizes, mixed dtypes, variances, options out of range, mixture
        or backend; BackendError (a ValueError) naming why a backend asked for cannot serve the inputs; MaskError for
        masks.
    """
    check_arguments(is_causal=is_causal, dropout_p=dropout_p, return_weights=return_weights, chunk_size=chunk_size,
                    backend=backend, backends=BACKENDS)
    if shifts is not None or (isinstance(key, Tensor) and isinstance(query, Tensor) and key.dim() == 5
                              and query.dim() == 4 and key.shape[1] != query.shape[1]):
        call = _mgk_backends.Call(is_causal, mixture, float(dropout_p), return_weights, chunk_size,
                                  pi_given=log_pi is not None)
        return _compact(query, key, value, log_pi, sigma2, attn_mask, bias, backend, centre, shifts, call)
    B, H, L, S, M, D, mask = check_mixture(query, key, value, log_pi, mixture, attn_mask)
    mask, bias = _bias(bias, mask, B, H, L, S)
    out_dtype = query.dtype
    with full_precision(query.device):
        q, k, v, s2, log_prior = _inputs(query, key, value, log_pi, sigma2, H, M, D)
        bias = None if bias is None else bias.to(q.dtype)
        name = _choose(backend, q, k, v, s2, log_prior, mask, bias, mixture, dropout_p, return_weights)
        c = _centre_of(centre, q, mask, is_causal, S)
        if L == 0 or S == 0:  # nothing to attend from, or nothing to attend to: rows with no key are zero
            out = value.new_zeros(B, H, L, value.shape[-1], dtype=out_dtype)
            return (out, value.new_zeros(B, H, L, S, dtype=out_dtype)) if return_weights else out
        q, k = apply_centre(q, k, c)
        call = _mgk_backends.Call(is_causal, mixture, float(dropout_p), return_weights, chunk_size,
                                  pi_given=log_pi is not None)
        out, weights = _mgk_backends.IMPLEMENTATIONS[name](q, k, v, log_prior, s2, mask, bias, call)
    out = out.to(out_dtype)
    return (out, weights.to(out_dtype)) if return_weights else out


def _compact(query, key, value, log_pi, sigma2, attn_mask, bias, backend, centre, shifts, call):
    """:func:`mgk_attention` of compact keys (key groups, shifted keys): the C++ kernel reads them as they are; every
    other backend (and the kernel for masks or biases that differ per query head) takes them repeated for each query
    head and component, the same numbers. The centre is one per (row, group), exact for every head of the group."""
    B, H, G, L, S, M, D, shifts, mask = _check_compact(query, key, value, log_pi, call.mixture, attn_mask, shifts)
    mask, bias = _bias(bias, mask, B, H, L, S)
    R = H // G
    with full_precision(query.device):
        q, k, v, s2, log_prior = _inputs(query, key, value, log_pi, sigma2, G, M, D)
        bias = None if bias is None else bias.to(q.dtype)
        name = _choose(backend, q, k, v, s2, log_prior, mask, bias, call.mixture, call.dropout_p, call.return_weights)
        grouped_mask = mask if mask is None or mask.shape[1] == 1 else mask.unflatten(1, (G, R)).any(dim=2)
        c = _centre_of(centre, q if R == 1 else q.unflatten(1, (G, R)).mean(dim=2), grouped_mask, call.is_causal, S)
        if L == 0 or S == 0:  # nothing to attend from, or nothing to attend to: rows with no key are zero
            out = value.new_zeros(B, H, L, value.shape[-1], dtype=query.dtype)
            return (out, value.new_zeros(B, H, L, S, dtype=query.dtype)) if call.return_weights else out
        q = q - to_heads(c, G, R).unsqueeze(2)
        k = k - (c.unsqueeze(2) if shifts is not None else c.unsqueeze(2).unsqueeze(2))
        one_head = all(t is None or t.shape[1] == 1 for t in (mask, bias))
        if name == "kernel" and one_head:
            out, weights = _mgk_backends.kernel(q, k, v, log_prior, s2, mask, bias, call, shifts=shifts)
        else:
            k = k if shifts is None else shifted_keys(k, shifts)
            s2 = s2 if s2.shape[0] == 1 else to_heads(s2, G, R, dim=0)
            out, weights = _mgk_backends.IMPLEMENTATIONS[name](q, to_heads(k, G, R), to_heads(v, G, R),
                                                               to_heads(log_prior, G, R), s2, mask, bias, call)
    out = out.to(query.dtype)
    return (out, weights.to(query.dtype)) if call.return_weights else out


def _check_compact(query, key, value, log_pi, mixture, attn_mask, shifts):
    """The checks of compact keys (:func:`_compact`); returns ``(B, H, G, L, S, M, D, shifts, mask)``."""
    shifted = shifts is not None
    B, H, L, S, M, D = check_qkv(query, key, value, mixture=not shifted, grouped=True)
    G = key.shape[1]
    if shifted:
        shifts = check_shifts(shifts, None, G, D)
        M = shifts.shape[0]
    check_mixture_args(mixture, log_pi)
    check_log_pi(log_pi, (B, G, M, S), "(B, G, M, S)")
    return B, H, G, L, S, M, D, shifts, _masks.check_mask(attn_mask, "attn_mask", B, H, L, S)


def mgk_centre(query: Tensor, key: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
    """The (B, H, D) vector :func:`mgk_attention` subtracts from query (B, H, L, D) and key (B, H, M, S, D) when
    ``centre`` is None (detached; float32 for 16-bit inputs): under ``is_causal`` the query of the first row that
    may attend to two keys (else to one: a far first token, an "attention sink", is not the centre), otherwise the
    query of a row that may attend to some key nearest to their mean (see :mod:`mgk.functional._centre` for why). A
    decoder computes it at prefill and passes it to every later step (:func:`mgk_cache_centre` while a row has seen
    fewer than two tokens).

    Raises ValueError / MaskError as :func:`mgk_attention` for the shapes, dtypes and mask."""
    check_arguments(is_causal=is_causal)
    B, H, L, S, M, D, mask = check_mixture(query, key, None, None, "sum", attn_mask)
    with full_precision(query.device):
        return choose_centre(query.to(compute_dtype(query, key)), mask, is_causal, S)


def mgk_responsibilities(query: Tensor, key: Tensor, *, log_pi: Tensor | None = None,
                         sigma2: float | Tensor | None = None, attn_mask: Tensor | None = None,
                         is_causal: bool = False, query_mask: Tensor | None = None, chunk_size: int = 512,
                         backend: str | None = None, centre: Tensor | None = None):
    """E-step statistics for Soft-E (the paper's "+Soft-E" ablation: the E-step of EM for the key mixture),
    computed without gradient.

    ``gamma_ijr = softmax_r(log pi_jr - |q_i - k_jr|^2 / (2 sigma_r^2))`` is the responsibility of component r for
    the pair (i, j). Returns sums over the batch and over every query allowed to attend to j, and their counts:

    Args: as :func:`mgk_attention` (the same centre, so the same numbers as its scores, unless a padded query that
        ``attn_mask`` does not mark would have been chosen); ``query_mask`` bool (B, L), True = real query (padded
        queries contribute no responsibility and never set the centre). A key whose every component has
        log_pi = -inf is a masked key (no responsibility, no count).
    Returns:
        ``(resp_sum, count)``: float32 (or float64) tensors of shapes (H, M, S) and (H, S). The Soft-E update is
        ``pi[h, r, j] = resp_sum[h, r, j] / count[h, j]`` where ``count > 0``. Under DDP, all-reduce both first.

    ``backend``: one of ``STATISTICS_BACKENDS``: "kernel" (the C++ kernel, block by block, no L x S tensor: CPU,
    M > 1, masks at most key padding), "explicit" (the (B, H, chunk, M, S) log-kernel in query chunks), or None:
    :func:`select_backend`'s rules pick "kernel" where it serves.
    """
    check_arguments(is_causal=is_causal, chunk_size=chunk_size, backend=backend, backends=STATISTICS_BACKENDS)
    B, H, L, S, M, D, mask = check_mixture(query, key, None, log_pi, "sum", attn_mask)
    if query_mask is not None:
        if not isinstance(query_mask, Tensor) or query_mask.dtype != torch.bool or tuple(query_mask.shape) != (B, L):
            what = (f"{query_mask.dtype} {tuple(query_mask.shape)}" if isinstance(query_mask, Tensor)
                    else type(query_mask).__name__)
            raise _masks.MaskError(f"query_mask must be bool of shape (B, L) = {(B, L)}, True = real query; "
                                   f"got {what}")
    with torch.no_grad(), full_precision(query.device):
        q, k, _, s2, log_prior = _inputs(query.detach(), key.detach(), None, log_pi, sigma2, H, M, D)
        log_prior = log_prior.detach()
        name = _choose_statistics(backend, q, k, s2, log_prior, mask)
        query_ok = None if query_mask is None else query_mask.view(B, 1, L)  # padded queries never set the centre
        q, k = apply_centre(q, k, _centre_of(centre, q, mask, is_causal, S, query_ok))  # they depend only on q - k
        if log_pi is not None:  # a key with every component switched off is a masked key
            live = (log_prior > float("-inf")).any(dim=2, keepdim=True)
            mask = live if mask is None else mask & live
        if name == "kernel":
            return _responsibilities_kernel(q, k, log_prior, s2, mask, is_causal, query_mask)
        return _responsibilities_explicit(q, k, log_prior, s2, mask, is_causal, query_mask, chunk_size)


def _responsibilities_explicit(q, k, log_prior, s2, mask, is_causal, query_mask, chunk_size):
    """:func:`mgk_responsibilities` from the (B, H, chunk, M, S) log-kernel of :func:`gaussian_log_kernel`."""
    B, H, L, _ = q.shape
    M, S = k.shape[2], k.shape[3]
    valid = _masks.combine(mask, is_causal, L, S, q.device)
    if query_mask is not None:
        qm = query_mask.view(B, 1, L, 1)
        valid = qm if valid is None else (valid & qm)
    if valid is None:
        valid = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device)
    valid = valid.expand(B, H, L, S)
    # Dead keys are zeroed so that NaN/inf padding cannot poison the sums (where, not multiply).
    _, k, _, _ = _masks.prepare(valid, k, k[:, :, 0])
    count = valid.sum(dim=(0, 2)).to(q.dtype)
    if M == 1:  # one component takes all the responsibility
        return count.unsqueeze(1).clone(), count
    resp = torch.zeros(H, M, S, dtype=q.dtype, device=q.device)
    lp = log_prior.unsqueeze(2)
    for a, b in _mgk_backends._chunks(L, chunk_size):
        gamma = torch.softmax(gaussian_log_kernel(q[:, :, a:b], k, s2) + lp, dim=-2)  # (B, H, c, M, S)
        resp += gamma.masked_fill_(~valid[:, :, a:b].unsqueeze(-2), 0.0).sum(dim=(0, 2))  # also an all -inf key
    return resp, count


def _responsibilities_kernel(q, k, log_prior, s2, mask, is_causal, query_mask):
    """:func:`mgk_responsibilities` through the C++ kernel, for masks that are at most key padding: nothing of
    size L x S is built (the counts are computed from the query and key masks)."""
    B, H, L, _ = q.shape
    S = k.shape[3]
    key_ok = None if mask is None else mask[..., 0, :].expand(B, H, S)
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    if key_ok is not None:  # padded keys may hold NaN: zero them (where, not multiply)
        k = torch.where(key_ok[:, :, None, :, None], k, zero)
    bias = key_bias(k, s2, log_prior)
    if key_ok is not None:  # the kernel needs finite scores at the keys it skips
        bias = torch.where(key_ok[:, :, None, :], bias, zero)
    rowbias = row_bias(q, s2) if needs_qnorm(s2) else None
    query_ok = None if query_mask is None else query_mask.view(B, 1, L).expand(B, H, L)
    resp = _mixture_flash.responsibilities(q, scaled_keys(k, s2), bias, rowbias, query_ok, key_ok,
                                           is_causal)
    return resp.sum(0), responsibility_counts(B, H, L, S, query_mask, key_ok, is_causal, q.dtype, q.device)


def responsibility_counts(B: int, H: int, L: int, S: int, query_mask: Tensor | None, key_ok: Tensor | None,
                          is_causal: bool, dtype, device) -> Tensor:
    """(H, S): the number of (b, i) with a real query i (``query_mask`` (B, L) bool, None = all) that may see key
    j, for masks that are at most key padding (``key_ok`` broadcastable to (B, H, S), None = all) plus
    bottom-right ``is_causal``; computed from the masks, without an L x S tensor."""
    real = torch.ones(B, L, dtype=dtype, device=device) if query_mask is None else query_mask.to(dtype)
    if is_causal:  # query i sees j when i >= j - (S - L): a suffix count of real queries
        suffix = F.pad(real.flip(-1).cumsum(-1).flip(-1), (0, 1))  # suffix[b, t] = real queries at i >= t
        first = (torch.arange(S, device=device) - (S - L)).clamp(0, L)
        per_key = suffix[:, first]  # (B, S)
    else:
        per_key = real.sum(-1, keepdim=True).expand(B, S)
    seen = per_key.unsqueeze(1).expand(B, H, S)
    if key_ok is not None:
        seen = seen * key_ok.expand(B, H, S).to(dtype)
    return seen.sum(0)
