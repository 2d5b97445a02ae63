"""Decoding caches: one object per attention layer, updated in place by the layer's ``forward(...,
past_key_values=cache)``, and :class:`DecodingCache`, one per model (a cache per layer).

The anchor is Hugging Face's ``past_key_values`` objects (``DynamicCache``), so the drop-in ``forward`` keeps
returning ``(output, weights)``: a layer called with a cache attends from its new tokens to every token the cache has
seen and to themselves (causally, bottom-right aligned), then adds them to the cache. The first call is the prefill
(any length), every later call one token or a few.

Every kind's layer fills the same holder, :class:`LayerCache` (one per layer, as flash-linear-attention's
``Cache``): the layer it serves (its class and sizes, a weak reference), and the states beside their ops in
:mod:`mgk.functional`: the per-token state :class:`mgk.functional.KVCacheState` (:attr:`LayerCache.kv`: named slot
buffers that grow with the sequence, the valid-slot mask, per-row counts, a fixed capacity; :mod:`.kv_state`), an
optional fixed recurrent state, and a dict of the kind's own bookkeeping; its row, length, cast and saving
operations fan out to what it holds. What is stored, and how a call updates it, is the kind's (its module's
``cache_slots`` and ``_cached_core``, one call in the kind's file into the functional op's step:
:func:`mgk.functional.softmax_cache_step`, ``MGKDecodeState``, the linear ops' ``initial_state``):

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
from ..functional.kv_state import STATE_KEYS, KVCacheState, cast_floating, check_capacity, plain, token_positions

__all__ = ["DecodingCache", "LayerCache", "check_capacity", "token_positions"]


# The keys of LayerCache.state_dict(), in the order of the saved format.
_SAVED_KEYS = ("layout", "slots", "capacity", "length", "max_seen", "padded", "owner", "seen", "valid", "slot",
               "buffers", "state", "extra")


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


def _on_kv(name: str, doc: str) -> property:
    """A :class:`LayerCache` attribute that is its per-token state's (:attr:`LayerCache.kv`), read and written there."""
    return property(lambda self: getattr(self.kv, name), lambda self, value: setattr(self.kv, name, value), doc=doc)


class LayerCache(_SavedByStateDict):
    """One layer's decoding state for a batch of B rows: every kind's layer fills this one class, a thin holder of
    the layer binding, the per-token state (:class:`mgk.functional.KVCacheState`, :attr:`kv`: slots, counts,
    capacity, masks), the recurrent state of linear / MLK and the kind's bookkeeping.

    Args:
        slots: the per-token entries the kind stores, name -> slot dimension (e.g. ``{"keys": 2, "values": 2}`` for
            (B, H, T, D) buffers); empty for a kind with a fixed recurrent state only.
        capacity: tokens to allocate room for at the first call (default that call's length); buffers grow by
            doubling when full.
        layout: the name of the kind's layout, checked when a layer is handed a cache (a cache of another layout is
            refused in one line).

    Attributes:
        kv: the per-token state (:class:`mgk.functional.KVCacheState`); its counts serve a recurrent state too.
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
        self.kv = KVCacheState(slots, capacity, layout=layout)
        self.layout = layout
        self.state = None
        self.extra: dict = {}
        self._owner: tuple | None = None
        self._module = None  # weakref.ref of the layer that filled the cache

    # What the per-token state answers, as before the move (its plain attributes still writable): one attribute
    # lookup more, nothing checked twice on a step's path.
    slots = _on_kv("slots", "The kind's slots, name -> slot dimension.")
    capacity = _on_kv("capacity", "Slots allocated (or to allocate), int or None.")
    length = _on_kv("length", "Tokens (padding included) this layer has been called with since it was created.")
    seen = _on_kv("seen", "(B,) int64, real tokens per row (None before the first call).")
    batch_size = property(lambda self: self.kv.batch_size, doc="B, once the first call has been made.")
    fixed = property(lambda self: self.kv.fixed, doc="Whether the capacity is fixed (:meth:`fix_capacity`).")
    padded = property(lambda self: self.kv.padded, doc="Whether any call so far had padding (:meth:`key_valid`).")
    _buffers = property(lambda self: self.kv.buffers, doc="The slot buffers at their whole capacity.")
    _slot = property(lambda self: self.kv.slot, doc="A fixed capacity's next slot, (1,) int64, or None.")

    def bind(self, owner: tuple, B: int, device, module=None) -> None:
        """Check that this cache serves the layer described by ``owner`` (its class and sizes) with B rows on
        ``device``, and is the cache of ``module`` itself (held by a weak reference: two layers of the same class
        and sizes sharing one cache would silently mix their keys); the first call sets them. ValueError naming
        ``past_key_values`` otherwise."""
        if self._owner is None:
            self._owner = owner
            self._module = None if module is None else weakref.ref(module)
            self.kv.start(B, device)
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

    # -- the per-token state's operations (documented on KVCacheState) ---------------------------------------------
    def positions(self, valid: Tensor | None, L: int) -> Tensor:
        """:func:`token_positions` of L new tokens after those this cache has seen (:meth:`KVCacheState.positions`)."""
        return self.kv.positions(valid, L)

    def last_position(self, valid: Tensor | None, L: int) -> int:
        """The largest position of a real token after L new ones (:meth:`KVCacheState.last_position`)."""
        return self.kv.last_position(valid, L)

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` tokens in all (:meth:`KVCacheState.reserve`; nothing for a recurrent state)."""
        self.kv.reserve(capacity)

    def append(self, valid: Tensor | None, **entries: Tensor) -> dict[str, Tensor]:
        """Write L new tokens' entries; returns every entry's view over the slots in use
        (:meth:`KVCacheState.append`: ValueError naming an entry the cache has no slot for)."""
        return self.kv.append(valid, **entries)

    def check_fixed_call(self, valid: Tensor | None, L: int) -> None:
        """ValueError (one line) unless a call of L new tokens suits a cache of fixed capacity
        (:meth:`KVCacheState.check_fixed_call`)."""
        self.kv.check_fixed_call(valid, L)

    def fix_capacity(self, capacity: int) -> None:
        """Fix the buffers at ``capacity`` slots, a static cache (:meth:`KVCacheState.fix_capacity`, module
        docstring); the host counts are then the caller's (:meth:`advance`)."""
        self.kv.fix_capacity(capacity)

    def room(self) -> int | None:
        """Slots left in a cache of fixed capacity (None for a growing cache, or one without slots)."""
        return self.kv.room()

    def advance(self, L: int) -> None:
        """Advance the host counts of a cache of fixed capacity by L tokens (:meth:`KVCacheState.advance`)."""
        self.kv.advance(L)

    def claim(self, L: int, valid: Tensor | None = None) -> tuple[dict[str, Tensor], int]:
        """Room for L new tokens whose entries the caller writes itself: ``(buffers, slot)``
        (:meth:`KVCacheState.claim`)."""
        return self.kv.claim(L, valid)

    def entries(self) -> dict[str, Tensor]:
        """Every entry's view over the slots in use (the whole buffers once the capacity is fixed)."""
        return self.kv.entries()

    def write_slot(self, rows: Tensor, slot: Tensor, **entries: Tensor) -> None:
        """Replace one slot per row for the rows ``rows`` (:meth:`KVCacheState.write_slot`)."""
        self.kv.write_slot(rows, slot, **entries)

    def key_valid(self) -> Tensor:
        """(B, T) bool, True = a real token, over the slots in use (call after :meth:`bind`)."""
        return self.kv.key_valid()

    def attn_mask(self) -> Tensor | None:
        """(B, 1, 1, T) bool key-padding mask over the slots in use, or None (:meth:`KVCacheState.attn_mask`)."""
        return self.kv.attn_mask()

    def cast(self, dtype: torch.dtype) -> None:
        """Convert every floating tensor the cache holds (slot buffers, recurrent state, the kind's bookkeeping in
        :attr:`extra`) to ``dtype``, in place of the old ones: a model cast between two calls of one cache
        (``model.double()``, ``.to(torch.bfloat16)``) goes on as a cache filled in the new dtype would (each kind
        calls it with the dtype its entries are made in). Integer and bool tensors are kept."""
        self.kv.cast(dtype)  # written only where a dtype differs (a traced step: nothing)
        cast_floating(self.extra, dtype)
        held = self.state
        if held is not None and (held.kv.dtype != dtype or held.k_sum.dtype != dtype):
            self.state = LinearAttentionState(held.kv.to(dtype), held.k_sum.to(dtype), held.length)

    # -- recurrent state ------------------------------------------------------------------------------------------
    def set_state(self, valid: Tensor | None, L: int, state) -> None:
        """Take the recurrent state after L new tokens (:class:`mgk.functional.LinearAttentionState`, detached)."""
        if self.kv.fixed:
            self.kv.check_fixed_call(valid, L)
        self.state = LinearAttentionState(state.kv.detach(), state.k_sum.detach(), state.length)
        self.kv.count(valid, L)

    # -- saving (prompt caching to disk) ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything this cache holds, as plain tensors, ints, bools, strings and None in dicts and tuples, so that
        ``torch.save(cache.state_dict(), f)`` and ``torch.load(f, weights_only=True)`` keep a prompt's cache on disk
        (the cache object itself is not pickled: it refers to its layer). Slot buffers are saved over the slots
        that hold tokens (copies, not the whole allocation; the capacity is recorded), with the valid-slot mask,
        the per-row counts, a fixed capacity's slot (:meth:`KVCacheState.state_dict`), the recurrent state and the
        kind's bookkeeping (MGK's centre). Restore with :meth:`load_state_dict` on a new cache of the same layer
        (``layer.new_cache()``).

        Returns:
            dict; its tensors are detached copies on the cache's device.
        """
        state = None if self.state is None else {
            "kv": self.state.kv.clone(), "k_sum": self.state.k_sum.clone(),
            "length": None if self.state.length is None else self.state.length.clone()}
        held = {**self.kv.state_dict(), "layout": self.layout, "owner": self._owner, "state": state,
                "extra": {name: plain(value, f"extra[{name!r}]") for name, value in self.extra.items()}}
        return {key: held[key] for key in _SAVED_KEYS}  # the order of the saved format

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` into this cache, which must be new (no call yet) and of the same layout
        (``layer.new_cache()`` of the layer that filled it, or one of the same class and sizes: a loaded cache
        serves the first layer it is called by). Its tensors stay on the device they were loaded on
        (``torch.load(..., map_location=...)``), which the next call must match.

        Raises:
            ValueError naming ``state_dict`` when it is not a cache's state dict, is of another layout, or this
            cache has had a call.
        """
        self._check_load(state_dict)
        self._load(state_dict)

    def _check_load(self, state_dict) -> None:
        """The checks of :meth:`load_state_dict`, nothing loaded (:class:`DecodingCache` checks every layer first)."""
        keys = set(_SAVED_KEYS)
        if not isinstance(state_dict, dict) or set(state_dict) != keys:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"state_dict must be a LayerCache.state_dict() with keys {sorted(keys)}, got {got}")
        if state_dict["layout"] != self.layout or dict(state_dict["slots"]) != self.slots:
            raise ValueError(f"state_dict holds a {state_dict['layout'] or 'layer'} cache with slots "
                             f"{state_dict['slots']}; this is a {self.layout or 'layer'} cache with slots {self.slots}")
        if self.seen is not None:
            raise ValueError("state_dict is loaded into a new cache (new_cache()); this one has had a call")
        self.kv.check_load({key: state_dict[key] for key in STATE_KEYS})

    def _load(self, sd: dict) -> None:
        """:meth:`load_state_dict` after :meth:`_check_load`."""
        self.kv.load_state_dict({key: sd[key] for key in STATE_KEYS})
        self._owner = None if sd["owner"] is None else tuple(sd["owner"])
        self._module = None
        self.extra = dict(sd["extra"])
        self.state = None if sd["state"] is None else LinearAttentionState(
            sd["state"]["kv"], sd["state"]["k_sum"], sd["state"]["length"])

    # -- sizes -----------------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of what attention reads: every entry over the slots in use (the tokens seen, padding included) and
        the recurrent state; bookkeeping and the slots ahead excluded."""
        return self.kv.nbytes() + (0 if self.state is None else self.state.nbytes())

    def allocated_bytes(self) -> int:
        """Bytes as allocated: the buffers at their capacity (slots ahead included) and the recurrent state."""
        return self.kv.allocated_bytes() + (0 if self.state is None else self.state.nbytes())

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
        stays; the host bound of ``seen.max()`` is taken again from the rows kept (:meth:`KVCacheState.select`).

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
        rows = self.kv.repeated_rows(repeats)
        if rows is not None:
            self._move_rows(self._check_rows(rows))

    def _check_rows(self, index, *, same_size: bool = False) -> Tensor | None:
        """``index`` as int64 on the cache's device (None before the first call), checked (:meth:`select`)."""
        index = self.kv.check_rows(index, same_size=same_size)
        if index is None:
            return None
        B = self.batch_size
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

        self.kv.move_rows(index)
        if self.state is not None:
            self.state = LinearAttentionState(rows(self.state.kv), rows(self.state.k_sum), rows(self.state.length))
        self.extra = {name: rows(t) if isinstance(t, Tensor) else t for name, t in self.extra.items()}

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (slots) and forget the rest; a negative ``length`` drops that many from
        the end (as transformers' ``crop``). The counts follow the valid-slot mask (:attr:`seen`, the host bound
        exact again, :attr:`padded`), the dropped slots are zeroed (a fixed capacity's slot moves back to the first
        of them, the capacity kept; :meth:`KVCacheState.crop`), and the kind puts its bookkeeping in line: the
        cache calls its layer's ``cache_cropped(cache)`` when the layer has one (MGK's centre,
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
        self.kv.truncate(keep)
        module = None if self._module is None else self._module()
        hook = getattr(module, "cache_cropped", None)
        if hook is not None:
            hook(self)

    def _check_crop(self, length) -> int:
        """The tokens :meth:`crop` keeps, checked (nothing changed)."""
        keep = self.kv.check_crop(length)
        if keep != self.length and self.extra and (self._module is None or self._module() is None):
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
        """Restore a :meth:`state_dict` into this new cache of the same model (``model.new_cache()``), all or
        nothing: every layer is checked before any is loaded, so a refused load leaves the cache new (a retry with
        the right state dict loads). ValueError naming ``state_dict`` for another number of layers, or as
        :meth:`LayerCache.load_state_dict`."""
        layers = state_dict.get("layers") if isinstance(state_dict, dict) else None
        if not isinstance(layers, (list, tuple)) or len(layers) != len(self.layers):
            got = len(layers) if isinstance(layers, (list, tuple)) else type(state_dict).__name__
            raise ValueError(f"state_dict must be a DecodingCache.state_dict() of {len(self.layers)} layers, got {got}")
        for layer, sd in zip(self.layers, layers):
            layer._check_load(sd)
        for layer, sd in zip(self.layers, layers):
            layer._load(sd)
