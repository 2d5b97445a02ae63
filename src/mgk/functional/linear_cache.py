"""The decoding state of causal linear attention and MLK: :class:`LinearCacheState`, the running sums of
:class:`mgk.functional.LinearAttentionState` (Katharopoulos et al. 2020, Section 3.4, "Transformers are RNNs")
with the per-row token counts every decoding state keeps, doing a whole cached call itself
(:meth:`~LinearCacheState.step`: a prefill of any length in one chunked call, then a token or a few a call)."""
from __future__ import annotations

import torch
from torch import Tensor

from ._linear_state import LinearAttentionState
from .kv_state import KVCacheState
from .linear import linear_attention, mlk_attention

__all__ = ["LinearCacheState"]


class LinearCacheState(KVCacheState):
    """Decoding state of linear attention or MLK for B rows: the sums :attr:`sums` (a
    :class:`mgk.functional.LinearAttentionState`, of a fixed size whatever the length) and the counts of a
    :class:`mgk.functional.KVCacheState` without slots (positions of per-position weights, :attr:`seen`); it keeps
    the protocol of every decoding state (:mod:`mgk.functional.decoding_state`). It has no per-token entries, so it
    cannot be cropped (ValueError in one line).

    Args:
        capacity: checked as every state's (nothing is allocated ahead).
        layout: the name of what is stored, used in error messages only.

    Attributes:
        sums: the running sums after the tokens seen, or None before the first call.
    """

    def __init__(self, capacity: int | None = None, *, layout: str = ""):
        super().__init__({}, capacity, layout=layout)
        self.sums: LinearAttentionState | None = None

    def empty(self) -> LinearCacheState:
        """A new state like this one before its first call."""
        return type(self)(layout=self.layout)

    def step(self, query: Tensor, key: Tensor, value: Tensor, valid: Tensor | None = None, *,
             log_pi: Tensor | None = None, **form) -> Tensor:
        """One cached call: the L new tokens' keys added to the sums, and the new queries attending causally over
        every token seen (:func:`mgk.functional.linear_attention` with ``initial_state`` and
        ``output_final_state``, or :func:`mgk.functional.mlk_attention` for mixture keys).

        Args:
            query: (B, H, L, D); key: (B, H, L, D), or MLK's mixture keys (B, H, M, L, D); value: (B, H, L, Dv).
            valid: (B, L) bool, True = a real token (padding is never attended nor counted), or None.
            log_pi: MLK's log mixture weights of the new tokens, broadcastable to (B, H, M, L) (with mixture keys).
            form: the form options of the op (``eps``, ``normalize``, ``feature_map``, ``output_scale``,
                ``eps_mode``; MLK's ``mix``).
        Returns:
            (B, H, L, Dv) in query's dtype.
        Raises:
            ValueError as the op, or as :meth:`mgk.functional.KVCacheState.check_fixed_call` for a state of fixed
            capacity.
        """
        B, L = query.shape[0], query.shape[2]
        if self.seen is None:
            self.start(B, query.device)
        if self.fixed:
            self.check_fixed_call(valid, L)
        mask = None if valid is None else valid[:, None, None, :]
        if key.dim() == 5:
            out, state = mlk_attention(query, key, value, log_pi=log_pi, attn_mask=mask, is_causal=True,
                                       initial_state=self.sums, output_final_state=True, **form)
        else:
            out, state = linear_attention(query, key, value, attn_mask=mask, is_causal=True,
                                          initial_state=self.sums, output_final_state=True, **form)
        self.sums = LinearAttentionState(state.kv.detach(), state.k_sum.detach(), state.length)
        self.count(valid, L)
        return out

    # -- the protocol beside the counts --------------------------------------------------------------------------
    def cast(self, dtype: torch.dtype) -> None:
        """The sums converted to ``dtype`` (the counts kept), as :meth:`mgk.functional.KVCacheState.cast`."""
        super().cast(dtype)
        held = self.sums
        if held is not None and (held.kv.dtype != dtype or held.k_sum.dtype != dtype):
            self.sums = LinearAttentionState(held.kv.to(dtype), held.k_sum.to(dtype), held.length)

    def move_rows(self, index: Tensor | None) -> None:
        """The sums and counts taken at the rows ``index`` (:meth:`mgk.functional.KVCacheState.move_rows`)."""
        if index is None:
            return
        super().move_rows(index)
        held = self.sums
        if held is not None:
            self.sums = LinearAttentionState(*(None if t is None else t.index_select(0, index)
                                               for t in (held.kv, held.k_sum, held.length)))

    def nbytes(self) -> int:
        """Bytes of the sums ``kv`` and ``k_sum`` (the counts are bookkeeping, not counted)."""
        return 0 if self.sums is None else self.sums.nbytes()

    def allocated_bytes(self) -> int:
        """As :meth:`nbytes`: nothing is allocated ahead."""
        return self.nbytes()

    def _saved_state(self) -> dict | None:
        held = self.sums
        return None if held is None else {"kv": held.kv.clone(), "k_sum": held.k_sum.clone(),
                                          "length": None if held.length is None else held.length.clone()}

    def _check_saved_state(self, saved) -> None:
        if saved is not None and (not isinstance(saved, dict) or set(saved) != {"kv", "k_sum", "length"}):
            got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(f"state_dict's state must be a recurrent state's sums with keys ['k_sum', 'kv', "
                             f"'length'], got {got}")

    def _restore_state(self, saved) -> None:
        self.sums = None if saved is None else LinearAttentionState(saved["kv"], saved["k_sum"], saved["length"])
