"""Attention with a mixture of Gaussian keys (MGK), Nguyen et al., ICML 2022, eq. 9-10.

For query i, key position j with M components k_{j,r}, priors pi_{j,r} and variances sigma_r^2::

    s_ijr = log pi_jr - |q_i - k_jr|^2 / (2 sigma_r^2)           (Gaussian log-kernel plus log prior)
    A_ij  = softmax_j( logsumexp_r s_ijr )     mixture="sum"  (learned pi, Soft-E)
    A_ij  = softmax_j( max_r  s'_ijr )         mixture="max"  (Hard-E, the k-means limit; pi unused)

Everything is computed in log space, so queries far from every key (every exp underflowing) still give a proper
distribution concentrated on the nearest key. The scores depend only on q - k, so every path first subtracts one
shared vector per (batch, head) from queries and keys (the mean of the real keys): the expanded distance
``|q|^2 - 2 q.k + |k|^2`` would otherwise cancel catastrophically under a large common offset (the fault of the
matrix-multiplication form of ``torch.cdist``, pytorch/pytorch#42479).

Four implementations compute the same numbers (:mod:`._mgk_backends`): "kernel" (our C++ CPU kernel), "triton",
"sdpa" (the bias folded into extra head dimensions of dot-product attention) and "explicit" (the log-kernel in
query chunks, the twin the tests compare the others with). :func:`select_backend` is the one place that decides
which serves a call; ``mgk_attention(..., backend=NAME)`` asks for one by name.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _mgk_backends, _mixture_flash, _mixture_triton
from . import masks as _masks
from ._checks import check_qkv, compute_dtype, full_precision
from ._mgk_backends import gaussian_log_kernel, needs_qnorm

__all__ = ["BACKENDS", "BackendError", "gaussian_log_kernel", "mgk_attention", "mgk_responsibilities",
           "select_backend"]

MIXTURES = ("sum", "max")
BACKENDS = ("triton", "kernel", "sdpa", "explicit")  # select_backend's order of preference
_LOG_PI_FLOOR = -1.0e4  # exp(-1e4) is 0 in every dtype; keeps 0 * (-inf) out of SDPA's backward


class BackendError(ValueError):
    """A backend was asked for by name that cannot serve the inputs (the message says why)."""


def _check(query, key, value, log_pi, mixture, attn_mask):
    B, H, L, S, M, D = check_qkv(query, key, value, mixture=True)
    if mixture not in MIXTURES:
        raise ValueError(f"mixture must be one of {MIXTURES}, got {mixture!r}")
    if log_pi is not None:
        if mixture == "max":
            raise ValueError("log_pi is unused by mixture='max' (Hard-E takes the nearest component); pass None")
        if not isinstance(log_pi, Tensor) or not log_pi.is_floating_point():
            raise ValueError(f"log_pi must be a floating tensor broadcastable to (B, H, M, S) = {(B, H, M, S)}")
        if log_pi.dim() > 4 or any(
                a not in (1, b) for a, b in zip((1,) * (4 - log_pi.dim()) + tuple(log_pi.shape), (B, H, M, S))):
            raise ValueError(f"log_pi of shape {tuple(log_pi.shape)} does not broadcast to (B, H, M, S) = "
                             f"{(B, H, M, S)}")
    mask = _masks.check_mask(attn_mask, "attn_mask", B, H, L, S)
    return B, H, L, S, M, D, mask


def _variances(sigma2, M: int, D: int, dtype, device) -> Tensor:
    """Per-component variances as a (M,) tensor; default sqrt(D), the 1/sqrt(D) scale of dot-product attention.

    Values are checked (positive, finite) for Python numbers and CPU tensors. Tensors on an accelerator are not:
    reading them back would synchronise the device on every call, and the modules check theirs at construction."""
    if sigma2 is None:
        return torch.full((M,), math.sqrt(D), dtype=dtype, device=device)
    if isinstance(sigma2, (int, float)):
        if not sigma2 > 0 or not math.isfinite(sigma2):
            raise ValueError(f"sigma2 must be a positive finite variance, got {sigma2}")
        return torch.full((M,), float(sigma2), dtype=dtype, device=device)
    if not isinstance(sigma2, Tensor):
        raise ValueError(f"sigma2 must be a float or a tensor of shape (M,) = ({M},), got {type(sigma2).__name__}")
    s = sigma2.to(device=device, dtype=dtype).reshape(-1)
    if s.numel() == 1:
        s = s.expand(M)
    if s.numel() != M:
        raise ValueError(f"sigma2 must have one variance per mixture component, shape ({M},); "
                         f"got {tuple(sigma2.shape)}")
    if s.device.type != "cpu" or torch.compiler.is_compiling() or _transformed(s):
        return s  # a traced or torch.func-wrapped tensor has no values to read (a module checked its own)
    # One read of the M values instead of four reductions: this runs on every call.
    if not all(x > 0 and math.isfinite(x) for x in s.tolist()):
        raise ValueError(f"sigma2 must be positive and finite, got {sigma2.tolist()}")
    return s


def _log_prior(log_pi, M: int, dtype, device) -> Tensor:
    """log pi as a 4-dim tensor broadcastable to (B, H, M, S), floored away from -inf; default uniform 1/M."""
    if log_pi is None:
        return torch.full((1, 1, M, 1), -math.log(M), dtype=dtype, device=device)
    lp = log_pi.to(dtype)
    lp = lp.reshape((1,) * (4 - lp.dim()) + tuple(lp.shape))
    return lp.clamp_min(_LOG_PI_FLOOR)


def _centre(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool) -> tuple[Tensor, Tensor]:
    """Subtract one vector per (batch, head) from q and k: the mean of the keys some query may attend to, or under
    ``is_causal`` the mean over components of the first such key (every row that sees a key sees that one, so no
    output depends, even in rounding, on a key its row may not see).

    The scores depend only on q - k, so the result is unchanged in exact arithmetic and the gradient through the
    shift is exactly zero (it is detached); in floating point it removes a common offset before the distance is
    expanded. Masked keys (which may hold NaN) are left out with ``torch.where``."""
    kd = k.detach()
    alive = None if mask is None else mask.any(dim=-2)  # (B?, H?, S)
    zero = None if alive is None and not is_causal else torch.zeros((), dtype=kd.dtype, device=kd.device)
    if is_causal:
        first = 0 if alive is None else alive.to(torch.int8).argmax(dim=-1)  # (B?, H?); 0 when none is alive
        pick = torch.arange(k.shape[3], device=k.device) == (first if alive is None else first.unsqueeze(-1))
        c = torch.where(pick[..., None, :, None], kd, zero).sum(dim=(2, 3)) / k.shape[2]
    elif alive is None:
        c = kd.mean(dim=(2, 3))
    else:
        total = torch.where(alive[..., None, :, None], kd, zero).sum(dim=(2, 3))
        c = total / (alive.sum(dim=-1, keepdim=True).to(kd.dtype) * k.shape[2]).clamp_min(1)
    c = c.unsqueeze(2)  # (B, H, 1, D)
    return q - c, k - c.unsqueeze(2)


def _transformed(*tensors: Tensor) -> bool:
    """Whether forward-mode AD (dual tensors) or a torch.func transform sees these tensors."""
    if torch.compiler.is_compiling():
        return False
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        return True
    from torch.autograd import forward_ad

    return forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _unserved(backend, q, v, s2, mask, mixture, dropout_p, return_weights, transformed, automatic) -> str | None:
    """Why ``backend`` cannot serve a call (None when it can)."""
    if backend == "explicit":
        return None
    if return_weights:
        return "return_weights=True needs the (B, H, L, S) weights, which only backend='explicit' builds"
    if transformed:
        return "forward-mode AD and torch.func transforms need backend='explicit' (the fused paths have no such rule)"
    if backend == "sdpa":
        return "mixture='max' (Hard-E) has no dot-product form" if mixture == "max" else None
    if dropout_p != 0.0 and not 0.0 < dropout_p < 1.0:
        return f"dropout_p={dropout_p}: the fused kernels (C++ and Triton) take 0 <= dropout_p < 1"
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
    if why is None and (s2.requires_grad or torch.compiler.is_compiling() or not bool(torch.all(s2 == s2[0]))):
        why = "the Triton kernels take equal fixed variances (no per-row |q|^2 term)"
    return why


def _choose(backend, q, k, v, s2, log_prior, mask, mixture, dropout_p, return_weights) -> str:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
    transformed = _transformed(q, k, v, s2, log_prior)
    args = (q, v, s2, mask, mixture, dropout_p, return_weights, transformed)
    if backend is None:
        return next(b for b in BACKENDS if _unserved(b, *args, automatic=True) is None)
    why = _unserved(backend, *args, automatic=False)
    if why is not None:
        raise BackendError(f"backend={backend!r} cannot serve these inputs: {why}")
    return backend


def _inputs(query, key, value, log_pi, sigma2, M, D):
    """q, k, v in the compute dtype (float32 for 16-bit inputs), the (M,) variances and the 4-dim log prior."""
    dt = compute_dtype(query, key, value)
    s2 = _variances(sigma2, M, D, dt, query.device)
    return query.to(dt), key.to(dt), value.to(dt), s2, _log_prior(log_pi, M, dt, query.device)


def select_backend(query: Tensor, key: Tensor, value: Tensor, *, log_pi: Tensor | None = None,
                   sigma2: float | Tensor | None = None, mixture: str = "sum", attn_mask: Tensor | None = None,
                   dropout_p: float = 0.0, return_weights: bool = False) -> str:
    """The implementation :func:`mgk_attention` runs for these inputs when ``backend`` is None: the first of
    ``BACKENDS`` that can serve them, in this order:

    * "triton": CUDA tensors with ``MGK_TRITON=1``, mixture "sum", equal fixed variances; attention dropout runs
      inside it, with the C++ kernel's mask;
    * "kernel": CPU tensors, once our C++ kernel is built (``MGK_CPU_KERNEL=0`` switches it off); attention
      dropout runs inside it (a counter-based mask regenerated in backward);
    * "sdpa": mixture "sum", anything else the above refuse (masks that depend on the query);
    * "explicit": always (``return_weights``, Hard-E without the kernel, forward-mode AD and torch.func).

    The fused ones ("triton", "kernel") need masks that are at most key padding (plus ``is_causal``,
    which every backend takes) and head sizes >= 1. Arguments as :func:`mgk_attention`; raises as it does."""
    B, H, L, S, M, D, mask = _check(query, key, value, log_pi, mixture, attn_mask)
    with full_precision(query.device):
        q, k, v, s2, log_prior = _inputs(query, key, value, log_pi, sigma2, M, D)
        return _choose(None, q, k, v, s2, log_prior, mask, mixture, dropout_p, return_weights)


def mgk_attention(query: Tensor, key: Tensor, value: Tensor, *, log_pi: Tensor | None = None,
                  sigma2: float | Tensor | None = None, mixture: str = "sum", attn_mask: Tensor | None = None,
                  is_causal: bool = False, dropout_p: float = 0.0, return_weights: bool = False,
                  backend: str | None = None, chunk_size: int = 512):
    """Mixture-of-Gaussian-keys attention (paper eq. 9-10; the Hard-E ablation for mixture="max").

    Args:
        query: (B, H, L, D) floating; key: (B, H, M, S, D), M mixture components per key position; value:
            (B, H, S, Dv). One dtype for all three.
        log_pi: log prior of each component, broadcastable to (B, H, M, S); default uniform ``-log M``. Should
            satisfy ``logsumexp_r log_pi = 0`` (not checked: un-normalised priors only rescale a key's mass).
            Must be None for mixture="max".
        sigma2: per-component variance, a float or a (M,) tensor; default sqrt(D) for every component.
        mixture: "sum" (logsumexp over components) or "max" (Hard-E).
        attn_mask: bool broadcastable to (B, H, L, S), True = may attend.
        is_causal: causal masking aligned bottom-right (query i sees keys j <= i + S - L).
        dropout_p: dropout on attention weights: "kernel", "triton" and "explicit" drop each key's mixed weight,
            "sdpa" each (key, component) pair; all keep the expectation.
        return_weights: also return the (B, H, L, S) attention weights (served by "explicit" only).
        backend: None (:func:`select_backend` picks) or one of "kernel", "triton", "sdpa", "explicit".
        chunk_size: queries per chunk of "explicit" (memory O(chunk * M * S) per head; one chunk inside a
            torch.compile trace, where a loop over a dynamic length would recompile per length).
    Returns:
        (B, H, L, Dv) in query's dtype, and the (B, H, L, S) weights when ``return_weights``. Rows that may attend
        to no key are exactly zero. 16-bit inputs or autocast are computed in float32.
    Raises:
        ValueError naming the argument for wrong ranks, sizes, mixed dtypes, variances, mixture or backend;
        BackendError (a ValueError) naming why a backend asked for cannot serve the inputs; MaskError for masks.
    """
    B, H, L, S, M, D, mask = _check(query, key, value, log_pi, mixture, attn_mask)
    out_dtype = query.dtype
    with full_precision(query.device):
        q, k, v, s2, log_prior = _inputs(query, key, value, log_pi, sigma2, M, D)
        name = _choose(backend, q, k, v, s2, log_prior, mask, mixture, dropout_p, return_weights)
        if L == 0 or S == 0:  # nothing to attend from, or nothing to attend to: rows with no key are zero
            out = value.new_zeros(B, H, L, value.shape[-1], dtype=out_dtype)
            return (out, value.new_zeros(B, H, L, S, dtype=out_dtype)) if return_weights else out
        q, k = _centre(q, k, mask, is_causal)
        call = _mgk_backends.Call(bool(is_causal), mixture, float(dropout_p), bool(return_weights),
                                  max(1, int(chunk_size)))
        out, weights = _mgk_backends.IMPLEMENTATIONS[name](q, k, v, log_prior, s2, mask, call)
    out = out.to(out_dtype)
    return (out, weights.to(out_dtype)) if return_weights else out


def mgk_responsibilities(query: Tensor, key: Tensor, *, log_pi: Tensor | None = None,
                         sigma2: float | Tensor | None = None, attn_mask: Tensor | None = None,
                         is_causal: bool = False, query_mask: Tensor | None = None, chunk_size: int = 512,
                         backend: str | None = None):
    """E-step statistics for Soft-E (the paper's "+Soft-E" ablation: the E-step of EM for the key mixture),
    computed without gradient.

    ``gamma_ijr = softmax_r(log pi_jr - |q_i - k_jr|^2 / (2 sigma_r^2))`` is the responsibility of component r for
    the pair (i, j). Returns sums over the batch and over every query allowed to attend to j, and their counts:

    Args: as :func:`mgk_attention`; ``query_mask`` bool (B, L), True = real query (padded queries contribute no
        responsibility).
    Returns:
        ``(resp_sum, count)``: float32 (or float64) tensors of shapes (H, M, S) and (H, S). The Soft-E update is
        ``pi[h, r, j] = resp_sum[h, r, j] / count[h, j]`` where ``count > 0``. Under DDP, all-reduce both first.

    ``backend``: "kernel" (the C++ kernel, block by block, no L x S tensor: CPU, M > 1, masks at most key padding),
    "explicit" (the (B, H, chunk, M, S) scores in query chunks), or None: "kernel" where it serves.
    """
    if backend not in (None, "kernel", "explicit"):
        raise ValueError(f"backend must be None, 'kernel' or 'explicit', got {backend!r}")
    B, H, L, S, M, D, mask = _check(query, key, None, log_pi, "sum", attn_mask)
    if query_mask is not None:
        if query_mask.dtype != torch.bool or tuple(query_mask.shape) != (B, L):
            raise _masks.MaskError(f"query_mask must be bool of shape (B, L) = {(B, L)}, True = real query; "
                                   f"got {query_mask.dtype} {tuple(query_mask.shape)}")
    dt = compute_dtype(query, key)
    with torch.no_grad(), full_precision(query.device):
        q, k = query.detach().to(dt), key.detach().to(dt)
        q, k = _centre(q, k, mask, is_causal)  # the responsibilities, too, depend only on q - k
        s2 = _variances(sigma2, M, D, dt, query.device)
        log_prior = _log_prior(log_pi, M, dt, query.device)
        kernel_ok = (M > 1 and (mask is None or mask.shape[-2] == 1) and not torch.compiler.is_compiling()
                     and _mixture_flash.usable(q, k[:, :, 0], 0.0))
        if backend == "kernel" and not kernel_ok:
            raise BackendError("backend='kernel' cannot serve these inputs: it needs CPU float tensors, M > 1, masks "
                               f"that are at most key padding and a built kernel ({_mixture_flash.build_error()})")
        if kernel_ok and backend != "explicit":
            return _responsibilities_kernel(q, k, log_prior, s2, mask, is_causal, query_mask)
        valid = _masks.combine(mask, is_causal, L, S, query.device)
        if query_mask is not None:
            qm = query_mask.view(B, 1, L, 1)
            valid = qm if valid is None else (valid & qm)
        if valid is None:
            valid = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=query.device)
        valid = valid.expand(B, H, L, S)
        # Dead keys are zeroed so that NaN/inf padding cannot poison the sums (where, not multiply).
        _, k, _, _ = _masks.prepare(valid, k, k[:, :, 0])
        count = valid.sum(dim=(0, 2)).to(dt)
        if M == 1:  # one component takes all the responsibility
            return count.unsqueeze(1).clone(), count
        resp = torch.zeros(H, M, S, dtype=dt, device=query.device)
        kn = (k * k).sum(-1).unsqueeze(2)  # (B, H, 1, M, S)
        scale = (-0.5 / s2).view(M, 1)
        lp = log_prior.unsqueeze(2)
        for a, b in _mgk_backends._chunks(L, max(1, int(chunk_size))):
            # In place on one (B, H, c, M, S) buffer: no gradient is needed, and each pass over it costs as much
            # as the attention itself. g = log pi - |q - k|^2 / (2 sigma^2), then a softmax over components.
            qc = q[:, :, a:b]
            g = torch.einsum("bhld,bhmsd->bhlms", qc, k).mul_(-2.0)
            g.add_(kn).add_((qc * qc).sum(-1)[..., None, None]).clamp_(min=0.0).mul_(scale).add_(lp)
            g.sub_(g.amax(dim=-2, keepdim=True)).exp_()
            g.div_(g.sum(dim=-2, keepdim=True))
            g.masked_fill_(~valid[:, :, a:b].unsqueeze(-2), 0.0)
            resp += g.sum(dim=(0, 2))
    return resp, count


def _responsibilities_kernel(q, k, log_prior, s2, mask, is_causal, query_mask):
    """:func:`mgk_responsibilities` through the C++ kernel, for masks that are at most key padding: nothing of
    size L x S is built (the counts are computed from the query and key masks)."""
    B, H, L, D = q.shape
    M, S = k.shape[2], k.shape[3]
    key_ok = None if mask is None else mask[..., 0, :].expand(B, H, S)
    if key_ok is not None:  # padded keys may hold NaN: zero them (where, not multiply)
        k = torch.where(key_ok[:, :, None, :, None], k, torch.zeros((), dtype=k.dtype, device=k.device))
    inv = (1.0 / s2).view(M, 1)
    bias = log_prior - (k * k).sum(-1) * (0.5 * inv)
    rowbias = None
    if needs_qnorm(s2):  # unequal variances: |q|^2 does not cancel across components
        rowbias = (q * q).sum(-1).unsqueeze(2) * (-0.5 * inv)
    query_ok = None if query_mask is None else query_mask.view(B, 1, L).expand(B, H, L)
    resp = _mixture_flash.responsibilities(q, k * inv.view(M, 1, 1), bias, rowbias, query_ok, key_ok, is_causal)
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
