"""Scaled dot-product (softmax) attention: the baseline of the paper (Vaswani et al. 2017)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _mixture_flash
from . import masks as _masks
from ._checks import check_qkv, compute_dtype, full_precision

SOFTMAX_BACKENDS = ("sdpa", "explicit")


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
        backend: None or "sdpa" (``F.scaled_dot_product_attention``), or "explicit"
            (:func:`softmax_attention_reference`, the (B, H, L, S) weights built). Both serve every input.
    Returns:
        (B, H, L, Dv) in query's dtype. Rows that may attend to no key are exactly zero.
    Raises:
        ValueError naming the argument for wrong ranks, sizes, mixed dtypes or backend; MaskError for a non-bool
        mask.

    Masked keys and values are replaced by zeros before the call, so NaN/inf padding cannot leak. 16-bit inputs and
    autocast are computed in float32 (scores with |q||k| ~ 1e3 lose whole units in bf16) and cast back.
    """
    B, H, L, S, _, D = check_qkv(query, key, value, mixture=False)
    if backend not in (None, *SOFTMAX_BACKENDS):
        raise ValueError(f"backend must be None or one of {SOFTMAX_BACKENDS}, got {backend!r}")
    if backend == "explicit":
        return softmax_attention_reference(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                           dropout_p=dropout_p, scale=scale)
    mask = _masks.check_mask(attn_mask, "attn_mask", B, H, L, S)
    out_dtype = query.dtype
    dt = compute_dtype(query, key, value)
    q, k, v = query.to(dt), key.to(dt), value.to(dt)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    with full_precision(query.device):
        if dropout_p > 0.0 and (mask is None or mask.shape[-2] == 1) and _mixture_flash.usable(q, v, dropout_p):
            # SDPA has no fused CPU kernel with dropout (it builds the L x S weights); ours keeps O(L + S) memory.
            _, k, v, _, q = _masks.prepare(mask, k, v, q)
            out = _mixture_flash.softmax_flash(q, k, v, key_padding=mask, is_causal=is_causal, dropout_p=dropout_p,
                                               scale=scale)
            return out.to(out_dtype)
        if mask is None and is_causal and L == S:
            # SDPA's own causal flag skips masked blocks; it is top-left aligned, which equals ours when L == S.
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
            return out.to(out_dtype)
        mask = _masks.combine(mask, is_causal, L, S, query.device)
        mask, k, v, empty, q = _masks.prepare(mask, k, v, q)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        return _masks.zero_rows(out, empty).to(out_dtype)


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
