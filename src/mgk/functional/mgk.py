"""Attention with a mixture of Gaussian keys (MGK), paper eq. 9-10.

For query i, key position j with M components k_{j,r}, priors pi_{j,r} and variances sigma_r^2::

    s_ijr = log pi_jr - |q_i - k_jr|^2 / (2 sigma_r^2)           (Gaussian log-kernel plus log prior)
    A_ij  = softmax_j( logsumexp_r s_ijr )     mixture="sum"  (learned pi, Soft-E)
    A_ij  = softmax_j( max_r  s'_ijr )         mixture="max"  (Hard-E, the k-means limit; pi unused)

Everything is computed in log space, so queries far from every key (every exp underflowing) still give a proper
distribution concentrated on the nearest key. Two paths compute the same numbers:

* fast (mixture="sum", default). ``|q - k|^2 = |q|^2 - 2 q.k + |k|^2``, so the score is
  ``q.k_r / sigma_r^2 + b_r`` with the per-key bias ``b_r = log pi_r - |k_r|^2 / (2 sigma_r^2)`` (the ``|q|^2`` term is
  constant along a row and cancels, except with unequal or learned variances, where it is kept per component).
  On CPU our C++ kernel (:mod:`._mixture_flash`) sums the component weights before the value product in one
  online-softmax pass. Otherwise the bias is folded into an extra head dimension, ``q' = [q, 1]`` and
  ``k'_r = [k_r / sigma_r^2, b_r]`` (a third column ``[|q|^2]``/``[-1/(2 sigma_r^2)]`` when needed), making MGK
  dot-product attention over the M*S concatenated keys with scale 1: one SDPA flash call per component on CPU,
  merged through the log-sum-exps (:mod:`._component_flash`), or one SDPA call over the concatenated keys (GPU,
  dropout, query-dependent masks). Memory stays O(L + S) per head on the fused kernels.
* Hard-E (mixture="max") runs in the same CPU kernel (``max_r`` instead of the log-sum-exp over components) when
  it is available and masks are at most key padding; otherwise it takes the explicit path.
* explicit: the (B, H, L, M, S) log-kernel in query chunks; used for returned weights, for Hard-E without the CPU
  kernel, and as the twin that tests compare the fast path with.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from . import _component_flash, _mixture_flash, _mixture_triton
from . import masks as _masks
from ._checks import check_same, check_tensor, compute_dtype, full_precision

MIXTURES = ("sum", "max")
_LOG_PI_FLOOR = -1.0e4  # exp(-1e4) is 0 in every dtype; keeps 0 * (-inf) out of SDPA's backward


def _check(query, key, value, log_pi, sigma2, mixture, attn_mask):
    check_tensor(query, "query", 4, "(B, H, L, D)")
    check_tensor(key, "key", 5, "(B, H, M, S, D)")
    check_tensor(value, "value", 4, "(B, H, S, Dv)")
    B, H, L, D = query.shape
    M, S = key.shape[2], key.shape[3]
    check_same("query", B, "key", key.shape[0], "batch size")
    check_same("query", H, "key", key.shape[1], "number of heads")
    check_same("query", D, "key", key.shape[4], "head_dim")
    check_same("key", S, "value", value.shape[2], "key length S")
    check_same("key", B, "value", value.shape[0], "batch size")
    check_same("key", H, "value", value.shape[1], "number of heads")
    if mixture not in MIXTURES:
        raise ValueError(f"mixture must be one of {MIXTURES}, got {mixture!r}")
    if M < 1:
        raise ValueError("key must have at least one mixture component (M >= 1)")
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
    """Per-component variances as a (M,) tensor; default sqrt(D) (SPEC section 1)."""
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
        raise ValueError(f"sigma2 must have one variance per mixture component, shape ({M},); got {tuple(sigma2.shape)}")
    if torch.compiler.is_compiling():  # a value check would break the graph; modules check at construction
        return s
    if not bool(torch.all(s > 0)) or not bool(torch.all(torch.isfinite(s))):
        raise ValueError(f"sigma2 must be positive and finite, got {sigma2.tolist()}")
    return s


def _log_prior(log_pi, M: int, dtype, device) -> Tensor:
    """log pi as a 4-dim tensor broadcastable to (B, H, M, S), floored away from -inf; default uniform 1/M."""
    if log_pi is None:
        return torch.full((1, 1, M, 1), -math.log(M), dtype=dtype, device=device)
    lp = log_pi.to(dtype)
    lp = lp.reshape((1,) * (4 - lp.dim()) + tuple(lp.shape))
    return lp.clamp_min(_LOG_PI_FLOOR)


def gaussian_log_kernel(q: Tensor, k: Tensor, sigma2: Tensor) -> Tensor:
    """``-|q_i - k_jr|^2 / (2 sigma_r^2)`` for q (B, H, L, D), k (B, H, M, S, D), sigma2 (M,); returns (B, H, L, M, S).

    The squared distance is expanded (one matmul) and clamped at 0, so rounding never makes it negative and every
    kernel value is <= 1."""
    qn = (q * q).sum(-1)[..., :, None, None]  # (B, H, L, 1, 1)
    kn = (k * k).sum(-1).unsqueeze(2)  # (B, H, 1, M, S)
    qk = torch.einsum("bhld,bhmsd->bhlms", q, k)
    d2 = (qn + kn - 2.0 * qk).clamp_min(0.0)
    return d2 * (-0.5 / sigma2.view(-1, 1))


def _scores(q, k, log_prior, sigma2, mixture) -> Tensor:
    """(B, H, Lc, S) unnormalised log-weights for a chunk of queries."""
    g = gaussian_log_kernel(q, k, sigma2)
    if mixture == "max":
        return g.amax(dim=-2)
    return torch.logsumexp(g + log_prior.unsqueeze(2), dim=-2)


def _chunks(L: int, chunk_size: int):
    if torch.compiler.is_compiling():
        # A Python loop over a dynamic length would pin it (one recompile per length): one chunk when traced.
        yield 0, L
        return
    for start in range(0, L, chunk_size):
        yield start, min(L, start + chunk_size)


def _transformed(*tensors: Tensor) -> bool:
    """Whether forward-mode AD (dual tensors) or a torch.func transform sees these tensors: the fused kernels have
    no forward-mode rule (a custom op would silently drop the tangent), so such calls take the explicit path."""
    if torch.compiler.is_compiling():
        return False
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        return True
    from torch.autograd import forward_ad

    return forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _chunk_weights(qc, k, log_prior, s2, mask, empty, mixture):
    scores = _scores(qc, k, log_prior, s2, mixture)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return _masks.zero_rows(torch.softmax(scores, dim=-1), empty)


def _chunk_output(qc, k, v, log_prior, s2, mask, empty, mixture, dropout_p):
    w = _chunk_weights(qc, k, log_prior, s2, mask, empty, mixture)
    return (F.dropout(w, p=dropout_p) if dropout_p > 0.0 else w) @ v


def _explicit(q, k, v, log_prior, s2, mask, empty, mixture, dropout_p, want_weights, chunk_size):
    # In training each chunk is checkpointed (recomputed in backward), so memory stays O(chunk * M * S) per head
    # instead of keeping every chunk's (chunk, M, S) scores for the backward pass.
    recompute = (not want_weights and torch.is_grad_enabled() and q.shape[2] > chunk_size
                 and any(t.requires_grad for t in (q, k, v, log_prior, s2)))
    outs, weights = [], []
    for a, b in _chunks(q.shape[2], chunk_size):
        m = None if mask is None else (mask[..., a:b, :] if mask.shape[-2] > 1 else mask)
        e = None if empty is None else (empty[..., a:b, :] if empty.shape[-2] > 1 else empty)
        if want_weights:
            w = _chunk_weights(q[:, :, a:b], k, log_prior, s2, m, e, mixture)
            weights.append(w)
            outs.append((F.dropout(w, p=dropout_p) if dropout_p > 0.0 else w) @ v)
        elif recompute:
            outs.append(checkpoint(_chunk_output, q[:, :, a:b], k, v, log_prior, s2, m, e, mixture, dropout_p,
                                   use_reentrant=False))
        else:
            outs.append(_chunk_output(q[:, :, a:b], k, v, log_prior, s2, m, e, mixture, dropout_p))
    out = torch.cat(outs, dim=2)
    return out, (torch.cat(weights, dim=2) if want_weights else None)


def _needs_qnorm(s2: Tensor) -> bool:
    """With equal variances the |q|^2 term cancels in the output, but not in the gradient of each sigma_r^2."""
    return s2.requires_grad or torch.compiler.is_compiling() or not bool(torch.all(s2 == s2[0]))


def _triton_usable(q: Tensor, v: Tensor, s2: Tensor, dropout_p: float, hard: bool) -> bool:
    """The Triton kernels take the sum mixture with equal fixed variances and positive head sizes."""
    return (not hard and _mixture_triton.available(q, dropout_p) and q.shape[-1] > 0 and v.shape[-1] > 0
            and not _needs_qnorm(s2))


def _causal_empty_rows(keys_ok: Tensor | None, L: int, S: int, device) -> Tensor | None:
    """Rows (broadcastable to (B, H, L, 1)) that see no key under bottom-right causality and key padding
    ``keys_ok`` (bool, broadcastable to (B, H, 1, S)); None when every row sees a key."""
    if keys_ok is None and L <= S:
        return None
    last = (torch.arange(L, device=device) + (S - L + 1)).clamp(0, S)  # keys j < last[i] are visible from i
    if keys_ok is None:
        return (last == 0).view(L, 1)
    ok = keys_ok[..., 0, :]
    ok = ok.expand(*ok.shape[:-1], S)  # a mask may broadcast along S
    seen = F.pad(ok.to(torch.int32).cumsum(-1), (1, 0))  # seen[..., n]: valid keys among j < n
    return (seen[..., last] == 0).unsqueeze(-1)


def _fused_sdpa(q, k, v, log_prior, s2, mask, dropout_p, causal=False, hard=False):
    """SDPA over the M*S concatenated keys with the bias folded into extra head dimensions (module docstring).

    With ``causal`` (L == S) ``mask`` must not depend on the query and the CPU flash kernel must be available.
    On CPU without dropout and with at most key padding, our C++ kernel runs (:mod:`._mixture_flash`: component
    weights summed before the value product), or, when it could not be built, one SDPA flash call per component
    (:mod:`._component_flash`). On CUDA with ``MGK_TRITON=1`` and equal fixed variances the Triton kernels run
    (:mod:`._mixture_triton`). Otherwise one SDPA call runs over the concatenated keys."""
    B, H, M, S, D = k.shape
    Dv = v.shape[-1]
    inv = (1.0 / s2).view(M, 1, 1)
    bias = -(k * k).sum(-1) * (0.5 * inv.view(M, 1))  # (B, H, M, S)
    if not hard:
        bias = bias + log_prior
    need_qnorm = _needs_qnorm(s2)
    triton_ok = _triton_usable(q, v, s2, dropout_p, hard)
    kernel_ok = triton_ok or _mixture_flash.usable(q, v, dropout_p)
    if mask is not None and mask.shape[-2] == 1:
        # A mask that does not depend on the query (key padding) goes into the bias: the kernels then run without
        # a mask (SDPA can take its fused O(L + S)-memory kernel). Our kernels take -inf; SDPA's backward needs a
        # finite value (0 * -inf would be NaN), and -1e30 is below any real score.
        fill = float("-inf") if kernel_ok else -1e30
        bias = torch.where(mask[..., 0, :].unsqueeze(-2), bias, torch.full((), fill, dtype=bias.dtype,
                                                                           device=bias.device))
        mask = None
    if mask is None and triton_ok:
        return _mixture_triton.MixtureTriton.apply(q, k * inv, bias.expand(B, H, M, S), v, causal)
    if mask is None and kernel_ok:
        rowbias = None
        if need_qnorm:
            rowbias = (q * q).sum(-1).unsqueeze(2) * (-0.5 * inv.view(M, 1))  # (B, H, M, L)
        return _mixture_flash.mixture_flash(q, k * inv, bias, v, rowbias, causal, hard, dropout_p)
    if hard:
        raise RuntimeError("internal: Hard-E's fused path needs the CPU kernel and at most key padding")
    ones = torch.ones(q.shape[:-1] + (1,), dtype=q.dtype, device=q.device)
    cols_k = [k * inv, bias.unsqueeze(-1)]
    cols_q = [q, ones]
    if need_qnorm:
        cols_k.append((-0.5 * inv).expand(B, H, M, S, 1))
        cols_q.append((q * q).sum(-1, keepdim=True))
    kp = torch.cat(cols_k, dim=-1)
    qp = torch.cat(cols_q, dim=-1)
    # The fused CPU kernel needs one head size for q, k and v: pad with zero columns (no effect on scores; the
    # padded output columns are dropped).
    width = max(qp.shape[-1], Dv)
    qp, kp, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (qp, kp, v))
    if causal and q.shape[2] != S:  # SDPA's is_causal is aligned top-left when L != S
        raise RuntimeError("internal: causal with L != S needs the mixture kernel")
    if mask is None and _component_flash.available(q, dropout_p):
        return _component_flash.ComponentAttention.apply(qp, kp, v, causal)[..., :Dv]
    if causal:
        raise RuntimeError("internal: the causal fused path needs the CPU flash kernel; mgk_attention builds an "
                           "explicit mask otherwise")
    kp = kp.reshape(B, H, M * S, width)
    vp = v.unsqueeze(2).expand(B, H, M, S, width).reshape(B, H, M * S, width)
    mp = None
    if mask is not None:
        mp = mask.unsqueeze(-2).expand(*mask.shape[:-1], M, S).reshape(*mask.shape[:-1], M * S)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mp, dropout_p=dropout_p, scale=1.0)
    return out[..., :Dv]


def mgk_attention(query: Tensor, key: Tensor, value: Tensor, *, log_pi: Tensor | None = None,
                  sigma2: float | Tensor | None = None, mixture: str = "sum", attn_mask: Tensor | None = None,
                  is_causal: bool = False, dropout_p: float = 0.0, return_weights: bool = False,
                  explicit: bool = False, chunk_size: int = 512):
    """Mixture-of-Gaussian-keys attention (paper eq. 9-10; Hard-E ablation for mixture="max").

    Args:
        query: (B, H, L, D) floating.
        key: (B, H, M, S, D), M mixture components per key position.
        value: (B, H, S, Dv).
        log_pi: log prior of each component, broadcastable to (B, H, M, S); default uniform ``-log M``. Should
            satisfy ``logsumexp_r log_pi = 0`` (not checked: un-normalised priors only rescale a key's mass).
            Must be None for mixture="max".
        sigma2: per-component variance, a float or a (M,) tensor; default sqrt(D) for every component.
        mixture: "sum" (logsumexp over components) or "max" (Hard-E).
        attn_mask: bool broadcastable to (B, H, L, S), True = may attend.
        is_causal: causal masking aligned bottom-right (query i sees keys j <= i + S - L).
        dropout_p: dropout on attention weights. The CPU kernel and the explicit path drop each key's mixed
            weight; the SDPA path over concatenated keys drops each (key, component) pair. All keep the expectation.
        return_weights: also return the (B, H, L, S) attention weights (forces the explicit path).
        explicit: force the explicit path (the tests' twin of the fast path).
        chunk_size: queries per chunk on the explicit path (memory O(chunk * M * S) per head; one chunk inside a
            torch.compile trace, where a loop over a dynamic length would recompile per length).
    Returns:
        (B, H, L, Dv) in query's dtype, and the (B, H, L, S) weights when ``return_weights``. Rows that may attend
        to no key are exactly zero. 16-bit inputs or autocast are computed in float32.
    Raises:
        ValueError naming the argument for wrong ranks, sizes, dtypes, variances or mixture; MaskError for masks.
    """
    B, H, L, S, M, D, mask = _check(query, key, value, log_pi, sigma2, mixture, attn_mask)
    out_dtype = query.dtype
    if L == 0 or S == 0:  # nothing to attend from, or nothing to attend to: rows with no key are zero
        out = value.new_zeros(B, H, L, value.shape[-1], dtype=out_dtype)
        return (out, value.new_zeros(B, H, L, S, dtype=out_dtype)) if return_weights else out
    dt = compute_dtype(query, key, value)
    q, k, v = query.to(dt), key.to(dt), value.to(dt)
    with full_precision(query.device):
        s2 = _variances(sigma2, M, D, dt, query.device)
        log_prior = _log_prior(log_pi, M, dt, query.device)
        fast = not (return_weights or explicit or _transformed(q, k, v, s2, log_prior))
        key_padding_only = mask is None or mask.shape[-2] == 1
        hard = mixture == "max"
        if hard:  # Hard-E has a fused form only in our CPU kernel
            fast = fast and key_padding_only and _mixture_flash.usable(q, v, dropout_p)
        if fast and is_causal and key_padding_only and (
                _mixture_flash.usable(q, v, dropout_p) or (L == S and _component_flash.available(q, dropout_p))
                or _triton_usable(q, v, s2, dropout_p, hard)):
            # Causal with at most key padding: the fused kernels apply causality themselves and skip the blocks
            # above the diagonal (an explicit (L, S) mask would make them visit every block).
            keys_ok, k, v, _ = _masks.prepare(mask, k, v)
            empty = _causal_empty_rows(keys_ok, L, S, q.device)
            if empty is not None:
                q = torch.where(empty, torch.zeros((), dtype=q.dtype, device=q.device), q)
            out = _fused_sdpa(q, k, v, log_prior, s2, mask, dropout_p, causal=True, hard=hard)
            return _masks.zero_rows(out, empty).to(out_dtype)
        mask = _masks.combine(mask, is_causal, L, S, query.device)
        mask, k, v, empty, q = _masks.prepare(mask, k, v, q)
        if fast:
            out = _masks.zero_rows(_fused_sdpa(q, k, v, log_prior, s2, mask, dropout_p, hard=hard), empty)
            return out.to(out_dtype)
        out, weights = _explicit(q, k, v, log_prior, s2, mask, empty, mixture, dropout_p, return_weights,
                                 max(1, int(chunk_size)))
    out = out.to(out_dtype)
    return (out, weights.to(out_dtype)) if return_weights else out


def mgk_responsibilities(query: Tensor, key: Tensor, *, log_pi: Tensor | None = None,
                         sigma2: float | Tensor | None = None, attn_mask: Tensor | None = None,
                         is_causal: bool = False, query_mask: Tensor | None = None, chunk_size: int = 512):
    """E-step statistics for Soft-E (SPEC section 1, paper "+Soft-E" ablation), computed without gradient.

    ``gamma_ijr = softmax_r(log pi_jr - |q_i - k_jr|^2 / (2 sigma_r^2))`` is the responsibility of component r for
    the pair (i, j). Returns sums over the batch and over every query allowed to attend to j, and their counts:

    Args: as :func:`mgk_attention`; ``query_mask`` bool (B, L), True = real query (padded queries contribute no
        responsibility).
    Returns:
        ``(resp_sum, count)``: float32 (or float64) tensors of shapes (H, M, S) and (H, S). The Soft-E update is
        ``pi[h, r, j] = resp_sum[h, r, j] / count[h, j]`` where ``count > 0``. Under DDP, all-reduce both first.

    On CPU with at most key padding the C++ kernel computes the sums block by block (no L x S tensor); otherwise
    the (B, H, chunk, M, S) scores are built in query chunks.
    """
    check_tensor(key, "key", 5, "(B, H, M, S, D)")
    if key.shape[2] < 1:
        raise ValueError("key must have at least one mixture component (M >= 1)")
    B, H, L, S, M, D, mask = _check(query, key, key[:, :, 0], log_pi, sigma2, "sum", attn_mask)
    if query_mask is not None:
        if query_mask.dtype != torch.bool or tuple(query_mask.shape) != (B, L):
            raise _masks.MaskError(f"query_mask must be bool of shape (B, L) = {(B, L)}, True = real query; "
                                   f"got {query_mask.dtype} {tuple(query_mask.shape)}")
    dt = compute_dtype(query, key)
    with torch.no_grad(), full_precision(query.device):
        q, k = query.detach().to(dt), key.detach().to(dt)
        s2 = _variances(sigma2, M, D, dt, query.device)
        log_prior = _log_prior(log_pi, M, dt, query.device)
        if (M > 1 and (mask is None or mask.shape[-2] == 1) and not torch.compiler.is_compiling()
                and _mixture_flash.usable(q, k[:, :, 0], 0.0)):
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
        for a, b in _chunks(L, max(1, int(chunk_size))):
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
    if _needs_qnorm(s2):  # unequal variances: |q|^2 does not cancel across components
        rowbias = (q * q).sum(-1).unsqueeze(2) * (-0.5 * inv)
    query_ok = None if query_mask is None else query_mask.view(B, 1, L).expand(B, H, L)
    resp = _mixture_flash.responsibilities(q, k * inv.view(M, 1, 1), bias, rowbias, query_ok, key_ok, is_causal)
    # count[h, j] = number of (b, i) with a real query i that may see key j.
    real = (torch.ones(B, L, dtype=q.dtype, device=q.device) if query_mask is None else query_mask.to(q.dtype))
    if is_causal:  # query i sees j when i >= j - (S - L): a suffix count of real queries
        suffix = F.pad(real.flip(-1).cumsum(-1).flip(-1), (0, 1))  # suffix[b, t] = real queries at i >= t
        first = (torch.arange(S, device=q.device) - (S - L)).clamp(0, L)
        per_key = suffix[:, first]  # (B, S)
    else:
        per_key = real.sum(-1, keepdim=True).expand(B, S)
    seen = per_key.unsqueeze(1).expand(B, H, S)
    if key_ok is not None:
        seen = seen * key_ok.to(q.dtype)
    return resp.sum(0), seen.sum(0)

