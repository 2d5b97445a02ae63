"""The recurrent state of causal linear / MLK attention (Katharopoulos et al. 2020, Section 3.4, "Transformers are
RNNs"): the running key-value sum, the running normaliser and the number of real keys each row has seen.

:func:`mgk.functional.linear_attention` and :func:`mgk.functional.mlk_attention` take one as ``initial_state`` and
return the next with ``output_final_state=True`` (the convention of flash-linear-attention's ops), so that a prompt is
prefilled in one chunked call and every later call adds one token (or a few) to the sums.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LinearAttentionState:
    """Running sums of causal linear/MLK attention, in float32 (float64 for float64 inputs).

    Attributes:
        kv: (B, H, D', Dv), ``sum_j phi~(k_j) v_j^T`` over the keys seen so far.
        k_sum: (B, H, D'), ``sum_j phi~(k_j)``.
        length: (B, H) int64, the number of real (unpadded) keys in the sums; None in a state built by hand, which
            is then taken to hold keys wherever ``k_sum`` is non-zero. ``normalize="length"`` needs it.

    Bytes: ``H (D' Dv + D')`` numbers per sequence whatever the length (plus the counts).
    """

    kv: Tensor
    k_sum: Tensor
    length: Tensor | None = None

    def nbytes(self) -> int:
        """Bytes of the sums ``kv`` and ``k_sum`` (the counts are bookkeeping, not counted)."""
        return self.kv.numel() * self.kv.element_size() + self.k_sum.numel() * self.k_sum.element_size()


@dataclass(frozen=True)
class Prior:
    """A checked initial state in the compute dtype: sums (B, H, D', Dv) and (B, H, D'), counts (B, H) int64 or
    None, and ``seen`` (B, H, 1, 1) bool: rows whose sums hold a key."""

    kv: Tensor
    k_sum: Tensor
    length: Tensor | None
    seen: Tensor


def check_state(state, B: int, H: int, Dk: int, Dv: int, dtype) -> Prior:
    """``state`` (a :class:`LinearAttentionState`) for a call with B rows, H heads, feature size Dk and value size Dv,
    cast to ``dtype``. ValueError naming ``initial_state`` for another type or shapes."""
    if not isinstance(state, LinearAttentionState):
        raise ValueError(f"initial_state must be a LinearAttentionState or None, got {type(state).__name__}")
    want = (B, H, Dk, Dv)
    if tuple(state.kv.shape) != want or tuple(state.k_sum.shape) != want[:3]:
        raise ValueError(f"initial_state has kv {tuple(state.kv.shape)} and k_sum {tuple(state.k_sum.shape)}; this "
                         f"call needs {want} and {want[:3]} (B, H, feature size D', value size Dv)")
    length = state.length
    if length is not None and (not isinstance(length, Tensor) or tuple(length.shape) != (B, H)
                               or length.is_floating_point()):
        what = tuple(length.shape) if isinstance(length, Tensor) else type(length).__name__
        raise ValueError(f"initial_state.length must be an integer tensor of shape (B, H) = {(B, H)}, got {what}")
    kv, k_sum = state.kv.to(dtype), state.k_sum.to(dtype)
    seen = (k_sum != 0).any(dim=-1) if length is None else length > 0
    return Prior(kv, k_sum, length, seen.view(B, H, 1, 1))


def final_state(prior: Prior | None, phi_k: Tensor, v: Tensor, keep: Tensor | None) -> LinearAttentionState:
    """The state after adding the (masked) key features phi_k (B, H, S, D') and values v (B, H, S, Dv) to ``prior``
    (None: an empty state)."""
    B, H, S = phi_k.shape[:3]
    kv = phi_k.transpose(-1, -2) @ v
    k_sum = phi_k.sum(dim=-2)
    added = (torch.full((B, H), S, dtype=torch.int64, device=phi_k.device) if keep is None
             else keep.sum(dim=-1).to(torch.int64).expand(B, H))
    if prior is None:
        return LinearAttentionState(kv, k_sum, added)
    base = prior.length if prior.length is not None else torch.zeros_like(added)
    return LinearAttentionState(prior.kv + kv, prior.k_sum + k_sum, base.to(added.device) + added)
