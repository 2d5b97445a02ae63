"""MGK's ops over a decoding cache: the entries a cache stores (:func:`mgk_cache_entries`), the centre after new tokens
(:func:`mgk_cache_centre`), attention of new queries over the entries (:func:`mgk_attention_cached`) and a whole
step over preallocated buffers (:func:`mgk_cache_step`), with the step's terms made once (:class:`MGKStepTerms`).

The formulas are :mod:`._mgk_algebra`'s (what the entries hold, and why); a layer's decoding state, which calls these
ops and keeps the causal centre protocol, is :class:`mgk.functional.MGKDecodeState`. Every op equals
:func:`mgk.functional.mgk_attention` of the uncached keys with the same centre, which is its reference in the tests.
Grouped keys (gMGK): the entries and buffers have G heads (key groups) dividing the queries' H, query head h reading
group h // (H / G); the centre, variances and shifts are then the groups'.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import _mixture_decode, _mixture_flash
from . import _mixture_terms as mixture_terms
from ._centre import check_centre, choose_centre
from ._checks import check_arguments, check_tensor, compute_dtype, full_precision
from ._dispatch import pick
from ._mgk_algebra import DECODE_BACKENDS, cached_output, entries, fold_mask, fold_queries
from ._mgk_checks import check_attention, check_backend, check_slots, check_step, refuse_graph
from ._mixture_terms import (
    check_components,
    check_log_pi,
    check_mixture_args,
    check_shifts,
    needs_qnorm,
    shifted_keys,
    to_heads,
)

__all__ = ["DECODE_BACKENDS", "MGKStepTerms", "Memo", "mgk_attention_cached", "mgk_cache_centre",
           "mgk_cache_entries", "mgk_cache_step", "mgk_step_terms", "shifted_keys", "step_terms_for", "to_heads"]

# Below this many bytes of cached keys a traced step at a slot tensor takes the explicit composition, which inductor
# fuses with the rest of the graph, instead of the kernel's custom op, whose call costs more than such a step reads
# (2-core AMD EPYC VM, 2026-12-02, MGK-4 / sMGK-4 compiled against eager: whole models at batch 1, 0.1-1 MiB of keys
# per layer, 0.88-1.02x through the composition and 0.95-1.00x through the op; one layer at batch 8 and 4096 tokens,
# 33 MiB, 1.29x through the composition and 1.24x through the op; BENCHMARKS.md, "Compiled decoding").
TRACED_EXPLICIT_BYTES = 2 ** 20


def mgk_cache_entries(key: Tensor, *, centre: Tensor, log_pi: Tensor | None = None,
                      sigma2: float | Tensor | None = None, mixture: str = "sum",
                      shifts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """What a decoding cache stores for S new key positions (:mod:`._mgk_algebra`).

    Args:
        key: (B, H, M, S, D) the component keys (MGK); or, with ``shifts``, (B, H, S, D) the one unshifted key of
            sMGK, whose components are ``key - shifts[r]``. H is the key heads (gMGK's key groups G).
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
        return entries(key.detach().to(dt), c, terms, prior)


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


def mgk_attention_cached(query: Tensor, keys: Tensor, key_bias: Tensor, value: Tensor, *, centre: Tensor,
                         sigma2: float | Tensor | None = None, shifts: Tensor | None = None, mixture: str = "sum",
                         attn_mask: Tensor | None = None, is_causal: bool = True, dropout_p: float = 0.0,
                         chunk_size: int = 512, backend: str | None = None) -> Tensor:
    """MGK attention of new queries over a cache of :func:`mgk_cache_entries` (a decoding step).

    Args:
        query: (B, H, L, D), the L new queries (L = 1 for one generated token).
        keys, key_bias: the cache's entries for its S positions (the new ones included), as
            :func:`mgk_cache_entries` returns them: keys (B, G, M, S, D) (or (B, G, S, D) with ``shifts``), key_bias
            (B, G, M, S); G = H, or G key groups dividing H (gMGK: query head h reads group h // (H / G), the H / G
            heads of a group reading its entries once).
        value: (B, G, S, Dv).
        centre: the centre the entries were made with, (B, G, D).
        sigma2, shifts, mixture: those the entries were made with (per key group: sigma2 (G, M), shifts (M, G, D)).
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
    B, H, G, L, S, M, D, shifts, mask = check_attention(query, keys, key_bias, value, shifts, mixture, attn_mask)
    dt = compute_dtype(query, keys, value)
    with full_precision(query.device):
        c = check_centre(centre, B, G, D, dt, query.device)
        s2 = mixture_terms.variances(sigma2, G, M, D, dt, query.device)
        q = fold_queries(query.to(dt), G) - c.unsqueeze(2)
        out = cached_output(q, keys.to(dt), key_bias.to(dt), value.to(dt), s2, shifts, fold_mask(mask, H, G, L),
                            mixture, is_causal=is_causal, period=L, dropout_p=dropout_p, chunk_size=chunk_size,
                            backend=backend)
    return out.reshape(B, H, L, value.shape[-1]).to(query.dtype)


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
        key: the new tokens' raw key projections: (B, G, M, L, D) (MGK), or with ``shifts`` the one unshifted key
            (B, G, L, D) (sMGK); G = H, or G key groups dividing H (gMGK, as :func:`mgk_attention_cached`).
        value: (B, G, L, Dv) the new values.
        keys, key_bias, values: the cache's buffers, (B, G, M, T, D) (or (B, G, T, D) with shifts),
            (B, G, M, T) and (B, G, T, Dv), with T >= slot + L; written in place at the new slots.
        slot: the first slot of the new tokens (the slots before it hold earlier entries made with ``centre``); or
            a (1,) int64 tensor holding it (a cache of fixed capacity,
            :meth:`mgk.attention.cache.LayerCache.fix_capacity`, whose step torch.compile traces): then
            ``key_valid`` (B, T) covers every slot (False past the new ones) and is required, L must be 1, and the
            kernel runs as the custom op ``mgk::cache_step_at``, which reads the slot on the host inside the op
            and attends to slots ``[0, slot + L)`` only (torch.compile keeps it in its graph).
        centre: (B, G, D), the cache's fixed centre (:func:`mgk_cache_centre`).
        key_valid: (B, slot + L) bool, True = a real token (padding in the cache), or None (every slot real).
        log_pi: log prior of the new tokens broadcastable to (B, G, M, L), or None (uniform; None for "max").
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
    check_backend(backend, DECODE_BACKENDS)
    if _usual(query, key, value, keys, key_bias, values):  # the rest is checked by the step against the terms
        M, dt = key_bias.shape[2], keys.dtype
    else:
        M, dt = check_step(query, key, value, keys, key_bias, values, shifts), compute_dtype(query, key, value, keys)
    G, D = keys.shape[1], query.shape[3]
    # kept per key buffer (a decoding session) while sigma2 and shifts stay the same: a step then makes no terms
    terms = step_terms_for(keys, (dt, query.device, mixture, G, M, D, sigma2, shifts), lambda: mgk_step_terms(
        G, M, D, sigma2=sigma2, shifts=shifts, mixture=mixture, dtype=dt, device=query.device))
    return terms.step(query, key, value, keys=keys, key_bias=key_bias, values=values, slot=slot, centre=centre,
                      key_valid=key_valid, log_pi=log_pi, backend=backend)


def _usual(query, key, value, keys, key_bias, values) -> bool:
    """Whether a step's operands are tensors of one compute dtype, with the ranks :meth:`MGKStepTerms.step` checks
    in a few comparisons (its :meth:`MGKStepTerms._fits`, or else the full checks); M >= 1."""
    dt = keys.dtype if type(keys) is Tensor else None
    return (dt in (torch.float32, torch.float64) and type(query) is Tensor and type(key) is Tensor
            and type(value) is Tensor and type(key_bias) is Tensor and type(values) is Tensor
            and query.dtype is dt and key.dtype is dt and value.dtype is dt and query.dim() == 4
            and key_bias.dim() == 4 and key_bias.shape[2] >= 1 and keys.dim() >= 2 and keys.shape[1] >= 1)


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
        heads, components, head_dim: the cache's heads (H, or gMGK's key groups G), M and D.
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
        check_backend(backend, DECODE_BACKENDS)
        if log_pi is not None:
            check_mixture_args(self.mixture, log_pi)
        if not self._fits(query, key, value, keys, key_bias, values):
            self._check_operands(query, key, value, keys, key_bias, values)
        B, H, L = query.shape[:3]
        G, T, Dv, at_slot = self.heads, values.shape[2], values.shape[3], isinstance(slot, Tensor)
        S, mask = check_slots(slot, key_valid, B, L, T)
        c = self._centre(centre, B)
        prior = self._prior(log_pi, B, L)
        if torch.is_grad_enabled():  # before any write: a refused step leaves the buffers as they were
            refuse_graph(key, value, prior, self, keys, key_bias, values)
        q = fold_queries(query, G)  # a group's query heads as its rows (none for MGK: G = H)
        with full_precision(query.device):
            kernel = _step_kernel(q, key, value, keys, key_bias, values, mask, self.s2, self.shifts, backend, at_slot)
            if torch.is_grad_enabled():
                with torch.no_grad():  # the entries hold no graph (a cache is for inference)
                    new_keys, new_bias = entries(_as(key.detach(), self.dtype), c, self, prior)
            else:
                new_keys, new_bias = entries(_as(key, self.dtype), c, self, prior)
            if kernel:
                args = self._kernel_args(q, new_keys, new_bias, value, keys, key_bias, values, c, key_valid)
                if at_slot:
                    return _step_at_op(*args, slot, self.mixture == "max").view(B, H, L, Dv)
                try:
                    return _mixture_flash._module.decode_step(*args, slot, self.mixture == "max").view(B, H, L, Dv)
                except (RuntimeError, TypeError) as exc:  # the kernel's own bounds checks, in one line
                    raise ValueError(str(exc).splitlines()[0]) from None
            _write(new_keys, new_bias, value, keys, key_bias, values, slot)
            dt = self.dtype
            out = cached_output(_as(q, dt) - c.unsqueeze(2), _as(keys.narrow(-2, 0, S), dt),
                                _as(key_bias.narrow(-1, 0, S), dt), _as(values.narrow(2, 0, S), dt), self.s2,
                                self.shifts, mask, self.mixture, is_causal=True, period=L, backend="explicit")
        return _as(out.reshape(B, H, L, Dv), keys.dtype)

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
        B, Hq, L, D = query.shape
        H, M, T, Dv = self.heads, self.components, values.shape[2], values.shape[3]
        shifted = self.mu is not None
        return (Hq % H == 0 and D == self.head_dim and value.shape == (B, H, L, Dv)
                and key.shape == ((B, H, L, D) if shifted else (B, H, M, L, D))
                and keys.shape == ((B, H, T, D) if shifted else (B, H, M, T, D)) and key_bias.shape == (B, H, M, T)
                and keys.is_contiguous() and key_bias.is_contiguous() and values.is_contiguous())

    def _check_operands(self, query, key, value, keys, key_bias, values) -> None:
        """The full checks of a step's operands (ValueError naming the argument), then their fit to the terms
        (ValueError naming ``terms``)."""
        M = check_step(query, key, value, keys, key_bias, values, self.shifts)
        got = (keys.shape[1], M, query.shape[3], compute_dtype(query, key, value, keys))
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
        """The C++ ``decode_step``'s arguments but the slot and ``hard``: the new entries (made by
        :func:`._mgk_algebra.entries`), the query with a group's heads folded into its rows,
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


class Memo:
    """One value kept while what it is made from stays the same: a decoding state's step terms
    (:class:`mgk.functional.MGKDecodeState`), a layer's decoding parameters, :func:`mgk_cache_step`'s terms per key
    buffer.

    :meth:`get` takes ``watch``, what the value is made from: tensors (the same objects at the same version, so that
    a parameter replaced, moved, cast, or changed in place by an optimiser or ``load_state_dict`` makes it anew)
    and plain values compared by equality (dtype, options, numbers). Kept tensors stay alive with the value, so a
    new tensor never takes a kept one's address. Changes the version counter does not see (writes through ``.data``)
    are not seen: a cache is one decoding session. Nothing is kept inside torch.compile, torch.func transforms,
    forward-mode AD or dispatch modes (their tensors are not plain), for inference tensors (whose in-place changes
    are not counted), nor while a watched tensor would record a gradient (the value would hold a graph that the next
    step's backward could not reuse)."""

    __slots__ = ("_kept",)

    def __init__(self):
        self._kept = None

    def get(self, watch: tuple, make: Callable):
        """The value kept when ``watch`` is as it was when it was made, else ``make()``'s, kept in its place."""
        if not _mixture_flash.plain_eager():
            return make()
        kept = self._kept
        if kept is not None and _same(kept[0], kept[1], watch):
            return kept[2]
        grad, versions = torch.is_grad_enabled(), []
        for t in watch:
            if isinstance(t, Tensor):
                if t.is_inference() or (grad and t.requires_grad):
                    return make()
                versions.append(t._version)
        value = make()
        self._kept = (watch, versions, value)
        return value


def _same(old: tuple, versions: list, watch: tuple) -> bool:
    """Whether ``watch`` is ``old`` (kept with the tensors' ``versions``): the same tensors at the same versions, not
    recording a gradient now, and equal plain values. A few comparisons a step: written out, no generator."""
    if len(old) != len(watch):
        return False
    grad, n = torch.is_grad_enabled(), 0
    for a, b in zip(old, watch):
        if isinstance(b, Tensor):
            if a is not b or b._version != versions[n] or (grad and b.requires_grad):
                return False
            n += 1
        elif isinstance(a, Tensor) or a != b:
            return False
    return True


# mgk_cache_step's terms per key buffer (a direct caller's decoding session has no state object to keep them): a new
# buffer starts anew, a deleted one takes its terms along. Keyed by identity (a tensor's == is elementwise).
_TERMS_OF = WeakIdKeyDictionary()


def step_terms_for(owner, watch: tuple, make: Callable[[], MGKStepTerms]) -> MGKStepTerms:
    """The :class:`MGKStepTerms` kept for ``owner`` (a cache's key buffer, by identity) when ``watch`` is as it was
    when they were made, else ``make()``'s, kept in their place (:class:`Memo`'s rules)."""
    if not _mixture_flash.plain_eager():  # before the dictionary, which torch.compile does not trace
        return make()
    memo = _TERMS_OF.get(owner)
    if memo is None:
        memo = _TERMS_OF[owner] = Memo()
    return memo.get(watch, make)


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


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t in ``dtype`` (itself when it is already: a step skips the call, whose overhead counts at every token)."""
    return t if t.dtype is dtype else t.to(dtype)


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


# The C++ step at a slot held in a tensor, as a custom op that mutates the cache's buffers: torch.compile keeps it in
# its graph as one opaque call (the bare C++ function cannot be traced), and the slot is read on the host inside it,
# so the traced step reads no host count and attends to the slots in use only.
@torch.library.custom_op("mgk::cache_step_at", mutates_args=("keys", "key_bias", "values"), device_types="cpu")
def _step_at_op(query: Tensor, key: Tensor, bias: Tensor, value: Tensor, centre: Tensor, inv: Tensor,
                shifts: Tensor, qnorm: bool, keys: Tensor, key_bias: Tensor, values: Tensor, valid: Tensor,
                slot: Tensor, hard: bool) -> Tensor:
    t = int(slot.reshape(-1)[0])
    used = valid if valid.numel() == 0 else valid[:, :t + key.shape[-2]]
    return _mixture_flash._module.decode_step(query, key, bias, value, centre, inv, shifts, qnorm, keys, key_bias,
                                              values, used, t, hard)


@_step_at_op.register_fake
def _(query, key, bias, value, centre, inv, shifts, qnorm, keys, key_bias, values, valid, slot, hard):
    return query.new_empty((query.shape[0], query.shape[1], query.shape[2], values.shape[-1]))
