"""Attention with a float bias added to the logits, for module-level float masks (``nn.MultiheadAttention``
semantics: a float ``attn_mask`` / ``key_padding_mask`` is added to the attention logits before the softmax).

The functional core takes bool masks only, so a float mask with finite non-zero entries takes this explicit
(B, H, L, S) path. For MGK the logit of key j is ``logsumexp_r(log pi_jr - |q_i - k_jr|^2 / (2 sigma_r^2))`` (paper
eq. 9-10; the max over r for Hard-E), so adding ``b_ij`` multiplies key j's mixture weight by ``exp(b_ij)``.
Scores run in float32 (float64 for float64 inputs) with autocast off; masked content is made inert with
``torch.where`` and rows that may attend to no key are exactly zero, as in the functional core.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional import masks as _masks


def _dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _attend(logits, allowed, empty, v, bias, dropout_p, need_weights, out_dtype):
    logits = logits + bias.to(logits.dtype)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    w = _masks.zero_rows(torch.softmax(logits, dim=-1), empty)
    out = (F.dropout(w, p=dropout_p) if dropout_p > 0.0 else w) @ v.to(w.dtype)
    out = out.to(out_dtype)
    return (out, w.to(out_dtype)) if need_weights else out


def _prepared(mask, is_causal, L, S, k, v, q):
    mask = _masks.combine(mask, is_causal, L, S, q.device)
    return _masks.prepare(mask, k, v, q)


def softmax(q, k, v, mask, bias, is_causal, dropout_p, need_weights):
    """Scaled dot-product attention (Vaswani et al. 2017, eq. 1) plus ``bias`` (broadcastable to (B, H, L, S)).

    q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv); ``mask`` bool, True = may attend. Returns (B, H, L, Dv) and,
    with ``need_weights``, the (B, H, L, S) weights."""
    dt, out_dtype = _dtype(q, k, v), q.dtype
    with torch.autocast(q.device.type, enabled=False):
        allowed, k, v, empty, q = _prepared(mask, is_causal, q.shape[2], k.shape[2], k.to(dt), v.to(dt), q.to(dt))
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return _attend(logits, allowed, empty, v, bias, dropout_p, need_weights, out_dtype)


def mgk(q, k, v, log_pi, sigma2, mixture, mask, bias, is_causal, dropout_p, need_weights):
    """MGK attention (paper eq. 9-10; Hard-E for ``mixture="max"``) plus ``bias`` on the per-key logits.

    q (B, H, L, D), k (B, H, M, S, D), v (B, H, S, Dv); ``log_pi`` broadcastable to (B, H, M, S) or None (uniform);
    ``sigma2`` (M,). Returns as :func:`softmax`."""
    dt, out_dtype = _dtype(q, k, v), q.dtype
    M, S = k.shape[2], k.shape[3]
    with torch.autocast(q.device.type, enabled=False):
        allowed, k, v, empty, q = _prepared(mask, is_causal, q.shape[2], S, k.to(dt), v.to(dt), q.to(dt))
        d2 = ((q * q).sum(-1)[..., None, None] + (k * k).sum(-1).unsqueeze(2)
              - 2.0 * torch.einsum("bhld,bhmsd->bhlms", q, k)).clamp_min(0.0)
        g = d2 * (-0.5 / sigma2.to(dt).view(M, 1))  # (B, H, L, M, S)
        if mixture == "max":
            logits = g.amax(dim=-2)
        else:
            lp = torch.full((1, 1, M, 1), -math.log(M), dtype=dt, device=q.device) if log_pi is None else log_pi
            lp = lp.to(dt)
            lp = lp.reshape((1,) * (4 - lp.dim()) + tuple(lp.shape)).unsqueeze(2)
            logits = torch.logsumexp(g + lp, dim=-2)
        return _attend(logits, allowed, empty, v, bias, dropout_p, need_weights, out_dtype)
