"""The implementations of MGK attention behind ``mgk_attention(..., backend=...)``, one function each, beside the
explicit reference (the layout of flash-linear-attention's ``ops/<op>/{chunk,fused_recurrent,naive}.py``).

Every implementation takes the checked inputs in the compute dtype: q (B, H, L, D), k (B, H, M, S, D) (already
centred, see :func:`mgk.functional.mgk.mgk_attention`), v (B, H, S, Dv), log_prior broadcastable to (B, H, M, S), s2
(M,), mask (4-dim bool broadcastable to (B, H, L, S), True = may attend, or None) and the call options
:class:`Call`; it returns ``(out, weights)``, weights None unless the explicit path was asked for them. Which one
serves which inputs is decided in one place only, :func:`mgk.functional.mgk.select_backend`.

* :func:`explicit`: the (B, H, L, M, S) log-kernel in query chunks (paper eq. 9-10 as written).
* :func:`kernel`: our C++ CPU kernel (:mod:`._mixture_flash`), the component weights summed before the value product.
* :func:`triton`: the same algorithm, attention dropout included, as Triton kernels (:mod:`._mixture_triton`).
* :func:`sdpa`: MGK as dot-product attention with the per-key bias folded into extra head dimensions
  (``|q - k|^2 = |q|^2 - 2 q.k + |k|^2``): one CPU flash call per component merged through the log-sum-exps
  (:mod:`._component_flash`), or one ``F.scaled_dot_product_attention`` over the M*S concatenated keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from . import _component_flash, _mixture_flash, _mixture_triton
from . import masks as _masks


@dataclass(frozen=True)
class Call:
    """Options of one call: causality (bottom-right), mixture ("sum" or "max"), dropout, weights, chunk size."""

    is_causal: bool
    mixture: str
    dropout_p: float
    return_weights: bool
    chunk_size: int


def gaussian_log_kernel(q: Tensor, k: Tensor, sigma2: Tensor) -> Tensor:
    """``-|q_i - k_jr|^2 / (2 sigma_r^2)`` for q (B, H, L, D), k (B, H, M, S, D), sigma2 (M,); returns (B, H, L, M, S).

    The squared distance is expanded (one matmul) and clamped at 0, so rounding never makes it negative and every
    kernel value is <= 1. The expansion cancels catastrophically when q and k share a large offset; mgk_attention
    centres both first."""
    qn = (q * q).sum(-1)[..., :, None, None]  # (B, H, L, 1, 1)
    kn = (k * k).sum(-1).unsqueeze(2)  # (B, H, 1, M, S)
    qk = torch.einsum("bhld,bhmsd->bhlms", q, k)
    d2 = (qn + kn - 2.0 * qk).clamp_min(0.0)
    return d2 * (-0.5 / sigma2.view(-1, 1))


def needs_qnorm(s2: Tensor) -> bool:
    """Whether the per-row ``-|q|^2 / (2 sigma_r^2)`` term must be kept: with equal fixed variances it cancels in
    the softmax; with unequal or learned ones it does not (nor in the gradient of each sigma_r^2). Reading the
    values would synchronise an accelerator, so off the CPU the term is always kept (exact either way)."""
    if s2.requires_grad or torch.compiler.is_compiling() or s2.device.type != "cpu":
        return True
    values = s2.tolist()  # one read of the M values instead of three small ops, on every call
    return any(x != values[0] for x in values)


def _chunks(L: int, chunk_size: int):
    if torch.compiler.is_compiling():
        # A Python loop over a dynamic length would pin it (one recompile per length): one chunk when traced.
        yield 0, L
        return
    for start in range(0, L, chunk_size):
        yield start, min(L, start + chunk_size)


def _chunk_weights(qc, k, log_prior, s2, mask, empty, mixture):
    g = gaussian_log_kernel(qc, k, s2)
    scores = g.amax(dim=-2) if mixture == "max" else torch.logsumexp(g + log_prior.unsqueeze(2), dim=-2)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return _masks.zero_rows(torch.softmax(scores, dim=-1), empty)


def _chunk_output(qc, k, v, log_prior, s2, mask, empty, mixture, dropout_p):
    w = _chunk_weights(qc, k, log_prior, s2, mask, empty, mixture)
    return (F.dropout(w, p=dropout_p) if dropout_p > 0.0 else w) @ v


def explicit(q, k, v, log_prior, s2, mask, call: Call):
    """The explicit path; the only one that returns weights, runs under forward-mode AD and drops whole keys."""
    mask = _masks.combine(mask, call.is_causal, q.shape[2], k.shape[3], q.device)
    mask, k, v, empty, q = _masks.prepare(mask, k, v, q)
    # In training each chunk is checkpointed (recomputed in backward), so memory stays O(chunk * M * S) per head
    # instead of keeping every chunk's (chunk, M, S) scores for the backward pass.
    want = call.return_weights
    recompute = (not want and torch.is_grad_enabled() and q.shape[2] > call.chunk_size
                 and any(t.requires_grad for t in (q, k, v, log_prior, s2)))
    outs, weights = [], []
    for a, b in _chunks(q.shape[2], call.chunk_size):
        m = None if mask is None else (mask[..., a:b, :] if mask.shape[-2] > 1 else mask)
        e = None if empty is None else (empty[..., a:b, :] if empty.shape[-2] > 1 else empty)
        args = (q[:, :, a:b], k, v, log_prior, s2, m, e, call.mixture, call.dropout_p)
        if want:
            w = _chunk_weights(*args[:2], *args[3:8])
            weights.append(w)
            outs.append((F.dropout(w, p=call.dropout_p) if call.dropout_p > 0.0 else w) @ v)
        elif recompute:
            outs.append(checkpoint(_chunk_output, *args, use_reentrant=False))
        else:
            outs.append(_chunk_output(*args))
    return torch.cat(outs, dim=2), (torch.cat(weights, dim=2) if want else None)


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


def _inert(q, k, v, mask, call: Call, fused_causal: bool):
    """Masked keys, values and key-less query rows made inert (``torch.where``, so NaN padding never leaks).

    With ``fused_causal`` the kernel applies causality itself (skipping the blocks above the diagonal; an explicit
    (L, S) mask would make it visit every block): ``mask`` stays at most key padding. Returns (q, k, v, mask,
    empty rows)."""
    L, S = q.shape[2], k.shape[3]
    if fused_causal:
        keys_ok, k, v, _ = _masks.prepare(mask, k, v)
        empty = _causal_empty_rows(keys_ok, L, S, q.device)
        if empty is not None:
            q = torch.where(empty, torch.zeros((), dtype=q.dtype, device=q.device), q)
        return q, k, v, mask, empty
    mask = _masks.combine(mask, call.is_causal, L, S, q.device)
    mask, k, v, empty, q = _masks.prepare(mask, k, v, q)
    return q, k, v, mask, empty


def _key_bias(k, s2, log_prior, mask, hard: bool, fill: float):
    """``log pi_jr - |k_jr|^2 / (2 sigma_r^2)`` (B, H, M, S), ``fill`` at keys a query-independent mask removes."""
    M = k.shape[2]
    bias = (k * k).sum(-1) * (-0.5 / s2).view(M, 1)  # the same bits as -(|k|^2 * (0.5 / s2)), one op fewer
    if not hard:
        bias = bias + log_prior
    if mask is not None:
        bias = torch.where(mask[..., 0, :].unsqueeze(-2), bias,
                           torch.full((), fill, dtype=bias.dtype, device=bias.device))
    return bias


def kernel(q, k, v, log_prior, s2, mask, call: Call):
    """Our C++ CPU kernel (sum or max over components); masks at most key padding, plus ``is_causal``."""
    hard = call.mixture == "max"
    q, k, v, mask, empty = _inert(q, k, v, mask, call, fused_causal=call.is_causal)
    inv = 1.0 / s2
    bias = _key_bias(k, s2, log_prior, mask, hard, float("-inf"))
    rowbias = None
    if needs_qnorm(s2):
        rowbias = (q * q).sum(-1).unsqueeze(2) * (-0.5 * inv.view(-1, 1))  # (B, H, M, L)
    out = _mixture_flash.mixture_flash(q, k * inv.view(-1, 1, 1), bias, v, rowbias, call.is_causal, hard,
                                       call.dropout_p)
    return _masks.zero_rows(out, empty), None


def triton(q, k, v, log_prior, s2, mask, call: Call):
    """The Triton kernels (sum mixture, equal fixed variances); masks at most key padding, plus ``is_causal``;
    attention dropout inside, on the mixed weight (the C++ kernel's mask for the same (seed, offset))."""
    q, k, v, mask, empty = _inert(q, k, v, mask, call, fused_causal=call.is_causal)
    B, H, M, S, _ = k.shape
    bias = _key_bias(k, s2, log_prior, mask, False, float("-inf")).expand(B, H, M, S)
    out = _mixture_triton.MixtureTriton.apply(q, k * (1.0 / s2).view(M, 1, 1), bias, v, call.is_causal,
                                              call.dropout_p)
    return _masks.zero_rows(out.to(q.dtype), empty), None


def sdpa(q, k, v, log_prior, s2, mask, call: Call):
    """MGK as dot-product attention over the M*S keys with the bias folded into extra head dimensions."""
    L, S = q.shape[2], k.shape[3]
    # Causal with at most key padding and L == S: SDPA's own causal flag (top-left aligned, equal to ours when
    # L == S) on each component skips the masked blocks.
    fused_causal = (call.is_causal and (mask is None or mask.shape[-2] == 1) and L == S
                    and _component_flash.available(q, call.dropout_p))
    q, k, v, mask, empty = _inert(q, k, v, mask, call, fused_causal)
    return _masks.zero_rows(_folded(q, k, v, log_prior, s2, mask, call.dropout_p, fused_causal), empty), None


def _folded(q, k, v, log_prior, s2, mask, dropout_p, causal):
    """``q' = [q, 1 (, |q|^2)]``, ``k'_r = [k_r / sigma_r^2, b_r (, -1 / (2 sigma_r^2))]``: scale-1 SDPA over k'."""
    B, H, M, S, D = k.shape
    Dv = v.shape[-1]
    inv = (1.0 / s2).view(M, 1, 1)
    if mask is not None and mask.shape[-2] == 1:
        # A mask that does not depend on the query goes into the bias: SDPA then runs without a mask and can take
        # its fused O(L + S)-memory kernel. SDPA's backward needs a finite value (0 * -inf would be NaN), and
        # -1e30 is below any real score.
        bias, mask = _key_bias(k, s2, log_prior, mask, False, -1e30), None
    else:
        bias = _key_bias(k, s2, log_prior, None, False, 0.0)
    cols_k, cols_q = [k * inv, bias.unsqueeze(-1)], [q, q.new_ones(q.shape[:-1] + (1,))]
    if needs_qnorm(s2):
        cols_k.append((-0.5 * inv).expand(B, H, M, S, 1))
        cols_q.append((q * q).sum(-1, keepdim=True))
    kp, qp = torch.cat(cols_k, dim=-1), torch.cat(cols_q, dim=-1)
    # The fused CPU kernel needs one head size for q, k and v: zero columns change no score and are dropped after.
    width = max(qp.shape[-1], Dv)
    qp, kp, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (qp, kp, v))
    if mask is None and _component_flash.available(q, dropout_p):
        return _component_flash.ComponentAttention.apply(qp, kp, v, causal)[..., :Dv]
    kp = kp.reshape(B, H, M * S, width)
    vp = v.unsqueeze(2).expand(B, H, M, S, width).reshape(B, H, M * S, width)
    mp = None
    if mask is not None:
        mp = mask.unsqueeze(-2).expand(*mask.shape[:-1], M, S).reshape(*mask.shape[:-1], M * S)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mp, dropout_p=dropout_p, scale=1.0)
    return out[..., :Dv]


IMPLEMENTATIONS = {"triton": triton, "kernel": kernel, "sdpa": sdpa, "explicit": explicit}
