"""MGK's decoding state: :class:`MGKDecodeState`, one object that owns a layer's MGK cache (entries, centre, the keys
its provisional rows keep, the step terms) and does every cached call of MGK, sMGK and gMGK in one
:meth:`~MGKDecodeState.step`: the prefill, the steps that may move a row's centre, the fused steady step and the step
of a cache of fixed capacity. The ops it calls are :mod:`.mgk_cache`'s; the formulas :mod:`._mgk_algebra`'s."""
from __future__ import annotations

import torch
from torch import Tensor

from ._centre import check_centre
from .kv_state import KVCacheState
from .mgk import mgk_attention
from .mgk_cache import (
    Memo,
    MGKStepTerms,
    mgk_attention_cached,
    mgk_cache_centre,
    mgk_cache_entries,
    mgk_step_terms,
)

__all__ = ["MGKDecodeState"]


def _compute_dtype(query: Tensor) -> torch.dtype:
    """The dtype a cache's entries are made and kept in: float64 for float64 queries, else float32."""
    return torch.float64 if query.dtype == torch.float64 else torch.float32


class MGKDecodeState(KVCacheState):
    """The decoding state of one MGK, sMGK or gMGK layer for B rows: the slot buffers of a
    :class:`mgk.functional.KVCacheState` (the entries of :func:`mgk.functional.mgk_cache_entries`: keys, the M
    per-key scalars, values), the centre every entry is made with, and the home of the causal centre protocol.

    The scores depend on q - k only, and every fast path subtracts one centre per (row, key group) first
    (:mod:`mgk.functional._centre`). Under causality the centre is the query of the first token that sees two keys
    (:func:`mgk.functional.mgk_cache_centre`; for gMGK the mean of the group's query heads, exact for all of them), so
    a row's centre is provisional until it has seen two real tokens, and a new centre must remake the entries already
    cached for that row: at most one real token, whose uncentred key and log prior are kept (one slot per row,
    whatever the number of steps; never the keys of a row that stays empty). Once every row has seen two real tokens
    nothing is kept, and :attr:`ready_to_fix`. A centre given by the caller (``step(..., centre=...)``, e.g. zeros) is
    kept as it is from the first call: never chosen nor moved.

    Args:
        slots: the buffers, name -> slot dimension: ``{"keys": 3, "key_bias": 3, "values": 2}`` for separate keys
            (B, G, M, T, D), ``"keys": 2`` for sMGK's one unshifted key (B, G, T, D).
        capacity: as :class:`mgk.functional.KVCacheState`.
        groups: G, the key groups whose entries are cached (None: those of the first call; G = H for MGK and sMGK);
            query head h reads group h // (H / G).
        layout: the name of what is stored, used in error messages only.

    Attributes (its bookkeeping, :attr:`BOOKKEEPING`, saved as ``state_dict()["extra"]``):
        centre: (B, G, D) the centre of every row, None before the first call.
        provisional: whether some row may still change its centre (None before the first call).
        raw_key, raw_log_pi, raw_slot, raw_has: a provisional row's one real token: its uncentred key, log prior,
            slot, and whether one is held (None when none is kept).
    Raises:
        ValueError naming ``capacity`` or ``groups``.
    """

    _KEPT = ("raw_key", "raw_log_pi", "raw_slot", "raw_has")
    BOOKKEEPING = ("centre", "provisional", *_KEPT)

    def __init__(self, slots: dict[str, int], capacity: int | None = None, *, groups: int | None = None,
                 layout: str = ""):
        super().__init__(slots, capacity, layout=layout)
        if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 1):
            raise ValueError(f"groups must be None or a positive int, got {groups!r}")
        self.groups = groups
        self.centre = self.provisional = None
        self.raw_key = self.raw_log_pi = self.raw_slot = self.raw_has = None
        self._terms = Memo()  # the step terms, kept while the parameters they come from stay the same

    def empty(self) -> MGKDecodeState:
        """A new state like this one (slots, groups, layout) before its first call."""
        return type(self)(self.slots, groups=self.groups, layout=self.layout)

    @property
    def shifted(self) -> bool:
        """Whether the keys are sMGK's one unshifted key per position (the shifts applied when read)."""
        return self.slots.get("keys") == 2

    @property
    def ready_to_fix(self) -> bool:
        """Whether every centre is settled, so the cache may take a fixed capacity (a step over one cannot remake a
        provisional row's entries)."""
        return self.provisional is False

    def step(self, query: Tensor, key: Tensor, value: Tensor, valid: Tensor | None = None, *,
             sigma2: float | Tensor | None = None, shifts: Tensor | None = None, prior: Tensor | None = None,
             log_pi: Tensor | None = None, mixture: str = "sum", centre: Tensor | None = None,
             dropout_p: float = 0.0, backend: str | None = None) -> Tensor:
        """One cached call of an MGK layer, whatever it is: the prefill (the uncached causal attention at the
        centre, :func:`mgk.functional.mgk_attention`, its entries kept), a call that may move a provisional row's
        centre (entries appended, then :func:`mgk.functional.mgk_attention_cached`), the fused steady step (every
        centre this call could change is settled: :meth:`settled_for`, one write-and-attend call of
        :meth:`mgk.functional.mgk_cache.MGKStepTerms.step`), or the step of a cache of fixed capacity (the same at
        the slot tensor). The entries are kept in the compute dtype (float64 for float64 queries, else float32),
        and the state casts itself to it (a model cast between two calls).

        Args:
            query: (B, H, L, D) the new queries.
            key: the new keys, (B, G, M, L, D), or sMGK's unshifted (B, G, L, D) (with ``shifts``).
            value: (B, G, L, Dv).
            valid: (B, L) bool, True = a real token (padding is stored as the entries of a zero key, never attended
                and not counted), or None: all real.
            sigma2: the key groups' variances as :func:`mgk.functional.mgk_attention` reads them (None, a float,
                (M,) or (G, M)); shifts: (M, G, D) sMGK's offsets, or None for separate keys.
            prior: the log prior of every new token when it does not depend on its position, broadcastable to
                (B, G, M, 1), kept in the step terms; log_pi: this call's tokens' own log prior (per-position
                weights), broadcastable to (B, G, M, L). Neither: uniform; both None for mixture="max".
            mixture: "sum" or "max" (Hard-E).
            centre: a fixed centre (B?, G, D) (e.g. zeros), taken at the first call and kept (never chosen); None:
                the causal protocol's.
            dropout_p: the prefill's and the protocol's calls' attention dropout (the fused step has none).
            backend: the prefill's :func:`mgk.functional.mgk_attention` backend (None: it picks).
        Returns:
            (B, H, L, Dv) in value's dtype.
        Raises:
            ValueError for a fixed capacity before the centre is settled, naming ``key`` for groups that do not
            divide the query's heads or differ from the state's, or as the ops raise.
        """
        self._check_call(query, key)
        held = self._buffers.get("values")
        if held is None or held.dtype is not _compute_dtype(query):  # a model cast between two calls
            self.cast(_compute_dtype(query))
        if self.fixed:
            return self._fixed_step(query, key, value, valid, sigma2, shifts, prior, log_pi, mixture)
        if self.settled_for(valid):
            return self._fused_step(query, key, value, valid, sigma2, shifts, prior, log_pi, mixture)
        entry = dict(sigma2=sigma2, mixture=mixture, shifts=shifts)
        return self._protocol_step(query, key, value, valid, log_pi if log_pi is not None else prior, entry, centre,
                                   dropout_p, backend)

    def _check_call(self, query: Tensor, key: Tensor) -> None:
        """The rows and groups of a call (ValueError naming ``key``), the counts started at the first."""
        B, H, G = query.shape[0], query.shape[1], key.shape[1]
        if H % G or (self.groups is not None and G != self.groups):
            raise ValueError(f"key must hold {self.groups or 'G'} key groups dividing the query's {H} heads, got {G}")
        self.groups = G
        if self.seen is None:
            self.start(B, query.device)
        elif self.batch_size != B:
            raise ValueError(f"this state holds {self.batch_size} rows; this call has {B}")

    def _terms_for(self, query: Tensor, key: Tensor, sigma2, shifts, prior, mixture) -> MGKStepTerms:
        """The step terms (:func:`mgk.functional.mgk_cache.mgk_step_terms`), kept while the variances, shifts and
        prior given are the same tensors at the same version (:class:`mgk.functional.mgk_cache.Memo`)."""
        G, D, dt = key.shape[1], key.shape[-1], _compute_dtype(query)
        M = shifts.shape[0] if shifts is not None else key.shape[2]
        return self._terms.get((dt, query.device, mixture, G, M, D, sigma2, shifts, prior), lambda: mgk_step_terms(
            G, M, D, sigma2=sigma2, shifts=shifts, log_pi=prior, mixture=mixture, dtype=dt, device=query.device))

    def _fused_step(self, q, key, v, valid, sigma2, shifts, prior, log_pi, mixture):
        """The steady state: one fused write-and-attend call (:meth:`MGKStepTerms.step`), padding among the new
        tokens included. A padded token's entries are made from a zero key and value: finite (its inputs may be
        anything, NaN included, and a masked slot must hold finite numbers) and never attended (the valid-slot
        mask)."""
        terms = self._terms_for(q, key, sigma2, shifts, prior, mixture)
        if valid is not None:
            B, L = valid.shape
            zero = torch.zeros((), dtype=v.dtype, device=v.device)
            key = torch.where(valid.view(B, *[1] * (key.dim() - 3), L, 1), key, zero.to(key.dtype))
            v = torch.where(valid.view(B, 1, L, 1), v, zero)
        buffers, slot = self.claim(q.shape[2], valid)
        return terms.step(q, key, v, keys=buffers["keys"], key_bias=buffers["key_bias"], values=buffers["values"],
                          slot=slot, centre=self.centre, key_valid=self.key_valid() if self.padded else None,
                          log_pi=log_pi).to(v.dtype)

    def _fixed_step(self, q, key, v, valid, sigma2, shifts, prior, log_pi, mixture):
        """A step over a cache of fixed capacity: the fused step at the slot tensor (under torch.compile the C++
        kernel as a custom op, else the explicit composition over the whole capacity with the valid-slot mask)."""
        if not self.ready_to_fix:
            raise ValueError("a cache of fixed capacity needs MGK's settled centre: fix it once every row has seen "
                             "two real tokens")
        if valid is not None:
            self.check_fixed_call(valid, q.shape[2])  # the padding named (claim checks the rest)
        terms = self._terms_for(q, key, sigma2, shifts, prior, mixture)
        buffers, slot = self.claim(q.shape[2])
        return terms.step(q, key, v.to(buffers["values"].dtype), keys=buffers["keys"], key_bias=buffers["key_bias"],
                          values=buffers["values"], slot=slot, centre=self.centre, key_valid=self.key_valid(),
                          log_pi=log_pi).to(v.dtype)

    def _protocol_step(self, q, key, v, valid, log_pi, entry: dict, centre, dropout_p: float, backend):
        """A call that may change a centre: take it (:meth:`update`), then the first call's uncached attention, or
        the new entries appended and attended; keep what a provisional row needs (:meth:`keep`)."""
        first, before = self.centre is None, self.seen
        self.update(q, valid, entry, centre)
        if first:
            out = self._prefill(q, key, v, valid, log_pi, entry, dropout_p, backend)
        keys, key_bias = mgk_cache_entries(key, centre=self.centre, log_pi=log_pi, **entry)
        slot = self.length
        held = self.append(valid, keys=keys, key_bias=key_bias, values=v.to(keys.dtype))
        self.keep(before, slot, key, log_pi, valid)
        if first:
            return out
        return mgk_attention_cached(q, held["keys"], held["key_bias"], held["values"], centre=self.centre,
                                    attn_mask=self.attn_mask(), is_causal=True, dropout_p=dropout_p,
                                    **entry).to(v.dtype)

    def _prefill(self, q, key, v, valid, log_pi, entry: dict, dropout_p: float, backend):
        """The first call's output: the uncached causal attention (:func:`mgk.functional.mgk_attention`) at the
        state's centre, of the compact keys (the kernel reads each group's keys, and sMGK's one key, in place)."""
        return mgk_attention(q, key, v, log_pi=log_pi, attn_mask=None if valid is None else valid[:, None, None, :],
                             is_causal=True, dropout_p=dropout_p, backend=backend, centre=self.centre, **entry)

    def settled_for(self, valid: Tensor | None) -> bool:
        """Whether a call whose new tokens are ``valid`` (B, L) bool (None: all real) leaves every centre and kept
        key as they are, so that it may take the fused step: every row has seen two real tokens, or the rows that
        have not (an empty slot of a batch, a row of one token) get only padding now. A provisional row thus costs
        the batch nothing until its own tokens come."""
        if self.provisional is False:
            return True
        if self.centre is None or valid is None:  # the first call; or every provisional row gets a real token
            return False
        return not bool(((self.seen < 2) & valid.any(dim=1)).any())

    def update(self, q: Tensor, valid: Tensor | None, entry: dict, centre: Tensor | None = None) -> None:
        """Take the centre after this call's queries q (B, H, L, D) (a fixed ``centre`` given at the first call:
        that one, settled) and, for rows whose centre changed, remake the entry of the one real token they had
        cached (``entry``: :func:`mgk.functional.mgk_cache_entries`' sigma2, mixture, shifts)."""
        if self.provisional is False:
            return
        B, H, _, D = q.shape
        G, dt = self.groups, _compute_dtype(q)
        if centre is not None and self.centre is None:
            self.centre = check_centre(centre, B, G, D, dt, q.device).contiguous()
            self.provisional = False
            return
        first, self.provisional = self.centre is None, True
        grouped = q if G == H else q.unflatten(1, (G, H // G)).mean(dim=2)  # one centre per group, among its queries
        self.centre, changed = mgk_cache_centre(grouped, self.centre, key_valid=self.key_valid(), valid=valid)
        if first or self.raw_key is None:
            return
        rows = changed & self.raw_has
        if bool(rows.any()):
            keys, key_bias = mgk_cache_entries(self.raw_key, centre=self.centre, log_pi=self.raw_log_pi, **entry)
            self.write_slot(rows, self.raw_slot, keys=keys, key_bias=key_bias)

    def keep(self, before: Tensor, slot: int, key: Tensor, log_pi: Tensor | None, valid: Tensor | None) -> None:
        """After this call's entries were appended at slots ``slot`` on (``before``: the rows' real tokens before
        the call): keep the raw key (and log prior) of every row whose first real token came in this call and that
        has seen one real token only; forget everything once no row is provisional."""
        if self.provisional is False:
            return
        seen = self.seen
        if not bool((seen < 2).any()):
            self._forget()
            return
        B, L = key.shape[0], key.shape[-2]
        dim = key.dim() - 2  # the slot dimension of the raw keys
        index = torch.arange(B, device=key.device)
        pos = torch.zeros(B, dtype=torch.int64, device=key.device) if valid is None else \
            valid.to(torch.int64).argmax(dim=1)  # the first real token of the call
        new = (before == 0) & (seen == 1)
        raw = key.detach().movedim(dim, 1)[index, pos].unsqueeze(dim)
        prior = None if log_pi is None else \
            log_pi.detach().expand(B, key.shape[1], -1, L).movedim(3, 1)[index, pos].unsqueeze(3)
        if self.raw_key is None:
            self.raw_key, self.raw_slot, self.raw_has = torch.zeros_like(raw), torch.zeros_like(pos), \
                torch.zeros_like(new)
            self.raw_log_pi = None if prior is None else torch.zeros_like(prior)
        self.raw_key = torch.where(new.view(-1, *[1] * (raw.dim() - 1)), raw, self.raw_key)
        if prior is not None:
            self.raw_log_pi = torch.where(new.view(-1, 1, 1, 1), prior, self.raw_log_pi)
        self.raw_slot = torch.where(new, slot + pos, self.raw_slot)
        self.raw_has = (self.raw_has | new) & (seen < 2)

    def _forget(self) -> None:
        """Every centre settled: nothing kept."""
        for name in self._KEPT:
            setattr(self, name, None)
        self.provisional = False

    def truncate(self, keep: int) -> None:
        """:meth:`mgk.functional.KVCacheState.truncate`, then the centre protocol put in line (:meth:`cropped`)."""
        if keep == self.length:
            return
        super().truncate(keep)
        self.cropped()

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
        seen = self.seen
        kept = None if self.raw_has is None else self.raw_has & (seen == 1)  # a kept token cropped away: row empty
        lone = (seen == 1) if kept is None else (seen == 1) & ~kept
        if self.fixed or bool(lone.any()):
            self._forget()
        elif bool((seen < 2).any()):
            self.provisional = True
            if kept is not None:
                self.raw_has = kept
