"""Decoding caches: one object per attention layer, updated in place by the layer's ``forward(...,
past_key_values=cache)``, and :class:`DecodingCache`, one per model (a cache per layer).

The anchor is Hugging Face's ``past_key_values`` objects (``DynamicCache``), so the drop-in ``forward`` keeps
returning ``(output, weights)``: a layer called with a cache attends from its new tokens to every token the cache has
seen and to themselves (causally, bottom-right aligned), then adds them to the cache. The first call is the prefill
(any length), every later call one token or a few.

Every kind's layer fills the same holder, :class:`LayerCache` (one per layer, as flash-linear-attention's
``Cache``): the layer it serves (its class and sizes) and the kind's decoding state (:attr:`LayerCache.state`), one
object beside its op in :mod:`mgk.functional` that owns its tensors and does a whole cached call. The layer's cached
call is one call into it, for every kind: :func:`mgk.functional.softmax_cache_step` on a
:class:`mgk.functional.KVCacheState` (softmax and GQA: keys and values (B, H or G, T, D)),
:meth:`mgk.functional.MGKDecodeState.step` (MGK: the M component keys centred and divided by sigma_r^2
(B, H, M, T, D), the per-key scalars ``log pi_jr - |k~_jr|^2 / (2 sigma_r^2)`` (B, H, M, T) and the values; sMGK
the one unshifted centred key (B, H, T, D) instead of M, the shifts applied when the cache is read; gMGK the same for
its G key groups; :mod:`mgk.functional.mgk_cache`), :meth:`mgk.functional.LinearCacheState.step` (linear and MLK:
no slots, the sums (S, z) of :class:`mgk.functional.LinearAttentionState`, of a fixed size whatever the length).
Each state keeps one small protocol (:mod:`mgk.functional.decoding_state`: rows, lengths, cast, sizes, saving), and
the holder answers its public names through it, with no branch for any kind.

The registry's :class:`mgk.attention.registry.CacheSpec` of each kind is the formula of those bytes; the tests hold
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
``.to(torch.bfloat16)``) casts the cache to the dtype its entries are made in then (each state casts itself, for
every kind). A cache is saved as plain tensors and ints (:meth:`LayerCache.state_dict` / ``load_state_dict``, and
:class:`DecodingCache`'s, for ``torch.save`` and ``torch.load(..., weights_only=True)``: a prompt's cache kept on
disk); the object itself refers to its layer and is not pickled (a TypeError in one line says so). A dict of any
other form is refused in one line naming the format it must have.

Rows and lengths (beam search, assisted decoding; :mod:`mgk.integrations.hf.cache` calls them): every kind's cache
reorders, selects and repeats its rows (:meth:`~mgk.functional.decoding_state.DecodingState.reorder`, ``select``,
``repeat_interleave``), every per-row tensor moving with its row (a state's bookkeeping, such as MGK's centre, has
the B rows as dim 0: checked at each move). A cache of per-token entries drops its last tokens (``crop``, a fixed
capacity's slot moving back with them), its state putting its own bookkeeping in line (MGK's centre); a recurrent
state has no tokens to drop and refuses in one line.

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

from ..functional.decoding_state import DecodingState
from ..functional.kv_state import STATE_KEYS, KVCacheState, check_capacity, token_positions

__all__ = ["DecodingCache", "LayerCache", "check_capacity", "token_positions"]


# The keys of LayerCache.state_dict(), in the order of the saved format: the layer's, then its state's.
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


class LayerCache(_SavedByStateDict):
    """One layer's decoding cache for a batch of B rows: every kind's layer fills this one class, a thin holder of
    the layer binding and of the kind's decoding state (:attr:`state`), whose protocol
    (:mod:`mgk.functional.decoding_state`) answers the public names below.

    Args:
        state: the kind's decoding state (the layer's ``new_cache`` makes it: :class:`mgk.functional.KVCacheState`,
            :class:`mgk.functional.MGKDecodeState`, :class:`mgk.functional.LinearCacheState`, or any state keeping
            the protocol); or the per-token entries of a plain :class:`mgk.functional.KVCacheState`, name -> slot
            dimension (e.g. ``{"keys": 2, "values": 2}`` for (B, H, T, D) buffers).
        capacity: with slots, tokens to allocate room for at the first call (default that call's length); buffers
            grow by doubling when full. A state is made with its own.
        layout: the name of the kind's layout, checked when a layer is handed a cache (a cache of another layout is
            refused in one line).

    Attributes:
        state: the kind's decoding state; the attributes and methods below are its (through the protocol).
        length: tokens (padding included) this layer has been called with since it was created.
        seen: (B,) int64, real tokens per row (None before the first call).
        slots, capacity, batch_size, fixed, padded, ready_to_fix: the state's. Its methods are answered here too
            (documented there): positions, last_position, reserve, append, claim, entries, write_slot, key_valid,
            attn_mask, check_fixed_call, fix_capacity, room, advance, cast, nbytes, allocated_bytes, extra_bytes,
            select, reorder, repeat_interleave, crop.
    Raises:
        ValueError naming ``capacity`` unless it is None or a positive int (given with slots only).
    """

    def __init__(self, state: DecodingState | dict[str, int] | None = None, capacity: int | None = None, *,
                 layout: str = ""):
        if state is None or isinstance(state, dict):
            state = KVCacheState(state, capacity, layout=layout)
        elif capacity is not None:
            raise ValueError("capacity is given with slots; a decoding state is made with its own capacity")
        self.state = state
        self.layout = layout
        self._owner: tuple | None = None
        self._module = None  # weakref.ref of the layer that filled the cache (bind's check, nothing called on it)

    @property
    def extra(self) -> dict:
        """The state's bookkeeping, name -> tensor or plain value (MGK's centre and kept keys; empty before the
        first call, and for kinds that keep none): a read-only view, what ``state_dict()["extra"]`` saves."""
        return self.state.bookkeeping()

    def emptied(self) -> LayerCache:
        """A new, empty cache of the same layout and kind (:meth:`mgk.functional.KVCacheState.empty`)."""
        return type(self)(self.state.empty(), layout=self.layout)

    def bind(self, owner: tuple, B: int, device, module=None) -> None:
        """Check that this cache serves the layer described by ``owner`` (its class and sizes) with B rows on
        ``device``, and is the cache of ``module`` itself (held by a weak reference: two layers of the same class
        and sizes sharing one cache would silently mix their keys); the first call sets them. ValueError naming
        ``past_key_values`` otherwise."""
        if self._owner is None:
            self._owner = owner
            self._module = None if module is None else weakref.ref(module)
            self.state.start(B, device)
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

    # -- saving (prompt caching to disk) ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything this cache holds, as plain tensors, ints, bools, strings and None in dicts and tuples, so that
        ``torch.save(cache.state_dict(), f)`` and ``torch.load(f, weights_only=True)`` keep a prompt's cache on disk
        (the cache object itself is not pickled: it refers to its layer): the layout, the layer's sizes and the
        state's :meth:`mgk.functional.KVCacheState.state_dict` (slot buffers over the slots that hold tokens, the
        valid-slot mask, the per-row counts, a fixed capacity's slot, a recurrent state's sums, the bookkeeping such
        as MGK's centre). Restore with :meth:`load_state_dict` on a new cache of the same layer
        (``layer.new_cache()``).

        Returns:
            dict with the keys of the saved format, in its order; its tensors are detached copies on the cache's
            device.
        """
        held = {**self.state.state_dict(), "layout": self.layout, "owner": self._owner}
        return {key: held[key] for key in _SAVED_KEYS}  # the order of the saved format

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` into this cache, which must be new (no call yet) and of the same layout
        (``layer.new_cache()`` of the layer that filled it, or one of the same class and sizes: a loaded cache
        serves the first layer it is called by). Its tensors stay on the device they were loaded on
        (``torch.load(..., map_location=...)``), which the next call must match.

        Raises:
            ValueError naming ``state_dict`` when it is not a cache's state dict of the saved format, is of another
            layout, or this cache has had a call.
        """
        self._check_load(state_dict)
        self._load(state_dict)

    def _check_load(self, state_dict) -> None:
        """The checks of :meth:`load_state_dict`, nothing loaded (:class:`DecodingCache` checks every layer first)."""
        keys = set(_SAVED_KEYS)
        if not isinstance(state_dict, dict) or set(state_dict) != keys:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"state_dict must be a LayerCache.state_dict() with keys {sorted(keys)} (the saved "
                             f"format of mgk's decoding caches), got {got}")
        if state_dict["layout"] != self.layout or dict(state_dict["slots"]) != self.slots:
            raise ValueError(f"state_dict holds a {state_dict['layout'] or 'layer'} cache with slots "
                             f"{state_dict['slots']}; this is a {self.layout or 'layer'} cache with slots {self.slots}")
        if self.seen is not None:
            raise ValueError("state_dict is loaded into a new cache (new_cache()); this one has had a call")
        self.state.check_load({key: state_dict[key] for key in STATE_KEYS})

    def _load(self, sd: dict) -> None:
        """:meth:`load_state_dict` after :meth:`_check_load`."""
        self.state.load_state_dict({key: sd[key] for key in STATE_KEYS})
        self._owner = None if sd["owner"] is None else tuple(sd["owner"])
        self._module = None

    # -- what DecodingCache checks on every layer before it changes any -------------------------------------------
    def _check_rows(self, index, *, same_size: bool = False) -> Tensor | None:
        return self.state.check_rows(index, same_size=same_size)

    def _move_rows(self, index: Tensor | None) -> None:
        self.state.move_rows(index)

    def _check_crop(self, length) -> int:
        return self.state.check_crop(length)


def _forwarded(name: str, target: str, settable: bool) -> property:
    """A :class:`LayerCache` attribute that is its state's ``target`` (read, and written when ``settable``)."""
    doc = getattr(getattr(KVCacheState, target, None), "__doc__", None) or f"The state's {target}."

    def read(self):
        """The state's attribute."""
        return getattr(self.state, target)

    def write(self, value):
        """Set the state's attribute."""
        setattr(self.state, target, value)

    return property(read, write if settable else None, doc=doc)


# The protocol names a holder answers through its state: attributes read (and written) there, methods called there.
for _name, _target, _settable in (
        *((n, n, True) for n in ("slots", "capacity", "length", "seen")),
        *((n, n, False) for n in ("batch_size", "fixed", "padded", "ready_to_fix", "positions", "last_position",
                                  "reserve", "append", "check_fixed_call", "fix_capacity", "room", "advance",
                                  "claim", "entries", "write_slot", "key_valid", "attn_mask", "cast", "nbytes",
                                  "allocated_bytes", "extra_bytes", "select", "reorder", "repeat_interleave",
                                  "crop")),
        ("_buffers", "buffers", False), ("_slot", "slot", False)):
    setattr(LayerCache, _name, _forwarded(_name, _target, _settable))


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
