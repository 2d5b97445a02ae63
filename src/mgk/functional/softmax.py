"""Scaled dot-product (softmax) attention: the baseline of the paper (Vaswani et al. 2017), with H query heads over H
key/value heads or over G of them (grouped-query attention, Ainslie et al., EMNLP 2023; multi-query for G = 1)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _mixture_flash
from . import masks as _masks
from ._checks import check_arguments, check_qkv, compute_dtype, full_precision
from ._dispatch import BackendError, is_transformed
from .kv_state import KVCacheState

SOFTMAX_BACKENDS = ("kernel", "sdpa", "explicit")


def _expand_groups(k: Tensor, v: Tensor, H: int) -> tuple[Tensor, Tensor]:
    """Key and value of G heads (G dividing H) as H heads: query head h reads key/value head h // (H / G) (Ainslie
    et al. 2023, Section 3; Shazeer 2019 for G = 1)."""
    G = k.shape[1]
    if G == H:
        return k, v
    return k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)


def _kernel_unserved(q: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, dropout_p: float) -> str | None:
    """Why our CPU kernel cannot serve a softmax call (None when it can)."""
    if bias is not None and bias.shape[-2] != 1:  # first: its -inf entries have become a mask of its shape
        return "bias depends on the query: the kernel takes at most a per-key bias (B, H, 1, S)"
    if mask is not None and mask.shape[-2] != 1:
        return "attn_mask depends on the query: the kernel takes at most key padding plus is_causal"
    if q.device.type != "cpu":
        return f"the C++ kernel runs on CPU tensors, got {q.device.type}"
    if not _mixture_flash.usable(q, v, dropout_p):
        return ("needs float32/float64 (or 16-bit, computed in float32), head sizes >= 1, 0 <= dropout_p < 1 and "
                f"a built kernel ({_mixture_flash.build_error() or 'not loaded'})")
    return None


def _checked(query, key, value, attn_mask, bias):
    """(B, H, L, S, D, mask, bias): shapes checked, the bias finite with its -inf entries moved into the mask."""
    B, H, L, S, _, D = check_qkv(query, key, value, mixture=False, grouped=True)
    mask = _masks.check_mask(attn_mask, "attn_mask", B, H, L, S)
    mask, bias = _masks.fold_bias(mask, _masks.check_bias(bias, "bias", B, H, L, S))
    return B, H, L, S, D, mask, (None if bias is None else bias.to(compute_dtype(query, key, value)))


def select_softmax_backend(query: Tensor, key: Tensor, value: Tensor, *, attn_mask: Tensor | None = None,
                           bias: Tensor | None = None, dropout_p: float = 0.0) -> str:
    """The implementation :func:`softmax_attention` runs for these inputs when ``backend`` is None.

    * "kernel": CPU inputs with attention dropout (``dropout_p > 0``), a mask that is at most key padding and a bias
      that is at most per key: SDPA has no fused CPU kernel with dropout and builds the (L, S) weights, our kernel
      (one component; :func:`mgk.functional._mixture_flash.softmax_flash`) keeps O(L + S) memory per head;
    * "sdpa": everything else (its fused flash kernel serves CPU calls without dropout; a bias becomes its float
      ``attn_mask``).

    "explicit" (the (B, H, L, S) weights built) is used when asked for, and for forward-mode AD and torch.func
    transforms (``jvp``, ``vmap``, ``grad``), which neither fused kernel has a rule for. Arguments as
    :func:`softmax_attention`; raises as it does for bad masks and options."""
    check_arguments(dropout_p=dropout_p)
    *_, mask, bias = _checked(query, key, value, attn_mask, bias)
    dt = compute_dtype(query, key, value)
    return _select(query.to(dt), value.to(dt), mask, bias, dropout_p)


def _select(q: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, dropout_p: float) -> str:
    """select_softmax_backend on checked inputs in the compute dtype."""
    if is_transformed(q, v):
        return "explicit"
    if dropout_p > 0.0 and _kernel_unserved(q, v, mask, bias, dropout_p) is None:
        return "kernel"
    return "sdpa"


def softmax_attention(query: Tensor, key: Tensor, value: Tensor, *, attn_mask: Tensor | None = None,
                      bias: Tensor | None = None, is_causal: bool = False, dropout_p: float = 0.0,
                      scale: float | None = None, backend: str | None = None) -> Tensor:
    """Softmax attention ``softmax(q k^T / sqrt(D) + bias) v`` (Vaswani et al. 2017, eq. 1).

    Args:
        query: (B, H, L, D) floating.
        key: (B, H, S, D), same dtype as query; or (B, G, S, D) with G dividing H, grouped-query attention (Ainslie
            et al. 2023; G = 1 is multi-query attention, Shazeer 2019): query head h reads key head h // (H / G),
            served by SDPA's own grouped path (``enable_gqa``) without copying keys per query head.
        value: (B, H, S, Dv), or (B, G, S, Dv) as key.
        attn_mask: bool, broadcastable to (B, H, L, S); True = may attend (SDPA convention; float masks are refused,
            see ``bias``).
        bias: float broadcastable to (B, H, L, S), added to the logits (ALiBi, relative positions, a module's float
            mask); -inf = may not attend; differentiable.
        is_causal: causal masking aligned bottom-right (query i sees keys j <= i + S - L).
        dropout_p: dropout on the attention weights, in [0, 1] (pass 0.0 in evaluation).
        scale: score scale, a finite float > 0; default 1 / sqrt(D).
        backend: None (:func:`select_softmax_backend` picks), "kernel" (our CPU kernel, O(L + S) memory also with
            dropout; CPU, masks and bias at most per key), "sdpa" (``F.scaled_dot_product_attention``) or
            "explicit" (:func:`softmax_attention_reference`, the (B, H, L, S) weights built). "sdpa" and "explicit"
            serve every input. Dropout masks differ between backends (each draws its own); the expectation is the
            same.
    Returns:
        (B, H, L, Dv) in query's dtype. Rows that may attend to no key are exactly zero.
    Raises:
        ValueError naming the argument for wrong ranks, sizes, mixed dtypes, options out of range or backend;
        BackendError (a ValueError) when backend="kernel" cannot serve the inputs; MaskError for a non-bool mask.

    Masked keys and values are replaced by zeros before the call, so NaN/inf padding cannot leak. 16-bit inputs and
    autocast are computed in float32 (scores with |q||k| ~ 1e3 lose whole units in bf16) and cast back.
    """
    check_arguments(is_causal=is_causal, dropout_p=dropout_p, scale=scale, backend=backend,
                    backends=SOFTMAX_BACKENDS)
    B, H, L, S, D, mask, folded = _checked(query, key, value, attn_mask, bias)
    out_dtype = query.dtype
    dt = compute_dtype(query, key, value)
    q, k, v = query.to(dt), key.to(dt), value.to(dt)
    if backend is None:
        backend = _select(q, v, mask, folded, dropout_p)
    if backend == "explicit":
        return softmax_attention_reference(query, key, value, attn_mask=attn_mask, bias=bias, is_causal=is_causal,
                                           dropout_p=dropout_p, scale=scale)
    bias = folded
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if backend == "kernel":
        why = _kernel_unserved(q, v, mask, bias, dropout_p)
        if why is not None:
            raise BackendError(f"backend='kernel' cannot serve these inputs: {why}")
    with full_precision(query.device):
        if backend == "kernel":
            return _kernel(q, *_expand_groups(k, v, H), mask, bias, is_causal, dropout_p, scale).to(out_dtype)
        if mask is not None and mask.shape[1] != 1:  # a per-head mask zeroes keys per query head
            k, v = _expand_groups(k, v, H)
        return _sdpa(q, k, v, mask, bias, is_causal, dropout_p, scale).to(out_dtype)


def _kernel(q, k, v, mask, bias, is_causal, dropout_p, scale):
    """Our CPU kernel with one component; masked keys and values zeroed first (NaN padding)."""
    L, S = q.shape[2], k.shape[2]
    if L == 0 or S == 0:
        return v.new_zeros(*q.shape[:3], v.shape[-1])
    _, k, v, _, q = _masks.prepare(mask, k, v, q)
    return _mixture_flash.softmax_flash(q, k, v, key_padding=mask, bias=bias, is_causal=is_causal,
                                        dropout_p=dropout_p, scale=scale)


def _sdpa(q, k, v, mask, bias, is_causal, dropout_p, scale):
    L, S = q.shape[2], k.shape[2]
    grouped = k.shape[1] != q.shape[1]  # SDPA's own grouped-query path reads each key/value head once
    if mask is None and bias is None and is_causal and L == S:
        # SDPA's own causal flag skips masked blocks; it is top-left aligned, which equals ours when L == S.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=grouped)
    mask = _masks.combine(mask, is_causal, L, S, q.device)
    mask, k, v, empty, q = _masks.prepare(mask, k, v, q)
    attn = mask
    if bias is not None:  # as SDPA's float mask; empty rows are all-True here, so no row is all -inf
        attn = bias if mask is None else torch.where(mask, bias, torch.full((), float("-inf"), dtype=bias.dtype,
                                                                            device=bias.device))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=grouped)
    return _masks.zero_rows(out, empty)


def softmax_attention_reference(query: Tensor, key: Tensor, value: Tensor, *, attn_mask: Tensor | None = None,
                                bias: Tensor | None = None, is_causal: bool = False, dropout_p: float = 0.0,
                                scale: float | None = None, return_weights: bool = False):
    """Explicit twin of :func:`softmax_attention` (no SDPA): builds the (B, H, L, S) weights. Used by tests and
    when weights are requested. Same arguments and conventions; returns ``out`` or ``(out, weights)``."""
    check_arguments(is_causal=is_causal, dropout_p=dropout_p, scale=scale, return_weights=return_weights)
    B, H, L, S, D, mask, bias = _checked(query, key, value, attn_mask, bias)
    dt = compute_dtype(query, key, value)
    q, (k, v) = query.to(dt), _expand_groups(key.to(dt), value.to(dt), H)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    with full_precision(query.device):
        mask = _masks.combine(mask, is_causal, L, S, query.device)
        mask, k, v, empty, q = _masks.prepare(mask, k, v, q)
        scores = (q @ k.transpose(-1, -2)) * scale
        if bias is not None:
            scores = scores + bias.to(dt)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = _masks.zero_rows(torch.softmax(scores, dim=-1), empty)
        dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0.0 else weights
        out = (dropped @ v).to(query.dtype)
    return (out, weights.to(query.dtype)) if return_weights else out


def _grouped_step(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """SDPA of queries (B, G, R, D) over keys / values (B, G, S, D) with a key-padding mask broadcastable to
    (B, 1, 1, S) or None; rows that see no key are zero."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    empty = ~mask.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty, scale=scale)
    return _masks.zero_rows(out, empty)


def softmax_attention_cached(query: Tensor, key: Tensor, value: Tensor, *, attn_mask: Tensor | None = None,
                             is_causal: bool = True, dropout_p: float = 0.0, scale: float | None = None) -> Tensor:
    """Softmax attention of new queries over a decoding cache, read in place (a decoding step of a softmax or GQA
    layer's :class:`mgk.attention.cache.LayerCache`): :func:`softmax_attention` through SDPA, except that keys and
    values at slots no query may attend to must be finite (a cache stores zeros there), so they are not copied to be
    zeroed.

    Args: query (B, H, L, D), the L new queries; key (B, H, S, D) and value (B, H, S, Dv) (or G heads dividing H,
        as :func:`softmax_attention`), the cache's slots in use
        (the new ones included); attn_mask bool broadcastable to (B, H, L, S), True = may attend; is_causal
        bottom-right (a no-op for L = 1: the last query sees every key); dropout_p, scale as
        :func:`softmax_attention`.
    Returns: (B, H, L, Dv) in query's dtype; rows that may attend to no key are zero.
    Raises: as :func:`softmax_attention`."""
    check_arguments(is_causal=is_causal, dropout_p=dropout_p, scale=scale)
    *_, mask, _ = _checked(query, key, value, attn_mask, None)
    return _attend_cache(query, key, value, mask, is_causal, dropout_p, scale)


def _attend_cache(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, is_causal: bool, dropout_p: float,
                  scale: float | None) -> Tensor:
    """:func:`softmax_attention_cached` on operands already checked (``mask`` 4D bool or None): its public entry and
    :func:`softmax_cache_step`, which checks before the state is written and would otherwise check twice a step."""
    B, H, L, D = query.shape
    S = key.shape[2]
    dt = compute_dtype(query, key, value)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    with full_precision(query.device):
        q, k, v = query.to(dt), key.to(dt), value.to(dt)
        grouped = k.shape[1] != H
        causal = is_causal and L > 1
        if grouped and L == 1 and (mask is None or (mask.shape[1] == 1 and mask.shape[2] == 1)) and dropout_p == 0:
            # One new token: the H / G query heads of a group read the same keys, so they are G heads of H / G
            # queries each (the cache is read once per group, never expanded to H heads).
            G = k.shape[1]
            out = _grouped_step(q.view(B, G, H // G, D), k, v, mask, scale)
            return out.view(B, H, 1, v.shape[-1]).to(query.dtype)
        if mask is None and (not causal or L == S):  # SDPA's causal flag is top-left: ours when L == S
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                                  enable_gqa=grouped).to(query.dtype)
        mask = _masks.combine(mask, causal, L, S, query.device)
        empty = ~mask.any(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty, dropout_p=dropout_p, scale=scale,
                                             enable_gqa=grouped)
        return _masks.zero_rows(out, empty).to(query.dtype)


def softmax_cache_step(query: Tensor, key: Tensor, value: Tensor, state: KVCacheState, *,
                       valid: Tensor | None = None, dropout_p: float = 0.0, scale: float | None = None) -> Tensor:
    """One cached call of softmax or GQA attention: the L new keys and values are appended to ``state`` (slots
    ``keys`` and ``values`` along dim 2; padded tokens stored as zeros, never attended and not counted) and the L
    new queries attend, causally and bottom-right aligned, over every token the state holds and themselves
    (:func:`softmax_attention_cached`, the cache read in place). The first call is the prefill (any L), later ones a
    token or a few; a state of fixed capacity (:meth:`KVCacheState.fix_capacity`) takes one real token per call and
    reads its whole capacity with the valid-slot mask.

    Args:
        query: (B, H, L, D), the new queries.
        key: (B, G, L, D) and value: (B, G, L, Dv), the new keys and values (G = H, or G key/value heads dividing H:
            grouped-query attention).
        state: a :class:`KVCacheState` with slots ``{"keys": 2, "values": 2}``, updated in place; a new one is
            started for B rows on query's device.
        valid: (B, L) bool, True = a real token (left padding of prompts of different lengths), or None: all real.
        dropout_p, scale: as :func:`softmax_attention`.
    Returns:
        (B, H, L, Dv) in query's dtype; a query whose row holds no real token yet gives zeros.
    Raises:
        ValueError naming ``query``, ``key`` or ``value`` for a rank other than 4, ``key`` / ``value`` / ``valid``
        for a batch or length other than query's, ``valid`` not bool, ``state`` for another object or slots or a
        state started for another batch; otherwise as :meth:`KVCacheState.append` and
        :func:`softmax_attention_cached`; ValueError naming ``key`` or ``value`` when gradients are enabled and it
        requires grad (the state keeps no graph, so its gradient would silently be lost: decode under
        ``torch.no_grad()`` / ``torch.inference_mode()`` or detach it; a ``query`` that requires grad is fine, its
        gradient is exact when the backward comes before the next call writes the buffers it read). A refused call
        leaves ``state`` as it was.
    """
    if not isinstance(state, KVCacheState) or state.slots != {"keys": 2, "values": 2}:
        got = state.slots if isinstance(state, KVCacheState) else type(state).__name__
        raise ValueError(f"state must be a KVCacheState with slots {{'keys': 2, 'values': 2}}, got {got}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, heads, L, D), got shape {tuple(t.shape)}")
    B, L = query.shape[0], query.shape[2]
    for name, t in (("key", key), ("value", value)):
        if t.shape[0] != B or t.shape[2] != L:
            raise ValueError(f"{name} must have query's batch and length ({B}, {L}) as dims 0 and 2, got shape "
                             f"{tuple(t.shape)}")
    if valid is not None and (not isinstance(valid, Tensor) or valid.dtype != torch.bool
                              or tuple(valid.shape) != (B, L)):
        got = (tuple(valid.shape), valid.dtype) if isinstance(valid, Tensor) else type(valid).__name__
        raise ValueError(f"valid must be (B, L) = {(B, L)} bool, got {got}")
    # checked before the state is written: a refused call leaves it as it was (a retry would store the keys twice)
    check_arguments(dropout_p=dropout_p, scale=scale)
    check_qkv(query, key, value, mixture=False, grouped=True)
    if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
        # The state stores detached copies, and the queries attend over those: a graph would reach the query only.
        name = "key" if key.requires_grad else "value"
        raise ValueError(f"{name} requires grad: softmax_cache_step stores keys and values without their graph, so "
                         "their gradients would be lost; decode under torch.no_grad() or torch.inference_mode(), "
                         f"pass {name}.detach(), or call softmax_attention (exact gradients)")
    if state.seen is None:
        state.start(B, query.device)
    elif state.seen.shape[0] != B:
        raise ValueError(f"state holds {state.seen.shape[0]} rows; this call has {B}")
    entries = state.append(valid, keys=key, values=value)
    # the entries are the state's, checked on the way in; its mask is (B, 1, 1, T) bool
    return _attend_cache(query, entries["keys"], entries["values"], state.attn_mask(), True, dropout_p, scale)
