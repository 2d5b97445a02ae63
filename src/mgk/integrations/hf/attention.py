"""The attention module that sits where a Hugging Face model had its own: an mgk module of any registered kind,
called with the model's masks, rotary embeddings and cache."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .cache import mgk_layer

__all__ = ["HFAttention", "key_valid"]

# what the decoder layers of the supported transformers versions call the cache argument
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value")


def key_valid(attention_mask, L: int) -> Tensor | None:
    """(B, L) bool, True = a real token, of the last L keys of the mask a transformers model passes its attention
    modules, or None (no padding).

    The model's mask is (B, 1, L, S) bool (True = may attend) or float (0 = may attend, a large negative number
    not), a (B, S) 0/1 padding mask (flash attention's form), or None. Its last query row sees every real key
    before it (causal masks are lower triangular, padding masks hide keys only), so it gives the keys' padding;
    the causal order itself is the architecture's, applied by :class:`HFAttention` whatever the mask (transformers
    PR #45811: an attention that takes causality from the mask alone gets none when the model passes None).
    ValueError naming ``attn_implementation`` for another form (flex attention's BlockMask)."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() not in (2, 4):
        raise ValueError(f"mgk attention takes the model's mask as a (B, S) or (B, 1, L, S) tensor, got "
                         f"{type(attention_mask).__name__}: load the model with attn_implementation='sdpa' or "
                         "'eager'")
    row = attention_mask if attention_mask.dim() == 2 else attention_mask[:, 0, -1, :]
    if row.dtype == torch.bool:
        valid = row
    elif row.is_floating_point() and attention_mask.dim() == 4:
        valid = row > torch.finfo(row.dtype).min / 2
    else:
        valid = row != 0
    valid = valid[:, -L:]
    return None if bool(valid.all()) else valid


class HFAttention(nn.Module):
    """An mgk attention module (:attr:`attn`, any registered kind) in a transformers model's attention slot.

    Args:
        attn: the mgk module (batch_first=True), built by :func:`mgk.swap_attention`.
        layer_idx: the model's index of this layer (its slot in the model's cache).
        causal: whether the architecture is causal (Llama, GPT-2) or bidirectional (BERT). Applied on every call,
            whatever mask the model passes (None when it has no padding).
        rotary: the model's own ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=...)`` for rotary models, else
            None. The query and every key projection (``q_proj`` and each ``k_proj`` below :attr:`attn`: MGK's M
            components, a GQA kind's G heads) are rotated by it, head by head, as they leave the projection, so
            the kind's own core, cache and options apply unchanged; sMGK's learned shifts apply after the rotation.
        resid_dropout: GPT-2's dropout after the output projection (kept from the old module), else None.

    ``forward(hidden_states, attention_mask=None, position_embeddings=None, cache=None, ...)`` takes what the
    model's layers pass (other keyword arguments are ignored) and returns ``(output (B, L, E), None)``; attention
    weights are not returned. With a cache (a ``DynamicCache``; :func:`mgk.integrations.hf.mgk_layer`) the call is
    the layer's cached decoding step: its new tokens attend to everything the layer has seen. When gradients are on
    and the layer's cache is empty (a training forward with ``use_cache=True``, the default of many configs), the
    output is the uncached forward's, so gradients reach every key and value, and the cache is filled without
    gradient besides (pass ``use_cache=False`` in training to skip that).
    """

    def __init__(self, attn: nn.Module, *, layer_idx: int | None, causal: bool, rotary=None,
                 resid_dropout: nn.Module | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_causal = causal
        self.resid_dropout = resid_dropout if resid_dropout is not None else nn.Identity()
        self._rotary = rotary
        self._position: tuple[Tensor, Tensor] | None = None  # (cos, sin) of the call in progress
        self._hooks: list = []
        self.attn = attn
        self.set_module(attn)

    def set_module(self, attn: nn.Module) -> None:
        """Make ``attn`` the mgk module (rotating its query and key projections for rotary models); ValueError
        when a rotary model's new module has no ``k_proj``."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.attn = attn
        if self._rotary is None:
            return
        names = [n for n, m in attn.named_modules() if isinstance(m, nn.Linear)
                 and n.rpartition(".")[2] in ("q_proj", "k_proj")]
        if not any(n.rpartition(".")[2] == "k_proj" for n in names):
            raise ValueError(f"swap_attention: {type(attn).__name__} has no key projection k_proj to apply the "
                             "model's rotary embeddings to")
        self._hooks = [attn.get_submodule(n).register_forward_hook(self._rotate) for n in names]

    def _rotate(self, module: nn.Module, inputs, out: Tensor) -> Tensor | None:
        """A projection's output (B, L, n * D) rotated per D-wide head by the call's (cos, sin) (B, L, D)."""
        if self._position is None:
            return None
        cos, sin = self._position
        heads = out.unflatten(-1, (-1, cos.shape[-1]))
        return self._rotary(heads, heads[..., :0, :], cos, sin, unsqueeze_dim=2)[0].flatten(-2)

    def forward(self, hidden_states: Tensor, *args, attention_mask=None, position_embeddings=None, **kwargs):
        if args:
            raise TypeError(f"HFAttention takes hidden_states and keyword arguments, got {len(args)} more "
                            "positional ones")
        if kwargs.get("encoder_hidden_states") is not None:
            raise ValueError("mgk attention replaces self-attention only; cross-attention was not swapped")
        cache = next((kwargs[n] for n in _CACHE_NAMES if kwargs.get(n) is not None), None)
        if self._rotary is not None:
            if position_embeddings is None:
                raise ValueError("this rotary model's layer was called without position_embeddings (cos, sin)")
            self._position = position_embeddings
        try:
            out = self._attend(hidden_states, key_valid(attention_mask, hidden_states.shape[1]), cache)
        finally:
            self._position = None
        return self.resid_dropout(out), None

    def _attend(self, x: Tensor, valid: Tensor | None, cache) -> Tensor:
        padding = None if valid is None else ~valid
        if cache is None:
            return self.attn(x, key_padding_mask=padding, is_causal=self.is_causal, need_weights=False)[0]
        if not self.is_causal:
            raise ValueError("a decoding cache needs a causal model; this layer attends in both directions")
        layer = mgk_layer(cache, self.layer_idx, self.attn)
        cached = dict(key_padding_mask=padding, is_causal=True, need_weights=False, past_key_values=layer.mgk_cache)
        if torch.is_grad_enabled() and layer.mgk_cache.length == 0:
            out = self.attn(x, key_padding_mask=padding, is_causal=True, need_weights=False)[0]
            with torch.no_grad():
                self.attn(x, **cached)
            return out
        return self.attn(x, **cached)[0]

    @property
    def rotary(self) -> bool:
        """Whether the query and keys are rotated (the model has rotary embeddings)."""
        return self._rotary is not None

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, causal={self.is_causal}, rotary={self.rotary}"
