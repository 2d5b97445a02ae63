"""Multi-head linear attention and attention with a mixture of linear keys: linear, MLK and sMLK (paper eq. 14)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..functional.linear import linear_attention, mlk_attention
from .base import AttentionBase, _positive_int
from .mgk import KEY_MODES, PI_MODES, PI_SHAPES, MGKAttention


class LinearAttention(AttentionBase):
    """Linear attention with H heads of size D and the feature map ``elu(x) + 1`` (Katharopoulos et al. 2020).

    Args:
        embed_dim, num_heads, head_dim, bias, kdim, vdim: as :class:`AttentionBase`.
        dropout: accepted so that one constructor call builds every attention kind, but unused: linear attention
            never forms attention weights, so there is nothing to drop (the output is deterministic in training).
        eps: added to the denominator of :func:`mgk.functional.linear_attention`.

    ``forward`` is :meth:`AttentionBase.forward`. Only ``key_padding_mask`` and ``is_causal`` can be expressed;
    an ``attn_mask`` raises :class:`mgk.functional.MaskError`. ``need_weights=True`` returns the explicit
    (B, H, L, S) normalised weights (O(L S) memory).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, eps: float = 1e-6, **kwargs):
        super().__init__(embed_dim, num_heads, **kwargs)
        self.eps = float(eps)
        self.k_proj = nn.Linear(self.kdim, self.num_heads * self.head_dim, bias=self.q_proj.bias is not None)

    def _keys(self, key: Tensor) -> Tensor:
        return self._split(self.k_proj(key))

    def _core(self, q, k, v, mask, is_causal, need_weights, query_mask):
        result = linear_attention(q, k, v, attn_mask=mask, is_causal=is_causal, eps=self.eps,
                                  return_weights=need_weights)
        return result if need_weights else (result, None)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", eps={self.eps} (dropout unused)"


class MLKAttention(AttentionBase):
    """Linear attention with a mixture of M linear keys per position (MLK / sMLK, paper eq. 14).

    The key feature is ``phi~(k_j) = sum_r pi_r phi(k_jr)``; see :func:`mgk.functional.mlk_attention`.

    Args:
        embed_dim, num_heads, head_dim, bias, kdim, vdim: as :class:`AttentionBase`.
        dropout: accepted but unused, as in :class:`LinearAttention`.
        num_keys: M, mixture components per key (the paper uses 2).
        keys: "separate" (MLK: M key projections) or "shifted" (sMLK: one key projection and learned offsets
            ``k_r = x W_k - mu_r``, ``mu_1 = 0``), exactly as :class:`MGKAttention`.
        pi: only "learned" (log-softmax of learned logits, never clamped). Soft-E and Hard-E are defined through
            the Gaussian kernel of MGK and are rejected.
        pi_shape: "head" (logits (H, M)) or "position" (logits (H, M, max_len), needs ``max_len``).
        max_len: longest key sequence, for pi_shape="position".
        eps: added to the denominator.

    Raises:
        ValueError for bad options, and in ``forward`` when S exceeds ``max_len`` (naming both).
    """

    _keys = MGKAttention._keys  # same key projection and shift as MGK (needs k_proj, key_shift, keys, num_keys)

    def __init__(self, embed_dim: int, num_heads: int, *, num_keys: int = 2, keys: str = "separate",
                 pi: str = "learned", pi_shape: str = "head", max_len: int | None = None, eps: float = 1e-6,
                 **kwargs):
        super().__init__(embed_dim, num_heads, **kwargs)
        M = self.num_keys = _positive_int(num_keys, "num_keys")
        if keys not in KEY_MODES:
            raise ValueError(f"keys must be one of {KEY_MODES}, got {keys!r}")
        if pi != "learned":
            why = ("Soft-E and Hard-E are MGK ablations built on the Gaussian kernel" if pi in PI_MODES
                   else "unknown mode")
            raise ValueError(f"MLKAttention supports only pi='learned', got pi={pi!r} ({why})")
        if pi_shape not in PI_SHAPES:
            raise ValueError(f"pi_shape must be one of {PI_SHAPES}, got {pi_shape!r}")
        self.keys, self.pi_mode, self.pi_shape = keys, pi, pi_shape
        self.max_len = None if max_len is None else _positive_int(max_len, "max_len")
        if pi_shape == "position" and self.max_len is None:
            raise ValueError("pi_shape='position' needs max_len (the longest key sequence)")
        self.eps = float(eps)
        H, D = self.num_heads, self.head_dim
        bias = self.q_proj.bias is not None
        if keys == "separate":
            self.k_proj = nn.Linear(self.kdim, M * H * D, bias=bias)
        else:
            self.k_proj = nn.Linear(self.kdim, H * D, bias=bias)
            self.key_shift = nn.Parameter(torch.randn(M - 1, H, D) * 0.5)
        self.pi_logits = nn.Parameter(torch.zeros((H, M) if pi_shape == "head" else (H, M, self.max_len)))

    def mixture_log_weights(self, S: int) -> Tensor:
        """log pi broadcastable to (B, H, M, S). Raises ValueError when S > max_len for per-position weights."""
        if self.pi_shape == "head":
            return torch.log_softmax(self.pi_logits, dim=1).unsqueeze(0).unsqueeze(-1)
        if S > self.max_len:
            raise ValueError(f"key sequence length {S} exceeds max_len={self.max_len} of this MLKAttention "
                             f"(per-position mixture weights exist for {self.max_len} positions)")
        return torch.log_softmax(self.pi_logits[:, :, :S], dim=1).unsqueeze(0)

    def _core(self, q, k, v, mask, is_causal, need_weights, query_mask):
        log_pi = self.mixture_log_weights(k.shape[3])
        result = mlk_attention(q, k, v, log_pi=log_pi, attn_mask=mask, is_causal=is_causal, eps=self.eps,
                               return_weights=need_weights)
        return result if need_weights else (result, None)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", num_keys={self.num_keys}, keys={self.keys!r}, pi={self.pi_mode!r}, "
                f"pi_shape={self.pi_shape!r}, max_len={self.max_len}, eps={self.eps} (dropout unused)")
