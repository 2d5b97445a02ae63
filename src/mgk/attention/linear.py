"""Multi-head linear attention and attention with a mixture of linear keys: linear, MLK and sMLK (paper eq. 14)."""
from __future__ import annotations

from torch import Tensor, nn

from ..functional.linear import linear_attention, mlk_attention
from . import module_masks
from .base import AttentionBase
from .mixture_keys import PI_MODES, MixtureKeys, MixtureKeysMixin


class _KeyMasksOnly:
    """Linear attention sums over keys once for all queries, so masks can remove keys (padding) or apply the
    causal order, nothing that varies per query; float masks only as 0 / -inf (there are no logits to bias)."""

    _takes_bias = False

    def _attn_mask_hook(self, attn_mask, is_causal: bool, L: int, S: int):
        # torch's Transformer layers pass the causal mask as attn_mask (as float, converted back to bool here),
        # with or without the is_causal hint: take it as is_causal, which linear attention computes directly.
        if module_masks.is_causal_mask(attn_mask, L, S):
            return None, True
        return attn_mask, is_causal


class LinearAttention(_KeyMasksOnly, AttentionBase):
    """Linear attention with H heads of size D and the feature map ``elu(x) + 1`` (Katharopoulos et al. 2020).

    Args:
        embed_dim, num_heads, head_dim, bias, kdim, vdim, batch_first: as :class:`AttentionBase`.
        dropout: accepted so that one constructor call builds every attention kind, but unused: linear attention
            never forms attention weights, so there is nothing to drop (the output is deterministic in training).
        eps: added to the denominator of :func:`mgk.functional.linear_attention`.

    ``forward`` is :meth:`AttentionBase.forward`. Only ``key_padding_mask`` and ``is_causal`` can be expressed: an
    ``attn_mask`` equal to the causal mask is taken as ``is_causal=True``, any other raises
    :class:`mgk.functional.MaskError`; float masks may hold only 0 (allowed) and -inf (not allowed). ``need_weights=True`` returns the explicit
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


class MLKAttention(MixtureKeysMixin, _KeyMasksOnly, AttentionBase):
    """Linear attention with a mixture of M linear keys per position (MLK / sMLK, paper eq. 14).

    The key feature is ``phi~(k_j) = sum_r pi_r phi(k_jr)``; see :func:`mgk.functional.mlk_attention`.

    Args:
        embed_dim, num_heads, head_dim, bias, kdim, vdim, batch_first: as :class:`AttentionBase`.
        dropout: accepted but unused, as in :class:`LinearAttention`.
        num_keys: M, mixture components per key (the paper uses 2).
        keys: "separate" (MLK: M key projections) or "shifted" (sMLK: one key projection and learned offsets
            ``k_r = x W_k - mu_r``, ``mu_1 = 0``), exactly as :class:`MGKAttention`: both hold the keys and weights
            in the same submodule ``mixture`` (:class:`mgk.attention.mixture_keys.MixtureKeys`).
        pi: only "learned" (log-softmax of learned logits, never clamped). Soft-E and Hard-E are defined through
            the Gaussian kernel of MGK and are rejected.
        pi_shape: "head" (logits (H, M)) or "position" (logits (H, M, max_len), needs ``max_len``).
        max_len: longest key sequence, for pi_shape="position".
        eps: added to the denominator.

    Masks as :class:`LinearAttention`.

    Raises:
        ValueError for bad options, and in ``forward`` when S exceeds ``max_len`` (naming both).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_keys: int = 2, keys: str = "separate",
                 pi: str = "learned", pi_shape: str = "head", max_len: int | None = None, eps: float = 1e-6,
                 **kwargs):
        super().__init__(embed_dim, num_heads, **kwargs)
        if pi != "learned":
            why = ("Soft-E and Hard-E are MGK ablations built on the Gaussian kernel" if pi in PI_MODES
                   else "unknown mode")
            raise ValueError(f"MLKAttention supports only pi='learned', got pi={pi!r} ({why})")
        self.mixture = MixtureKeys(self.kdim, self.num_heads, self.head_dim, num_keys=num_keys, keys=keys, pi=pi,
                                   pi_shape=pi_shape, max_len=max_len, bias=self.q_proj.bias is not None)
        self.eps = float(eps)

    def mixture_log_weights(self, S: int) -> Tensor:
        """log pi broadcastable to (B, H, M, S). Raises ValueError when S > max_len for per-position weights."""
        self.mixture.check_length(S, "MLKAttention")
        return self.mixture.log_weights(S)

    def _core(self, q, k, v, mask, is_causal, need_weights, query_mask):
        log_pi = self.mixture_log_weights(k.shape[3])
        result = mlk_attention(q, k, v, log_pi=log_pi, attn_mask=mask, is_causal=is_causal, eps=self.eps,
                               return_weights=need_weights)
        return result if need_weights else (result, None)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", num_keys={self.num_keys}, keys={self.keys!r}, pi={self.pi_mode!r}, "
                f"pi_shape={self.pi_shape!r}, max_len={self.max_len}, eps={self.eps} (dropout unused)")
