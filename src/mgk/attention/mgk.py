"""Multi-head attention with a mixture of Gaussian keys: MGK and sMGK (paper sections 3-4)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..functional import _mixture_flash
from ..functional.mgk import mgk_attention, mgk_responsibilities
from .base import AttentionBase, _positive_int

KEY_MODES = ("separate", "shifted")
PI_MODES = ("learned", "soft_e", "hard_e")
PI_SHAPES = ("head", "position")


class MGKAttention(AttentionBase):
    """Transformer-MGK attention: each head's keys are a mixture of M Gaussians (paper eq. 9-10).

    Args:
        embed_dim, num_heads, head_dim, dropout, bias, kdim, vdim: as :class:`AttentionBase`.
        num_keys: M, mixture components per key (the paper uses 2).
        keys: "separate" (MGK: M key projections) or "shifted" (sMGK: one key projection and learned offsets,
            ``k_r = x W_k - mu_r`` with ``mu_1 = 0``, others initialised from N(0, 0.5^2)).
        pi: "learned" (log-softmax of learned logits, never clamped), "soft_e" (a buffer set by the E-step in
            training, paper "+Soft-E"), or "hard_e" (max over components, paper "+Hard-E").
        pi_shape: for pi="learned", "head" (logits (H, M)) or "position" (logits (H, M, max_len)).
        sigma2: per-component variances: None (sqrt(head_dim) for all), a float, or a sequence of M floats
            (the authors' LM code used ``[sqrt(D), sqrt(D) / 3]``).
        max_len: longest key sequence; required by pi="soft_e" and pi_shape="position".

    Soft-E: in training mode with gradients enabled, each forward computes the responsibilities of the components
    (without gradient; padded queries and masked pairs excluded), all-reduces their sums and counts when
    ``torch.distributed`` is initialised, and overwrites ``pi[:, :, :S]`` in place with their averages. The output of
    that forward uses the pi from before the update. Eval mode and ``torch.no_grad`` never change pi.

    Raises:
        ValueError for bad options, and in ``forward`` when S exceeds ``max_len`` (naming both).
    """

    backend: str | None = None  # mgk_attention's backend; None lets mgk.functional.select_backend pick

    def __init__(self, embed_dim: int, num_heads: int, *, num_keys: int = 2, keys: str = "separate",
                 pi: str = "learned", pi_shape: str = "head", sigma2=None, max_len: int | None = None, **kwargs):
        super().__init__(embed_dim, num_heads, **kwargs)
        M = self.num_keys = _positive_int(num_keys, "num_keys")
        if keys not in KEY_MODES:
            raise ValueError(f"keys must be one of {KEY_MODES}, got {keys!r}")
        if pi not in PI_MODES:
            raise ValueError(f"pi must be one of {PI_MODES}, got {pi!r}")
        if pi_shape not in PI_SHAPES:
            raise ValueError(f"pi_shape must be one of {PI_SHAPES}, got {pi_shape!r}")
        self.keys, self.pi_mode, self.pi_shape = keys, pi, pi_shape
        self.max_len = None if max_len is None else _positive_int(max_len, "max_len")
        needs_len = pi == "soft_e" or (pi == "learned" and pi_shape == "position")
        if needs_len and self.max_len is None:
            raise ValueError(f"pi={pi!r} with per-position weights needs max_len (the longest key sequence)")
        H, D = self.num_heads, self.head_dim
        bias = self.q_proj.bias is not None
        if keys == "separate":
            self.k_proj = nn.Linear(self.kdim, M * H * D, bias=bias)
        else:
            self.k_proj = nn.Linear(self.kdim, H * D, bias=bias)
            self.key_shift = nn.Parameter(torch.randn(M - 1, H, D) * 0.5)
        if sigma2 is None:
            sigma2 = [math.sqrt(D)] * M
        elif isinstance(sigma2, (int, float)):
            sigma2 = [float(sigma2)] * M
        sigma2 = torch.as_tensor(sigma2, dtype=torch.float32).reshape(-1)
        if sigma2.numel() != M or not bool(torch.all(sigma2 > 0)):
            raise ValueError(f"sigma2 must be positive with one value per component ({M}), got {sigma2.tolist()}")
        self.register_buffer("sigma2", sigma2)
        if pi == "learned":
            shape = (H, M) if pi_shape == "head" else (H, M, self.max_len)
            self.pi_logits = nn.Parameter(torch.zeros(shape))
        elif pi == "soft_e":
            self.register_buffer("pi", torch.full((H, M, self.max_len), 1.0 / M))
        if not torch.cuda.is_available():
            # Build or load the CPU kernel now, outside any torch.compile trace (a trace cannot build it and would
            # fall back to the SDPA form). Without a compiler this warns once and MGK uses the SDPA form.
            _mixture_flash.available(torch.empty(0), 0.0)

    def _keys(self, key: Tensor) -> Tensor:
        B, S, _ = key.shape
        H, D, M = self.num_heads, self.head_dim, self.num_keys
        if self.keys == "separate":
            return self.k_proj(key).view(B, S, M, H, D).permute(0, 3, 2, 1, 4)
        k = self._split(self.k_proj(key)).unsqueeze(2)  # (B, H, 1, S, D)
        shift = torch.cat([self.key_shift.new_zeros(1, H, D), self.key_shift], dim=0)  # (M, H, D), mu_1 = 0
        return k - shift.transpose(0, 1).unsqueeze(0).unsqueeze(3).to(k.dtype)

    def mixture_log_weights(self, S: int) -> Tensor | None:
        """log pi broadcastable to (B, H, M, S); None for Hard-E. Raises ValueError when S > max_len."""
        if self.max_len is not None and S > self.max_len and self.pi_mode != "hard_e":
            raise ValueError(f"key sequence length {S} exceeds max_len={self.max_len} of this MGKAttention "
                             f"(per-position mixture weights exist for {self.max_len} positions)")
        if self.pi_mode == "hard_e":
            return None
        if self.pi_mode == "soft_e":
            return self.pi[:, :, :S].clamp_min(torch.finfo(self.pi.dtype).tiny).log().unsqueeze(0)
        logits = self.pi_logits if self.pi_shape == "head" else self.pi_logits[:, :, :S]
        lp = torch.log_softmax(logits, dim=1)
        return lp.unsqueeze(0).unsqueeze(-1) if self.pi_shape == "head" else lp.unsqueeze(0)

    def _core(self, q, k, v, mask, is_causal, need_weights, query_mask):
        S = k.shape[3]
        log_pi = self.mixture_log_weights(S)
        mixture = "max" if self.pi_mode == "hard_e" else "sum"
        result = mgk_attention(q, k, v, log_pi=log_pi, sigma2=self.sigma2, mixture=mixture, attn_mask=mask,
                               is_causal=is_causal, dropout_p=self.attn_dropout, return_weights=need_weights, backend=self.backend)
        if self.pi_mode == "soft_e" and self.training and torch.is_grad_enabled():
            self._soft_e_update(q, k, log_pi, mask, is_causal, query_mask)
        return result if need_weights else (result, None)

    @torch.no_grad()
    def _soft_e_update(self, q, k, log_pi, mask, is_causal, query_mask):
        resp, count = mgk_responsibilities(q, k, log_pi=log_pi, sigma2=self.sigma2, attn_mask=mask,
                                           is_causal=is_causal, query_mask=query_mask)
        S = k.shape[3]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Ranks may hold batches of different lengths: reduce over the whole buffer so that every rank sends
            # the same number of values, then update the positions any rank saw.
            H, M, T = self.pi.shape
            stats = resp.new_zeros(H, M + 1, T, dtype=torch.float64)
            stats[:, :M, :S] = resp
            stats[:, M, :S] = count
            dist.all_reduce(stats)
            resp, count = stats[:, :M], stats[:, M]
            S = T
        current = self.pi[:, :, :S]
        seen = (count > 0).unsqueeze(1)
        new = resp / count.clamp_min(1).unsqueeze(1)
        current.copy_(torch.where(seen, new.to(current.dtype), current))

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", num_keys={self.num_keys}, keys={self.keys!r}, pi={self.pi_mode!r}, "
                f"sigma2={self.sigma2.tolist()}, max_len={self.max_len}")
