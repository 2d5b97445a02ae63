"""The protocol every decoding state keeps, written once: :class:`DecodingState`.

Each attention kind's decoding state is one object beside its op that owns its tensors and does a whole cached call
(a prefill of any length, then steps): :class:`mgk.functional.KVCacheState` for softmax and GQA
(:func:`mgk.functional.softmax_cache_step`), :class:`mgk.functional.MGKDecodeState` for MGK, sMGK and gMGK,
:class:`mgk.functional.LinearCacheState` for linear attention and MLK. Whatever it holds, a state answers the same
small protocol, which is all a layer's holder (:class:`mgk.attention.cache.LayerCache`) and the callers above it
(beam search, assisted decoding, saving a prompt's cache, a model cast) ever use:

* rows: :meth:`~DecodingState.select`, :meth:`~DecodingState.reorder`, :meth:`~DecodingState.repeat_interleave`
  (checked by :meth:`~DecodingState.check_rows`, then :meth:`move_rows`), every per-row tensor moving with its row;
* lengths: ``crop`` (``check_crop``, then ``truncate``), ``length``, ``seen``, ``positions``;
* ``cast(dtype)`` after a model cast between two calls;
* sizes: ``nbytes`` (what attention reads), ``allocated_bytes``, :meth:`~DecodingState.extra_bytes` (bookkeeping);
* saving: ``state_dict`` / ``load_state_dict`` (``check_load`` first), plain tensors and ints for
  ``torch.load(..., weights_only=True)``.

A state's own bookkeeping (MGK's centre and the keys its provisional rows keep) is a set of attributes named in
:attr:`DecodingState.BOOKKEEPING`: each a tensor with the B rows as dim 0, a plain value (bool, int) or None. This
base moves, casts, saves, loads and counts them, so a kind that keeps bookkeeping declares it and writes none of that.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DecodingState", "cast_floating", "plain"]


def plain(value, name: str):
    """A value of a cache's state dict as what ``torch.load(weights_only=True)`` reads back (a tensor cloned);
    TypeError naming it otherwise."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"the cache's {name} holds a {type(value).__name__}, which state_dict() cannot save")


def cast_floating(held: dict, dtype: torch.dtype) -> None:
    """Convert, in the dict ``held``, every floating tensor of another dtype than ``dtype`` (integer and bool
    tensors kept; written only where a dtype differs, so a traced step writes nothing)."""
    for name, t in list(held.items()):
        if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != dtype:
            held[name] = t.to(dtype)


class DecodingState:
    """The protocol of a decoding state (module docstring): rows, bookkeeping and its saving, written once.

    A subclass holds ``seen`` ((B,) int64 real tokens per row, None before its first call) and implements
    :meth:`move_rows` (calling this base's to move the bookkeeping), ``cast``, ``crop``, ``nbytes`` and the saving
    methods; everything else here is shared.

    Attributes:
        BOOKKEEPING: names of the attributes that hold the state's bookkeeping (per-row tensors, rows as dim 0;
            plain values; None when unset), saved as ``state_dict()["extra"]``. Empty here.
    """

    BOOKKEEPING: tuple[str, ...] = ()
    seen: Tensor | None = None

    @property
    def batch_size(self) -> int | None:
        """B, once the first call has been made."""
        return None if self.seen is None else self.seen.shape[0]

    @property
    def ready_to_fix(self) -> bool:
        """Whether the state may now take a fixed capacity (the static cache a compiled step runs over): once it
        has had its first call. A state that settles later says so (MGK: once its centre is settled)."""
        return self.seen is not None

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def bookkeeping(self) -> dict:
        """The bookkeeping that is set, name -> tensor or plain value (:attr:`BOOKKEEPING`; empty before the first
        call): what ``state_dict()["extra"]`` saves."""
        return {name: getattr(self, name) for name in self.BOOKKEEPING if getattr(self, name) is not None}

    def extra_bytes(self) -> int:
        """Bytes of the bookkeeping tensors (not counted in ``nbytes``: attention does not read them)."""
        return sum(t.numel() * t.element_size() for t in self.bookkeeping().values() if isinstance(t, Tensor))

    def _cast_bookkeeping(self, dtype: torch.dtype) -> None:
        """The floating bookkeeping tensors converted to ``dtype`` (integer and bool ones kept)."""
        for name in self.BOOKKEEPING:  # written only where a dtype differs (a traced step: nothing)
            t = getattr(self, name)
            if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != dtype:
                setattr(self, name, t.to(dtype))

    def _saved_bookkeeping(self) -> dict:
        """The bookkeeping as plain values for a state dict (tensors cloned)."""
        return {name: plain(value, f"extra[{name!r}]") for name, value in self.bookkeeping().items()}

    def _check_bookkeeping(self, extra) -> None:
        """ValueError naming ``state_dict`` unless ``extra`` is a dict of this state's bookkeeping names."""
        unknown = sorted(set(extra) - set(self.BOOKKEEPING)) if isinstance(extra, dict) else None
        if unknown is None or unknown:
            got = unknown if unknown else type(extra).__name__
            raise ValueError(f"state_dict's extra holds {got}, which a {type(self).__name__} does not keep (it keeps "
                             f"{list(self.BOOKKEEPING) or 'nothing'})")

    def _load_bookkeeping(self, extra: dict) -> None:
        """Set every bookkeeping attribute from a saved ``extra`` (None where it holds none)."""
        for name in self.BOOKKEEPING:
            setattr(self, name, extra.get(name))

    # -- rows (beam search, assisted decoding) ---------------------------------------------------------------------
    def select(self, index: Tensor) -> None:
        """Keep the rows ``index`` of the batch, in that order: row i becomes row ``index[i]`` of the old state
        (beam search's ``beam_idx``; a row may come several times or not at all, and B' may differ from B). Every
        per-row tensor moves with its row (:meth:`move_rows`); before the first call there is nothing to move.

        Args:
            index: (B',) integer tensor (int64 as beam search gives it), values in [0, B), on any device.
        Raises:
            ValueError naming ``index`` for another type, dtype, rank, an empty index or a row out of range;
            ValueError naming ``extra`` for a bookkeeping tensor without the B rows as dim 0 (a kind's bug).
        """
        self.move_rows(self.check_rows(index))

    def reorder(self, index: Tensor) -> None:
        """:meth:`select` keeping the number of rows (``index`` (B,): beam search's ``beam_idx``, repeats allowed).
        ValueError naming ``index`` for another length, or as :meth:`select`."""
        self.move_rows(self.check_rows(index, same_size=True))

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place, each copy next to its row (``torch.repeat_interleave`` on the
        batch: B rows become B * repeats). ValueError naming ``repeats`` unless it is a positive int."""
        rows = self.repeated_rows(repeats)
        if rows is not None:
            self.move_rows(self.check_rows(rows))

    def repeated_rows(self, repeats: int) -> Tensor | None:
        """The rows of :meth:`repeat_interleave` (None before the first call), ``repeats`` checked."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        if self.seen is None:
            return None
        return torch.arange(self.batch_size, device=self.seen.device).repeat_interleave(repeats)

    def check_rows(self, index, *, same_size: bool = False) -> Tensor | None:
        """``index`` as int64 on the state's device (None before the first call), checked (:meth:`select`)."""
        if (not isinstance(index, Tensor) or index.dim() != 1 or index.numel() == 0 or index.dtype == torch.bool
                or index.is_floating_point() or index.is_complex()):
            got = (tuple(index.shape), index.dtype) if isinstance(index, Tensor) else type(index).__name__
            raise ValueError(f"index must be a non-empty 1-D integer tensor of rows (B',), got {got}")
        B = self.batch_size
        if B is None:
            return None
        if same_size and index.shape[0] != B:
            raise ValueError(f"index must have one entry per row ({B}) to reorder, got {index.shape[0]}; select() "
                             "changes the number of rows")
        bad = sorted(name for name, t in self.bookkeeping().items() if isinstance(t, Tensor)
                     and (t.dim() == 0 or t.shape[0] != B))
        if bad:
            raise ValueError(f"the bookkeeping (extra) {bad} of this {type(self).__name__} lacks the batch's {B} rows "
                             "as dim 0: a kind's bookkeeping tensors are per row")
        index = index.to(device=self.seen.device, dtype=torch.int64)
        lo, hi = torch.aminmax(index)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= B:
            raise ValueError(f"index must hold rows in [0, {B}), got values from {lo} to {hi}")
        return index

    def move_rows(self, index: Tensor | None) -> None:
        """Every per-row tensor taken at the rows ``index`` (checked by :meth:`check_rows`; None: nothing held):
        here the bookkeeping; a subclass moves its own tensors and calls this."""
        if index is None:
            return
        for name, t in self.bookkeeping().items():
            if isinstance(t, Tensor):  # new tensors: ones filled under inference mode stay usable
                setattr(self, name, t.index_select(0, index))
