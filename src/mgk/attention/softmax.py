"""The kind "softmax": multi-head softmax attention, the baseline (Vaswani et al. 2017), with
``nn.MultiheadAttention``'s conventions and state dicts; its options, FLOPs, cache layout and registration."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from ..functional.softmax import softmax_attention, softmax_attention_reference, softmax_cache_step
from .base import AttentionBase, factory_kwargs
from .registry import AttentionKind, CacheSpec, Options, register, total

__all__ = ["MultiheadAttention", "SoftmaxOptions", "from_torch_state_dict", "softmax_flops"]


@dataclass(frozen=True)
class SoftmaxOptions(Options):
    """Softmax attention (Vaswani et al. 2017) has no options."""

# nn.MultiheadAttention's entries that have no counterpart here, and the constructor option that creates them.
_UNCARRIED = {"bias_k": "add_bias_kv=True", "bias_v": "add_bias_kv=True"}


def from_torch_state_dict(state_dict: dict, prefix: str = "") -> str | None:
    """Rename, in place, the entries of a ``torch.nn.MultiheadAttention`` state dict under ``prefix`` to this
    module's: the packed ``in_proj_weight`` (3E, E) / ``in_proj_bias`` (3E,) split into ``q_proj``, ``k_proj``,
    ``v_proj`` (rows 0:E, E:2E, 2E:3E, torch's order), or ``q/k/v_proj_weight`` (torch's form when kdim / vdim
    differ from E) moved to ``q/k/v_proj.weight``; ``out_proj.*`` keeps its name. Entries already in this module's
    form are left alone, so a state dict of either form loads.

    Returns None, or a one-line reason when the state dict holds what this module cannot represent (``bias_k`` /
    ``bias_v`` of ``add_bias_kv=True``: learned key and value rows appended to every sequence; they are removed
    from the dict so that the reason is the only error)."""
    packed = {"weight": state_dict.pop(prefix + "in_proj_weight", None),
              "bias": state_dict.pop(prefix + "in_proj_bias", None)}
    for kind, tensor in packed.items():
        if tensor is not None:
            for proj, part in zip("qkv", tensor.chunk(3)):
                state_dict.setdefault(f"{prefix}{proj}_proj.{kind}", part.clone())
    for proj in "qkv":
        separate = state_dict.pop(f"{prefix}{proj}_proj_weight", None)
        if separate is not None:
            state_dict.setdefault(f"{prefix}{proj}_proj.weight", separate)
    found = [prefix + name for name in _UNCARRIED if state_dict.pop(prefix + name, None) is not None]
    if found:
        return (f"{' and '.join(found)} come from nn.MultiheadAttention({_UNCARRIED[found[0][len(prefix):]]}), "
                "which appends learned key/value rows to every sequence; mgk's attention modules have no such rows")
    return None


class MultiheadAttention(AttentionBase):
    """Softmax attention with H heads of size D (Vaswani et al. 2017), through SDPA; the drop-in for
    ``torch.nn.MultiheadAttention``.

    Same constructor (``batch_first`` required) and ``forward`` as :class:`mgk.attention.base.AttentionBase`,
    which take ``nn.MultiheadAttention``'s arguments and defaults. ``need_weights=True`` (the default, as torch)
    takes the explicit path; mgk's own models pass False. Float masks are added to the logits, as in
    ``nn.MultiheadAttention``.

    ``load_state_dict`` also takes an ``nn.MultiheadAttention`` state dict (packed ``in_proj_weight`` /
    ``in_proj_bias``, or ``q/k/v_proj_weight`` for kdim / vdim != E): see :func:`from_torch_state_dict`. Loading
    one with ``bias_k`` / ``bias_v`` (``add_bias_kv=True``) fails, naming them. With the same weights and
    ``head_dim = E / H`` the outputs equal ``nn.MultiheadAttention``'s (tests/attention/test_drop_in.py); torch's
    ``add_zero_attn`` has no counterpart.
    """

    cache_slots = {"keys": 2, "values": 2}  # (B, H, T, D) each

    def __init__(self, embed_dim: int, num_heads: int, **kwargs):
        super().__init__(embed_dim, num_heads, **kwargs)
        self.k_proj = nn.Linear(self.kdim, self.kv_heads * self.head_dim, bias=self.q_proj.bias is not None,
                                **factory_kwargs(kwargs.get("device"), kwargs.get("dtype")))

    def _cached_core(self, q, x, v, valid, cache):
        return softmax_cache_step(q, self._keys(x), v, cache.state, valid=valid, dropout_p=self.attn_dropout)

    def _keys(self, key: Tensor) -> Tensor:
        return self._split(self.k_proj(key), self.kv_heads)

    def _core(self, q, k, v, mask, is_causal, need_weights, query_mask, bias=None):
        if need_weights:
            return softmax_attention_reference(q, k, v, attn_mask=mask, bias=bias, is_causal=is_causal,
                                               dropout_p=self.attn_dropout, return_weights=True)
        return softmax_attention(q, k, v, attn_mask=mask, bias=bias, is_causal=is_causal,
                                 dropout_p=self.attn_dropout), None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        why = from_torch_state_dict(state_dict, prefix)
        if why is not None:
            error_msgs.append(why)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def softmax_flops(options, *, heads: int, length: int, batch: int, embed_dim: int, head_dim: int, causal: bool,
                  backward: bool, mixture_kernel: bool = False) -> int:
    """FLOPs of one call (:func:`mgk.attention.registry.total`): four projections and ``4 N S D`` per head (scores
    and the value product); ``mixture_kernel`` unused."""
    core = 4 * length * length * head_dim * (0.5 if causal else 1.0)
    return total(core, 4, heads=heads, length=length, batch=batch, embed_dim=embed_dim, head_dim=head_dim,
                 backward=backward)


register(AttentionKind("softmax", "softmax", "softmax", SoftmaxOptions, MultiheadAttention, softmax_flops,
                       CacheSpec(keys_per_token=1)))
