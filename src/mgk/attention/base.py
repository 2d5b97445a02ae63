"""Projection and mask plumbing shared by every attention module.

Modules are drop-ins for ``torch.nn.MultiheadAttention``: inputs (B, L, E) with ``batch_first=True`` (our default,
kept for backward compatibility; torch's default is False) or (L, B, E) with ``batch_first=False``;
``key_padding_mask`` (B, S) and ``attn_mask`` (L, S) / (B*H, L, S) / (B, H, L, S) follow torch's documentation: bool
True = not allowed, float = added to the attention logits (-inf = not allowed). The masks are converted once here
to the functional core's convention (bool, True = may attend); see :mod:`mgk.attention.module_masks`.
"""
from __future__ import annotations

import abc

from torch import Tensor, nn

from ..functional import masks as _masks
from . import module_masks


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


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
        batch_first: inputs and output are (B, T, E) when True (default), (T, B, E) when False, as in
            ``nn.MultiheadAttention`` (whose default is False).

    ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` accept these modules as ``self_attn`` /
    ``multihead_attn``: their eval-mode fast path reads ``in_proj_bias`` and ``_qkv_same_embed_dim``, which are None
    and False here (no packed projection), so it declines and they call ``forward`` like any attention.
    """

    # Read by torch's Transformer layers to decide on their fused fast path, which needs nn.MultiheadAttention.
    _qkv_same_embed_dim = False
    in_proj_weight = None
    in_proj_bias = None
    # Whether a float bias (from a float mask) can be added to the logits; linear attention has none.
    _takes_bias = True

    def __init__(self, embed_dim: int, num_heads: int, *, head_dim: int | None = None, dropout: float = 0.0,
                 bias: bool = True, kdim: int | None = None, vdim: int | None = None, batch_first: bool = True):
        super().__init__()
        if not isinstance(batch_first, bool):
            raise ValueError(f"batch_first must be a bool, got {batch_first!r}")
        self.batch_first = batch_first
        self.embed_dim = _positive_int(embed_dim, "embed_dim")
        self.num_heads = _positive_int(num_heads, "num_heads")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim ({embed_dim}) is not divisible by num_heads ({num_heads}); "
                                 "pass head_dim explicitly")
            head_dim = embed_dim // num_heads
        self.head_dim = _positive_int(head_dim, "head_dim")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.dropout = float(dropout)
        self.kdim = _positive_int(kdim if kdim is not None else embed_dim, "kdim")
        self.vdim = _positive_int(vdim if vdim is not None else embed_dim, "vdim")
        width = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(self.embed_dim, width, bias=bias)
        self.v_proj = nn.Linear(self.vdim, width, bias=bias)
        self.out_proj = nn.Linear(width, self.embed_dim, bias=bias)

    # -- hooks for subclasses -------------------------------------------------------------------------------
    @abc.abstractmethod
    def _keys(self, key: Tensor) -> Tensor:
        """Project key inputs (B, S, kdim) to (B, H, S, D) or (B, H, M, S, D)."""

    @abc.abstractmethod
    def _core(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, need_weights: bool,
              query_mask: Tensor | None):
        """Attention on projected heads; returns ((B, H, L, D), weights (B, H, L, S) or None)."""

    # -- shared ------------------------------------------------------------------------------------------------
    def _split(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

    @property
    def attn_dropout(self) -> float:
        """Dropout probability in effect now (0 in eval mode)."""
        return self.dropout if self.training else 0.0

    def _check_inputs(self, query, key, value):
        layout = "(B, T, {})" if self.batch_first else "(T, B, {})"
        for name, x, width in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != width:
                shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"{name} must have shape {layout.format(width)} (batch_first={self.batch_first}), "
                                 f"got {shape}")
        b = 0 if self.batch_first else 1
        if key.shape[b] != query.shape[b] or value.shape[:2] != key.shape[:2]:
            raise ValueError(f"batch/length mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                             f"value {tuple(value.shape)} (batch_first={self.batch_first})")

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                need_weights: bool = False):
        """Attend from ``query`` (B, L, E) to ``key`` (B, S, kdim) / ``value`` (B, S, vdim) ((L, B, E) etc. when
        ``batch_first=False``); self-attention when key and value are None. Returns ``(output (B, L, E) or
        (L, B, E), weights (B, H, L, S) or None)``. Masks as in the module docstring; ``is_causal=True`` with an
        ``attn_mask`` (torch's hint that the mask is causal) applies both.

        Raises ValueError naming the argument for wrong ranks or sizes; MaskError for masks of other dtypes/shapes.
        """
        self_attention = key is None or key is query
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        if not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, L, _ = query.shape
        S = key.shape[1]
        key_padding_mask, attn_mask, bias = module_masks.split_masks(
            key_padding_mask, attn_mask, B, self.num_heads, L, S, bias_ok=self._takes_bias,
            owner=type(self).__name__)
        attn_mask, is_causal = self._attn_mask_hook(attn_mask, is_causal, L, S)
        mask = _masks.from_module_masks(key_padding_mask, attn_mask, B, L, S, self.num_heads)
        query_mask = (~key_padding_mask) if (self_attention and key_padding_mask is not None) else None
        q = self._split(self.q_proj(query))
        k = self._keys(key)
        v = self._split(self.v_proj(value))
        extra = {} if bias is None else {"bias": bias}  # subclasses outside this package may not take a bias
        out, weights = self._core(q, k, v, mask, is_causal, need_weights, query_mask, **extra)
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim))
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _attn_mask_hook(self, attn_mask, is_causal: bool, L: int, S: int):
        """Subclasses that cannot take a query-dependent mask may recognise a causal one here."""
        return attn_mask, is_causal

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"dropout={self.dropout}, batch_first={self.batch_first}")
