"""The algebra of MGK over a decoding cache: the entries a cache stores, the terms of a new query, and the explicit
attention over the cache (the C++ kernel where it serves), written once for every caller (:mod:`.mgk_cache`'s ops
and :class:`.mgk_state.MGKDecodeState`).

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
|k~|^2 would otherwise be recomputed from them). Hard-E (mixture="max") takes the best component instead of the
log-sum-exp and stores ``b_jr`` without log pi.

Grouped keys (gMGK: H query heads share G key groups, Ainslie et al. 2023's grouping): the cache holds the G groups'
entries (centre, variances and shifts per group) and the H / G query heads of a group are folded into its query
rows (:func:`fold_queries`), so that every path reads a group's keys and values once for all its heads; the causal
alignment then repeats with the period of the new tokens (:func:`inert`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _mixture_decode
from . import _mixture_terms as mixture_terms
from . import masks as _masks
from ._dispatch import is_transformed, pick
from ._mgk_backends import _chunks
from ._mixture_terms import query_terms

DECODE_BACKENDS = ("kernel", "explicit")  # the step's order of preference


def entries(key: Tensor, c: Tensor, terms, prior: Tensor | None) -> tuple[Tensor, Tensor]:
    """The entries' formula, the one place a cache's keys and ``b_jr`` are made
    (:func:`mgk.functional.mgk_cache_entries` after its checks, and every step, whose kernel only reads them): key
    (B, G, M, L, D), or sMGK's (B, G, L, D), centred on c (B, G, D), then :func:`._mixture_terms.scaled_keys_inv`
    and :func:`._mixture_terms.key_bias_inv` with the terms' (:class:`mgk.functional.mgk_cache.MGKStepTerms`)
    inverse variances (and shifts) and log prior ``prior`` (None: Hard-E). Operands in the terms' dtype; the caller
    holds no_grad. Few operators (four for MGK, five for sMGK): a step runs this at every token."""
    B, G, D = c.shape
    if terms.mu is not None:
        k = key - c.view(B, G, 1, D)
        return k, mixture_terms.key_bias_inv(k, terms.inv, prior, terms.mu)
    k = key - c.view(B, G, 1, 1, D)
    return mixture_terms.scaled_keys_inv(k, terms.inv_keys), mixture_terms.key_bias_inv(k, terms.inv, prior)


def fold_queries(query: Tensor, groups: int) -> Tensor:
    """(B, H, L, D) queries as (B, G, (H / G) L, D): the H / G query heads of each key group as more rows of the
    group (a view for a contiguous query), rows ordered head by head."""
    B, H, L, D = query.shape
    return query if groups == H else query.reshape(B, groups, (H // groups) * L, D)


def fold_mask(mask: Tensor | None, H: int, groups: int, L: int) -> Tensor | None:
    """A bool mask broadcastable to (B, H, L, S) as one over the folded rows (B, G, (H / G) L, S)
    (:func:`fold_queries`); a key-padding mask (one head, one row) is left as it is."""
    if mask is None or groups == H or (mask.shape[1] == 1 and mask.shape[2] == 1):
        return mask
    Bm, S = mask.shape[0], mask.shape[-1]
    return mask.expand(Bm, H, L, S).reshape(Bm, groups, (H // groups) * L, S)


def scores(q, keys, key_bias, scale, rowbias):
    """s_ijr as (B, G, M, L, S) for centred queries q (B, G, L, D) against cached entries
    (:func:`._mixture_terms.query_terms`).
    (query @ keys^T reads the cache as the transposed operand of one GEMM per head, several times faster on CPU than
    keys @ query.)"""
    if scale is None:
        s = q.unsqueeze(2) @ keys.transpose(-1, -2)  # (B, G, 1, L, D) @ (B, G, M, D, S)
    else:
        s = (q @ keys.transpose(-1, -2)).unsqueeze(2) * scale.unsqueeze(-1)
    s = s + key_bias.unsqueeze(3)
    return s if rowbias is None else s + rowbias.unsqueeze(-1)


def attend(s, v, mask, mixture, dropout_p: float):
    """The output (B, G, L, Dv) from scores s (B, G, M, L, S), values v (B, G, S, Dv) and a bool mask broadcastable
    to (B, G, L, S)."""
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


def inert(mask, kb, mixture, is_causal: bool, L: int, S: int, period: int):
    """(mask, empty rows) over L query rows: causality folded into the mask (bottom-right, repeating every
    ``period`` rows: the new tokens of each folded query head), a key whose every component has log pi = -inf masked
    (looked for first: a cache made from finite priors has none, and a step then builds no mask at all; under
    torch.compile or a torch.func transform, whose tensors have no values to read, always), and the rows that see
    no key marked (their mask opened so that the softmax stays finite; the caller zeroes them). Masked slots are
    removed by the mask alone (their scores become -inf), so the step reads the cache in place."""
    unread = torch.compiler.is_compiling() or is_transformed(kb)
    if mixture == "sum" and kb.numel() and (unread or bool(kb.amin() == float("-inf"))):
        live = (kb > float("-inf")).any(dim=2).unsqueeze(2)  # (B, G, 1, S)
        mask = live if mask is None else mask & live
    if is_causal and period > 1:  # one query at the end sees every key
        causal = _masks.causal_mask(period, S, kb.device).repeat(L // period, 1).view(1, 1, L, S)
        mask = causal if mask is None else mask & causal
    if mask is None:
        return None, None
    empty = ~mask.any(dim=-1, keepdim=True)  # (B, G, L, 1)
    return mask | empty, empty


def cached_output(q, kc, kb, v, s2, shifts, mask, mixture, *, is_causal: bool, period: int | None = None,
                  dropout_p: float = 0.0, chunk_size: int = 512, backend: str | None = None) -> Tensor:
    """MGK attention of centred queries q (B, G, L, D) over cached entries kc, kb and values v (one compute dtype)
    with variances s2 (G', M) and ``shifts`` (M, G, D) or None: the C++ kernel where it serves, else the explicit
    GEMMs in query chunks. ``period``: the new tokens of each query head when q's rows are several heads folded
    (:func:`fold_queries`; None: L). Returns (B, G, L, Dv) in q's dtype."""
    B, H, L, _ = q.shape
    S = kb.shape[-1]
    period = L if period is None else period
    scale, rowbias = query_terms(q, s2, shifts)
    # the kernel has no backward: any operand in a graph (sigma2 and shifts reach it through scale and rowbias)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, kc, kb, v, scale, rowbias))
    kernel_unserved = _mixture_decode.unserved(q, v, mask, dropout_p, needs_grad)
    name = pick(backend, DECODE_BACKENDS, lambda b, _: kernel_unserved if b == "kernel" else None)
    if name == "kernel":
        return _mixture_decode.mixture_decode(q, kc, kb, v, scale=scale, rowbias=rowbias, mask=mask,
                                              is_causal=is_causal, hard=mixture == "max", period=period)
    mask, empty = inert(mask, kb, mixture, is_causal, L, S, period)
    outs = []
    for a, b in _chunks(L, chunk_size):
        rows = _rows(mask, a, b)
        terms = None if rowbias is None else rowbias[..., a:b]
        out = attend(scores(q[:, :, a:b], kc, kb, scale, terms), v, rows, mixture, dropout_p)
        outs.append(_masks.zero_rows(out, _rows(empty, a, b)))
    if not outs:  # no new query (an empty chunk): nothing to attend from
        return q.new_zeros(B, H, 0, v.shape[-1])
    return torch.cat(outs, dim=2)
