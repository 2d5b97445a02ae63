"""The per-token decoding state: :class:`KVCacheState`, softmax's and GQA's state
(:func:`mgk.functional.softmax_cache_step`) and the base of every other kind's (:class:`mgk.functional.MGKDecodeState`
adds MGK's entries and centre, :class:`mgk.functional.LinearCacheState` a recurrent state's sums to its counts).

It holds named slot buffers along a slot dimension, the valid-slot mask (B, capacity), the per-row counts of real
tokens and the capacity: grown geometrically, or fixed with the next slot held as a tensor so that a step has the same
shapes every time (``torch.compile``; gpt-fast's static cache). It keeps the protocol of every decoding state
(:mod:`.decoding_state`): the rows move together (beam search), the last tokens can be dropped (assisted decoding),
the floating buffers follow a model's cast, and the tensors are saved as plain tensors and ints
(``torch.load(..., weights_only=True)``). A layer's :class:`mgk.attention.cache.LayerCache` holds one; its module
docstring tells the design.
"""
from __future__ import annotations

import operator

import torch
from torch import Tensor

from .decoding_state import DecodingState, cast_floating, plain

__all__ = ["KVCacheState", "check_capacity", "plain", "token_positions"]

# The keys of KVCacheState.state_dict(), in their order: the counts and slots, then a fixed-size state ("state", None
# here) and the bookkeeping ("extra"). A state dict saved before the last two existed still loads.
STATE_KEYS = ("slots", "capacity", "length", "max_seen", "padded", "seen", "valid", "slot", "buffers", "state", "extra")
_BEFORE_HELD = STATE_KEYS[:-2]


def token_positions(seen: Tensor, valid: Tensor | None, L: int) -> Tensor:
    """(B, L) int64 positions of L new tokens after ``seen`` (B,) real tokens per row, counted from each row's first
    real token (``valid`` (B, L) bool, True = real token, or None: all real); a padding token gets the position of
    the next real one (a valid index that nothing attends to)."""
    if valid is None:
        return seen.unsqueeze(1) + torch.arange(L, device=seen.device)
    step = valid.to(torch.int64)
    return seen.unsqueeze(1) + step.cumsum(dim=1) - step


def check_capacity(capacity, *, optional: bool = True) -> None:
    """ValueError naming ``capacity`` unless it is a positive int (or None when ``optional``): every kind's cache
    takes the same values, whether or not it allocates ahead."""
    if capacity is None and optional:
        return
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be {'None or ' if optional else ''}a positive int, got {capacity!r}")


class KVCacheState(DecodingState):
    """Per-token decoding state of a batch of B rows: named slot buffers, the valid-slot mask and per-row counts.

    Args:
        slots: the per-token entries stored, name -> slot dimension (e.g. ``{"keys": 2, "values": 2}`` for
            (B, H, T, D) buffers; dim 0 is always the batch); empty for a state that only counts tokens (the
            counts of a recurrent state's cache).
        capacity: tokens to allocate room for at the first :meth:`append` (default that call's length); buffers
            grow by doubling when full.
        layout: the name of what is stored, used in error messages only.

    Attributes:
        length: tokens (padding included) appended since it was created (host int; once the capacity is fixed,
            counted by :meth:`advance`).
        seen: (B,) int64, real tokens per row (None before :meth:`start`, which the first call of a layer makes,
            or :func:`mgk.functional.softmax.softmax_cache_step`'s first call).
        capacity: slots allocated (or to allocate), int or None.
    Raises:
        ValueError naming ``capacity`` unless it is None or a positive int.
    """

    def __init__(self, slots: dict[str, int] | None = None, capacity: int | None = None, *, layout: str = ""):
        check_capacity(capacity)
        self.slots = dict(slots or {})
        self.layout = layout
        self.capacity = capacity
        self.length = 0
        self.seen: Tensor | None = None
        self._buffers: dict[str, Tensor] = {}
        self._valid: Tensor | None = None  # (B, capacity) bool: a real token in the slot
        self._padded = False
        self._max_seen = 0  # an upper bound of seen.max(), kept on the host (no device sync per step)
        self._slot: Tensor | None = None  # (1,) int64, the next slot, once the capacity is fixed

    def empty(self) -> KVCacheState:
        """A new state like this one (its slots and layout) before its first call."""
        return type(self)(self.slots, layout=self.layout)

    def start(self, B: int, device) -> None:
        """Begin counting for B rows on ``device`` (``seen`` zeros): before the first call."""
        self.seen = torch.zeros(B, dtype=torch.int64, device=device)

    @property
    def buffers(self) -> dict[str, Tensor]:
        """The slot buffers at their whole capacity, by name (empty before the first :meth:`append`)."""
        return self._buffers

    def positions(self, valid: Tensor | None, L: int) -> Tensor:
        """:func:`token_positions` of L new tokens after those this state has seen."""
        return token_positions(self.seen, valid, L)

    def last_position(self, valid: Tensor | None, L: int) -> int:
        """The largest position of a real token after L new ones: the host's bound (exact without padding) for a
        growing state; once the capacity is fixed, an eager call reads :attr:`seen` itself, since the host counts
        are the caller's (:meth:`advance`) and may lag the steps taken."""
        added = L if valid is None else int(valid.sum(dim=1).max()) if valid.numel() else 0
        if self._slot is not None and not torch.compiler.is_compiling() and self.seen.numel():
            return int(self.seen.max()) + added - 1
        return self._max_seen + added - 1

    def count(self, valid: Tensor | None, L: int) -> None:
        """Count L new tokens (``valid`` (B, L) bool True = real, or None): ``seen`` per row and, unless the
        capacity is fixed (the caller's :meth:`advance` then), the host counts."""
        self.seen = self.seen + (L if valid is None else valid.sum(dim=1))
        if self._slot is not None:  # the host counts are the caller's (advance): a traced step reads none
            return
        self._max_seen += L if valid is None else (int(valid.sum(dim=1).max()) if valid.numel() else 0)
        self.length += L

    # -- slot buffers ---------------------------------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` tokens in all (before the first call: allocate that much). A state with no
        slots (a recurrent state's counts) has nothing to reserve; ``capacity`` is checked alike."""
        check_capacity(capacity, optional=False)
        if not self.slots:
            return
        if self._buffers:
            self._check_counted("reserve")
            self._grow(capacity)
        elif self.capacity is None or capacity > self.capacity:
            self.capacity = capacity

    def _grow(self, needed: int) -> None:
        if needed <= self._valid.shape[1]:
            return
        self._resize(max(needed, 2 * self._valid.shape[1]))

    def _resize(self, new: int) -> None:
        for name, buf in self._buffers.items():
            dim = self.slots[name]
            shape = list(buf.shape)
            shape[dim] = new
            grown = buf.new_zeros(shape)
            grown.narrow(dim, 0, self.length).copy_(buf.narrow(dim, 0, self.length))
            self._buffers[name] = grown
        valid = self._valid.new_zeros(self._valid.shape[0], new)
        valid[:, :self.length] = self._valid[:, :self.length]
        self._valid, self.capacity = valid, new

    def _allocate(self, entries: dict[str, Tensor], L: int) -> None:
        capacity = max(self.capacity or 0, L)
        for name, x in entries.items():
            shape = list(x.shape)
            shape[self.slots[name]] = capacity
            self._buffers[name] = x.new_zeros(shape)
        self._valid = torch.zeros(self.batch_size, capacity, dtype=torch.bool, device=self.seen.device)
        self.capacity = capacity

    def append(self, valid: Tensor | None, **entries: Tensor) -> dict[str, Tensor]:
        """Write L new tokens' entries (each with batch dim 0 and L along its slot dimension); padded tokens are
        stored as zeros. Returns every entry's view over the slots in use (the new ones included). ValueError naming
        an entry the cache has no slot for, one shaped otherwise than in earlier calls, or an entry or ``valid`` on
        another device than the state's (nothing written then)."""
        unknown = set(entries) - set(self.slots)
        if unknown:
            raise ValueError(f"this {self.layout or 'layer'} cache has no slots for {sorted(unknown)}; it stores "
                             f"{sorted(self.slots) or 'a recurrent state only'}")
        self._check_devices(valid, entries)
        L = next(iter(entries.values())).shape[self.slots[next(iter(entries))]]
        for name, x in entries.items():  # before anything is written: a refused call leaves the state as it was
            shape = list(self._buffers[name].shape) if name in self._buffers else list(x.shape)
            shape[self.slots[name]] = L
            if tuple(x.shape) != tuple(shape):
                raise ValueError(f"{name} must be shaped {tuple(shape)} as in this cache's earlier calls, got "
                                 f"{tuple(x.shape)}")
        if self._buffers:  # a model cast between calls (.double(), .to(torch.bfloat16)): the cache follows it
            for name, x in entries.items():
                if self._buffers[name].dtype != x.dtype:
                    self._buffers[name] = self._buffers[name].to(x.dtype)
        if self._slot is not None:
            return self._append_fixed(valid, L, entries)
        if not self._buffers:
            self._allocate(entries, L)
        self._grow(self.length + L)
        for name, x in entries.items():
            dim = self.slots[name]
            x = x.detach()
            if valid is not None:
                keep = valid.view(valid.shape[0], *([1] * (dim - 1)), L, *([1] * (x.dim() - dim - 1)))
                x = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
            self._buffers[name].narrow(dim, self.length, L).copy_(x)
        self._valid[:, self.length:self.length + L] = True if valid is None else valid
        self._padded = self._padded or valid is not None
        self.count(valid, L)
        return {name: buf.narrow(self.slots[name], 0, self.length) for name, buf in self._buffers.items()}

    def _check_devices(self, valid: Tensor | None, entries: dict[str, Tensor]) -> None:
        """ValueError (one line) naming the first of ``valid`` and ``entries`` on another device than the state's:
        copy_ would fail deep in torch (a meta tensor) or carry the tokens across devices, to fail later."""
        if self.seen is None:
            return
        here = self.seen.device
        for name, x in (("valid", valid), *entries.items()):
            if isinstance(x, Tensor) and x.device != here:
                raise ValueError(f"{name} is on {x.device} but this {self.layout or 'layer'} cache lives on {here}: "
                                 "a cache stays on the device it was filled on (start a new one after moving)")

    def _append_fixed(self, valid: Tensor | None, L: int, entries: dict[str, Tensor]) -> dict[str, Tensor]:
        """:meth:`append` of a state of fixed capacity: one real token written at the slot tensor, every buffer
        returned whole (the valid-slot mask, :meth:`attn_mask`, hides the slots not yet filled)."""
        if valid is not None:
            self.check_fixed_call(valid, L)  # the padding named (claim checks the rest)
        buffers, slot = self.claim(L)
        for name, x in entries.items():
            buffers[name].index_copy_(self.slots[name], slot, x.detach())
        return dict(buffers)

    def check_fixed_call(self, valid: Tensor | None, L: int) -> None:
        """ValueError (one line) unless a call of L new tokens with padding ``valid`` (None: none) suits a cache of
        fixed capacity: one real token, and room for it (checked on the host count when not tracing)."""
        if L != 1 or valid is not None:
            raise ValueError("a cache of fixed capacity (fix_capacity) takes one real token per call, got "
                             f"{L} new tokens{' with key_padding_mask' if valid is not None else ''}")
        if self._buffers and not torch.compiler.is_compiling() and int(self._slot) + L > self.capacity:
            # eager calls read the slot itself (a traced step reads nothing on the host: its caller checks the room)
            raise ValueError(f"this cache's fixed capacity ({self.capacity} tokens) is used up")

    # -- fixed capacity (a static cache, for torch.compile) --------------------------------------------------------
    @property
    def fixed(self) -> bool:
        """Whether the capacity is fixed (:meth:`fix_capacity`)."""
        return self._slot is not None

    @property
    def slot(self) -> Tensor | None:
        """The next slot as a (1,) int64 tensor once the capacity is fixed (the device's count), else None."""
        return self._slot

    def fix_capacity(self, capacity: int) -> None:
        """Fix the buffers at ``capacity`` slots (a static cache): from now on a call takes one real token, written
        at a slot held as a tensor, and the whole capacity is read with the valid-slot mask, so a step has the same
        shapes and reads no host-side count. The host counts (:attr:`length`) are the caller's from then on: call
        :meth:`advance` after each step. ValueError naming ``capacity`` unless it is a positive int holding the
        tokens seen, or before the first call (the prefill, which allocates the buffers)."""
        check_capacity(capacity, optional=False)
        if self.seen is None:
            raise ValueError("fix_capacity() needs a cache that has had its first call (the prefill)")
        self._check_counted("fix_capacity")
        if capacity < self.length:
            raise ValueError(f"capacity must hold the {self.length} tokens this cache has seen, got {capacity}")
        if self._buffers:  # new buffers of exactly that size, zero past the tokens seen: a step reads every slot
            self._resize(capacity)
        self._slot = torch.full((1,), self.length, dtype=torch.int64, device=self.seen.device)

    def _check_counted(self, method: str) -> None:
        """ValueError (one line) when a state of fixed capacity holds more tokens than :meth:`advance` has counted
        (eager steps without it): moving its buffers copies the counted slots only and restarts the slot there,
        which would drop the tokens past them silently."""
        if self._slot is None or not self._buffers:
            return
        held = int(self._slot)
        if held > self.length:
            raise ValueError(f"{method}(): this cache of fixed capacity holds {held} tokens but advance() has "
                             f"counted {self.length}; call advance() after each step (advance({held - self.length}) "
                             "now) before resizing it")
        if held < self.length:
            raise ValueError(f"{method}(): advance() has counted {self.length} tokens but this cache of fixed "
                             f"capacity holds {held}; advance() counts the tokens its steps took, no more")

    def room(self) -> int | None:
        """Slots left in a state of fixed capacity (None for a growing one, or one without slots)."""
        if self._slot is None or not self._buffers:
            return None
        return self.capacity - self.length

    def advance(self, L: int) -> None:
        """Advance the host counts of a state of fixed capacity by L real tokens after a step (which, traced or
        not, updated the device counts itself). Reads nothing on the device: a count past the slots the steps
        filled (but within the room) is refused later, by the next resize or :meth:`crop`.

        Raises:
            ValueError for a growing cache, whose calls count themselves; ValueError naming ``L`` unless it is a
            positive int (not a bool) no larger than the room left (:meth:`room`).
        """
        if self._slot is None:
            raise ValueError("advance() is for a cache of fixed capacity (fix_capacity); a growing cache counts its "
                             "own calls")
        room = self.room()
        given = L
        try:  # an integer of any kind (numpy's, a 0-dim integer tensor) is a count; a bool or a float is not
            L = None if isinstance(L, bool) else operator.index(L)
        except TypeError:
            L = None
        if L is None or L < 1 or (room is not None and L > room):
            within = "" if room is None else f" at most the room left ({room} of {self.capacity} slots)"
            raise ValueError(f"L must be a positive int{within}: the tokens the steps since the last advance() "
                             f"took, got {given!r}")
        self._max_seen += L
        self.length += L

    def claim(self, L: int, valid: Tensor | None = None) -> tuple[dict[str, Tensor], int]:
        """Room for L new tokens whose entries the caller writes itself, in place: the slots are marked real where
        ``valid`` (B, L) bool is True (None: every one) and the real ones counted; the caller writes finite entries
        at padded slots (never attended). Returns ``(buffers, slot)``: every buffer at its whole capacity and the
        first new slot (the static-cache form of :func:`mgk.functional.mgk_cache_step`); once the capacity is
        fixed, the slot as a (1,) int64 tensor, L must be 1 and ``valid`` None. Call after a first :meth:`append`
        (which allocates the buffers); ValueError otherwise."""
        if not self._buffers:
            raise ValueError("claim() needs the buffers of a first append() (the prefill)")
        if self._slot is not None:  # the slot as a tensor (taken before it moves on), for a traced step
            self.check_fixed_call(valid, L)
            slot = self._slot.clone()
            self._valid.index_fill_(1, self._slot, True)
            self._slot.add_(L)
            self.count(None, L)
            return self._buffers, slot
        self._grow(self.length + L)
        slot = self.length
        self._valid[:, slot:slot + L] = True if valid is None else valid
        self._padded = self._padded or valid is not None
        self.count(valid, L)
        return self._buffers, slot

    def entries(self) -> dict[str, Tensor]:
        """Every entry's view over the slots in use (the whole buffers once the capacity is fixed)."""
        if self._slot is not None:
            return dict(self._buffers)
        return {name: buf.narrow(self.slots[name], 0, self.length) for name, buf in self._buffers.items()}

    def write_slot(self, rows: Tensor, slot: Tensor, **entries: Tensor) -> None:
        """Replace, for the rows ``rows`` (B,) bool, the entries of one slot per row (``slot`` (B,) int64): each
        entry shaped as its buffer with the slot dimension of size 1."""
        index = torch.arange(rows.shape[0], device=rows.device)
        for name, x in entries.items():
            buf, dim = self._buffers[name], self.slots[name]
            moved = buf.movedim(dim, 1)  # (B, T, ...) view: one slot per row by (index, slot)
            old = moved[index, slot]
            new = x.detach().to(buf.dtype).movedim(dim, 1)[:, 0]
            keep = rows.view(-1, *([1] * (old.dim() - 1)))
            moved[index, slot] = torch.where(keep, new, old)

    def cast(self, dtype: torch.dtype) -> None:
        """Convert every floating slot buffer to ``dtype``, in place of the old ones (a model cast between two
        calls: the state goes on as one filled in the new dtype would). The valid-slot mask and counts are kept.
        ValueError naming ``dtype`` unless it is a floating torch.dtype (an integer one would truncate the entries)."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        cast_floating(self._buffers, dtype)
        self._cast_bookkeeping(dtype)

    @property
    def padded(self) -> bool:
        """Whether any call so far had padding (then :meth:`key_valid` masks some slots)."""
        return self._padded

    def key_valid(self) -> Tensor:
        """(B, T) bool, True = a real token, over the slots in use (call after :meth:`start`)."""
        if self._valid is None:
            return torch.zeros(self.batch_size, 0, dtype=torch.bool, device=self.seen.device)
        return self._valid if self._slot is not None else self._valid[:, :self.length]

    def attn_mask(self) -> Tensor | None:
        """(B, 1, 1, T) bool, True = a real token (the functional core's key-padding mask over the slots in use), or
        None when no call has had padding; once the capacity is fixed, always the mask over the whole capacity."""
        if self._slot is not None:
            return self._valid[:, None, None, :]
        return self._valid[:, None, None, :self.length] if self._padded else None

    # -- saving ------------------------------------------------------------------------------------------------------
    def _held(self) -> int:
        """Slots holding tokens: the slot tensor's value once the capacity is fixed (the host count may lag it until
        :meth:`advance`), else :attr:`length`."""
        return int(self._slot) if self._slot is not None and self._buffers else self.length

    def state_dict(self) -> dict:
        """The state as plain tensors, ints, bools and None in dicts (``torch.save`` /
        ``torch.load(..., weights_only=True)``), keys :data:`STATE_KEYS`: slot buffers over the slots that hold
        tokens (copies, not the whole allocation; the capacity is recorded), the valid-slot mask over them, the
        per-row counts, a fixed capacity's slot, a fixed-size state beside the slots ("state": a recurrent state's
        sums, None here) and the bookkeeping ("extra", :attr:`BOOKKEEPING`). Restore with :meth:`load_state_dict`
        on a new state.

        Returns:
            dict; its tensors are detached copies on the state's device.
        """
        held = self._held()
        buffers = {name: buf.narrow(self.slots[name], 0, held).clone() for name, buf in self._buffers.items()}
        return {
            "slots": dict(self.slots), "capacity": self.capacity, "length": self.length,
            "max_seen": self._max_seen, "padded": self._padded, "seen": plain(self.seen, "seen"),
            "valid": None if self._valid is None else self._valid[:, :held].clone(),
            "slot": plain(self._slot, "slot"), "buffers": buffers, "state": self._saved_state(),
            "extra": self._saved_bookkeeping(),
        }

    def _saved_state(self) -> dict | None:
        """The fixed-size state beside the slots as plain tensors (a recurrent state's sums), None here."""
        return None

    def _check_saved_state(self, saved) -> None:
        """ValueError naming ``state_dict`` unless ``saved`` is a fixed-size state this state can take (none)."""
        if saved is not None:
            raise ValueError(f"state_dict holds a fixed-size (recurrent) state, which a {type(self).__name__} does "
                             "not keep")

    def _restore_state(self, saved) -> None:
        """Take the saved fixed-size state (checked by :meth:`_check_saved_state`): nothing here."""

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` into this state, which must be new (no call yet) and of the same slots. Its
        tensors stay on the device they were loaded on.

        Raises:
            ValueError naming ``state_dict`` when it is not such a state dict, has other slots, or this state has
            had a call.
        """
        self.check_load(state_dict)
        self._restore(state_dict)

    def check_load(self, state_dict) -> None:
        """The checks of :meth:`load_state_dict`, nothing loaded (a cache of several layers checks every one first)."""
        if not isinstance(state_dict, dict) or set(state_dict) not in (set(STATE_KEYS), set(_BEFORE_HELD)):
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"state_dict must be a KVCacheState.state_dict() with keys {sorted(STATE_KEYS)}, "
                             f"got {got}")
        if dict(state_dict["slots"]) != self.slots:
            raise ValueError(f"state_dict holds slots {state_dict['slots']}; this state has slots {self.slots}")
        if self.seen is not None:
            raise ValueError("state_dict is loaded into a new state; this one has had a call")
        self._check_saved_state(state_dict.get("state"))
        self._check_bookkeeping(state_dict.get("extra", {}))

    def _restore(self, sd: dict) -> None:
        """:meth:`load_state_dict` after its checks: buffers made at the saved capacity, the held slots copied."""
        self.capacity, self.length, self._max_seen = sd["capacity"], sd["length"], sd["max_seen"]
        # the slot tensor is advanced in place: a copy, so two states loaded from one dict do not share it
        self._padded, self.seen, self._slot = sd["padded"], sd["seen"], plain(sd["slot"], "slot")
        self._buffers, self._valid = {}, None
        self._restore_state(sd.get("state"))
        self._load_bookkeeping(dict(sd.get("extra", {})))
        if not sd["buffers"]:
            return
        for name, held in sd["buffers"].items():
            dim = self.slots[name]
            shape = list(held.shape)
            shape[dim] = self.capacity
            self._buffers[name] = held.new_zeros(shape)
            self._buffers[name].narrow(dim, 0, held.shape[dim]).copy_(held)
        valid = sd["valid"]
        self._valid = valid.new_zeros(valid.shape[0], self.capacity)
        self._valid[:, :valid.shape[1]] = valid

    # -- sizes -----------------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of what attention reads: every entry over the slots in use (the tokens seen, padding included);
        the mask, the counts and the slots ahead excluded."""
        return sum(buf.narrow(self.slots[name], 0, self.length).numel() * buf.element_size()
                   for name, buf in self._buffers.items())

    def allocated_bytes(self) -> int:
        """Bytes as allocated: the buffers at their capacity (slots ahead included)."""
        return sum(buf.numel() * buf.element_size() for buf in self._buffers.values())

    # -- rows and lengths (beam search, assisted decoding) ---------------------------------------------------------
    def move_rows(self, index: Tensor | None) -> None:
        """Every per-row tensor taken at the rows ``index`` (checked by :meth:`check_rows`; None: nothing held): the
        slot buffers (dim 0), the valid-slot mask, :attr:`seen` and the bookkeeping. A fixed capacity's slot is the
        same for every row and stays; the host bound of ``seen.max()`` is taken again from the rows kept (as
        :meth:`crop` does), so dropping the longest row does not hold the others to its positions."""
        if index is None:
            return
        super().move_rows(index)
        self.seen = self.seen.index_select(0, index)  # new tensors: ones filled under inference mode stay usable
        # the dropped rows' bound would refuse the kept ones' positions (check_rows has synced already)
        self._max_seen = int(self.seen.max()) if self.seen.numel() else 0
        self._valid = None if self._valid is None else self._valid.index_select(0, index)
        self._buffers = {name: buf.index_select(0, index) for name, buf in self._buffers.items()}

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (slots) and forget the rest; a negative ``length`` drops that many from
        the end (as transformers' ``crop``). The counts follow the valid-slot mask (:attr:`seen`, the host bound
        exact again, :attr:`padded`), the dropped slots are zeroed (a fixed capacity's slot moves back to the first
        of them, the capacity kept). Keeping every token changes nothing.

        Raises:
            ValueError naming the layout for a state without slots (a recurrent state's counts: no per-token
            entries to drop); ValueError naming ``length`` unless it is an int within the tokens held; ValueError
            for a state of fixed capacity whose steps :meth:`advance` has not counted.
        """
        self.truncate(self.check_crop(length))

    def check_crop(self, length) -> int:
        """The tokens :meth:`crop` keeps, checked (nothing changed)."""
        if isinstance(length, bool) or not isinstance(length, int):
            raise ValueError(f"length must be an int (negative: tokens to drop from the end), got {length!r}")
        held = self.length
        keep = held + length if length < 0 else length
        if keep == held:
            return keep
        if not self.slots:
            raise ValueError(f"a {self.layout or 'recurrent'} cache holds a recurrent state of fixed size, not "
                             "per-token entries, so it cannot be cropped (crop)")
        if not 0 <= keep <= held:
            raise ValueError(f"length must keep between 0 and the {held} tokens this cache holds (negative: drop "
                             f"that many from the end), got {length}")
        self._check_counted("crop")
        return keep

    def truncate(self, keep: int) -> None:
        """:meth:`crop` to ``keep`` tokens after :meth:`check_crop` (nothing when every token is kept)."""
        if keep == self.length:
            return
        held = self.length
        for name, buf in self._buffers.items():
            buf.narrow(self.slots[name], keep, held - keep).zero_()
        self._valid[:, keep:held] = False
        valid = self._valid[:, :keep]
        self.length, self.seen = keep, valid.sum(dim=1)
        self._max_seen = int(self.seen.max()) if self.seen.numel() else 0
        self._padded = self._padded and not bool(valid.all())
        if self._slot is not None:
            self._slot.fill_(keep)
