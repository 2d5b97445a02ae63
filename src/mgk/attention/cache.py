"""Decoding caches: one object per attention layer, updated in place by the layer's ``forward(...,
past_key_values=cache)``, and :class:`DecodingCache`, one per model (a cache per layer).

The anchor is Hugging Face's ``past_key_values`` objects (``DynamicCache``), so the drop-in ``forward`` keeps
returning ``(output, weights)``: a layer called with a cache attends from its new tokens to every token the cache has
seen and to themselves (causally, bottom-right aligned), then adds them to the cache. The first call is the prefill
(any length), every later call one token or a few.

Every kind's layer fills the same object, :class:`LayerCache` (one decoding state, as flash-linear-attention's
``Cache``): named slot buffers that grow with the sequence, the valid-slot mask, per-row counts, an optional fixed
recurrent state and a dict of the kind's own bookkeeping. What is stored, and how a call updates it, is the kind's
(its module's ``cache_slots`` and ``_cached_core``, in the kind's file):

* softmax and GQA: keys and values (B, H or G, T, D);
* MGK: the M component keys centred and divided by sigma_r^2 (B, H, M, T, D), the per-key scalars
  ``log pi_jr - |k~_jr|^2 / (2 sigma_r^2)`` (B, H, M, T) and the values (:mod:`mgk.functional.mgk_cache`); sMGK the
  one unshifted centred key (B, H, T, D) instead of M, the shifts applied when the cache is read;
* linear and MLK: no slots, the state (S, z) of :class:`mgk.functional.LinearAttentionState`, of a fixed size
  whatever the length.

The registry's :class:`mgk.attention.cache_spec.CacheSpec` of each kind is the formula of those bytes; the tests hold
it against :meth:`LayerCache.nbytes`, measured from the buffers.

Slots are shared by the rows of a batch: call t writes the same columns for every row. Per row, a cache counts the
real tokens it has seen (:attr:`LayerCache.seen`): padding (``key_padding_mask`` of the new tokens, e.g. the left
padding of prompts of different lengths) is stored as zeros (by MGK's fused step, as the finite entries of a zero
key), never attended, and not counted, so positions (of per-position mixture weights, and of the LM's sinusoids)
continue from each row's own prompt and a left-padded row decodes as that row alone. Key/value buffers are
allocated for a capacity (:meth:`LayerCache.reserve`, or the first call's length) and grown geometrically; a step
reads only the slots in use (gpt-fast#233 read empty slots). Each layer has its own cache and counts
(flash-linear-attention#747 counted the length once for all layers).

A cache can be fixed at a capacity (:meth:`LayerCache.fix_capacity`, gpt-fast's static cache): its buffers then never
grow, a call adds one real token at a time at a slot held as a tensor, and attention reads the whole capacity with
the valid-slot mask (slots ahead hold zeros and are masked). No step of that form reads a host-side count or
changes a tensor's shape, so ``torch.compile`` traces it once for every step (``generate(..., compile=True)``,
:mod:`mgk.models.compiled_decode`); the host-side counts (:attr:`LayerCache.length`) are then advanced by the caller
(:meth:`LayerCache.advance`). The price is gpt-fast's: a step reads the slots not yet filled as well, so the
capacity is sized to the tokens that will come (``generate`` fixes it at the prompt plus ``max_new_tokens``).

A cache never loses a token it accepted: resizing a cache of fixed capacity whose steps :meth:`LayerCache.advance`
has not yet counted is refused in one line. An empty chunk (a (B, 0, E) call of a chunked prefill) returns (B, 0, E)
and leaves the cache as it was. A model cast between two calls of one cache (``model.double()``,
``.to(torch.bfloat16)``) casts the cache to the dtype its entries are made in then (:meth:`LayerCache.cast`), for
every kind. A cache is saved as plain tensors and ints (:meth:`LayerCache.state_dict` / ``load_state_dict``, and
:class:`DecodingCache`'s, for ``torch.save`` and ``torch.load(..., weights_only=True)``: a prompt's cache kept on
disk); the object itself refers to its layer and is not pickled (a TypeError in one line says so).

Rows and lengths (beam search, assisted decoding; :mod:`mgk.integrations.hf.cache` calls them): every kind's cache
reorders, selects and repeats its rows (:meth:`LayerCache.reorder`, :meth:`~LayerCache.select`,
:meth:`~LayerCache.repeat_interleave`), every per-row tensor moving with its row; the kinds' bookkeeping in
:attr:`LayerCache.extra` keeps that working by contract: each of its tensors has the B rows as dim 0 (checked at
each move). A cache of per-token entries drops its last tokens (:meth:`LayerCache.crop`, a fixed capacity's slot
moving back with them) and asks its layer to put the kind's bookkeeping in line (a ``cache_cropped(cache)`` method:
MGK's centre); a recurrent state has no tokens to drop and refuses in one line.

Caches hold detached tensors and are for inference only: a cached call while autograd would record a graph
through the layer (gradients enabled, and the input or a parameter requires grad) is a ValueError naming
``past_key_values`` (:meth:`mgk.attention.base.AttentionBase.forward`); decode under ``torch.no_grad()`` or
``torch.inference_mode()``, and train through the uncached forward.
"""
from __future__ import annotations

import copy
import weakref

import torch
from torch import Tensor

from ..functional import LinearAttentionState

__all__ = ["DecodingCache", "LayerCache", "check_capacity", "token_positions"]


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


class _SavedByStateDict:
    """Pickling refused in one line (``torch.save(cache)`` met the weak reference to the layer deep in the pickler):
    a cache is saved as its :meth:`state_dict`. Copies (``copy.copy``, ``copy.deepcopy``) still work, the layer's
    weak reference shared."""

    def __reduce_ex__(self, protocol):
        raise TypeError(f"a {type(self).__name__} is not pickled (it refers to its layer): torch.save its "
                        "state_dict() (tensors and ints, read back by torch.load(..., weights_only=True)) and restore "
                        "it with load_state_dict() on a new cache of the same layers")

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))  # weakref.ref is copied as itself
        return new


def _plain(value, name: str):
    """A value of :meth:`LayerCache.state_dict`'s bookkeeping as what ``torch.load(weights_only=True)`` reads back
    (a tensor cloned); TypeError naming it otherwise."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"the cache's {name} holds a {type(value).__name__}, which state_dict() cannot save")


class LayerCache(_SavedByStateDict):
    """One layer's decoding state for a batch of B rows: every kind's layer fills this one class.

    Args:
        slots: the per-token entries the kind stores, name -> slot dimension (e.g. ``{"keys": 2, "values": 2}`` for
            (B, H, T, D) buffers); empty for a kind with a fixed recurrent state only.
        capacity: tokens to allocate room for at the first call (default that call's length); buffers grow by
            doubling when full.
        layout: the name of the kind's layout, checked when a layer is handed a cache (a cache of another layout is
            refused in one line).

    Attributes:
        length: tokens (padding included) this layer has been called with since it was created.
        seen: (B,) int64, real tokens per row (None before the first call).
        state: the fixed recurrent state (:class:`mgk.functional.LinearAttentionState`) of linear / MLK, or None.
        extra: the kind's own bookkeeping (MGK's centre, :mod:`mgk.attention.mgk`); not counted in :meth:`nbytes`.
            Each of its tensors has the B rows as dim 0 (:meth:`select` moves them with their rows); what a
            :meth:`crop` changes in it is the layer's ``cache_cropped(cache)``.
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
        self.state = None
        self.extra: dict = {}
        self._buffers: dict[str, Tensor] = {}
        self._valid: Tensor | None = None  # (B, capacity) bool: a real token in the slot
        self._padded = False
        self._owner: tuple | None = None
        self._module = None  # weakref.ref of the layer that filled the cache
        self._max_seen = 0  # an upper bound of seen.max(), kept on the host (no device sync per step)
        self._slot: Tensor | None = None  # (1,) int64, the next slot, once the capacity is fixed

    @property
    def batch_size(self) -> int | None:
        """B, once the first call has been made."""
        return None if self.seen is None else self.seen.shape[0]

    def bind(self, owner: tuple, B: int, device, module=None) -> None:
        """Check that this cache serves the layer described by ``owner`` (its class and sizes) with B rows on
        ``device``, and is the cache of ``module`` itself (held by a weak reference: two layers of the same class
        and sizes sharing one cache would silently mix their keys); the first call sets them. ValueError naming
        ``past_key_values`` otherwise."""
        if self._owner is None:
            self._owner = owner
            self._module = None if module is None else weakref.ref(module)
            self.seen = torch.zeros(B, dtype=torch.int64, device=device)
            return
        if owner != self._owner:
            raise ValueError(f"past_key_values holds the cache of another layer ({self._owner[0]} with "
                             f"{', '.join(map(str, self._owner[1:]))}), not of this {owner[0]} with "
                             f"{', '.join(map(str, owner[1:]))}: give each layer its own cache (DecodingCache holds "
                             "one per layer)")
        if B != self.batch_size:
            raise ValueError(f"past_key_values was filled for a batch of {self.batch_size} rows; this call has {B}")
        if torch.device(device) != self.seen.device:
            raise ValueError(f"past_key_values lives on {self.seen.device} but this call's inputs are on "
                             f"{torch.device(device)}: a cache stays on the device it was filled on (start a new one "
                             "after moving the model)")
        if module is not None and self._module is None:  # a loaded cache (load_state_dict): its first layer
            self._module = weakref.ref(module)
        if module is not None and self._module() is not module:
            raise ValueError(f"past_key_values was filled by another {owner[0]} layer (of the same sizes): a cache "
                             "serves the one layer that filled it; give each layer its own (DecodingCache holds one "
                             "per layer)")

    def positions(self, valid: Tensor | None, L: int) -> Tensor:
        """:func:`token_positions` of L new tokens after those this cache has seen."""
        return token_positions(self.seen, valid, L)

    def last_position(self, valid: Tensor | None, L: int) -> int:
        """The largest position of a real token after L new ones (the host's bound, exact without padding)."""
        added = L if valid is None else int(valid.sum(dim=1).max()) if valid.numel() else 0
        return self._max_seen + added - 1

    def _count(self, valid: Tensor | None, L: int) -> None:
        self.seen = self.seen + (L if valid is None else valid.sum(dim=1))
        if self._slot is not None:  # the host counts are the caller's (advance): a traced step reads none
            return
        self._max_seen += L if valid is None else (int(valid.sum(dim=1).max()) if valid.numel() else 0)
        self.length += L

    # -- slot buffers ---------------------------------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` tokens in all (before the first call: allocate that much). A cache with no
        slots (a recurrent state) has nothing to reserve; ``capacity`` is checked alike."""
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
        an entry the cache has no slot for."""
        unknown = set(entries) - set(self.slots)
        if unknown:
            raise ValueError(f"this {self.layout or 'layer'} cache has no slots for {sorted(unknown)}; it stores "
                             f"{sorted(self.slots) or 'a recurrent state only'}")
        L = next(iter(entries.values())).shape[self.slots[next(iter(entries))]]
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
        self._count(valid, L)
        return {name: buf.narrow(self.slots[name], 0, self.length) for name, buf in self._buffers.items()}

    def _append_fixed(self, valid: Tensor | None, L: int, entries: dict[str, Tensor]) -> dict[str, Tensor]:
        """:meth:`append` of a cache of fixed capacity: one real token written at the slot tensor, every buffer
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

    def fix_capacity(self, capacity: int) -> None:
        """Fix the buffers at ``capacity`` slots (a static cache): from now on a call takes one real token, written
        at a slot held as a tensor, and the whole capacity is read with the valid-slot mask, so a step has the same
        shapes and reads no host-side count (module docstring). The host counts (:attr:`length`) are the caller's
        from then on: call :meth:`advance` after each step. ValueError naming ``capacity`` unless it is a positive
        int holding the tokens seen, or before the first call (the prefill, which allocates the buffers)."""
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
        """ValueError (one line) when a cache of fixed capacity holds more tokens than :meth:`advance` has counted
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
        """Slots left in a cache of fixed capacity (None for a growing cache, or one without slots)."""
        if self._slot is None or not self._buffers:
            return None
        return self.capacity - self.length

    def advance(self, L: int) -> None:
        """Advance the host counts of a cache of fixed capacity by L real tokens after a step (which, traced or
        not, updated the device counts itself). ValueError for a growing cache, whose calls count themselves."""
        if self._slot is None:
            raise ValueError("advance() is for a cache of fixed capacity (fix_capacity); a growing cache counts its "
                             "own calls")
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
            self._count(None, L)
            return self._buffers, slot
        self._grow(self.length + L)
        slot = self.length
        self._valid[:, slot:slot + L] = True if valid is None else valid
        self._padded = self._padded or valid is not None
        self._count(valid, L)
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
        """Convert every floating tensor the cache holds (slot buffers, recurrent state, the kind's bookkeeping in
        :attr:`extra`) to ``dtype``, in place of the old ones: a model cast between two calls of one cache
        (``model.double()``, ``.to(torch.bfloat16)``) goes on as a cache filled in the new dtype would (each kind
        calls it with the dtype its entries are made in). Integer and bool tensors are kept."""
        def stale(t) -> bool:
            """Whether ``t`` is a floating tensor of another dtype than ``dtype`` (one to convert)."""
            return isinstance(t, Tensor) and t.is_floating_point() and t.dtype != dtype

        for held in (self._buffers, self.extra):  # written only where a dtype differs (a traced step: nothing)
            for name, t in list(held.items()):
                if stale(t):
                    held[name] = t.to(dtype)
        if self.state is not None and (stale(self.state.kv) or stale(self.state.k_sum)):
            self.state = LinearAttentionState(self.state.kv.to(dtype), self.state.k_sum.to(dtype), self.state.length)

    @property
    def padded(self) -> bool:
        """Whether any call so far had padding (then :meth:`key_valid` masks some slots)."""
        return self._padded

    def key_valid(self) -> Tensor:
        """(B, T) bool, True = a real token, over the slots in use (call after :meth:`bind`)."""
        if self._valid is None:
            return torch.zeros(self.batch_size, 0, dtype=torch.bool, device=self.seen.device)
        return self._valid if self._slot is not None else self._valid[:, :self.length]

    def attn_mask(self) -> Tensor | None:
        """(B, 1, 1, T) bool, True = a real token (the functional core's key-padding mask over the slots in use), or
        None when no call has had padding; once the capacity is fixed, always the mask over the whole capacity."""
        if self._slot is not None:
            return self._valid[:, None, None, :]
        return self._valid[:, None, None, :self.length] if self._padded else None

    # -- recurrent state ------------------------------------------------------------------------------------------
    def set_state(self, valid: Tensor | None, L: int, state) -> None:
        """Take the recurrent state after L new tokens (:class:`mgk.functional.LinearAttentionState`, detached)."""
        if self._slot is not None:
            self.check_fixed_call(valid, L)
        self.state = LinearAttentionState(state.kv.detach(), state.k_sum.detach(), state.length)
        self._count(valid, L)

    # -- saving (prompt caching to disk) ----------------------------------------------------------------------------
    def _held(self) -> int:
        """Slots holding tokens: the slot tensor's value once the capacity is fixed (the host count may lag it until
        :meth:`advance`), else :attr:`length`."""
        return int(self._slot) if self._slot is not None and self._buffers else self.length

    def state_dict(self) -> dict:
        """Everything this cache holds, as plain tensors, ints, bools, strings and None in dicts and tuples, so that
        ``torch.save(cache.state_dict(), f)`` and ``torch.load(f, weights_only=True)`` keep a prompt's cache on disk
        (the cache object itself is not pickled: it refers to its layer). Slot buffers are saved over the slots
        that hold tokens (copies, not the whole allocation; the capacity is recorded), with the valid-slot mask,
        the per-row counts, a fixed capacity's slot, the recurrent state and the kind's bookkeeping (MGK's centre).
        Restore with :meth:`load_state_dict` on a new cache of the same layer (``layer.new_cache()``).

        Returns:
            dict; its tensors are detached copies on the cache's device.
        """
        held = self._held()
        buffers = {name: buf.narrow(self.slots[name], 0, held).clone() for name, buf in self._buffers.items()}
        state = None if self.state is None else {
            "kv": self.state.kv.clone(), "k_sum": self.state.k_sum.clone(),
            "length": None if self.state.length is None else self.state.length.clone()}
        return {
            "layout": self.layout, "slots": dict(self.slots), "capacity": self.capacity, "length": self.length,
            "max_seen": self._max_seen, "padded": self._padded, "owner": self._owner,
            "seen": _plain(self.seen, "seen"), "valid": None if self._valid is None else self._valid[:, :held].clone(),
            "slot": _plain(self._slot, "slot"), "buffers": buffers, "state": state,
            "extra": {name: _plain(value, f"extra[{name!r}]") for name, value in self.extra.items()},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` into this cache, which must be new (no call yet) and of the same layout
        (``layer.new_cache()`` of the layer that filled it, or one of the same class and sizes: a loaded cache
        serves the first layer it is called by). Its tensors stay on the device they were loaded on
        (``torch.load(..., map_location=...)``), which the next call must match.

        Raises:
            ValueError naming ``state_dict`` when it is not a cache's state dict, is of another layout, or this
            cache has had a call.
        """
        keys = {"layout", "slots", "capacity", "length", "max_seen", "padded", "owner", "seen", "valid", "slot",
                "buffers", "state", "extra"}
        if not isinstance(state_dict, dict) or set(state_dict) != keys:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"state_dict must be a LayerCache.state_dict() with keys {sorted(keys)}, got {got}")
        if state_dict["layout"] != self.layout or dict(state_dict["slots"]) != self.slots:
            raise ValueError(f"state_dict holds a {state_dict['layout'] or 'layer'} cache with slots "
                             f"{state_dict['slots']}; this is a {self.layout or 'layer'} cache with slots {self.slots}")
        if self.seen is not None:
            raise ValueError("state_dict is loaded into a new cache (new_cache()); this one has had a call")
        self._restore(state_dict)

    def _restore(self, sd: dict) -> None:
        """:meth:`load_state_dict` after its checks: buffers made at the saved capacity, the held slots copied."""
        self.capacity, self.length, self._max_seen = sd["capacity"], sd["length"], sd["max_seen"]
        self._padded, self.seen, self._slot = sd["padded"], sd["seen"], sd["slot"]
        self._owner = None if sd["owner"] is None else tuple(sd["owner"])
        self._module = None
        self.extra = dict(sd["extra"])
        self.state = None if sd["state"] is None else LinearAttentionState(
            sd["state"]["kv"], sd["state"]["k_sum"], sd["state"]["length"])
        self._buffers, self._valid = {}, None
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
        """Bytes of what attention reads: every entry over the slots in use (the tokens seen, padding included) and
        the recurrent state; bookkeeping and the slots ahead excluded."""
        slots = sum(buf.narrow(self.slots[name], 0, self.length).numel() * buf.element_size()
                    for name, buf in self._buffers.items())
        return slots + (0 if self.state is None else self.state.nbytes())

    def allocated_bytes(self) -> int:
        """Bytes as allocated: the buffers at their capacity (slots ahead included) and the recurrent state."""
        return (sum(buf.numel() * buf.element_size() for buf in self._buffers.values())
                + (0 if self.state is None else self.state.nbytes()))

    def extra_bytes(self) -> int:
        """Bytes of the kind's bookkeeping tensors (:attr:`extra`: MGK's centre and kept keys)."""
        return sum(t.numel() * t.element_size() for t in self.extra.values() if isinstance(t, Tensor))

    # -- rows and lengths (beam search, assisted decoding) ---------------------------------------------------------
    def select(self, index: Tensor) -> None:
        """Keep the rows ``index`` of the batch, in that order: row i of the cache becomes row ``index[i]`` of the old
        one (beam search's ``beam_idx``; a row may come several times or not at all, and B' may differ from B).
        Every per-row tensor moves with its row: the slot buffers (dim 0), the valid-slot mask, :attr:`seen`, the
        recurrent state, and every tensor of :attr:`extra` (the contract of the kinds' bookkeeping: rows as dim 0).
        Before the first call there is nothing to move. A fixed capacity's slot is the same for every row and
        stays; the host bound of ``seen.max()`` stays a bound.

        Args:
            index: (B',) integer tensor (int64 as beam search gives it), values in [0, B), on any device.
        Raises:
            ValueError naming ``index`` for another type, dtype, rank, an empty index or a row out of range;
            ValueError naming ``extra`` for a bookkeeping tensor without the B rows as dim 0 (a kind's bug).
        """
        self._move_rows(self._check_rows(index))

    def reorder(self, index: Tensor) -> None:
        """:meth:`select` keeping the number of rows (``index`` (B,): beam search's ``beam_idx``, repeats allowed).
        ValueError naming ``index`` for another length, or as :meth:`select`."""
        self._move_rows(self._check_rows(index, same_size=True))

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place, each copy next to its row (``torch.repeat_interleave`` on the
        batch: B rows become B * repeats). ValueError naming ``repeats`` unless it is a positive int."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        if self.seen is not None:
            rows = torch.arange(self.batch_size, device=self.seen.device).repeat_interleave(repeats)
            self._move_rows(self._check_rows(rows))

    def _check_rows(self, index, *, same_size: bool = False) -> Tensor | None:
        """``index`` as int64 on the cache's device (None before the first call), checked (:meth:`select`)."""
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
        index = index.to(device=self.seen.device, dtype=torch.int64)
        lo, hi = torch.aminmax(index)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= B:
            raise ValueError(f"index must hold rows in [0, {B}), got values from {lo} to {hi}")
        bad = sorted(name for name, t in self.extra.items() if isinstance(t, Tensor) and (t.dim() == 0
                                                                                          or t.shape[0] != B))
        if bad:
            raise ValueError(f"extra holds {bad} without the batch's {B} rows as dim 0: a kind's bookkeeping tensors "
                             "are per row (LayerCache.extra)")
        return index

    def _move_rows(self, index: Tensor | None) -> None:
        """Every per-row tensor taken at the rows ``index`` (checked; None: nothing held yet)."""
        if index is None:
            return

        def rows(t):
            """``t``'s rows ``index`` (a new tensor: one filled under inference mode stays usable)."""
            return None if t is None else t.index_select(0, index)

        self.seen, self._valid = rows(self.seen), rows(self._valid)
        self._buffers = {name: rows(buf) for name, buf in self._buffers.items()}
        if self.state is not None:
            self.state = LinearAttentionState(rows(self.state.kv), rows(self.state.k_sum), rows(self.state.length))
        self.extra = {name: rows(t) if isinstance(t, Tensor) else t for name, t in self.extra.items()}

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (slots) and forget the rest; a negative ``length`` drops that many from
        the end (as transformers' ``crop``). The counts follow the valid-slot mask (:attr:`seen`, the host bound
        exact again, :attr:`padded`), the dropped slots are zeroed (a fixed capacity's slot moves back to the first
        of them, the capacity kept), and the kind puts its bookkeeping in line: the cache calls its layer's
        ``cache_cropped(cache)`` when the layer has one (MGK's centre,
        :meth:`mgk.attention.mgk.MGKAttention.cache_cropped`). Keeping every token changes nothing, for every kind.

        Raises:
            ValueError naming the cache's layout for a recurrent state (linear attention, MLK: no per-token entries
            to drop); ValueError naming ``length`` unless it is an int within the tokens held; ValueError for a
            cache of fixed capacity whose steps :meth:`advance` has not counted, or one whose kind keeps
            bookkeeping while its layer is unknown (a loaded cache before its first call).
        """
        keep = self._check_crop(length)
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
        module = None if self._module is None else self._module()
        hook = getattr(module, "cache_cropped", None)
        if hook is not None:
            hook(self)

    def _check_crop(self, length) -> int:
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
        if self.extra and (self._module is None or self._module() is None):
            raise ValueError("crop(): this cache's bookkeeping (extra) is its layer's to crop, and the layer is not "
                             "known (a loaded cache before its first call, or the layer is gone)")
        return keep


class DecodingCache(_SavedByStateDict):
    """The caches of a model's attention layers, one per layer, each with its own length and per-row counts
    (``model(..., past_key_values=cache)``; :meth:`mgk.models.TransformerLM.new_cache` makes one). Saved as its
    :meth:`state_dict`, not pickled."""

    def __init__(self, layers):
        self.layers = list(layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)

    @property
    def seen(self) -> Tensor | None:
        """(B,) real tokens per row seen by the first layer (every layer sees the same tokens)."""
        return self.layers[0].seen if self.layers else None

    def reserve(self, capacity: int) -> None:
        """:meth:`LayerCache.reserve` on every layer."""
        for layer in self.layers:
            layer.reserve(capacity)

    def select(self, index: Tensor) -> None:
        """:meth:`LayerCache.select` on every layer (every layer checked before any moves)."""
        rows = [layer._check_rows(index) for layer in self.layers]
        for layer, index in zip(self.layers, rows):
            layer._move_rows(index)

    def reorder(self, index: Tensor) -> None:
        """:meth:`LayerCache.reorder` on every layer (beam search's ``beam_idx``; every layer checked first)."""
        rows = [layer._check_rows(index, same_size=True) for layer in self.layers]
        for layer, index in zip(self.layers, rows):
            layer._move_rows(index)

    def repeat_interleave(self, repeats: int) -> None:
        """:meth:`LayerCache.repeat_interleave` on every layer."""
        for layer in self.layers:
            layer.repeat_interleave(repeats)

    def crop(self, length: int) -> None:
        """:meth:`LayerCache.crop` on every layer; a layer that refuses (a recurrent state) refuses before any
        layer is cropped."""
        for layer in self.layers:
            layer._check_crop(length)
        for layer in self.layers:
            layer.crop(length)

    def nbytes(self) -> int:
        """Bytes attention reads, summed over the layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def state_dict(self) -> dict:
        """``{"layers": [each layer's LayerCache.state_dict()]}``: plain tensors and ints, for ``torch.save`` and
        ``torch.load(..., weights_only=True)`` (a prompt's cache kept on disk)."""
        return {"layers": [layer.state_dict() for layer in self.layers]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` into this new cache of the same model (``model.new_cache()``). ValueError
        naming ``state_dict`` for another number of layers, or as :meth:`LayerCache.load_state_dict`."""
        layers = state_dict.get("layers") if isinstance(state_dict, dict) else None
        if not isinstance(layers, (list, tuple)) or len(layers) != len(self.layers):
            got = len(layers) if isinstance(layers, (list, tuple)) else type(state_dict).__name__
            raise ValueError(f"state_dict must be a DecodingCache.state_dict() of {len(self.layers)} layers, got {got}")
        for layer, sd in zip(self.layers, layers):
            layer.load_state_dict(sd)
