"""Scaled dot-product (softmax) attention: the baseline of the paper (Vaswani et al. 2017)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _mixture_flash
from . import masks as _masks
from ._checks import check_qkv, compute_dtype, full_precision
from .mgk import BackendError, _transformed

SOFTMAX_BACKENDS = ("kernel", "sdpa", "explicit")


def _kernel_unserved(q: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> str | None:
    """Why our CPU kernel cannot serve a softmax call (None when it can)."""
    if mask is not None and mask.shape[-2] != 1:
        return "attn_mask depends on the query: the kernel takes at most key padding plus is_causal"
    if q.device.type != "cpu":
        return f"the C++ kernel runs on CPU tensors, got {q.device.type}"
    if not _mixture_flash.usable(q, v, dropout_p):
        return ("needs float32/float64 (or 16-bit, computed in float32), head sizes >= 1, 0 <= dropout_p < 1 and "
                f"a built kernel ({_mixture_flash.build_error() or 'not loaded'})")
    return None


def select_softmax_backend(query: Tensor, key: Tensor, value: Tensor, *, attn_mask: Tensor | None = None,
                           dropout_p: float = 0.0) -> str:
    """The implementation :func:`softmax_attention` runs for these inputs when ``backend`` is None.

    * "kernel": CPU inputs with attention dropout (``dropout_p > 0``) and a mask that is at most key padding:
      SDPA has no fused CPU kernel with dropout and builds the (L, S) weights, our kernel (one component, no bias;
      :func:`mgk.functional._mixture_flash.softmax_flash`) keeps O(L + S) memory per head;
    * "sdpa": everything else (its fused flash kernel serves CPU calls without dropout).

    "explicit" (the (B, H, L, S) weights built) is used when asked for, and for forward-mode AD and torch.func
    transforms (``jvp``, ``vmap``, ``grad``), which neither fused kernel has a rule for. Arguments as
    :func:`softmax_attention`; raises as it does for bad masks."""
    B, H, L, S, _, _ = check_qkv(query, key, value, mixture=False)
    mask = _masks.check_mask(attn_mask, "attn_mask", B, H, L, S)
    dt = compute_dtype(query, key, value)
    return _select(query.to(dt), value.to(dt), mask, dropout_p)


def _select(q: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> str:
    """select_softmax_backend on checked inputs in the compute dtype."""
    if _transformed(q, v):
        return "explicit"
    if dropout_p > 0.0 and _kernel_unserved(q, v, mask, dropout_p) is None:
        return "kernel"
    return "sdpa"


def softmax_attention(query: Tensor, key: Tensor, value: Tensor, *, attn_mask: Tensor | None = None,
                      is_causal: bool = False, dropout_p: float = 0.0, scale: float | None = None,
                      backend: str | None = None) -> Tensor:
    """Softmax attention ``softmax(q k^T / sqrt(D)) v`` (Vaswani et al. 2017, eq. 1).

    Args:
        query: (B, H, L, D) floating.
        key: (B, H, S, D), same dtype as query.
        value: (B, H, S, Dv).
        attn_mask: bool, broadcastable to (B, H, L, S); True = may attend (SDPA convention).
        is_causal: causal masking aligned bottom-right (query i sees keys j <= i + S - L).
        dropout_p: dropout on the attention weights (pass 0.0 in evaluation).
        scale: score scale, default 1 / sqrt(D).
        backend: None (:func:`select_softmax_backend` picks), "kernel" (our CPU kernel, O(L + S) memory also with
            dropout; CPU, masks at most key padding), "sdpa" (``F.scaled_dot_product_attention``) or "explicit"
            (:func:`softmax_attention_reference`, the (B, H, L, S) weights built). "sdpa" and "explicit" serve
            every input. Dropout masks differ between backends (each draws its own); the expectation is the same.
    Returns:
        (B, H, L, Dv) in query's dtype. Rows that may attend to no key are exactly zero.
    Raises:
        ValueError naming the argument for wrong ranks, sizes, mixed dtypes or backend; BackendError (a
        ValueError) when backend="kernel" cannot serve the inputs; MaskError for a non-bool mask.

    Masked keys and values are replaced by zeros before the call, so NaN/inf padding cannot leak. 16-bit inputs and
    autocast are computed in float32 (scores with |q||k| ~ 1e3 lose whole units in bf16) and cast back.
    """
    B, H, L, S, _, D = check_qkv(query, key, value, mixture=False)
    if backend not in (None, *SOFTMAX_BACKENDS):
        raise ValueError(f"backend must be None or one of {SOFTMAX_BACKENDS}, got {backend!r}")
    mask = _masks.check_mask(attn_mask, "attn_mask", B, H, L, S)
    out_dtype = query.dtype
    dt = compute_dtype(query, key, value)
    q, k, v = query.to(dt), key.to(dt), value.to(dt)
    if backend is None:
        backend = _select(q, v, mask, dropout_p)
    if backend == "explicit":
        return softmax_attention_reference(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                           dropout_p=dropout_p, scale=scale)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if backend == "kernel":
        why = _kernel_unserved(q, v, mask, dropout_p)
        if why is not None:
            raise BackendError(f"backend='kernel' cannot serve these inputs: {why}")
    with full_precision(query.device):
        if backend == "kernel":
            return _kernel(q, k, v, mask, is_causal, dropout_p, scale).to(out_dtype)
        return _sdpa(q, k, v, mask, is_causal, dropout_p, scale).to(out_dtype)


def _kernel(q, k, v, mask, is_causal, dropout_p, scale):
    """Our CPU kernel with one component and no bias; masked keys and values zeroed first (NaN padding)."""
    L, S = q.shape[2], k.shape[2]
    if L == 0 or S == 0:
        return v.new_zeros(*q.shape[:3], v.shape[-1])
    _, k, v, _, q = _masks.prepare(mask, k, v, q)
    return _mixture_flash.softmax_flash(q, k, v, key_padding=mask, is_causal=is_causal, dropout_p=dropout_p,
                                        scale=scale)


def _sdpa(q, k, v, mask, is_causal, dropout_p, scale):
    L, S = q.shape[2], k.shape[2]
    if mask is None and is_causal and L == S:
        # SDPA's own causal flag skips masked blocks; it is top-left aligned, which equals ours when L == S.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
    mask = _masks.combine(mask, is_causal, L, S, q.device)
    mask, k, v, empty, q = _masks.prepare(mask, k, v, q)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    return _masks.zero_rows(out, empty)


def softmax_attention_reference(query: Tensor, key: Tensor, value: Tensor, *, attn_mask: Tensor | None = None,
                                is_causal: bool = False, dropout_p: float = 0.0, scale: float | None = None,
                                return_weights: bool = False):
    """Explicit twin of :func:`softmax_attention` (no SDPA): builds the (B, H, L, S) weights. Used by tests and
    when weights are requested. Same arguments and conventions; returns ``out`` or ``(out, weights)``."""
    B, H, L, S, _, D = check_qkv(query, key, value, mixture=False)
    mask = _masks.check_mask(attn_mask, "attn_mask", B, H, L, S)
    dt = compute_dtype(query, key, value)
    q, k, v = query.to(dt), key.to(dt), value.to(dt)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    with full_precision(query.device):
        mask = _masks.combine(mask, is_causal, L, S, query.device)
        mask, k, v, empty, q = _masks.prepare(mask, k, v, q)
        scores = (q @ k.transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = _masks.zero_rows(torch.softmax(scores, dim=-1), empty)
        dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0.0 else weights
        out = (dropped @ v).to(query.dtype)
    return (out, weights.to(query.dtype)) if return_weights else out
