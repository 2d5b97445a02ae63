"""Transformer blocks around any attention module (pre-LN for LRA, post-LN for the WikiText-103 decoder)."""
from __future__ import annotations

from torch import Tensor, nn

from ..attention import AttentionConfig


class FeedForward(nn.Module):
    """Position-wise MLP ``Linear(E, F) -> activation -> dropout -> Linear(F, E)``; activation "gelu" or "relu"."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float, activation: str = "gelu"):
        super().__init__()
        acts = {"gelu": nn.GELU, "relu": nn.ReLU}
        if activation not in acts:
            raise ValueError(f"activation must be one of {tuple(acts)}, got {activation!r}")
        self.net = nn.Sequential(nn.Linear(d_model, ffn_dim), acts[activation](), nn.Dropout(dropout),
                                 nn.Linear(ffn_dim, d_model))

    def forward(self, x: Tensor) -> Tensor:
        """(..., E) -> (..., E), each position on its own."""
        return self.net(x)


class TransformerBlock(nn.Module):
    """Self-attention + feed-forward with residuals; ``norm_first`` True is pre-LN, False post-LN.

    Args:
        d_model: width E.
        attention: an :class:`~mgk.attention.AttentionConfig` (built here for width ``d_model``), or an attention
            module with the ``forward(x, *, key_padding_mask, need_weights, is_causal)`` signature of
            :class:`mgk.attention.base.AttentionBase` (called with ``need_weights=False``).
        ffn_dim, dropout, activation: of the feed-forward part; dropout also applies to both residual branches.
    Forward: x (B, L, E), key_padding_mask bool (B, L) True = padding -> (B, L, E); with ``past_key_values`` (the
    attention's layer cache, :mod:`mgk.attention.cache`) x holds the new tokens only and the attention decodes.
    """

    def __init__(self, d_model: int, attention: AttentionConfig | nn.Module, ffn_dim: int, dropout: float, *,
                 activation: str = "gelu", norm_first: bool = True):
        super().__init__()
        self.attn = attention.build(d_model) if isinstance(attention, AttentionConfig) else attention
        self.ffn = FeedForward(d_model, ffn_dim, dropout, activation)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None, is_causal: bool = False,
                past_key_values=None) -> Tensor:
        """x (B, L, E) -> (B, L, E) as the class docstring says; ``is_causal`` and ``past_key_values`` go to the
        attention, which raises for a mask, cache or shape it cannot take."""
        # a module from outside mgk may not take past_key_values: it is passed only when decoding
        extra = {} if past_key_values is None else {"past_key_values": past_key_values}
        if self.norm_first:
            h = self.norm1(x)
            x = x + self.drop(self.attn(h, key_padding_mask=key_padding_mask, need_weights=False,
                                        is_causal=is_causal, **extra)[0])
            return x + self.drop(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.drop(self.attn(x, key_padding_mask=key_padding_mask, need_weights=False,
                                               is_causal=is_causal, **extra)[0]))
        return self.norm2(x + self.drop(self.ffn(x)))
