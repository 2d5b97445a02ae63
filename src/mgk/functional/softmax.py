"""Scaled dot-product (softmax) attention: the baseline of the paper (Vaswani et al. 2017)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _mixture_flash
from . import masks as _masks
from ._checks import check_same, check_tensor, compute_dtype, full_precision


def softmax_attention(query: Tensor, key: Tensor, value: Tensor, *, attn_mask: Tensor | None = None,
                      is_causal: bool = False, dropout_p: float = 0.0, scale: float | None = None) -> Tensor:
    """Softmax attention ``softmax(q k^T / sqrt(D)) v`` through ``F.scaled_dot_product_attention``.

    Args:
        query: (B, H, L, D) floating.
        key: (B, H, S, D), same dtype as query.
        value: (B, H, S, Dv).
        attn_mask: bool, broadcastable to (B, H, L, S); True = may attend (SDPA convention).
        is_causal: causal masking aligned bottom-right (query i sees keys j <= i + S - L).
        dropout_p: dropout on the attention weights (pass 0.0 in evaluation).
        scale: score scale, default 1 / sqrt(D).
    Returns:
        (B, H, L, Dv) in query's dtype. Rows that may attend to no key are exactly zero.
    Raises:
        ValueError naming the argument for wrong ranks, sizes or dtypes; MaskError for a non-bool mask.

    Masked keys and values are replaced by zeros before the call, so NaN/inf padding cannot leak. 16-bit inputs and
    autocast are computed in float32 (scores with |q||k| ~ 1e3 lose whole units in bf16) and cast back.
    """
    check_tensor(query, "query", 4, "(B, H, L, D)")
    check_tensor(key, "key", 4, "(B, H, S, D)")
    check_tensor(value, "value", 4, "(B, H, S, Dv)")
    B, H, L, D = query.shape
    S = key.shape[2]
    check_same("query", B, "key", key.shape[0], "batch size")
    check_same("query", H, "key", key.shape[1], "number of heads")
    check_same("query", D, "key", key.shape[3], "head_dim")
    check_same("key", S, "value", value.shape[2], "key length S")
    check_same("key", B, "value", value.shape[0], "batch size")
    check_same("key", H, "value", value.shape[1], "number of heads")
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
    B, H, L, D = query.shape
    S = key.shape[2]
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
