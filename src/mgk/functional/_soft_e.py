"""MGK attention and its Soft-E statistics from one pass of the C++ kernel (the paper's "+Soft-E" ablation, Nguyen et
al. 2022, Section 3.2: the E-step of EM for the key mixture, run in each training forward).

The E-step needs ``softmax_r(s_ijr)`` for every (query, key) pair, and the forward pass already computes every score
``s_ijr`` block by block: the kernel adds the responsibilities of each block while the scores are in cache, instead
of a second pass that recomputes the M score GEMMs (:func:`mgk.functional.mgk_responsibilities`). Same inputs,
centring, masks and numbers as :func:`mgk.functional.mgk_attention` followed by ``mgk_responsibilities``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _mgk_backends, _mixture_flash
from . import masks as _masks
from ._centre import apply_centre
from ._checks import check_arguments, full_precision
from ._mixture_terms import check_mixture, needs_qnorm, row_bias
from .mgk import _centre_of, _choose, _inputs, responsibility_counts


def mgk_attention_soft_e(query: Tensor, key: Tensor, value: Tensor, *, log_pi: Tensor | None = None,
                         sigma2=None, attn_mask: Tensor | None = None, is_causal: bool = False,
                         dropout_p: float = 0.0, query_mask: Tensor | None = None, backend: str | None = None,
                         centre: Tensor | None = None):
    """``mgk_attention(..., mixture="sum")`` and ``mgk_responsibilities(...)`` of the same inputs in one kernel pass.

    Args: as :func:`mgk.functional.mgk_attention` (mixture "sum", ``centre`` included); ``query_mask`` (B, L) bool,
        True = real query; ``backend`` None or "kernel" (any other name: not served here).
    Returns:
        ``(out (B, H, L, Dv), resp_sum (H, M, S), count (H, S))`` as those two functions return them (the statistics
        without gradient), or None when the kernel cannot serve the call (another backend, M = 1, masks that depend
        on the query, not CPU float, no built kernel, empty inputs): the caller then runs the two separately.
    Raises:
        as :func:`mgk.functional.mgk_attention`.
    """
    check_arguments(is_causal=is_causal, dropout_p=dropout_p)
    if backend not in (None, "kernel"):
        return None
    B, H, L, S, M, D, mask = check_mixture(query, key, value, log_pi, "sum", attn_mask)
    if query_mask is not None and (query_mask.dtype != torch.bool or tuple(query_mask.shape) != (B, L)):
        raise _masks.MaskError(f"query_mask must be bool of shape (B, L) = {(B, L)}, True = real query; "
                               f"got {query_mask.dtype} {tuple(query_mask.shape)}")
    if M < 2 or L == 0 or S == 0 or torch.compiler.is_compiling():
        return None
    out_dtype = query.dtype
    with full_precision(query.device):
        q, k, v, s2, log_prior = _inputs(query, key, value, log_pi, sigma2, H, M, D)
        if _choose(None, q, k, v, s2, log_prior, mask, None, "sum", dropout_p, False) != "kernel":
            return None
        query_ok = None if query_mask is None else query_mask.view(B, 1, L)
        q, k = apply_centre(q, k, _centre_of(centre, q, mask, is_causal, S, query_ok))
        call = _mgk_backends.Call(bool(is_causal), "sum", float(dropout_p), False, 512)
        q, k, v, mask, empty = _mgk_backends._inert(q, k, v, mask, call, fused_causal=call.is_causal)
        bias = _mgk_backends._key_bias(k, s2, log_prior, mask, None, False, float("-inf"))
        rowbias = row_bias(q, s2) if needs_qnorm(s2) else None
        out, resp = _mixture_flash.mixture_flash_with_responsibilities(
            q, _mgk_backends.scaled_keys(k, s2), bias, v, rowbias, query_ok, call.is_causal, call.dropout_p)
        out = _masks.zero_rows(out, empty).to(out_dtype)
        key_ok = None if mask is None else mask[..., 0, :]
        if log_pi is not None:  # keys with every component switched off: no responsibility, no count
            live = (log_prior > float("-inf")).any(dim=2)
            key_ok = live if key_ok is None else key_ok & live
        count = responsibility_counts(B, H, L, S, query_mask, key_ok, is_causal, resp.dtype, resp.device)
    return out, resp.detach().sum(0), count
