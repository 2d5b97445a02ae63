"""The implementations of MGK attention behind ``mgk_attention(..., backend=...)``, one function each, beside the
explicit reference (the layout of flash-linear-attention's ``ops/<op>/{chunk,fused_recurrent,naive}.py``).

Every implementation takes the checked inputs in the compute dtype: q (B, H, L, D), k (B, H, M, S, D) (already
centred, see :mod:`mgk.functional._centre`), v (B, H, S, Dv), log_prior broadcastable to (B, H, M, S) (-inf switches
a component off), s2 (H', M) with H' in (1, H), mask (4-dim bool broadcastable to (B, H, L, S), True = may attend, or
None), bias (a finite float broadcastable to (B, H, L, S) added to each key's logit, or None) and the call options
:class:`Call`; it returns ``(out, weights)``, weights None unless the explicit path was asked for them. Which one
serves which inputs is decided in one place only, :func:`mgk.functional.mgk.select_backend`.

* :func:`explicit`: the (B, H, L, M, S) log-kernel in query chunks (paper eq. 9-10 as written).
* :func:`kernel`: our C++ CPU kernel (:mod:`._mixture_flash`), the component weights summed before the value product.
* :func:`triton`: the same algorithm, attention dropout included, as Triton kernels (:mod:`._mixture_triton`).
* :func:`sdpa`: MGK as dot-product attention with the per-key bias folded into extra head dimensions
  (``|q - k|^2 = |q|^2 - 2 q.k + |k|^2``): one CPU flash call per component merged through the log-sum-exps
  (:mod:`._component_flash`), or one ``F.scaled_dot_product_attention`` over the M*S concatenated keys (with the
  bias, when it depends on the query, as its float ``attn_mask``).

A component with ``log_pi = -inf`` contributes nothing: the fused kernels take the -inf in their per-key bias (their
softmax skips it exactly); "explicit" and "sdpa" turn a key whose components are all switched off into a masked key
and "sdpa" replaces the remaining -inf by a finite value below any score (SDPA's backward would multiply 0 by it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from . import _component_flash, _mixture_flash, _mixture_triton
from . import masks as _masks
from ._mixture_terms import (
    gaussian_log_kernel,
    key_bias,
    needs_qnorm,
    per_component,
    query_terms,
    scaled_keys,
)


@dataclass(frozen=True)
class Call:
    """Options of one call: causality (bottom-right), mixture ("sum" or "max"), dropout, weights, chunk size, and
    whether the caller gave log_pi (only then can a key have every component switched off)."""

    is_causal: bool
    mixture: str
    dropout_p: float
    return_weights: bool
    chunk_size: int
    pi_given: bool = False


def _chunks(L: int, chunk_size: int):
    if torch.compiler.is_compiling():
        # A Python loop over a dynamic length would pin it (one recompile per length): one chunk when traced.
        yield 0, L
        return
    for start in range(0, L, chunk_size):
        yield start, min(L, start + chunk_size)


def _rows(t: Tensor | None, a: int, b: int) -> Tensor | None:
    """Rows a:b of a tensor broadcastable to (B, H, L, ...) (as is when it does not depend on the query)."""
    return t if t is None or t.shape[2] == 1 else t[:, :, a:b]


def _drop_dead_keys(mask, log_prior, call: Call):
    """A key whose every component has log_pi = -inf becomes a masked key, its log prior 0 (finite: the logsumexp's
    backward at an all -inf key would be 0 * NaN). Returns (mask, log_prior, dead): with one prior for every key
    position the mask is left alone (no masking pass over the keys) and ``dead`` (broadcastable to (B, H, L, 1))
    marks the heads whose every key is off, whose rows the caller sets to zero; otherwise ``dead`` is None."""
    if not call.pi_given or call.mixture == "max":
        return mask, log_prior, None
    live = (log_prior > float("-inf")).any(dim=2, keepdim=True)  # (B?, H?, 1, S?)
    log_prior = torch.where(live, log_prior, torch.zeros((), dtype=log_prior.dtype, device=log_prior.device))
    if live.shape[-1] == 1:
        return mask, log_prior, ~live
    return (live if mask is None else mask & live), log_prior, None


def _row_log_kernel(q, k, s2):
    """:func:`gaussian_log_kernel` up to a per-row constant, which the softmax over keys (and the sum or max over
    components) drops: without the ``-|q|^2 / (2 sigma^2)`` term when it cancels (:func:`needs_qnorm`). A query far
    from the centre has |q|^2 of order R^2, whose rounding (eps R^2 / (2 sigma^2)) would reach every score of its
    row: 3.5e-4 on the row of a token at distance 1000, against 5e-6 for the other paths, which never form it."""
    if needs_qnorm(s2):
        return gaussian_log_kernel(q, k, s2)
    qk = torch.einsum("bhld,bhmsd->bhlms", q, scaled_keys(k, s2))  # q . k_jr / sigma_r^2
    return qk + key_bias(k, s2).unsqueeze(2)  # + the per-key bias without a prior


def _chunk_weights(qc, k, log_prior, s2, mask, bias, empty, mixture):
    g = _row_log_kernel(qc, k, s2)
    scores = g.amax(dim=-2) if mixture == "max" else torch.logsumexp(g + log_prior.unsqueeze(2), dim=-2)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return _masks.zero_rows(torch.softmax(scores, dim=-1), empty)


def _chunk_output(qc, k, v, log_prior, s2, mask, bias, empty, mixture, dropout_p):
    w = _chunk_weights(qc, k, log_prior, s2, mask, bias, empty, mixture)
    return (F.dropout(w, p=dropout_p) if dropout_p > 0.0 else w) @ v


def explicit(q, k, v, log_prior, s2, mask, bias, call: Call):
    """The explicit path; the only one that returns weights, runs under forward-mode AD and drops whole keys."""
    mask, log_prior, dead = _drop_dead_keys(mask, log_prior, call)
    mask = _masks.combine(mask, call.is_causal, q.shape[2], k.shape[3], q.device)
    mask, k, v, empty, q = _masks.prepare(mask, k, v, q)
    # In training each chunk is checkpointed (recomputed in backward), so memory stays O(chunk * M * S) per head
    # instead of keeping every chunk's (chunk, M, S) scores for the backward pass.
    want = call.return_weights
    recompute = (not want and torch.is_grad_enabled() and q.shape[2] > call.chunk_size
                 and any(t is not None and t.requires_grad for t in (q, k, v, log_prior, s2, bias)))
    outs, weights = [], []
    for a, b in _chunks(q.shape[2], call.chunk_size):
        args = (q[:, :, a:b], k, v, log_prior, s2, _rows(mask, a, b), _rows(bias, a, b), _rows(empty, a, b),
                call.mixture, call.dropout_p)
        if want:
            w = _chunk_weights(*args[:2], *args[3:9])
            weights.append(w)
            outs.append((F.dropout(w, p=call.dropout_p) if call.dropout_p > 0.0 else w) @ v)
        elif recompute:
            outs.append(checkpoint(_chunk_output, *args, use_reentrant=False))
        else:
            outs.append(_chunk_output(*args))
    out = _masks.zero_rows(torch.cat(outs, dim=2), dead)
    return out, (_masks.zero_rows(torch.cat(weights, dim=2), dead) if want else None)


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
    L, S = q.shape[2], k.shape[-2]  # k: (B, G, M, S, D), or a shifted key (B, G, S, D)
    if fused_causal:
        _, k, v, _ = _masks.prepare(mask, k, v)
        # from the mask itself: prepare's mask has a batch row of padding only opened (NaN queries would get in)
        empty = _causal_empty_rows(mask, L, S, q.device)
        if empty is not None:
            q = torch.where(empty, torch.zeros((), dtype=q.dtype, device=q.device), q)
        return q, k, v, mask, empty
    mask = _masks.combine(mask, call.is_causal, L, S, q.device)
    mask, k, v, empty, q = _masks.prepare(mask, k, v, q)
    return q, k, v, mask, empty


def _key_bias(k, s2, log_prior, mask, bias, hard: bool, fill: float, shifts=None):
    """:func:`key_bias` plus ``bias_j`` (B, H, M, S), ``fill`` at keys a query-independent mask removes; ``bias`` is
    None or a per-key bias (B?, H?, 1, S?). A finite ``fill`` also replaces -inf log priors. With ``shifts``, k is
    sMGK's unshifted key (:func:`key_bias`)."""
    prior = None if hard else (log_prior if fill == float("-inf") else log_prior.clamp_min(fill))
    bias_jr = key_bias(k, s2, prior, shifts=shifts)
    if bias is not None:
        bias_jr = bias_jr + bias
    if mask is not None:
        bias_jr = torch.where(mask[..., 0, :].unsqueeze(-2), bias_jr,
                              torch.full((), fill, dtype=bias_jr.dtype, device=bias_jr.device))
    return bias_jr


def kernel(q, k, v, log_prior, s2, mask, bias, call: Call, shifts=None):
    """Our C++ CPU kernel (sum or max over components); masks and bias at most per key, plus ``is_causal``. It reads
    compact keys in place too: k (B, G, M, S, D) of G key groups dividing H (gMGK; v (B, G, S, Dv), log_prior
    broadcastable to (B, G, M, S), s2 (G', M), mask and bias of one head, broadcast over the groups), or with
    ``shifts`` (M, G, D) sMGK's one unshifted key (B, G, S, D), whose M components the kernel scores with one
    product (``s_ijr = (q_i . k_j) / sigma_r^2 + b_jr + rowbias_ir``, the shifts in the row term). Nothing is
    repeated for the query heads or the components."""
    hard = call.mixture == "max"
    R = q.shape[1] // max(k.shape[1], 1)  # (no head: nothing to repeat)
    q, k, v, mask, empty = _inert(q, k, v, mask, call, fused_causal=call.is_causal)
    key_bias = _key_bias(k, s2, log_prior, mask, bias, hard, float("-inf"), shifts=shifts)
    heads = s2 if R == 1 or s2.shape[0] == 1 else s2.repeat_interleave(R, 0)  # the variances of each query head
    _, rowbias = query_terms(q, heads, None if shifts is None else shifts.repeat_interleave(R, 1))
    if shifts is None:
        out = _mixture_flash.mixture_flash(q, scaled_keys(k, s2), key_bias, v, rowbias, call.is_causal, hard,
                                           call.dropout_p)
    else:
        out = _mixture_flash.mixture_flash(q, k.unsqueeze(2), key_bias, v, rowbias, call.is_causal, hard,
                                           call.dropout_p, scale=s2.reciprocal().unsqueeze(0))
    return _masks.zero_rows(out, empty), None


def triton(q, k, v, log_prior, s2, mask, bias, call: Call):
    """The Triton kernels (sum mixture, variances equal within each head and fixed); masks and bias at most per key,
    plus ``is_causal``; attention dropout inside, on the mixed weight (the C++ kernel's mask for the same (seed,
    offset))."""
    q, k, v, mask, empty = _inert(q, k, v, mask, call, fused_causal=call.is_causal)
    B, H, M, S, _ = k.shape
    key_bias = _key_bias(k, s2, log_prior, mask, bias, False, float("-inf")).expand(B, H, M, S)
    out = _mixture_triton.MixtureTriton.apply(q, scaled_keys(k, s2), key_bias, v, call.is_causal, call.dropout_p)
    return _masks.zero_rows(out.to(q.dtype), empty), None


def sdpa(q, k, v, log_prior, s2, mask, bias, call: Call):
    """MGK as dot-product attention over the M*S keys with the bias folded into extra head dimensions."""
    mask, log_prior, dead = _drop_dead_keys(mask, log_prior, call)
    L, S = q.shape[2], k.shape[3]
    # Causal with at most key padding and L == S: SDPA's own causal flag (top-left aligned, equal to ours when
    # L == S) on each component skips the masked blocks.
    fused_causal = (call.is_causal and (mask is None or mask.shape[-2] == 1) and (bias is None or bias.shape[-2] == 1)
                    and L == S and _component_flash.available(q, call.dropout_p))
    q, k, v, mask, empty = _inert(q, k, v, mask, call, fused_causal)
    out = _folded(q, k, v, log_prior, s2, mask, bias, call.dropout_p, fused_causal)
    return _masks.zero_rows(_masks.zero_rows(out, empty), dead), None


def _over_components(t: Tensor, M: int, S: int) -> Tensor:
    """A (..., S?) mask or bias repeated for the M components of the concatenated keys: (..., M * S)."""
    return t.unsqueeze(-2).expand(*t.shape[:-1], M, S).reshape(*t.shape[:-1], M * S)


def _folded(q, k, v, log_prior, s2, mask, bias, dropout_p, causal):
    """``q' = [q, 1 (, |q|^2)]``, ``k'_r = [k_r / sigma_r^2, b_r (, -1 / (2 sigma_r^2))]``: scale-1 SDPA over k'."""
    B, H, M, S, D = k.shape
    Dv = v.shape[-1]
    # SDPA's backward needs finite scores (0 * -inf would be NaN): masked keys and switched-off components take a
    # value below any real score. A bias that depends on the query becomes SDPA's float attn_mask.
    below = torch.finfo(q.dtype).min / 8
    query_bias = bias if bias is not None and bias.shape[-2] != 1 else None
    key_bias = None if query_bias is not None else bias
    if mask is not None and mask.shape[-2] == 1 and query_bias is None:
        # A mask that does not depend on the query goes into the bias: SDPA then runs without a mask and can take
        # its fused O(L + S)-memory kernel.
        kb, mask = _key_bias(k, s2, log_prior, mask, key_bias, False, below), None
    else:
        kb = _key_bias(k, s2, log_prior, None, key_bias, False, below)
    cols_k, cols_q = [scaled_keys(k, s2), kb.unsqueeze(-1)], [q, q.new_ones(q.shape[:-1] + (1,))]
    if needs_qnorm(s2):
        cols_k.append((-0.5 / per_component(s2, 1, 1)).expand(B, H, M, S, 1))
        cols_q.append((q * q).sum(-1, keepdim=True))
    kp, qp = torch.cat(cols_k, dim=-1), torch.cat(cols_q, dim=-1)
    # The fused CPU kernel needs one head size for q, k and v: zero columns change no score and are dropped after.
    width = max(qp.shape[-1], Dv)
    qp, kp, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (qp, kp, v))
    if mask is None and query_bias is None and _component_flash.available(q, dropout_p):
        return _component_flash.ComponentAttention.apply(qp, kp, v, causal)[..., :Dv]
    kp = kp.reshape(B, H, M * S, width)
    vp = v.unsqueeze(2).expand(B, H, M, S, width).reshape(B, H, M * S, width)
    attn = None if mask is None else _over_components(mask, M, S)
    if query_bias is not None:
        qb = _over_components(query_bias, M, S)
        attn = qb if attn is None else torch.where(attn, qb, torch.full((), float("-inf"), dtype=qb.dtype,
                                                                          device=qb.device))
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=attn, dropout_p=dropout_p, scale=1.0)
    return out[..., :Dv]


IMPLEMENTATIONS = {"triton": triton, "kernel": kernel, "sdpa": sdpa, "explicit": explicit}
