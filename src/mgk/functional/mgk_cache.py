"""MGK attention over a decoding cache: the keys stored in the form every step reads, and the step itself.

A step of MGK (Nguyen et al. 2022, eq. 9-10) scores a new query against every cached key position j and component r:

    s_ijr = q~_i . k~_jr / sigma_r^2 + b_jr (- |q~_i|^2 / (2 sigma_r^2) when the variances differ)
    b_jr  = log pi_jr - |k~_jr|^2 / (2 sigma_r^2)

with ``q~ = q - c`` and ``k~ = k - c`` centred on the prefill's centre c (:mod:`._centre`: fixed at prefill, so a
step never re-centres the cache). The cache therefore holds what does not depend on the query:

* separate keys (MGK): ``k~_jr / sigma_r^2`` (M vectors of D per position and head) and ``b_jr`` (M scalars);
* shifted keys (sMGK, ``k_jr = k_j - mu_r``): the one unshifted ``k~_j`` (D numbers) and
  ``b_jr = log pi_jr - (|k~_j|^2 - 2 k~_j . mu_r) / (2 sigma_r^2)`` (M scalars); the shifts are applied when the
  cache is read, through the per-query term ``-(q~_i . mu_r) / sigma_r^2 - |mu_r|^2 / (2 sigma_r^2)``, so a step
  reads S * D key numbers instead of M * S * D;
* the values (Dv per position and head).

Storing ``b_jr`` costs M numbers per position and head and saves a second pass over the keys at every step (its
|k~|^2 would otherwise be recomputed from them). The step (:func:`mgk_attention_cached`) equals
:func:`mgk.functional.mgk_attention` of the uncached keys with the same centre, which is its reference in the tests;
Hard-E (mixture="max") takes the best component instead of the log-sum-exp and stores ``b_jr`` without log pi.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import _mixture_decode, _mixture_flash
from . import _mixture_terms as mixture_terms
from . import masks as _masks
from ._centre import check_centre, choose_centre
from ._checks import check_arguments, check_same, check_tensor, compute_dtype, full_precision
from ._dispatch import is_transformed, pick
from ._mgk_backends import _chunks
from ._mixture_terms import (
    check_components,
    check_log_pi,
    check_mixture_args,
    check_shifts,
    needs_qnorm,
    row_bias,
)

__all__ = ["DECODE_BACKENDS", "MGKDecodeState", "MGKStepTerms", "mgk_attention_cached", "mgk_cache_centre",
           "mgk_cache_entries", "mgk_cache_step", "mgk_step_terms", "step_terms_for"]

DECODE_BACKENDS = ("kernel", "explicit")  # the step's order of preference
# Below this many bytes of cached keys a traced step at a slot tensor takes the explicit composition, which inductor
# fuses with the rest of the graph, instead of the kernel's custom op, whose call costs more than such a step reads
# (2-core AMD EPYC VM, 2026-12-02, MGK-4 / sMGK-4 compiled against eager: whole models at batch 1, 0.1-1 MiB of keys
# per layer, 0.88-1.02x through the composition and 0.95-1.00x through the op; one layer at batch 8 and 4096 tokens,
# 33 MiB, 1.29x through the composition and 1.24x through the op; BENCHMARKS.md, "Compiled decoding").
TRACED_EXPLICIT_BYTES = 2 ** 20


def mgk_cache_entries(key: Tensor, *, centre: Tensor, log_pi: Tensor | None = None,
                      sigma2: float | Tensor | None = None, mixture: str = "sum",
                      shifts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """What a decoding cache stores for S new key positions (module docstring).

    Args:
        key: (B, H, M, S, D) the component keys (MGK); or, with ``shifts``, (B, H, S, D) the one unshifted key of
            sMGK, whose components are ``key - shifts[r]``.
        centre: (B, H, D) (or broadcastable), the prefill's :func:`mgk.functional.mgk_centre`.
        log_pi: log prior of each component broadcastable to (B, H, M, S) (default uniform); None for mixture="max".
        sigma2: variances as :func:`mgk.functional.mgk_attention`.
        mixture: "sum" or "max" (Hard-E: the bias holds no log pi).
        shifts: (M, H, D), sMGK's offsets mu_r, or None for separate keys.
    Returns:
        ``(keys, key_bias)`` in the compute dtype (float32 for 16-bit keys): keys (B, H, M, S, D) scaled by
        1 / sigma_r^2, or (B, H, S, D) centred for sMGK; key_bias (B, H, M, S). No gradient is kept.
    Raises:
        ValueError naming the argument for wrong shapes, dtypes, variances or mixture.
    """
    shifted = shifts is not None
    check_tensor(key, "key", 4 if shifted else 5, "(B, H, S, D) with shifts" if shifted else "(B, H, M, S, D)")
    check_mixture_args(mixture, log_pi)
    B, H = key.shape[:2]
    S, D = key.shape[-2], key.shape[-1]
    shifts = check_shifts(shifts, None, H, D)
    M = shifts.shape[0] if shifted else key.shape[2]
    check_components(M, "shifts" if shifted else "key")
    check_log_pi(log_pi, (B, H, M, S))
    dt = compute_dtype(key)
    with torch.no_grad(), full_precision(key.device):
        c = check_centre(centre, B, H, D, dt, key.device)
        terms = mgk_step_terms(H, M, D, sigma2=sigma2, shifts=shifts, mixture=mixture, dtype=dt, device=key.device)
        prior = None if mixture == "max" else mixture_terms.log_prior(log_pi, M, dt, key.device).expand(B, H, M, S)
        return _entries(key.detach().to(dt), c, terms, prior)


def _entries(key: Tensor, c: Tensor, terms: MGKStepTerms, prior: Tensor | None) -> tuple[Tensor, Tensor]:
    """The entries' formula, the one place a cache's keys and ``b_jr`` are made (:func:`mgk_cache_entries` after its
    checks, and every step, whose kernel only reads them): key (B, H, M, L, D), or sMGK's (B, H, L, D), centred on c
    (B, H, D), then :func:`._mixture_terms.scaled_keys_inv` and :func:`._mixture_terms.key_bias_inv` with the
    terms' inverse variances (and shifts) and log prior ``prior`` (None: Hard-E). Operands in the terms' dtype; the
    caller holds no_grad. Few operators (four for MGK, five for sMGK): a step runs this at every token."""
    B, H, D = c.shape
    if terms.mu is not None:
        k = key - c.view(B, H, 1, D)
        return k, mixture_terms.key_bias_inv(k, terms.inv, prior, terms.mu)
    k = key - c.view(B, H, 1, 1, D)
    return mixture_terms.scaled_keys_inv(k, terms.inv_keys), mixture_terms.key_bias_inv(k, terms.inv, prior)


def mgk_cache_centre(query: Tensor, centre: Tensor | None, *, key_valid: Tensor,
                     valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The centre of a decoding cache after L new tokens, and the rows whose centre it changed.

    Under causality :func:`mgk.functional.mgk_centre` takes the query of the first row that sees two keys (a row
    that sees one key returns that key's value whatever the centre), falling back to the first row that sees one.
    A cache row that has seen fewer than two real tokens therefore holds a provisional centre, which its next real
    tokens replace: this function gives every row the centre that ``mgk_centre`` would give its whole sequence, so
    that a prefill of one token (a beginning-of-sequence token, often far from the rest) followed by steps equals the
    uncached call. A row's cached entries must then be made anew with the new centre (only rows that had seen fewer
    than two real tokens change).

    Args:
        query: (B, H, L, D) the new tokens' queries.
        centre: (B, H, D) the cache's centre, or None before its first call.
        key_valid: (B, T) bool, True = a real token, over the T slots the cache holds (T = 0 before the first call).
        valid: (B, L) bool, True = a real new token, or None (all real).
    Returns:
        ``(centre, changed)``: the (B, H, D) centre (detached, query's compute dtype) and (B,) bool, True where it
        differs from the given one (every row on the first call).
    Raises:
        ValueError naming the argument for wrong shapes or dtypes.
    """
    check_tensor(query, "query", 4, "(B, H, L, D)")
    B, H, L, D = query.shape
    for name, t, width in (("key_valid", key_valid, None), ("valid", valid, L)):
        if t is not None and (not isinstance(t, Tensor) or t.dtype != torch.bool or t.dim() != 2
                              or t.shape[0] != B or (width is not None and t.shape[1] != width)):
            what = (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a bool tensor (B, {'L' if width else 'T'}) = ({B}, "
                             f"{width if width else 'T'}), got {what}")
    new = torch.ones(B, L, dtype=torch.bool, device=query.device) if valid is None else valid
    alive = torch.cat([key_valid, new], dim=1)
    chosen = choose_centre(query.to(compute_dtype(query)), alive[:, None, None, :], True, alive.shape[1])
    if centre is None:
        return chosen, torch.ones(B, dtype=torch.bool, device=query.device)
    before = key_valid.sum(dim=1)
    changed = (before < 2) & (new.sum(dim=1) > 0)  # the rule's row lies among the new tokens exactly then
    old = check_centre(centre, B, H, D, chosen.dtype, query.device)
    return torch.where(changed[:, None, None], chosen, old), changed


def _query_terms(q, s2, shifts):
    """(scale, rowbias) of the scores ``s_ijr = scale_r * (q~_i . keys_jr) + key_bias_jr + rowbias_ir`` for centred
    queries q (B, H, L, D): scale (1, H', M, 1) for sMGK's unscaled keys (1 / sigma_r^2) or None; rowbias
    (B, H, M, L), the shifts' per-query term and / or the -|q~|^2 / (2 sigma_r^2) term when it does not cancel, or
    None."""
    scale = rowbias = None
    if shifts is not None:
        scale = 1.0 / mixture_terms.per_component(s2, 1)  # (1, H', M, 1)
        mu = shifts.to(q.dtype).transpose(0, 1)  # (H, M, D)
        rowbias = -((mu @ q.transpose(-1, -2)) * scale
                    + ((mu * mu).sum(-1) * 0.5).unsqueeze(-1) * scale)  # (B, H, M, L)
    if needs_qnorm(s2):
        qnorm = row_bias(q, s2)
        rowbias = qnorm if rowbias is None else rowbias + qnorm
    return scale, rowbias


def _scores(q, keys, key_bias, scale, rowbias):
    """s_ijr as (B, H, M, L, S) for centred queries q (B, H, L, D) against cached entries (:func:`_query_terms`).
    (query @ keys^T reads the cache as the transposed operand of one GEMM per head, several times faster on CPU than
    keys @ query.)"""
    if scale is None:
        s = q.unsqueeze(2) @ keys.transpose(-1, -2)  # (B, H, 1, L, D) @ (B, H, M, D, S)
    else:
        s = (q @ keys.transpose(-1, -2)).unsqueeze(2) * scale.unsqueeze(-1)
    s = s + key_bias.unsqueeze(3)
    return s if rowbias is None else s + rowbias.unsqueeze(-1)


def _attend(s, v, mask, mixture, dropout_p: float):
    """The output (B, H, L, Dv) from scores s (B, H, M, L, S), values v (B, H, S, Dv) and a bool mask broadcastable
    to (B, H, L, S)."""
    B, H, M, L, S = s.shape
    if mixture == "max":
        s = s.amax(dim=2)
        w = torch.softmax(s if mask is None else s.masked_fill(~mask, float("-inf")), dim=-1)
        return (F.dropout(w, p=dropout_p) if dropout_p > 0.0 else w) @ v
    if mask is not None:
        s = s.masked_fill(~mask.unsqueeze(2), float("-inf"))
    # softmax_j(logsumexp_r s_ijr) is one softmax over the M * S pairs, summed over r (a view for L = 1).
    w = torch.softmax(s.permute(0, 1, 3, 2, 4).reshape(B, H, L, M * S), dim=-1)
    if dropout_p > 0.0:  # on each key's mixed weight, as the other backends
        return F.dropout(w.view(B, H, L, M, S).sum(dim=3), p=dropout_p) @ v
    # the sum over r after the value product: one GEMM of M rows per query instead of a pass over the weights
    return (w.view(B, H, L * M, S) @ v).view(B, H, L, M, v.shape[-1]).sum(dim=3)


def _rows(t: Tensor | None, a: int, b: int) -> Tensor | None:
    return t if t is None or t.shape[2] == 1 else t[:, :, a:b]


def _inert(mask, kb, mixture, is_causal: bool, L: int, S: int):
    """(mask, empty rows): causality folded into the mask, a key whose every component has log pi = -inf masked
    (looked for first: a cache made from finite priors has none, and a step then builds no mask at all; under
    torch.compile or a torch.func transform, whose tensors have no values to read, always), and the rows that see
    no key marked (their mask opened so that the softmax stays finite; the caller zeroes them). Masked slots are
    removed by the mask alone (their scores become -inf), so the step reads the cache in place."""
    unread = torch.compiler.is_compiling() or is_transformed(kb)
    if mixture == "sum" and kb.numel() and (unread or bool(kb.amin() == float("-inf"))):
        live = (kb > float("-inf")).any(dim=2).unsqueeze(2)  # (B, H, 1, S)
        mask = live if mask is None else mask & live
    mask = _masks.combine(mask, is_causal and L > 1, L, S, kb.device)  # one query at the end sees every key
    if mask is None:
        return None, None
    empty = ~mask.any(dim=-1, keepdim=True)  # (B, H, L, 1)
    return mask | empty, empty


def _check_step(query, keys, key_bias, value, shifts, mixture, attn_mask):
    check_tensor(query, "query", 4, "(B, H, L, D)")
    shifted = shifts is not None
    check_tensor(keys, "keys", 4 if shifted else 5, "(B, H, S, D) with shifts" if shifted else "(B, H, M, S, D)")
    check_tensor(value, "value", 4, "(B, H, S, Dv)")
    check_tensor(key_bias, "key_bias", 4, "(B, H, M, S)")
    B, H, L, D = query.shape
    S = keys.shape[-2]
    for name, t in (("keys", keys), ("key_bias", key_bias), ("value", value)):
        check_same("query", B, name, t.shape[0], "batch size")
        check_same("query", H, name, t.shape[1], "number of heads")
    check_same("query", D, "keys", keys.shape[-1], "head_dim")
    check_same("keys", S, "value", value.shape[2], "key length S")
    check_same("keys", S, "key_bias", key_bias.shape[-1], "key length S")
    M = key_bias.shape[2]
    check_components(M, "key_bias")
    if not shifted:
        check_same("keys", keys.shape[2], "key_bias", M, "mixture components M")
    check_mixture_args(mixture, None)
    return B, H, L, S, M, D, check_shifts(shifts, M, H, D), _masks.check_mask(attn_mask, "attn_mask", B, H, L, S)


def mgk_attention_cached(query: Tensor, keys: Tensor, key_bias: Tensor, value: Tensor, *, centre: Tensor,
                         sigma2: float | Tensor | None = None, shifts: Tensor | None = None, mixture: str = "sum",
                         attn_mask: Tensor | None = None, is_causal: bool = True, dropout_p: float = 0.0,
                         chunk_size: int = 512, backend: str | None = None) -> Tensor:
    """MGK attention of new queries over a cache of :func:`mgk_cache_entries` (a decoding step).

    Args:
        query: (B, H, L, D), the L new queries (L = 1 for one generated token).
        keys, key_bias: the cache's entries for its S positions (the new ones included), as
            :func:`mgk_cache_entries` returns them: keys (B, H, M, S, D) (or (B, H, S, D) with ``shifts``), key_bias
            (B, H, M, S).
        value: (B, H, S, Dv).
        centre: the centre the entries were made with, (B, H, D).
        sigma2, shifts, mixture: those the entries were made with.
        attn_mask: bool broadcastable to (B, H, L, S), True = may attend (empty cache slots and padding False).
            Values at slots no query may attend to must be finite (a cache stores zeros there): the step reads the
            cache in place, and a weight of exactly 0 times NaN would still be NaN.
        is_causal: bottom-right causal masking among the positions (query i sees j <= i + S - L).
        dropout_p: dropout on the mixed attention weights, in [0, 1].
        chunk_size: queries per chunk of "explicit" (memory O(chunk * M * S) per head).
        backend: None (the first of :data:`DECODE_BACKENDS` that serves), "kernel" (our C++ CPU decoding kernel,
            which reads the cache in place once; no gradient, no dropout, at most a few queries, key padding only)
            or "explicit" (GEMMs over the cache, every input).
    Returns:
        (B, H, L, Dv) in query's dtype (float32 compute for 16-bit inputs). Rows that may attend to no key are
        zero. Equals ``mgk_attention(query, k, v, log_pi=..., sigma2=..., mixture=..., attn_mask=...,
        is_causal=..., centre=centre)`` of the keys k the entries were made from.
    Raises:
        ValueError naming the argument for wrong shapes, dtypes or options; BackendError (a ValueError) naming why
        a backend asked for cannot serve the inputs; MaskError for the mask.
    """
    check_arguments(is_causal=is_causal, dropout_p=dropout_p, chunk_size=chunk_size, backend=backend,
                    backends=DECODE_BACKENDS)
    B, H, L, S, M, D, shifts, mask = _check_step(query, keys, key_bias, value, shifts, mixture, attn_mask)
    dt = compute_dtype(query, keys, value)
    with full_precision(query.device):
        c = check_centre(centre, B, H, D, dt, query.device)
        s2 = mixture_terms.variances(sigma2, H, M, D, dt, query.device)
        out = _cached_output(query.to(dt) - c.unsqueeze(2), keys.to(dt), key_bias.to(dt), value.to(dt), s2, shifts,
                             mask, mixture, is_causal=is_causal, dropout_p=dropout_p, chunk_size=chunk_size,
                             backend=backend)
    return out.to(query.dtype)


def _cached_output(q, kc, kb, v, s2, shifts, mask, mixture, *, is_causal: bool, dropout_p: float = 0.0,
                   chunk_size: int = 512, backend: str | None = None) -> Tensor:
    """:func:`mgk_attention_cached` after its checks: centred queries q (B, H, L, D) over cached entries kc, kb and
    values v (one compute dtype) with variances s2 (H', M); the C++ kernel where it serves, else the explicit GEMMs.
    Returns (B, H, L, Dv) in q's dtype."""
    B, H, L, _ = q.shape
    S = kb.shape[-1]
    scale, rowbias = _query_terms(q, s2, shifts)
    # the kernel has no backward: any operand in a graph (sigma2 and shifts reach it through scale and rowbias)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, kc, kb, v, scale, rowbias))
    kernel_unserved = _mixture_decode.unserved(q, v, mask, dropout_p, needs_grad)
    name = pick(backend, DECODE_BACKENDS, lambda b, _: kernel_unserved if b == "kernel" else None)
    if name == "kernel":
        return _mixture_decode.mixture_decode(q, kc, kb, v, scale=scale, rowbias=rowbias, mask=mask,
                                              is_causal=is_causal, hard=mixture == "max")
    mask, empty = _inert(mask, kb, mixture, is_causal, L, S)
    outs = []
    for a, b in _chunks(L, chunk_size):
        rows = _rows(mask, a, b)
        terms = None if rowbias is None else rowbias[..., a:b]
        out = _attend(_scores(q[:, :, a:b], kc, kb, scale, terms), v, rows, mixture, dropout_p)
        outs.append(_masks.zero_rows(out, _rows(empty, a, b)))
    if not outs:  # no new query (an empty chunk): nothing to attend from
        return q.new_zeros(B, H, 0, v.shape[-1])
    return torch.cat(outs, dim=2)


def mgk_cache_step(query: Tensor, key: Tensor, value: Tensor, *, keys: Tensor, key_bias: Tensor, values: Tensor,
                   slot: int | Tensor, centre: Tensor, key_valid: Tensor | None = None, log_pi: Tensor | None = None,
                   sigma2: float | Tensor | None = None, shifts: Tensor | None = None, mixture: str = "sum",
                   backend: str | None = None) -> Tensor:
    """A whole decoding step over a preallocated (static) cache: the L new tokens' entries written into the cache's
    buffers at slots ``[slot, slot + L)``, then the new queries attended over slots ``[0, slot + L)`` causally.

    It is the composition ``mgk_cache_entries(key, ...)`` copied into the buffers, then :func:`mgk_attention_cached`
    over the filled slots, with the checks and the shared terms (centre, variances, prior) made once. The entries
    always come from the one formula (:func:`._mixture_terms.key_bias`, in PyTorch); the backend chooses who writes
    them and attends: "kernel" (our C++ CPU kernel, ``csrc/mixture_decode.cpp``: one call that copies them into the
    buffers, makes the query's own terms and reads the cache in place, saving a step's small PyTorch calls, which
    at batch 1 cost more than the attention itself) or "explicit" (``copy_``, or ``index_copy_`` at a slot tensor,
    then GEMMs).

    Args:
        query: (B, H, L, D) the new queries (uncentred).
        key: the new tokens' raw key projections: (B, H, M, L, D) (MGK), or with ``shifts`` the one unshifted key
            (B, H, L, D) (sMGK).
        value: (B, H, L, Dv) the new values.
        keys, key_bias, values: the cache's buffers, (B, H, M, T, D) (or (B, H, T, D) with shifts),
            (B, H, M, T) and (B, H, T, Dv), with T >= slot + L; written in place at the new slots.
        slot: the first slot of the new tokens (the slots before it hold earlier entries made with ``centre``); or
            a (1,) int64 tensor holding it (a cache of fixed capacity,
            :meth:`mgk.attention.cache.LayerCache.fix_capacity`, whose step torch.compile traces): then
            ``key_valid`` (B, T) covers every slot (False past the new ones) and is required, L must be 1, and the
            kernel runs as the custom op ``mgk::cache_step_at``, which reads the slot on the host inside the op
            and attends to slots ``[0, slot + L)`` only (torch.compile keeps it in its graph).
        centre: (B, H, D), the cache's fixed centre (:func:`mgk_cache_centre`).
        key_valid: (B, slot + L) bool, True = a real token (padding in the cache), or None (every slot real).
        log_pi: log prior of the new tokens broadcastable to (B, H, M, L), or None (uniform; None for "max").
        sigma2, shifts, mixture: as :func:`mgk_cache_entries`.
        backend: None (the kernel where it serves: CPU float32 / float64 buffers of the query's dtype, at most a
            few queries, outside autograd, torch.compile and torch.func; with a slot tensor inside torch.compile
            too, for caches of at least :data:`TRACED_EXPLICIT_BYTES` of keys), "kernel" or "explicit".
    Returns:
        (B, H, L, Dv) in the buffers' dtype; equals :func:`mgk_attention_cached` after the composition above.
    Raises:
        ValueError naming the argument for wrong shapes, dtypes, slots or options (before anything is written);
        ValueError naming it, before anything is written, when gradients are enabled and ``key``, ``value``,
        ``log_pi``, ``sigma2``, ``shifts`` or a buffer requires grad: the entries are stored without a graph, so
        their gradients would silently be lost (decode under ``torch.no_grad()`` / ``torch.inference_mode()`` or
        detach it; a ``query`` that requires grad is fine, its gradient is exact when the backward comes before the
        next step writes the buffers; ``centre`` is read detached, the output not depending on it); BackendError
        (a ValueError) naming why a backend asked for cannot serve.
    """
    check_mixture_args(mixture, log_pi)
    _check_backend(backend)
    if _usual(query, key, value, keys, key_bias, values):  # the rest is checked by the step against the terms
        M, dt = key_bias.shape[2], keys.dtype
    else:
        M, dt = _check_step_call(query, key, value, keys, key_bias, values, shifts), compute_dtype(query, key, value,
                                                                                                     keys)
    H, D = query.shape[1], query.shape[3]
    # kept per key buffer (a decoding session) while sigma2 and shifts stay the same: a step then makes no terms
    terms = step_terms_for(keys, (dt, query.device, mixture, H, M, D, sigma2, shifts), lambda: mgk_step_terms(
        H, M, D, sigma2=sigma2, shifts=shifts, mixture=mixture, dtype=dt, device=query.device))
    return terms.step(query, key, value, keys=keys, key_bias=key_bias, values=values, slot=slot, centre=centre,
                      key_valid=key_valid, log_pi=log_pi, backend=backend)


def _usual(query, key, value, keys, key_bias, values) -> bool:
    """Whether a step's operands are tensors of one compute dtype, with the ranks :meth:`MGKStepTerms.step` checks
    in a few comparisons (its :meth:`MGKStepTerms._fits`, or else the full checks); M >= 1."""
    dt = keys.dtype if type(keys) is Tensor else None
    return (dt in (torch.float32, torch.float64) and type(query) is Tensor and type(key) is Tensor
            and type(value) is Tensor and type(key_bias) is Tensor and type(values) is Tensor
            and query.dtype is dt and key.dtype is dt and value.dtype is dt and query.dim() == 4
            and key_bias.dim() == 4 and key_bias.shape[2] >= 1)


def _check_backend(backend) -> None:
    if backend is not None and backend not in DECODE_BACKENDS:
        raise ValueError(f"backend must be None or one of {DECODE_BACKENDS}, got {backend!r}")


class MGKStepTerms:
    """What every decoding step of one layer needs besides its tokens, made once (:func:`mgk_step_terms`): the
    variances and their inverses, sMGK's shifts in the forms the entries and the C++ step read, the log prior of a
    new token when it does not depend on its position, in one compute dtype on one device.

    A step's own work is then its tokens' only (:meth:`step`: the entries of the new tokens, the writes, the
    attention): remaking these terms and re-checking the layer's parameters at every token cost about as much as a
    small step itself (2-core CPU, one layer at batch 1: 30 us of a 90 us step). A layer keeps one per cache while
    its parameters stay the same (:func:`step_terms_for`). Attributes are read-only by contract.

    Attributes:
        dtype, device: of every tensor here and of the steps' compute.
        heads, components, head_dim: H, M and D.
        mixture: "sum" or "max" (Hard-E).
        s2: (H', M) the variances (as :func:`mgk.functional.mgk_attention` reads ``sigma2``; H' = 1 or H).
        shifts: (M, H, D) sMGK's offsets as given (gradient kept), or None for separate keys.
        prior: (B', H, M, 1) log pi of every new token (B' = 1 or B), or None for Hard-E.
        inv, inv_keys: 1 / s2 as (1, H', M, 1) and (1, H', M, 1, 1); mu: shifts as (H, M, D) (the entries' operands).
    """

    __slots__ = ("dtype", "device", "heads", "components", "head_dim", "mixture", "s2", "shifts", "prior", "inv",
                 "inv_keys", "mu", "_inv_flat", "_shifts_flat", "_empty", "_no_valid", "_qnorm")

    def __init__(self, s2: Tensor, shifts: Tensor | None, prior: Tensor | None, mixture: str, heads: int,
                 head_dim: int):
        self.dtype, self.device, self.mixture = s2.dtype, s2.device, mixture
        self.heads, self.components, self.head_dim = heads, s2.shape[-1], head_dim
        self.s2, self.shifts, self.prior = s2, shifts, prior
        self.inv = mixture_terms.per_component(s2, 1).reciprocal().detach()
        self.inv_keys = self.inv.unsqueeze(-1)
        self._inv_flat = self.inv.reshape(s2.shape).contiguous()  # the C++ step's (H', M)
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self._no_valid = torch.empty(0, dtype=torch.bool, device=self.device)
        self._shifts_flat = None if shifts is None else shifts.detach().to(self.dtype).contiguous()
        self.mu = None if shifts is None else self._shifts_flat.transpose(0, 1)
        # Read once here (the terms outlive many steps). The row term cancels when the variances are equal, but
        # adding it is exact only while |q~|^2 / sigma^2 is not far larger than the scores: a converted layer's
        # queries (key_scale c, 1/c times their size) would round every score away.
        self._qnorm = needs_qnorm(s2)

    def step(self, query: Tensor, key: Tensor, value: Tensor, *, keys: Tensor, key_bias: Tensor, values: Tensor,
             slot: int | Tensor, centre: Tensor, key_valid: Tensor | None = None, log_pi: Tensor | None = None,
             backend: str | None = None) -> Tensor:
        """:func:`mgk_cache_step` with these terms: its arguments but ``sigma2``, ``shifts`` and ``mixture``, which
        the terms hold; ``log_pi`` (broadcastable to (B, H, M, L)), when given, is the new tokens' log prior in
        place of :attr:`prior` (per-position weights). The operands are checked in a few comparisons when they
        have the usual form (one dtype, the terms', buffers that own their memory), else by the full checks.

        Returns:
            (B, H, L, Dv) in the buffers' dtype.
        Raises:
            ValueError naming the argument as :func:`mgk_cache_step` (``terms`` when the operands' heads, head_dim,
            components or compute dtype are not the terms'; ``sigma2``, ``shifts`` or ``log_pi`` when gradients are
            enabled and the terms' variances, shifts or log prior require grad, as for ``key`` and ``value``);
            BackendError naming why a backend asked for cannot serve.
        """
        _check_backend(backend)
        if log_pi is not None:
            check_mixture_args(self.mixture, log_pi)
        if not self._fits(query, key, value, keys, key_bias, values):
            self._check_operands(query, key, value, keys, key_bias, values)
        B, L, T = query.shape[0], query.shape[2], values.shape[2]
        at_slot = isinstance(slot, Tensor)
        S, mask = _check_slot_args(slot, key_valid, B, L, T)
        c = self._centre(centre, B)
        prior = self._prior(log_pi, B, L)
        if torch.is_grad_enabled():  # before any write: a refused step leaves the buffers as they were
            _refuse_graph(key, value, prior, self, keys, key_bias, values)
        with full_precision(query.device):
            kernel = _step_kernel(query, key, value, keys, key_bias, values, mask, self.s2, self.shifts, backend,
                                  at_slot)
            if torch.is_grad_enabled():
                with torch.no_grad():  # the entries hold no graph (a cache is for inference)
                    new_keys, new_bias = _entries(_as(key.detach(), self.dtype), c, self, prior)
            else:
                new_keys, new_bias = _entries(_as(key, self.dtype), c, self, prior)
            if kernel:
                args = self._kernel_args(query, new_keys, new_bias, value, keys, key_bias, values, c, key_valid)
                if at_slot:
                    return _step_at_op(*args, slot, self.mixture == "max")
                try:
                    return _mixture_flash._module.decode_step(*args, slot, self.mixture == "max")
                except (RuntimeError, TypeError) as exc:  # the kernel's own bounds checks, in one line
                    raise ValueError(str(exc).splitlines()[0]) from None
            _write(new_keys, new_bias, value, keys, key_bias, values, slot)
            dt, H, D = self.dtype, self.heads, self.head_dim
            out = _cached_output(_as(query, dt) - c.view(B, H, 1, D), _as(keys.narrow(-2, 0, S), dt),
                                 _as(key_bias.narrow(-1, 0, S), dt), _as(values.narrow(2, 0, S), dt), self.s2,
                                 self.shifts, mask, self.mixture, is_causal=True, backend="explicit")
        return _as(out, keys.dtype)

    def _fits(self, query, key, value, keys, key_bias, values) -> bool:
        """Whether the operands have the usual form, in a few comparisons: tensors of the terms' dtype and sizes,
        contiguous buffers (which own their memory). Anything else goes to :meth:`_check_operands`."""
        dt = self.dtype
        if not (type(query) is Tensor and type(key) is Tensor and type(value) is Tensor and type(keys) is Tensor
                and type(key_bias) is Tensor and type(values) is Tensor):
            return False
        if not (query.dtype is dt and key.dtype is dt and value.dtype is dt and keys.dtype is dt
                and key_bias.dtype is dt and values.dtype is dt and query.dim() == 4 and values.dim() == 4):
            return False
        B, H, L, D = query.shape
        M, T, Dv = self.components, values.shape[2], values.shape[3]
        shifted = self.mu is not None
        return (H == self.heads and D == self.head_dim and value.shape == (B, H, L, Dv)
                and key.shape == ((B, H, L, D) if shifted else (B, H, M, L, D))
                and keys.shape == ((B, H, T, D) if shifted else (B, H, M, T, D)) and key_bias.shape == (B, H, M, T)
                and keys.is_contiguous() and key_bias.is_contiguous() and values.is_contiguous())

    def _check_operands(self, query, key, value, keys, key_bias, values) -> None:
        """The full checks of a step's operands (ValueError naming the argument), then their fit to the terms
        (ValueError naming ``terms``)."""
        M = _check_step_call(query, key, value, keys, key_bias, values, self.shifts)
        got = (query.shape[1], M, query.shape[3], compute_dtype(query, key, value, keys))
        want = (self.heads, self.components, self.head_dim, self.dtype)
        if got != want:
            raise ValueError(f"terms were made for (heads, components, head_dim, dtype) = {want}; this step's "
                             f"operands have {got}")

    def _centre(self, centre, B: int) -> Tensor:
        """The centre as the step reads it, (B, H, D) contiguous in the terms' dtype (a cache's own, as it is)."""
        if type(centre) is Tensor and centre.dtype is self.dtype and centre.shape == (B, self.heads, self.head_dim) \
                and not centre.requires_grad and centre.is_contiguous():
            return centre
        return check_centre(centre, B, self.heads, self.head_dim, self.dtype, self.device).contiguous()

    def _prior(self, log_pi, B: int, L: int) -> Tensor | None:
        """The new tokens' log prior: the call's ``log_pi`` (checked against (B, H, M, L)), else :attr:`prior`,
        whose batch must be 1 or B."""
        shape = (B, self.heads, self.components, L)
        if log_pi is not None:
            if type(log_pi) is Tensor and log_pi.dtype is self.dtype and log_pi.dim() == 4 and all(
                    a in (1, b) for a, b in zip(log_pi.shape, shape)):  # a layer's own prior: as it is
                return log_pi
            check_log_pi(log_pi, shape, "(B, H, M, L)")
            return mixture_terms.log_prior(log_pi, self.components, self.dtype, self.device)
        if self.prior is not None and self.prior.shape[0] not in (1, B):
            raise ValueError(f"terms hold a log prior for a batch of {self.prior.shape[0]}; this step has B = {B}")
        return self.prior

    def _kernel_args(self, query, new_keys, new_bias, value, keys, key_bias, values, c, key_valid) -> tuple:
        """The C++ ``decode_step``'s arguments but the slot and ``hard``: the new entries (made by :func:`_entries`),
        the centre and inverse variances for the query's own terms, the buffers. The |q|^2 row term is asked for
        only where it does not cancel (:func:`._mixture_terms.needs_qnorm`, read when the terms were made)."""
        valid = self._no_valid if key_valid is None else \
            key_valid if key_valid.stride(-1) == 1 else key_valid.contiguous()
        q = query if query.is_contiguous() else query.contiguous()
        if self.mu is None:
            return (q, new_keys, new_bias, value, c, self._inv_flat, self._empty, self._qnorm, keys, key_bias,
                    values, valid)
        return (q, new_keys.unsqueeze(2), new_bias, value, c, self._inv_flat, self._shifts_flat, self._qnorm,
                keys.unsqueeze(2), key_bias, values, valid)


def mgk_step_terms(num_heads: int, num_keys: int, head_dim: int, *, sigma2: float | Tensor | None = None,
                   shifts: Tensor | None = None, log_pi: Tensor | None = None, mixture: str = "sum",
                   dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> MGKStepTerms:
    """The :class:`MGKStepTerms` of a layer, checked once, for :meth:`MGKStepTerms.step`.

    Args:
        num_heads, num_keys, head_dim: H, M and D.
        sigma2, shifts, mixture: as :func:`mgk_cache_step` (shifts (M, H, D) or None).
        log_pi: the log prior of every new token, broadcastable to (B, H, M, 1) (position-independent weights), or
            None (uniform; None for "max").
        dtype: the steps' compute dtype, float32 or float64. device: default the CPU.
    Returns:
        MGKStepTerms (a graph through ``sigma2``, ``shifts`` or ``log_pi`` is kept, and a step made with grad
        enabled refuses such terms: the entries it stores keep no graph).
    Raises:
        ValueError naming the argument.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64 (a step's compute dtype), got {dtype}")
    check_components(num_keys, "num_keys")
    check_mixture_args(mixture, log_pi)
    shifts = check_shifts(shifts, num_keys, num_heads, head_dim)
    device = torch.device("cpu") if device is None else torch.device(device)
    if log_pi is not None:
        B = log_pi.shape[0] if isinstance(log_pi, Tensor) and log_pi.dim() == 4 else 1
        check_log_pi(log_pi, (B, num_heads, num_keys, 1), "(B, H, M, 1)")
    s2 = mixture_terms.variances(sigma2, num_heads, num_keys, head_dim, dtype, device)
    prior = None if mixture == "max" else mixture_terms.log_prior(log_pi, num_keys, dtype, device)
    return MGKStepTerms(s2, shifts, prior, mixture, num_heads, head_dim)


# Step terms per decoding session: per cache for a layer, per key buffer for mgk_cache_step (a new cache or buffer
# starts anew; a deleted one takes its terms along). Keyed by identity (a tensor's == is elementwise).
_TERMS_OF = WeakIdKeyDictionary()


def step_terms_for(owner, watch: tuple, make: Callable[[], MGKStepTerms]) -> MGKStepTerms:
    """The :class:`MGKStepTerms` kept for ``owner`` (a decoding cache, or a cache's key buffer) when ``watch`` is as
    it was when they were made, else ``make()``'s, kept in their place.

    ``watch`` lists what the terms are made from: tensors (the layer's parameters and buffers: the same objects at
    the same version, so that a parameter replaced, moved, cast, or changed in place by an optimiser or
    ``load_state_dict`` makes them anew) and plain values compared by equality (dtype, options, numbers). Kept
    tensors stay alive with the terms, so a new tensor never takes a kept one's address. Changes the version counter
    does not see (writes through ``.data``) are not seen: a cache is one decoding session. Nothing is kept inside
    torch.compile, torch.func transforms, forward-mode AD or dispatch modes (their tensors are not plain), for
    inference tensors (whose in-place changes are not counted), nor while a watched tensor would record a gradient
    (the terms would hold a graph that the next step's backward could not reuse)."""
    if not _mixture_flash.plain_eager():
        return make()
    grad, versions = torch.is_grad_enabled(), []
    for t in watch:
        if isinstance(t, Tensor):
            if t.is_inference() or (grad and t.requires_grad):
                return make()
            versions.append(t._version)
    kept = _TERMS_OF.get(owner)
    if kept is not None and kept[1] == versions and len(kept[0]) == len(watch) and all(
            a is b or not isinstance(a, Tensor) and not isinstance(b, Tensor) and a == b
            for a, b in zip(kept[0], watch)):
        return kept[2]
    terms = make()
    _TERMS_OF[owner] = (watch, versions, terms)
    return terms


@torch.no_grad()
def _write(new_keys, new_bias, value, keys, key_bias, values, slot) -> None:
    """The explicit step's writes: the new entries and values into the buffers at ``slot`` (an int: ``copy_`` into
    the slots from it; a (1,) slot tensor: ``index_copy_``, which a traced step keeps in its graph)."""
    if isinstance(slot, Tensor):
        keys.index_copy_(keys.dim() - 2, slot, _as(new_keys, keys.dtype))
        key_bias.index_copy_(3, slot, _as(new_bias, key_bias.dtype))
        values.index_copy_(2, slot, _as(value, values.dtype))
        return
    L = value.shape[2]
    keys.narrow(-2, slot, L).copy_(new_keys)
    key_bias.narrow(-1, slot, L).copy_(new_bias)
    values.narrow(2, slot, L).copy_(value)


def _check_slot_args(slot, key_valid, B: int, L: int, T: int) -> tuple[int, Tensor | None]:
    """The slot and key_valid of a step (ValueError naming them); returns the slots the step reads, S, and the
    key-padding mask (B, 1, 1, S) or None: ``[0, slot + L)`` for an int slot, every slot for a slot tensor."""
    if isinstance(slot, Tensor):
        _check_slot_tensor(slot, L, T, key_valid, B)
        return T, key_valid[:, None, None, :]
    _check_slot(slot, L, T)
    S = slot + L
    if key_valid is not None and (not isinstance(key_valid, Tensor) or key_valid.dtype != torch.bool
                                  or tuple(key_valid.shape) != (B, S)):
        what = (tuple(key_valid.shape), key_valid.dtype) if isinstance(key_valid, Tensor) else type(key_valid)
        raise ValueError(f"key_valid must be a bool tensor (B, slot + L) = ({B}, {S}), got {what}")
    return S, None if key_valid is None else key_valid[:, None, None, :]


def _refuse_graph(key, value, prior, terms: MGKStepTerms, keys, key_bias, values) -> None:
    """ValueError naming the first of a step's stored operands that requires grad (called with grad enabled): the
    entries are made and written without a graph and the queries attend over the buffers, so a backward would reach
    the query alone and silently drop the rest. A few flag reads: this runs at every step."""
    for name, t in (("key", key), ("value", value), ("log_pi", prior), ("sigma2", terms.s2),
                    ("shifts", terms.shifts), ("keys", keys), ("key_bias", key_bias), ("values", values)):
        if t is not None and t.requires_grad:
            raise ValueError(f"{name} requires grad: a cached MGK step stores its entries without a graph, so "
                             "gradients through them would be lost; decode under torch.no_grad() or "
                             f"torch.inference_mode(), detach {name}, or call mgk_attention (exact gradients)")


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t in ``dtype`` (itself when it is already: a step skips the call, whose overhead counts at every token)."""
    return t if t.dtype is dtype else t.to(dtype)


def _check_step_call(query, key, value, keys, key_bias, values, shifts) -> int:
    """:func:`mgk_cache_step`'s operands: ranks, sizes against each other, the shifts, buffers that own their memory
    (written in place). ValueError naming the argument; returns M."""
    shifted = shifts is not None
    check_tensor(query, "query", 4, "(B, H, L, D)")
    check_tensor(key, "key", 4 if shifted else 5, "(B, H, L, D) with shifts" if shifted else "(B, H, M, L, D)")
    check_tensor(value, "value", 4, "(B, H, L, Dv)")
    check_tensor(keys, "keys", 4 if shifted else 5, "(B, H, T, D) with shifts" if shifted else "(B, H, M, T, D)")
    check_tensor(key_bias, "key_bias", 4, "(B, H, M, T)")
    check_tensor(values, "values", 4, "(B, H, T, Dv)")
    M = _check_step_sizes(query, key, value, keys, key_bias, values, shifted)
    check_shifts(shifts, M, query.shape[1], query.shape[3])
    for name, buf in (("keys", keys), ("key_bias", key_bias), ("values", values)):
        if any(st == 0 and n > 1 for st, n in zip(buf.stride(), buf.shape)):
            raise ValueError(f"{name} must be a buffer that owns its memory (written in place), not an expanded "
                             f"view (stride 0 in {tuple(buf.stride())})")
    return M


def _check_slot(slot, L: int, T: int) -> None:
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0 or slot + L > T:
        raise ValueError(f"slot must be an int with 0 <= slot and slot + L <= T (the buffers' {T} slots) for L = {L} "
                         f"new tokens, got {slot!r}")


def _check_slot_tensor(slot: Tensor, L: int, T: int, key_valid, B: int) -> None:
    """A slot tensor's rules (a cache of fixed capacity): (1,) int64, one new token, in range (read on the host
    outside a trace), key_valid (B, T) over every slot."""
    if not (slot.dtype == torch.int64 and tuple(slot.shape) == (1,)):
        raise ValueError(f"slot must be an int or a (1,) int64 tensor, got {slot.dtype} {tuple(slot.shape)}")
    if L != 1:
        raise ValueError(f"a slot tensor takes one new token a step, got L = {L}")
    if not torch.compiler.is_compiling() and not 0 <= int(slot) <= T - L:
        raise ValueError(f"slot must be in [0, T - L] = [0, {T - L}] (the buffers' {T} slots, L = {L}), got "
                         f"{int(slot)}")
    if not (isinstance(key_valid, Tensor) and key_valid.dtype == torch.bool and tuple(key_valid.shape) == (B, T)):
        what = (tuple(key_valid.shape), key_valid.dtype) if isinstance(key_valid, Tensor) else type(key_valid)
        raise ValueError(f"key_valid must be a bool tensor (B, T) = ({B}, {T}) over every slot when slot is a "
                         f"tensor, got {what}")


def _check_step_sizes(query, key, value, keys, key_bias, values, shifted: bool) -> int:
    """The sizes of :func:`mgk_cache_step`'s operands against each other (ValueError naming the two that differ);
    returns M."""
    B, H, L, D = query.shape
    M = key_bias.shape[2]
    for name, t in (("key", key), ("value", value), ("keys", keys), ("key_bias", key_bias), ("values", values)):
        check_same("query", B, name, t.shape[0], "batch size")
        check_same("query", H, name, t.shape[1], "number of heads")
    check_same("query", L, "key", key.shape[-2], "new tokens L")
    check_same("query", L, "value", value.shape[2], "new tokens L")
    check_same("query", D, "key", key.shape[-1], "head_dim")
    check_same("query", D, "keys", keys.shape[-1], "head_dim")
    check_same("value", value.shape[-1], "values", values.shape[-1], "value size Dv")
    check_same("keys", keys.shape[-2], "key_bias", key_bias.shape[-1], "slots T")
    check_same("keys", keys.shape[-2], "values", values.shape[2], "slots T")
    if not shifted:
        check_same("key", key.shape[2], "key_bias", M, "mixture components M")
        check_same("keys", keys.shape[2], "key_bias", M, "mixture components M")
    check_components(M, "key_bias")
    return M


def _step_kernel(query, key, value, keys, key_bias, values, mask, s2, shifts, backend, at_slot: bool) -> bool:
    """Whether the C++ step serves (it writes the new entries and attends in one call): not for backend="explicit";
    BackendError naming why for backend="kernel" where it cannot. Its rules: :func:`._mixture_decode.unserved`'s,
    one dtype for every operand (the buffers' own, read and written in place, uncast), no operand in an autograd
    graph, and inside torch.compile, at a slot tensor (where it runs as the custom op :func:`_step_at_op`), caches of
    at least :data:`TRACED_EXPLICIT_BYTES` of keys unless asked for: below that the explicit composition fuses with
    the rest of the graph."""
    if backend == "explicit":
        return False
    dt = keys.dtype
    if not all(t.dtype is dt for t in (query, key, value, key_bias, values)):
        why = f"the kernel takes one dtype: the buffers are {dt}, the new tokens' tensors must be too"
    elif at_slot and backend is None and torch.compiler.is_compiling() \
            and keys.numel() * keys.element_size() < TRACED_EXPLICIT_BYTES:
        return False
    else:
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, key, value, s2, shifts))
        why = _mixture_decode.unserved(query, values, mask, 0.0, needs_grad, traced_ok=at_slot)
    if why is not None and backend is not None:
        pick(backend, DECODE_BACKENDS, lambda b, _: why)  # BackendError naming why
    return why is None


class MGKDecodeState:
    """MGK's decoding state over one layer's cache, and the choice of each call's path: the one home of the causal
    centre protocol (state in ``cache.extra``, which the cache saves, moves with :meth:`select` and crops through
    the layer's ``cache_cropped``).

    ``cache`` is duck-typed (:class:`mgk.attention.cache.LayerCache`): ``extra``, ``seen``, ``length``, ``fixed``,
    ``padded``, ``key_valid()``, ``attn_mask()``, ``append``, ``claim``, ``write_slot``, ``check_fixed_call``.

    The scores depend on q - k only, and every fast path subtracts one centre per (row, head) first
    (:mod:`._centre`). Under causality the centre is the query of the first token that sees two keys
    (:func:`mgk_cache_centre`), so a row's centre is provisional until it has seen two real tokens, and a new
    centre must remake the entries already cached for that row: at most one real token, whose uncentred key and log
    prior are kept (one slot per row, ``(B, H, M, 1, D)``, whatever the number of steps; never the keys of a row
    that stays empty). Once every row has seen two real tokens nothing is kept, and :attr:`ready_to_fix`."""

    _KEPT = ("raw_key", "raw_log_pi", "raw_slot", "raw_has")

    def __init__(self, cache):
        self.cache, self.state = cache, cache.extra

    @property
    def centre(self) -> Tensor | None:
        """(B, H, D) the centre of every row, None before the first call."""
        return self.state.get("centre")

    @property
    def ready_to_fix(self) -> bool:
        """Whether every centre is settled, so the cache may take a fixed capacity (a step over one cannot remake a
        provisional row's entries)."""
        return self.state.get("provisional") is False

    def fix_centre(self, centre: Tensor) -> None:
        """Take ``centre`` (broadcastable to (B, H, D)) as every row's centre for good, before the first call: the
        protocol is then settled (nothing provisional, nothing kept) and every call takes the fused or fixed step. A
        caller whose scores need a centre the queries must not choose (a converted layer's 0) gives it here."""
        if self.centre is not None:
            raise ValueError("fix_centre: the cache already has a centre (give it before the first call)")
        self.state["centre"] = centre.detach()
        self.state["provisional"] = False

    def forward(self, q: Tensor, base: Tensor, v: Tensor, valid: Tensor | None, *,
                terms: Callable[[], MGKStepTerms], log_pi: Callable[[], Tensor | None], per_position: bool,
                options: Callable[[], dict], prefill: Callable[..., Tensor], dropout_p: float,
                centre: Tensor | None = None) -> Tensor:
        """One cached call of an MGK layer: the fixed-capacity step, the fused step (every centre this call could
        change is settled, :meth:`settled_for`), or the centre protocol's path (the first call's uncached attention,
        or entries appended and attended explicitly).

        Args:
            q: (B, H, L, D) queries; base: the new keys (B, H, M, L, D), or sMGK's unshifted (B, H, L, D); v
                (B, H, L, Dv); valid: (B, L) bool, True = a real token, or None.
            terms: the layer's step terms (:func:`step_terms_for`); log_pi: this call's log prior, broadcastable to
                (B, H, M, L), None for Hard-E (called before any slot is claimed); per_position: whether it
                depends on the position (else the terms hold it); options: ``sigma2``, ``mixture``, ``shifts`` for
                :func:`mgk_cache_entries`; prefill(log_pi, attn_mask, centre): the first call's uncached attention;
                dropout_p: the explicit path's; centre: None (the causal protocol chooses it), or the (B, H, D)
                centre of every call, fixed at the first (:meth:`fix_centre`).
        Returns:
            (B, H, L, Dv) in v's dtype.
        Raises:
            ValueError for a fixed capacity before the centre is settled, or as the steps raise.
        """
        if centre is not None and self.centre is None:  # the first call: the prefill at that centre
            self.fix_centre(centre.to(torch.float64 if q.dtype == torch.float64 else torch.float32))
            return self._protocol_step(q, base, v, valid, log_pi(), options(), prefill, dropout_p, first=True)
        if self.cache.fixed:
            return self._fixed_step(q, base, v, valid, terms(), log_pi() if per_position else None)
        if self.settled_for(valid):
            return self._fused_step(q, base, v, valid, terms(), log_pi() if per_position else None)
        return self._protocol_step(q, base, v, valid, log_pi(), options(), prefill, dropout_p)

    def _fused_step(self, q, base, v, valid, terms: MGKStepTerms, log_pi):
        """The steady state: one fused write-and-attend call (:meth:`MGKStepTerms.step`), padding among the new
        tokens included. A padded token's entries are made from a zero key and value: finite (its inputs may be
        anything, NaN included, and a masked slot must hold finite numbers) and never attended (the valid-slot
        mask)."""
        cache = self.cache
        if valid is not None:
            B, L = valid.shape
            zero = torch.zeros((), dtype=v.dtype, device=v.device)
            base = torch.where(valid.view(B, *[1] * (base.dim() - 3), L, 1), base, zero.to(base.dtype))
            v = torch.where(valid.view(B, 1, L, 1), v, zero)
        buffers, slot = cache.claim(q.shape[2], valid)
        return terms.step(q, base, v, keys=buffers["keys"], key_bias=buffers["key_bias"], values=buffers["values"],
                          slot=slot, centre=self.centre, key_valid=cache.key_valid() if cache.padded else None,
                          log_pi=log_pi).to(v.dtype)

    def _fixed_step(self, q, base, v, valid, terms: MGKStepTerms, log_pi):
        """A step over a cache of fixed capacity: the fused step at the slot tensor (under torch.compile the C++
        kernel as a custom op, else the explicit composition over the whole capacity with the valid-slot mask)."""
        cache = self.cache
        if not self.ready_to_fix:
            raise ValueError("a cache of fixed capacity needs MGK's settled centre: fix it once every row has seen "
                             "two real tokens")
        if valid is not None:
            cache.check_fixed_call(valid, q.shape[2])  # the padding named (claim checks the rest)
        buffers, slot = cache.claim(q.shape[2])
        return terms.step(q, base, v.to(buffers["values"].dtype), keys=buffers["keys"], key_bias=buffers["key_bias"],
                          values=buffers["values"], slot=slot, centre=self.centre, key_valid=cache.key_valid(),
                          log_pi=log_pi).to(v.dtype)

    def _protocol_step(self, q, base, v, valid, log_pi, options: dict, prefill, dropout_p: float,
                       first: bool = False):
        """A call that may change a centre: take it (:meth:`update`), then the first call's uncached attention, or
        the new entries appended and attended; keep what a provisional row needs (:meth:`keep`). ``first``: the
        first call of a cache whose centre was fixed before it (:meth:`fix_centre`)."""
        cache = self.cache
        first, before = first or self.centre is None, cache.seen
        self.update(q, valid, options)
        if first:
            out = prefill(log_pi, None if valid is None else valid[:, None, None, :], self.centre)
        keys, key_bias = mgk_cache_entries(base, centre=self.centre, log_pi=log_pi, **options)
        slot = cache.length
        entries = cache.append(valid, keys=keys, key_bias=key_bias, values=v.to(keys.dtype))
        self.keep(before, slot, base, log_pi, valid)
        if first:
            return out
        return mgk_attention_cached(q, entries["keys"], entries["key_bias"], entries["values"], centre=self.centre,
                                    attn_mask=cache.attn_mask(), is_causal=True, dropout_p=dropout_p,
                                    **options).to(v.dtype)

    def settled_for(self, valid: Tensor | None) -> bool:
        """Whether a call whose new tokens are ``valid`` (B, L) bool (None: all real) leaves every centre and kept
        key as they are, so that it may take the fused step: every row has seen two real tokens, or the rows that
        have not (an empty slot of a batch, a row of one token) get only padding now. A provisional row thus costs
        the batch nothing until its own tokens come."""
        provisional = self.state.get("provisional")
        if provisional is False:
            return True
        if self.centre is None or valid is None:  # the first call; or every provisional row gets a real token
            return False
        return not bool(((self.cache.seen < 2) & valid.any(dim=1)).any())

    def update(self, q: Tensor, valid: Tensor | None, entry_options: dict) -> None:
        """Take the centre after this call's queries q (B, H, L, D) and, for rows whose centre changed, remake the
        entry of the one real token they had cached (``entry_options``: :func:`mgk_cache_entries`' sigma2, mixture,
        shifts)."""
        if not self.state.setdefault("provisional", True):
            return
        first = self.centre is None
        centre, changed = mgk_cache_centre(q, self.centre, key_valid=self.cache.key_valid(), valid=valid)
        self.state["centre"] = centre
        if first or "raw_key" not in self.state:
            return
        rows = changed & self.state["raw_has"]
        if bool(rows.any()):
            keys, key_bias = mgk_cache_entries(self.state["raw_key"], centre=centre,
                                               log_pi=self.state.get("raw_log_pi"), **entry_options)
            self.cache.write_slot(rows, self.state["raw_slot"], keys=keys, key_bias=key_bias)

    def cropped(self) -> None:
        """Put the protocol in line with a cache just cropped (its counts already cut).

        Any fixed centre is exact (it only conditions the floats), so every row keeps its centre and entries; what
        must stay consistent is which rows are provisional, each holding the raw key of its one real token. A row
        left with no real token becomes provisional with nothing kept (its next tokens choose its centre, as a new
        row's). A row left with one real token whose raw key is not kept (it had two or more) cannot be provisional,
        and a cache of fixed capacity steps with a settled centre only: then the protocol is settled as it stands
        (every centre fixed, nothing kept), exactly as if the centre had been chosen so. Re-feeding the cropped
        tokens thus rebuilds the uncropped entries."""
        if self.centre is None:
            return
        seen, state = self.cache.seen, self.state
        kept = state.get("raw_has")
        kept = None if kept is None else kept & (seen == 1)  # a kept token cropped away leaves its row empty
        lone = (seen == 1) if kept is None else (seen == 1) & ~kept
        if self.cache.fixed or bool(lone.any()):
            for name in self._KEPT:
                state.pop(name, None)
            state["provisional"] = False
        elif bool((seen < 2).any()):
            state["provisional"] = True
            if kept is not None:
                state["raw_has"] = kept

    def keep(self, before: Tensor, slot: int, base: Tensor, log_pi: Tensor | None, valid: Tensor | None) -> None:
        """After this call's entries were appended at slots ``slot`` on (``before``: the rows' real tokens before
        the call): keep the raw key (and log prior) of every row whose first real token came in this call and that
        has seen one real token only; forget everything once no row is provisional."""
        if not self.state.get("provisional", True):
            return
        seen = self.cache.seen
        if not bool((seen < 2).any()):
            for name in self._KEPT:
                self.state.pop(name, None)
            self.state["provisional"] = False
            return
        B, L = base.shape[0], base.shape[-2]
        dim = base.dim() - 2  # the slot dimension of the raw keys
        index = torch.arange(B, device=base.device)
        pos = torch.zeros(B, dtype=torch.int64, device=base.device) if valid is None else \
            valid.to(torch.int64).argmax(dim=1)  # the first real token of the call
        new = (before == 0) & (seen == 1)
        key = base.detach().movedim(dim, 1)[index, pos].unsqueeze(dim)
        prior = None if log_pi is None else \
            log_pi.detach().expand(B, base.shape[1], -1, L).movedim(3, 1)[index, pos].unsqueeze(3)
        if "raw_key" not in self.state:
            self.state.update(raw_key=torch.zeros_like(key), raw_slot=torch.zeros_like(pos),
                              raw_has=torch.zeros_like(new))
            if prior is not None:
                self.state["raw_log_pi"] = torch.zeros_like(prior)
        state = self.state
        state["raw_key"] = torch.where(new.view(-1, *[1] * (key.dim() - 1)), key, state["raw_key"])
        if prior is not None:
            state["raw_log_pi"] = torch.where(new.view(-1, 1, 1, 1), prior, state["raw_log_pi"])
        state["raw_slot"] = torch.where(new, slot + pos, state["raw_slot"])
        state["raw_has"] = (state["raw_has"] | new) & (seen < 2)


# The C++ step at a slot held in a tensor, as a custom op that mutates the cache's buffers: torch.compile keeps it in
# its graph as one opaque call (the bare C++ function cannot be traced), and the slot is read on the host inside it,
# so the traced step reads no host count and attends to the slots in use only.
@torch.library.custom_op("mgk::cache_step_at", mutates_args=("keys", "key_bias", "values"), device_types="cpu")
def _step_at_op(query: Tensor, key: Tensor, bias: Tensor, value: Tensor, centre: Tensor, inv: Tensor,
                shifts: Tensor, qnorm: bool, keys: Tensor, key_bias: Tensor, values: Tensor, valid: Tensor,
                slot: Tensor, hard: bool) -> Tensor:
    t = int(slot.reshape(-1)[0])
    used = valid if valid.numel() == 0 else valid[:, :t + query.shape[2]]
    return _mixture_flash._module.decode_step(query, key, bias, value, centre, inv, shifts, qnorm, keys, key_bias,
                                              values, used, t, hard)


@_step_at_op.register_fake
def _(query, key, bias, value, centre, inv, shifts, qnorm, keys, key_bias, values, valid, slot, hard):
    return query.new_empty((query.shape[0], query.shape[1], query.shape[2], values.shape[-1]))
