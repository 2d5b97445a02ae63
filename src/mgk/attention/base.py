"""Projection and mask plumbing shared by every attention module.

Modules are drop-ins for ``torch.nn.MultiheadAttention``: the same ``forward`` signature, defaults and returns
(positional ``query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal``;
batched or unbatched inputs; weights averaged over heads by default). The layout is chosen at construction and has
no default: ``batch_first=True`` reads (B, T, E), ``batch_first=False`` reads (T, B, E) (torch's default). Masks
follow torch's documentation: ``key_padding_mask`` (B, S) or (S,) unbatched, ``attn_mask`` (L, S) /
(B*H, L, S) / (B, H, L, S); bool True = not allowed, float = added to the attention logits (-inf = not allowed).
They are converted once here to the functional core's convention (bool, True = may attend); see
:mod:`mgk.attention.module_masks`.

Decoding: ``forward(x, past_key_values=cache, is_causal=True, need_weights=False)`` with the layer's cache
(:meth:`AttentionBase.new_cache`, :mod:`mgk.attention.cache`) attends from the new tokens x to every token the cache
has seen and to themselves, adds them to the cache in place and returns ``(output, None)``. It is for inference only
(under ``torch.no_grad()`` / ``torch.inference_mode()``): a cached call that would record gradients is a ValueError.
"""
from __future__ import annotations

import abc

import torch
from torch import Tensor, nn

from ..functional import masks as _masks
from ..functional.decoding_state import DecodingState
from ..functional.kv_state import KVCacheState
from . import module_masks
from .cache import LayerCache

# a decoding cache stores a padding token as zeros, and has no per-key slot for a bias added to the logits
_CACHE_NO_BIAS = "with past_key_values it only marks padding among the new tokens"
_LAYOUTS = ("batch_first=True for (B, T, E) inputs, or batch_first=False for (T, B, E) inputs "
            "(torch.nn.MultiheadAttention's default)")


def positive_int(value, name: str) -> int:
    """``value`` when it is an int >= 1 (not a bool); ValueError naming ``name`` otherwise (heads, head sizes, key
    groups: every size an attention module or a conversion takes)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def factory_kwargs(device=None, dtype=None) -> dict:
    """``{"device": ..., "dtype": ...}`` for creating a module's parameters and buffers, as torch's modules take
    them (``nn.MultiheadAttention(..., device=, dtype=)``); None keeps torch's default for either.

    Args:
        device: None, a ``torch.device``, or what ``torch.device`` reads ("cpu", "cuda:0", "meta", an index).
        dtype: None or a floating-point ``torch.dtype`` (``torch.float64``, ``torch.bfloat16``, ...).
    Returns:
        the dict, device as a ``torch.device`` (or None).
    Raises:
        ValueError naming ``device`` when it is not a device, or one this machine lacks; naming ``dtype`` when it is
        not a floating-point dtype (attention's weights are real numbers with gradients).
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be None or a floating-point torch.dtype (e.g. torch.float32), got {dtype!r}")
    if device is not None:
        given = device
        try:
            device = torch.device(device)
            torch.empty(0, device=device)  # a device this build or machine lacks fails here, not mid-construction
        except (RuntimeError, TypeError, AssertionError) as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"device must be a torch.device or device name available here (e.g. 'cpu'), got "
                             f"{given!r}: {why}") from None
    return {"device": device, "dtype": dtype}


class AttentionBase(nn.Module, abc.ABC):
    """Query/value/output projections, head split and mask conversion; subclasses supply keys and the core.

    Args:
        embed_dim: model width E of the inputs and output.
        num_heads: H.
        head_dim: D per head; default ``embed_dim // num_heads``. May differ from E / H (the paper fixes D = 32 on
            LRA and varies H), so the attention width is H * D.
        dropout: dropout probability on attention weights, applied in training mode only.
        bias: whether the projections have biases.
        kdim, vdim: widths of key and value inputs (default embed_dim).
        batch_first: required keyword: True for inputs and output (B, T, E), False for (T, B, E), as in
            ``nn.MultiheadAttention`` (whose default is False). There is no default because a module built with one
            layout and set into a torch layer of the other would attend across the batch without any error
            (torch's layers default to False, mgk's models use True).
        device, dtype: where and in which floating dtype the parameters and buffers are created, as torch's factory
            keywords (``nn.MultiheadAttention(..., device=, dtype=)``; "meta" builds without memory); default
            torch's. Subclasses create their own parameters and buffers the same way (:func:`factory_kwargs`).

    Raises:
        TypeError when ``batch_first`` is not given; ValueError naming the argument for bad sizes, a ``dtype`` that
        is not floating-point or a ``device`` that is not available.

    ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` accept these modules as ``self_attn`` /
    ``multihead_attn``: their eval-mode fast path reads ``in_proj_bias`` and ``_qkv_same_embed_dim``, which are None
    and False here (no packed projection), so it declines and they call ``forward`` like any attention.
    :func:`mgk.swap_attention` does the replacement, with the layout and the weights carried over.
    """

    # Read by torch's Transformer layers to decide on their fused fast path, which needs nn.MultiheadAttention.
    _qkv_same_embed_dim = False
    in_proj_weight = None
    in_proj_bias = None
    # Whether a float bias (from a float mask) can be added to the logits; linear attention has none.
    _takes_bias = True
    # Multiplies each head's output before out_proj (Michel et al. 2019, "Are Sixteen Heads Really Better than
    # One?", eq. 2): (H,) for every example or (B, H) per example, None = no gate. Set by mgk.analyze.prune.
    head_gate: Tensor | None = None

    def __init__(self, embed_dim: int, num_heads: int, *, head_dim: int | None = None, dropout: float = 0.0,
                 bias: bool = True, kdim: int | None = None, vdim: int | None = None,
                 batch_first: bool | None = None, device=None, dtype=None):
        super().__init__()
        factory = factory_kwargs(device, dtype)
        if batch_first is None:
            raise TypeError(f"{type(self).__name__} needs batch_first: pass {_LAYOUTS}")
        if not isinstance(batch_first, bool):
            raise ValueError(f"batch_first must be a bool, got {batch_first!r}")
        self.batch_first = batch_first
        self.embed_dim = positive_int(embed_dim, "embed_dim")
        self.num_heads = positive_int(num_heads, "num_heads")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim ({embed_dim}) is not divisible by num_heads ({num_heads}); "
                                 "pass head_dim explicitly")
            head_dim = embed_dim // num_heads
        self.head_dim = positive_int(head_dim, "head_dim")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.dropout = float(dropout)
        self.kdim = positive_int(kdim if kdim is not None else embed_dim, "kdim")
        self.vdim = positive_int(vdim if vdim is not None else embed_dim, "vdim")
        width = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(self.embed_dim, width, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, self.kv_heads * self.head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(width, self.embed_dim, bias=bias, **factory)

    @property
    def kv_heads(self) -> int:
        """Heads of the values (and of the keys, for kinds with one key per head): H here; fewer for grouped-query
        attention, whose module sets them before this base's constructor runs."""
        return self.num_heads

    # Whether the kind's weights depend on the key position (then _core takes key_positions (B, S) int64 with a
    # key_padding_mask): mixture kinds with per-position weights.
    _position_weighted = False

    # -- hooks for subclasses -------------------------------------------------------------------------------
    @abc.abstractmethod
    def _keys(self, key: Tensor) -> Tensor:
        """Project key inputs (B, S, kdim) to (B, H, S, D) or (B, H, M, S, D)."""

    def _core_keys(self, key: Tensor) -> Tensor:
        """The keys as :meth:`_core` takes them: :meth:`_keys` here (MGK: each key head's compact projection)."""
        return self._keys(key)

    @abc.abstractmethod
    def _core(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, need_weights: bool,
              query_mask: Tensor | None):
        """Attention on projected heads; returns ((B, H, L, D), weights (B, H, L, S) or None)."""

    def _cached_core(self, q: Tensor, x: Tensor, v: Tensor, valid: Tensor | None, cache: LayerCache) -> Tensor:
        """Attention of the new tokens (queries q (B, H, L, D), inputs x (B, L, E), values v (B, H', L, Dv); ``valid``
        (B, L) bool True = real token, or None) over ``cache`` and themselves, adding them to it: one call into the
        cache's state (:attr:`LayerCache.state`). A kind without a decoding cache (a subclass outside mgk) raises
        ValueError."""
        raise ValueError(f"{type(self).__name__} has no decoding cache: call it without past_key_values")

    def cache_ready_to_fix(self, cache: LayerCache) -> bool:
        """Whether ``cache`` (this layer's) may now be fixed at a capacity (:meth:`LayerCache.fix_capacity`, the
        static cache a compiled step runs over): its state's ``ready_to_fix``, once it has had its first call (the
        prefill), or once it is settled for a state that settles later (MGK: its centre)."""
        return cache.ready_to_fix

    def _values(self, value: Tensor) -> Tensor:
        """Project value inputs (B, S, vdim) to (B, H', S, Dv), H' = :attr:`kv_heads`."""
        return self._split(self.v_proj(value), self.kv_heads)

    def _attn_mask_hook(self, attn_mask, is_causal: bool, L: int, S: int):
        """An ``attn_mask`` (bool, True = not allowed) equal to the causal mask is taken as ``is_causal=True``
        (:func:`module_masks.causal_hint`), so that MGK and softmax keep their causal kernels. Not inside a
        torch.compile / export trace, where comparing the mask's values would break the graph and the explicit
        mask gives the same outputs; subclasses that cannot take a query-dependent mask recognise it there too."""
        if torch.compiler.is_compiling():
            return attn_mask, is_causal
        return module_masks.causal_hint(attn_mask, is_causal, L, S)

    # -- shared ------------------------------------------------------------------------------------------------
    def _split(self, x: Tensor, heads: int | None = None) -> Tensor:
        """(B, T, heads * D) -> (B, heads, T, D); ``heads`` defaults to num_heads."""
        B, T, _ = x.shape
        return x.view(B, T, heads or self.num_heads, self.head_dim).transpose(1, 2)

    # The per-token entries a decoding cache of this kind stores: name -> slot dimension (empty: a recurrent state).
    cache_slots: dict[str, int] = {}

    @property
    def cache_layout(self) -> str:
        """The name of what this layer's cache holds (a cache filled by a layer of another layout is refused)."""
        return type(self).__name__

    def new_cache(self, capacity: int | None = None) -> LayerCache:
        """An empty decoding cache for this layer (:class:`mgk.attention.cache.LayerCache` holding this kind's
        decoding state, :meth:`_decoding_state`, with its :attr:`cache_slots`), room for ``capacity`` tokens
        allocated at its first call (default that call's length; it grows by doubling). Pass it as
        ``past_key_values``."""
        return LayerCache(self._decoding_state(capacity), layout=self.cache_layout)

    def _decoding_state(self, capacity: int | None) -> DecodingState:
        """The kind's empty decoding state: a :class:`mgk.functional.KVCacheState` of :attr:`cache_slots` here."""
        return KVCacheState(self.cache_slots, capacity, layout=self.cache_layout)

    # -- conversion (mgk.swap_attention) -----------------------------------------------------------------------------
    def per_head_projections(self) -> dict[str, Tensor]:
        """This layer's projections as those of a multi-head layer with H heads (detached): ``q_proj``, ``k_proj``,
        ``v_proj`` and ``out_proj`` weights (and biases, when present) by those names, what
        :func:`mgk.swap_attention` carries to the new kind (:meth:`load_projections`)."""
        out = {f"{p}.{n}": t.detach() for p in ("q_proj", "v_proj", "out_proj")
               for n, t in getattr(self, p).named_parameters()}
        out.update({f"k_proj.{n}": t.detach() for n, t in self._key_projection().items()})
        return out

    def _key_projection(self) -> dict[str, Tensor]:
        """``{"weight": (H*D, kdim), "bias": (H*D,)}``: the key projection as H heads (a mixture's components' mean,
        :class:`mgk.attention.mixture_keys.MixtureKeysMixin`)."""
        proj = getattr(self, "k_proj", None)
        if not isinstance(proj, nn.Linear):
            raise ValueError(f"{type(self).__name__} has no key projection k_proj to carry over")
        return dict(proj.named_parameters())

    def load_projections(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        """The kind's conversion rule: this layer's parameters, by name, made from another layer's
        :meth:`per_head_projections` (same widths). This base copies every projection of the same name and shape
        (exact for kinds with one key per head); kinds with other keys override it. Returns the parameters set."""
        params = dict(self.named_parameters())
        return {n: t for n, t in weights.items() if n in params and params[n].shape == t.shape}

    @property
    def attn_dropout(self) -> float:
        """Dropout probability in effect now (0 in eval mode)."""
        return self.dropout if self.training else 0.0

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None,
                key_padding_mask: Tensor | None = None, need_weights: bool = True, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True, is_causal: bool = False, *,
                past_key_values: LayerCache | None = None):
        """Attend from ``query`` to ``key`` / ``value``, as ``nn.MultiheadAttention.forward`` (same arguments, order
        and defaults), or decode with ``past_key_values``.

        Args:
            query: (B, L, E) with ``batch_first=True``, (L, B, E) with False, or (L, E) unbatched.
            key, value: (B, S, kdim) / (B, S, vdim) in the same layout, or (S, kdim) / (S, vdim) unbatched. Both
                None is self-attention (``key = value = query``), a shortcut ``nn.MultiheadAttention`` lacks.
            key_padding_mask: (B, S), or (S,) unbatched; bool True = padding, or float added to the logits.
            need_weights: also return the attention weights (default True, as torch; mgk's own models pass False,
                since the weights take O(L S) memory and a slower path).
            attn_mask: (L, S), (B*H, L, S) (unbatched: (H, L, S)) or (B, H, L, S); bool True = not allowed, or float.
                An (L, S) mask that is exactly the bottom-right causal mask (torch's Transformer layers pass it) runs
                as ``is_causal=True`` (:meth:`_attn_mask_hook`).
            average_attn_weights: return the weights averaged over heads (default), else per head.
            is_causal: the bottom-right causal mask. With an ``attn_mask`` (torch's hint that it is causal) both
                apply; without one it applies alone (torch then raises; here it is the causal mask itself).
            past_key_values: keyword only: this layer's decoding cache (:meth:`new_cache`), updated in place. Then
                the call is causal self-attention of the new tokens ``query`` over the cache and themselves
                (``key`` / ``value`` None, ``is_causal=True``, no ``attn_mask``, ``need_weights=False``);
                ``key_padding_mask`` (B, L) marks padding among the new tokens (left padding of prompts of different
                lengths), which is never attended and not counted in the rows' positions. Decoding is inference:
                with gradients enabled while the input or a parameter requires grad the call is refused (ValueError),
                since the cache holds detached entries; decode under ``torch.no_grad()`` /
                ``torch.inference_mode()``, and train through the uncached forward, whose gradients are exact.
        Returns:
            ``(output, weights)``: output shaped like ``query`` with E features; weights None without
            ``need_weights``, else (B, L, S) averaged / (B, H, L, S) per head ((L, S) / (H, L, S) unbatched), float.
            Differences from torch: a query row with no allowed key gives a zero output and zero weights (torch:
            NaN); in training the weights are those before attention dropout.
        Raises:
            ValueError naming the argument for wrong ranks or sizes, or ``past_key_values`` for a cached call that
            would record gradients; MaskError for masks of other dtypes/shapes.
        """
        if past_key_values is not None:
            return self._forward_cached(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal,
                                        past_key_values)
        self_attention = key is None or key is query
        key = query if key is None else key
        value = key if value is None else value
        batched = self._check_inputs(query, key, value, key_padding_mask)
        query, key, value, key_padding_mask = self._batch_first(query, key, value, key_padding_mask, batched)
        B, L, S = query.shape[0], query.shape[1], key.shape[1]
        mask, is_causal, bias, query_mask = self._masks(key_padding_mask, attn_mask, is_causal, B, L, S,
                                                        self_attention)
        q, k, v = self._split(self.q_proj(query)), self._core_keys(key), self._values(value)
        extra = {} if bias is None else {"bias": bias}  # subclasses outside this package may not take a bias
        if key_padding_mask is not None and self._position_weighted and (
                torch.compiler.is_compiling() or module_masks.shifts_positions(key_padding_mask)):
            # per-position weights are read at each row's own positions (counted from its first real key), as the
            # decoding cache counts them: a left-padded row gives what it gives alone (eagerly, right padding
            # shifts nothing, so it keeps the default positions and the fused Soft-E path; a trace cannot ask)
            extra["key_positions"] = module_masks.key_positions(key_padding_mask)
        out, weights = self._core(q, k, v, mask, is_causal, need_weights, query_mask, **extra)
        if self.head_gate is not None:
            out = out * self._gate_shape(self.head_gate, B)
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim))
        return self._outputs(out, weights if need_weights else None, batched, average_attn_weights)

    def _forward_cached(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal, cache):
        """:meth:`forward` with ``past_key_values``: checks, projections, :meth:`_cached_core`, output."""
        if not isinstance(cache, LayerCache) or cache.layout != self.cache_layout:
            got = f"a {cache.layout} cache" if isinstance(cache, LayerCache) else type(cache).__name__
            raise ValueError(f"past_key_values must be this layer's cache (a {self.cache_layout} cache, from "
                             f"new_cache()), got {got}")
        wrong = [why for bad, why in (
            ((key is not None and key is not query) or (value is not None and value is not query),
             "key / value None (self-attention of the new tokens)"),
            (not is_causal, "is_causal=True"), (attn_mask is not None, "no attn_mask"),
            (need_weights, "need_weights=False")) if bad]
        if wrong:
            raise ValueError(f"decoding with past_key_values needs {', '.join(wrong)}")
        batched = self._check_inputs(query, query, query, key_padding_mask)
        x, _, _, key_padding_mask = self._batch_first(query, query, query, key_padding_mask, batched)
        B, L = x.shape[0], x.shape[1]
        key_padding_mask, _, _ = module_masks.split_masks(key_padding_mask, None, B, self.num_heads, L, L,
                                                          bias_ok=False, owner=type(self).__name__, why=_CACHE_NO_BIAS)
        valid = None
        if key_padding_mask is not None:
            _masks.from_module_masks(key_padding_mask, None, B, L, L, self.num_heads)  # dtype and shape checks
            valid = ~key_padding_mask
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            # Caches hold detached entries, so a graph through them would give partial gradients (and a backward
            # through later steps met entries rewritten in place): decoding is inference only.
            raise ValueError("past_key_values is for inference: this call would record gradients (grad enabled and "
                             "the input or a parameter requires grad); decode under torch.no_grad() or "
                             "torch.inference_mode(), or call without past_key_values (the uncached forward gives "
                             "exact gradients)")
        if L > 0 or cache.seen is not None:  # an empty first chunk leaves a new cache unbound
            cache.bind(self._cache_owner(), B, x.device, self)
        if L == 0:  # an empty chunk (of a chunked prefill) adds nothing and attends to nothing, whatever the kind
            width = self.num_heads * self.head_dim
            return self._outputs(self.out_proj(x.new_zeros(B, 0, width)), None, batched, True)
        q, v = self._split(self.q_proj(x)), self._values(x)
        out = self._cached_core(q, x, v, valid, cache)
        if self.head_gate is not None:  # decoding sees the same gated heads as the full forward
            out = out * self._gate_shape(self.head_gate, B)
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim))
        return self._outputs(out, None, batched, True)

    def _cache_owner(self) -> tuple:
        """What a cache filled by this layer is checked against (:meth:`mgk.attention.cache.LayerCache.bind`, also
        after ``load_state_dict``): the class and every size that shapes its entries (a cache of 2 key/value heads
        read by a layer of 1 would attend over the wrong heads silently)."""
        sizes = {"num_heads": self.num_heads, "head_dim": self.head_dim, "kv_heads": self.kv_heads,
                 "keys": getattr(self, "keys", None), "num_keys": getattr(self, "num_keys", None)}
        return (type(self).__name__, *(f"{k}={v}" for k, v in sizes.items() if v is not None))

    def _gate_shape(self, gate: Tensor, B: int) -> Tensor:
        """:attr:`head_gate` (H,) or (B, H) as (B or 1, H, 1, 1); ValueError naming it for another shape."""
        H = self.num_heads
        if gate.shape not in ((H,), (B, H)):
            raise ValueError(f"head_gate must have shape (num_heads,) = ({H},) or (B, num_heads) = ({B}, {H}), "
                             f"got {tuple(gate.shape)}")
        return gate.reshape(-1, H, 1, 1)

    def _check_inputs(self, query, key, value, key_padding_mask) -> bool:
        """Whether the inputs are batched; ValueError naming the argument for wrong ranks, widths or sizes."""
        batched = isinstance(query, Tensor) and query.dim() == 3
        layout = ("(B, T, {})" if self.batch_first else "(T, B, {})") if batched else "(T, {})"
        for name, x, width in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if not isinstance(x, Tensor) or x.dim() != (3 if batched else 2) or x.shape[-1] != width:
                shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"{name} must have shape {layout.format(width)} (batch_first={self.batch_first}; "
                                 f"a query (T, {self.embed_dim}) is unbatched), got {shape}")
        b = (0 if self.batch_first else 1) if batched else None
        if (batched and key.shape[b] != query.shape[b]) or value.shape[:-1] != key.shape[:-1]:
            raise ValueError(f"batch/length mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                             f"value {tuple(value.shape)} (batch_first={self.batch_first})")
        if not batched and isinstance(key_padding_mask, Tensor) and key_padding_mask.dim() != 1:
            raise _masks.MaskError(f"key_padding_mask of unbatched inputs must have shape (S,) = "
                                   f"({key.shape[0]},), got {tuple(key_padding_mask.shape)}")
        return batched

    def _batch_first(self, query, key, value, key_padding_mask, batched: bool):
        """The inputs as (B, T, E) and the padding mask as (B, S)."""
        if not batched:
            pad = key_padding_mask.unsqueeze(0) if isinstance(key_padding_mask, Tensor) else key_padding_mask
            return query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), pad
        if not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        return query, key, value, key_padding_mask

    def _masks(self, key_padding_mask, attn_mask, is_causal: bool, B: int, L: int, S: int, self_attention: bool):
        """(core mask bool True = may attend or None, is_causal, float bias or None, query mask or None)."""
        key_padding_mask, attn_mask, bias = module_masks.split_masks(
            key_padding_mask, attn_mask, B, self.num_heads, L, S, bias_ok=self._takes_bias,
            owner=type(self).__name__)
        attn_mask, is_causal = self._attn_mask_hook(attn_mask, is_causal, L, S)
        mask = _masks.from_module_masks(key_padding_mask, attn_mask, B, L, S, self.num_heads)
        query_mask = (~key_padding_mask) if (self_attention and key_padding_mask is not None) else None
        return mask, is_causal, bias, query_mask

    def _outputs(self, out: Tensor, weights: Tensor | None, batched: bool, average: bool):
        """Output (B, L, E) in the caller's layout; weights averaged over heads when ``average``."""
        if weights is not None and average:
            weights = weights.mean(dim=1)
        if not batched:
            return out.squeeze(0), (None if weights is None else weights.squeeze(0))
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"dropout={self.dropout}, batch_first={self.batch_first}")
