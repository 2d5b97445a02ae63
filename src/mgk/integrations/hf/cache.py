"""mgk's decoding caches as Hugging Face cache layers.

A transformers ``Cache`` (``DynamicCache``, what ``generate`` and the models create) is a list of per-layer objects
(``cache.layers``). An mgk attention layer keeps what its kind needs (:mod:`mgk.attention.cache`: MGK its M keys per
token, sMGK one key, linear attention and MLK a fixed-size state) in its own :class:`mgk.attention.cache.LayerCache`,
so :func:`mgk_layer` puts an :class:`MGKCacheLayer` holding that cache in the layer's slot of the model's cache on the
layer's first cached call. The HF cache's length and mask sizes are then read from mgk's cache; the tensors stored
are mgk's and nothing else (no key/value copy in HF's layout).

Beam search (``num_beams > 1``: ``reorder_cache`` after every step), ``batch_select_indices`` /
``batch_repeat_interleave`` and assisted decoding (``crop`` of the rejected draft tokens) work for every kind: each
moves or cuts mgk's cache (:meth:`mgk.attention.cache.LayerCache.reorder` and the rest). A recurrent state (linear
attention, MLK) has no tokens to drop: its layer says ``is_croppable`` False, which assisted decoding checks.
Offloading is refused.
"""
from __future__ import annotations

import weakref

from torch import nn
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from ...attention.cache import LayerCache

__all__ = ["MGKCacheLayer", "mgk_layer"]


class MGKCacheLayer(CacheLayerMixin):
    """One layer's slot in a transformers ``Cache``, holding that layer's mgk cache (:attr:`mgk_cache`, filled by the
    mgk module's ``forward(..., past_key_values=...)``).

    ``keys`` / ``values`` stay None: what is stored is :attr:`mgk_cache`'s (e.g. MGK's (B, H, M, T, D) keys in
    ``mgk_cache._buffers``); :meth:`nbytes` is its size, ``B * CacheSpec.cache_bytes`` of the kind.

    What transformers calls on a cache layer (directly or through ``DynamicCache``'s method of the same name):
    ``get_seq_length``, ``get_mask_sizes``, ``get_max_length``, ``lazy_initialization`` (nothing to do),
    ``prefetch`` (nothing was offloaded) and ``reset`` (an empty cache of the same kind, which the next call
    fills) work, and so do the row and length methods of beam search and assisted decoding, on mgk's cache
    (:mod:`mgk.attention.cache`, "Rows and lengths"): ``reorder_cache``, ``batch_select_indices``,
    ``batch_repeat_interleave`` and ``crop`` (refused in one line by a recurrent state, whose
    :attr:`is_croppable` is False). ``offload`` raises NotImplementedError in one line naming what to use instead;
    ``update`` (transformers' key/value write) raises RuntimeError.

    Args:
        layer_cache: the layer's empty or filled mgk cache.
        new_cache: what makes an empty one of the same kind (the layer's ``new_cache``; held weakly, as the
            mgk cache holds its layer); default one with ``layer_cache``'s slots and layout.
    """

    is_compileable = False
    is_sliding = False
    # set by HFAttention's first cached call: several packed sequences share each row, so no step may follow
    packed = False

    def __init__(self, layer_cache: LayerCache, new_cache=None):
        super().__init__()
        self.mgk_cache = layer_cache
        self._new_cache = None if new_cache is None else weakref.WeakMethod(new_cache)

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to allocate ahead: mgk's cache allocates at its first call."""

    def update(self, key_states, value_states, *args, **kwargs):
        """RuntimeError: an mgk layer fills :attr:`mgk_cache` through its own forward, never HF keys/values."""
        raise RuntimeError("an mgk attention layer writes its cache through its own forward; this layer's slot holds "
                           "mgk's cache, not HF keys and values")

    def get_seq_length(self, *args) -> int:
        """Tokens this layer has been called with (padding included, as HF counts them)."""
        return self.mgk_cache.length

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        """(key length, offset) of the mask for ``query`` new tokens (an int; older transformers pass the
        cache positions (L,))."""
        L = query if isinstance(query, int) else query.shape[0]
        return self.mgk_cache.length + L, 0

    def get_max_length(self) -> int:
        """-1: mgk's caches grow without a maximum length."""
        return -1

    def get_max_cache_shape(self) -> int:
        """-1, as :meth:`get_max_length` (the method's name in transformers before 5.x)."""
        return -1

    def reset(self) -> None:
        """Empty the cache: a new mgk cache of the same kind (its layer's ``new_cache()``; an empty one of the same
        state and layout when the layer is gone), filled by the next call as at the start."""
        factory = None if self._new_cache is None else self._new_cache()
        old = self.mgk_cache
        self.mgk_cache = factory() if factory is not None else old.emptied()
        self.packed = False

    def offload(self):
        """Refused: mgk's caches stay on the device they were filled on (NotImplementedError in one line naming
        what to use instead)."""
        raise NotImplementedError("offload: mgk's decoding caches stay on their device; use a DynamicCache "
                                  "without offloading (cache_implementation='dynamic')")

    def prefetch(self):
        """Nothing to do: mgk's caches are never offloaded."""

    def nbytes(self) -> int:
        """Bytes attention reads from this layer's cache (:meth:`mgk.attention.cache.LayerCache.nbytes`)."""
        return self.mgk_cache.nbytes()

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can drop tokens (what assisted decoding asks after the prefill): a cache of per-token
        entries can; a recurrent state (linear attention, MLK) cannot."""
        return bool(self.mgk_cache.slots)

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: row i becomes row ``beam_idx[i]`` (a (B,) int64 tensor, repeats allowed;
        :meth:`mgk.attention.cache.LayerCache.reorder`). ValueError naming ``index`` for bad rows."""
        self.mgk_cache.reorder(beam_idx)

    def batch_select_indices(self, indices) -> None:
        """Keep the rows ``indices`` ((B',) integer tensor; :meth:`mgk.attention.cache.LayerCache.select`)."""
        self.mgk_cache.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times, each copy next to its row
        (:meth:`mgk.attention.cache.LayerCache.repeat_interleave`)."""
        self.mgk_cache.repeat_interleave(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers 5.x passes a negative count, and 0 for
        nothing); a positive value is the length to keep (the older ``crop(max_length)``; one beyond the tokens held
        keeps them all). :meth:`mgk.attention.cache.LayerCache.crop`: ValueError in one line for a recurrent state
        (linear attention, MLK; :attr:`is_croppable` False) when tokens would be dropped."""
        if isinstance(tokens_to_remove, int) and not isinstance(tokens_to_remove, bool) and tokens_to_remove >= 0:
            if tokens_to_remove == 0 or tokens_to_remove >= self.mgk_cache.length:
                return
        self.mgk_cache.crop(tokens_to_remove)


def mgk_layer(cache, layer_idx: int, module: nn.Module) -> MGKCacheLayer:
    """The :class:`MGKCacheLayer` of layer ``layer_idx`` in the transformers ``cache``: the one there, or a new one
    (``module.new_cache()``) in place of an empty ``DynamicLayer`` (what ``DynamicCache`` holds before the first
    call, or nothing yet for a lazily grown one). ValueError in one line for another cache layer (a ``StaticCache``,
    a quantised or offloaded cache, or HF keys already stored)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        raise ValueError(f"past_key_values must be a transformers Cache with per-layer slots (DynamicCache, "
                         f"generate's default), got {type(cache).__name__}")
    if getattr(cache, "offloading", False):
        raise ValueError(f"past_key_values is an offloading {type(cache).__name__}: mgk attention layers keep their "
                         "own cache on their device; pass a DynamicCache without offloading (generate's default)")
    while len(layers) <= layer_idx:
        layers.append(DynamicLayer())
    layer = layers[layer_idx]
    if isinstance(layer, MGKCacheLayer):
        return layer
    if type(layer) is not DynamicLayer or layer.get_seq_length() != 0:
        raise ValueError(f"past_key_values layer {layer_idx} is a {type(layer).__name__} of {type(cache).__name__}"
                         f"{' holding HF keys' if type(layer) is DynamicLayer else ''}: mgk attention layers keep "
                         "their own cache; pass a new DynamicCache (generate's default) or none")
    layers[layer_idx] = MGKCacheLayer(module.new_cache(), module.new_cache)
    return layers[layer_idx]
