"""Multi-head attention with a mixture of Gaussian keys: MGK and sMGK (paper sections 3-4)."""
from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from ..functional import _mixture_flash
from ..functional._soft_e import mgk_attention_soft_e
from ..functional.mgk import mgk_attention, mgk_responsibilities
from . import _recompute
from .base import AttentionBase, _positive_int
from .mixture_keys import KEY_MODES, PI_MODES, PI_NORMS, PI_SHAPES, MixtureKeys, MixtureKeysMixin

__all__ = ["MGKAttention", "KEY_MODES", "PI_MODES", "PI_NORMS", "PI_SHAPES"]

# Soft-E: the pi each checkpointed forward read, per checkpoint region (weakly keyed: freed with the graph) and per
# module, replayed in call order by the region's recomputation. Outside the modules so that they stay picklable.
_REPLAY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class MGKAttention(MixtureKeysMixin, AttentionBase):
    """Transformer-MGK attention: each head's keys are a mixture of M Gaussians (paper eq. 9-10).

    Args:
        embed_dim, num_heads, head_dim, dropout, bias, kdim, vdim, batch_first: as :class:`AttentionBase`.
        num_keys: M, mixture components per key (the paper uses 2).
        keys: "separate" (MGK: M key projections) or "shifted" (sMGK: one key projection and learned offsets,
            ``k_r = x W_k - mu_r`` with ``mu_1 = 0``, others initialised from N(0, 0.5^2)).
        pi: "learned" (log-softmax of learned logits, never clamped), "soft_e" (a buffer set by the E-step in
            training, paper "+Soft-E"), or "hard_e" (max over components, paper "+Hard-E").
        pi_shape: for pi="learned", "head" (logits (H, M)), "position" (logits (H, M, max_len)) or "layer" (logits
            (1, M) shared by all heads and positions, the authors' LRA form).
        pi_norm: for pi="learned", "softmax" (the default) or "none": free log-weights, pi = exp(pi_logits), not
            normalised over the components (initialised at 1/M); with pi_shape="position" and
            ``sigma2=(sqrt(D), sqrt(D) / 3)`` this is the authors' LM MGK
            (``language-modeling/lmtool-fwms/src/mem_transformer.py:81-231``, update_mode ``rbf2keys``) without
            its clamp's dead gradient and without its ``+1e-6`` in the row normaliser. See
            :class:`mgk.attention.mixture_keys.MixtureKeys`.
        sigma2: per-component variances: None (sqrt(head_dim) for all), a float, or a sequence (list or tuple) of
            M floats (the authors' LM code used ``(sqrt(D), sqrt(D) / 3)``, ``mem_transformer.py:150-151``).
        max_len: longest key sequence; required by pi="soft_e" and pi_shape="position".

    The keys and weights live in the submodule ``mixture`` (:class:`mgk.attention.mixture_keys.MixtureKeys`,
    shared with MLK); ``k_proj``, ``key_shift``, ``pi_logits`` and ``pi`` remain readable here, and state dicts
    saved before that submodule existed still load.

    Soft-E: in training mode with gradients enabled, each forward computes the responsibilities of the components
    (without gradient; padded queries and masked pairs excluded), all-reduces their sums and counts when
    ``torch.distributed`` is initialised, and overwrites ``pi[:, :, :S]`` in place with their averages. The output of
    that forward uses the pi from before the update. Eval mode and ``torch.no_grad`` never change pi.
    Under activation checkpointing (``torch.utils.checkpoint``, reentrant or not) the E-step runs once, in the
    original forward (for ``use_reentrant=True`` that forward runs under ``no_grad`` and still updates pi), and the
    recomputation in backward reuses the pi that forward read and changes nothing, so pi and the gradients equal
    those without checkpointing (also with gradient accumulation and DDP ``no_sync``). Not recognised inside a
    ``torch.compile`` trace.

    Raises:
        ValueError for bad options, and in ``forward`` when S exceeds ``max_len`` (naming both).
    """

    backend: str | None = None  # mgk_attention's backend; None lets mgk.functional.select_backend pick

    def __init__(self, embed_dim: int, num_heads: int, *, num_keys: int = 2, keys: str = "separate",
                 pi: str = "learned", pi_shape: str = "head", pi_norm: str = "softmax", sigma2=None,
                 max_len: int | None = None, **kwargs):
        super().__init__(embed_dim, num_heads, **kwargs)
        M = _positive_int(num_keys, "num_keys")
        self.mixture = MixtureKeys(self.kdim, self.num_heads, self.head_dim, num_keys=M, keys=keys, pi=pi,
                                   pi_shape=pi_shape, pi_norm=pi_norm, max_len=max_len,
                                   bias=self.q_proj.bias is not None)
        if sigma2 is None:
            sigma2 = [math.sqrt(self.head_dim)] * M
        elif isinstance(sigma2, (int, float)):
            sigma2 = [float(sigma2)] * M
        # float64, so that a float64 module is exact (sqrt(D) / 3 is not a float32 number); each call casts the
        # variances to its compute dtype
        sigma2 = torch.as_tensor(sigma2, dtype=torch.float64).reshape(-1)
        if sigma2.numel() != M or not bool(torch.all(sigma2 > 0)):
            raise ValueError(f"sigma2 must be positive with one value per component ({M}), got {sigma2.tolist()}")
        self.register_buffer("sigma2", sigma2)
        if not torch.cuda.is_available():
            # Build or load the CPU kernel now, outside any torch.compile trace (a trace cannot build it and would
            # fall back to the SDPA form). Without a compiler this warns once and MGK uses the SDPA form.
            _mixture_flash.available(torch.empty(0), 0.0)

    def mixture_log_weights(self, S: int, pi: Tensor | None = None) -> Tensor | None:
        """log pi broadcastable to (B, H, M, S); None for Hard-E. Raises ValueError when S > max_len."""
        self.mixture.check_length(S, "MGKAttention")
        return self.mixture.log_weights(S, pi)

    def _soft_e_pi(self, S: int) -> tuple[Tensor | None, bool]:
        """(pi (H, M, S) to use, or None for the buffer; whether to run the E-step) for a Soft-E forward."""
        if not self.training:
            return None, False
        region = _recompute.checkpoint_region()
        if region is None:
            return None, torch.is_grad_enabled()
        if region.recomputing:
            used = _REPLAY.get(region.key, {}).get(id(self))
            if not used:  # a recomputation without a recorded forward (should not happen): use the buffer
                return None, False
            index, snapshots = used
            used[0] = index + 1
            return snapshots[index % len(snapshots)], False
        if not (region.reentrant or torch.is_grad_enabled()):
            return None, False  # checkpoint under no_grad: nothing will be recomputed, nothing learned
        entry = _REPLAY.setdefault(region.key, {}).setdefault(id(self), [0, []])
        snapshot = self.mixture.pi[:, :, :S].clone()
        entry[1].append(snapshot)  # calls in one region replay in call order
        return snapshot, True

    def _core(self, q, k, v, mask, is_causal, need_weights, query_mask, bias=None):
        S = k.shape[3]
        pi, update = self._soft_e_pi(S) if self.pi_mode == "soft_e" else (None, False)
        log_pi = self.mixture_log_weights(S, pi)
        mixture = "max" if self.pi_mode == "hard_e" else "sum"
        if update and bias is None and not need_weights:
            # The E-step's statistics from the forward's own score GEMMs (None: the kernel cannot serve the call).
            fused = mgk_attention_soft_e(q, k, v, log_pi=log_pi, sigma2=self.sigma2, attn_mask=mask,
                                         is_causal=is_causal, dropout_p=self.attn_dropout, query_mask=query_mask,
                                         backend=self.backend)
            if fused is not None:
                self._soft_e_apply(*fused[1:], k.shape[3])
                return fused[0], None
        result = mgk_attention(q, k, v, log_pi=log_pi, sigma2=self.sigma2, mixture=mixture, attn_mask=mask,
                               bias=bias, is_causal=is_causal, dropout_p=self.attn_dropout,
                               return_weights=need_weights, backend=self.backend)
        if update:
            self._soft_e_update(q, k, log_pi, mask, is_causal, query_mask)
        return result if need_weights else (result, None)

    @torch.no_grad()
    def _soft_e_update(self, q, k, log_pi, mask, is_causal, query_mask):
        resp, count = mgk_responsibilities(q, k, log_pi=log_pi, sigma2=self.sigma2, attn_mask=mask,
                                           is_causal=is_causal, query_mask=query_mask)
        self._soft_e_apply(resp, count, k.shape[3])

    @torch.no_grad()
    def _soft_e_apply(self, resp, count, S):
        """pi[:, :, :S] = resp / count where count > 0, after the all-reduce over DDP ranks."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Ranks may hold batches of different lengths: reduce over the whole buffer so that every rank sends
            # the same number of values, then update the positions any rank saw.
            H, M, T = self.mixture.pi.shape
            stats = resp.new_zeros(H, M + 1, T, dtype=torch.float64)
            stats[:, :M, :S] = resp
            stats[:, M, :S] = count
            dist.all_reduce(stats)
            resp, count = stats[:, :M], stats[:, M]
            S = T
        current = self.mixture.pi[:, :, :S]
        seen = (count > 0).unsqueeze(1)
        new = resp / count.clamp_min(1).unsqueeze(1)
        current.copy_(torch.where(seen, new.to(current.dtype), current))

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", num_keys={self.num_keys}, keys={self.keys!r}, pi={self.pi_mode!r}, "
                f"pi_shape={self.pi_shape!r}, pi_norm={self.pi_norm!r}, sigma2={self.sigma2.tolist()}, "
                f"max_len={self.max_len}")
