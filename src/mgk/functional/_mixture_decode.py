"""MGK's decoding step on CPU through our C++ kernel (``csrc/mixture_decode.cpp``), which reads the cache in place.

A step is memory-bound: every cached number is read once. The GEMM form of :func:`mgk.functional.mgk_attention_cached`
reads keys and values once too, but then makes several passes over the (M, S) scores of each query (bias, mask,
softmax over M * S, sum over r) and waits on a host-side check for dead components; the kernel streams the keys
and values once and keeps one slice's scores in a per-thread buffer. Same numbers (both are tested against the
float64 formula); the kernel is part of the extension :mod:`._mixture_flash` builds, so it is there exactly when
that kernel is (``MGK_CPU_KERNEL=0`` turns both off).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _mixture_flash

# More new queries than this per step (a prefill, a long chunk) are better served by GEMMs over the query block.
MAX_QUERIES = 16


def _last_dim_contiguous(t: Tensor) -> Tensor:
    """t itself when its last dimension is contiguous (the cache's views are: read in place), else a copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def unserved(query: Tensor, value: Tensor, mask: Tensor | None, dropout_p: float, needs_grad: bool,
             traced_ok: bool = False) -> str | None:
    """Why the kernel cannot serve a step (None when it can): it takes CPU float32/float64, at most
    :data:`MAX_QUERIES` new queries, no dropout, no gradient wanted, a mask that is a key-padding mask (broadcastable
    to (B, 1, 1, S)) or none, runs outside torch.compile / torch.func / dispatch modes (they must see PyTorch
    operators; ``traced_ok``: the caller runs it as a custom op, which they see), and must be built."""
    if needs_grad:
        return "the decoding kernel has no backward, and an operand of the step is in an autograd graph"
    if dropout_p > 0.0:
        return f"dropout_p={dropout_p}: the decoding kernel takes no dropout"
    if query.shape[2] > MAX_QUERIES:
        return f"{query.shape[2]} new queries: the decoding kernel takes at most {MAX_QUERIES}"
    if query.shape[-1] == 0 or value.shape[-1] == 0:
        return "head_dim or the value size is 0"
    if mask is not None and (mask.shape[1] != 1 or mask.shape[2] != 1):
        return "attn_mask depends on the head or the query: the decoding kernel takes at most key padding"
    if not _mixture_flash.available(query):
        return f"the C++ kernel is unavailable ({_mixture_flash.build_error() or 'not loaded, or not float32/64'})"
    if not traced_ok and not _mixture_flash._eager_ok():
        return "torch.compile, torch.func and dispatch modes need PyTorch operators (backend='explicit')"
    return None


def mixture_decode(q: Tensor, keys: Tensor, key_bias: Tensor, value: Tensor, *, scale: Tensor | None,
                   rowbias: Tensor | None, mask: Tensor | None, is_causal: bool, hard: bool,
                   period: int | None = None) -> Tensor:
    """One decoding step: ``out_l = sum_j A_lj v_j / sum_j A_lj`` with ``s_lrj = scale_r (q_l . keys_jr) +
    key_bias_jr + rowbias_rl`` and ``A_lj = sum_r exp(s_lrj - m_l)`` (``hard``: ``exp(max_r s_lrj - m_l)``).

    Args: q (B, H, L, D) centred queries; keys (B, H, M, S, D), or (B, H, S, D) for sMGK's one key per position;
        key_bias (B, H, M, S); value (B, H, S, Dv): strided views of the cache's buffers are read in place; scale
        broadcastable to (1, H, M, 1) (sMGK's 1 / sigma_r^2) or None; rowbias broadcastable to (B, H, M, L) or None;
        mask bool broadcastable to (B, 1, 1, S), True = may attend, or None; is_causal bottom-right among the L new
        queries, or among each ``period`` of them (None: L) when q's rows are the query heads of a key group folded
        together (:func:`._mgk_algebra.fold_queries`); hard: Hard-E. One dtype, float32 or float64 (check
        :func:`unserved` first).
    Returns:
        (B, H, L, Dv); rows that see no key are 0.
    """
    B, H, L, _ = q.shape
    M, S = key_bias.shape[2], key_bias.shape[3]
    period = L if period is None else period
    if keys.dim() == 4:
        keys = keys.unsqueeze(2)
    empty = q.new_empty(0)
    scale = empty if scale is None else scale.reshape(-1, M).expand(H, M).contiguous()
    rowbias = empty if rowbias is None else rowbias.expand(B, H, M, L).contiguous()
    valid = q.new_empty(0, dtype=torch.bool) if mask is None else mask.expand(B, 1, 1, S)[:, 0, 0, :]
    rows = _last_dim_contiguous
    return _mixture_flash._module.decode(q.contiguous(), rows(keys), scale, rows(key_bias.expand(B, H, M, S)), rowbias,
                                         rows(value), rows(valid), bool(is_causal and period > 1), bool(hard),
                                         period)
