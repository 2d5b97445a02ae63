"""Per-layer attention weights of any mgk model, through the attention modules' own ``need_weights`` path.

The models call their attention modules with ``need_weights=False``; rather than changing them, :class:`WeightRecorder`
registers a forward pre-hook on every :class:`mgk.attention.AttentionBase` that sets ``need_weights=True`` and
``average_attn_weights=False`` (so the
module computes its explicit weights, the same code its tests check against float64 references) and a forward hook
that keeps, for each call, the returned weights (B, H, L, S), the query input (B, L, E), the key-padding mask and
``is_causal``. Nothing else about the forward changes (the output is the same function of the inputs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..attention import AttentionBase

__all__ = ["AttentionCall", "StopForward", "WeightRecorder", "attention_layers"]


class StopForward(Exception):
    """Raised by a :class:`WeightRecorder` with ``stop_after_last`` once the last attention layer has run."""


def attention_layers(model: nn.Module) -> list[tuple[str, AttentionBase]]:
    """``(name, module)`` of every attention module of ``model`` in forward (registration) order; layer i of the
    analysis is entry i. Raises ValueError when the model has none."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, AttentionBase)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no mgk attention module to analyse")
    return layers


@dataclass
class AttentionCall:
    """One call of one attention layer: ``weights`` (B, H, L, S), ``query`` input (B, L, E) (self-attention: also
    the key input), ``key_padding_mask`` bool (B, S) True = padding or None, ``is_causal``."""

    layer: int
    weights: Tensor
    query: Tensor
    key_padding_mask: Tensor | None
    is_causal: bool

    def real_lengths(self) -> Tensor:
        """int64 (B,) number of real tokens per sequence (padding at the end, as every mgk task batches)."""
        B, S = self.weights.shape[0], self.weights.shape[-1]
        if self.key_padding_mask is None:
            return torch.full((B,), S, dtype=torch.int64)
        return (~self.key_padding_mask).sum(dim=1).cpu()


class WeightRecorder:
    """Context manager recording every attention call of ``model`` into :attr:`calls` (cleared by :meth:`clear`).

    Only self-attention calls with query == key are supported (every mgk model); a call with a separate key input or
    an ``attn_mask`` raises ValueError, because cutting its padding would need more than the key-padding mask.

    ``stop_after_last``: raise :class:`StopForward` right after the last attention layer, so that the rest of the
    model (pooling, heads, an adaptive softmax that computes in float32) never runs: the analysis needs the
    attention only, and the model may then run in float64 whatever its head does.
    """

    def __init__(self, model: nn.Module, *, stop_after_last: bool = False):
        self.layers = attention_layers(model)
        self.stop_after_last = stop_after_last
        self.calls: list[AttentionCall] = []
        self._handles = []

    def __enter__(self) -> "WeightRecorder":
        for i, (name, module) in enumerate(self.layers):
            self._handles.append(module.register_forward_pre_hook(self._want_weights, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._keeper(i, name), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def clear(self) -> None:
        """Forget the recorded calls (call between batches so memory stays bounded)."""
        self.calls.clear()

    @staticmethod
    def _want_weights(module, args, kwargs):
        kwargs["need_weights"] = True
        kwargs["average_attn_weights"] = False  # the analysis reads each head's weights
        return args, kwargs

    def _keeper(self, index: int, name: str):
        def hook(module, args, kwargs, output):
            """Forward hook: keep the (B, H, L, S) weights of a self-attention call of layer ``index``."""
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs.get("key")
            if (key is not None and key is not query) or kwargs.get("attn_mask") is not None:
                raise ValueError(f"layer {name}: only self-attention with a key-padding mask can be analysed")
            weights = output[1]
            if weights is None:
                raise ValueError(f"layer {name} ({type(module).__name__}) returned no weights with need_weights")
            self.calls.append(AttentionCall(index, weights.detach(), query.detach(),
                                            kwargs.get("key_padding_mask"), bool(kwargs.get("is_causal", False))))
            if self.stop_after_last and index == len(self.layers) - 1:
                raise StopForward
        return hook
