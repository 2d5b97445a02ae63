"""Multi-head softmax attention, the baseline (batch_first, ``nn.MultiheadAttention`` conventions)."""
from __future__ import annotations

from torch import Tensor, nn

from ..functional.softmax import softmax_attention, softmax_attention_reference
from .base import AttentionBase


class MultiheadAttention(AttentionBase):
    """Softmax attention with H heads of size D (Vaswani et al. 2017), through SDPA.

    Same constructor (``batch_first`` included) and ``forward`` as :class:`mgk.attention.base.AttentionBase`.
    ``need_weights=True`` takes the explicit path and returns the (B, H, L, S) weights, per head (torch averages
    them over heads by default). Float masks are added to the logits, as in ``nn.MultiheadAttention``.
    """

    def __init__(self, embed_dim: int, num_heads: int, **kwargs):
        super().__init__(embed_dim, num_heads, **kwargs)
        self.k_proj = nn.Linear(self.kdim, self.num_heads * self.head_dim, bias=self.q_proj.bias is not None)

    def _keys(self, key: Tensor) -> Tensor:
        return self._split(self.k_proj(key))

    def _core(self, q, k, v, mask, is_causal, need_weights, query_mask, bias=None):
        if need_weights:
            return softmax_attention_reference(q, k, v, attn_mask=mask, bias=bias, is_causal=is_causal,
                                               dropout_p=self.attn_dropout, return_weights=True)
        return softmax_attention(q, k, v, attn_mask=mask, bias=bias, is_causal=is_causal,
                                 dropout_p=self.attn_dropout), None
