"""Attention modules (thin nn.Modules over :mod:`mgk.functional`) and the registry of attention kinds."""
from . import kinds  # noqa: F401  (registers the paper's six kinds)
from .base import AttentionBase
from .cache import DecodingCache
from .config import AttentionConfig
from .linear import LinearAttention, MLKAttention
from .mgk import MGKAttention, soft_e_step
from .mixture_keys import MixtureKeys
from .registry import AttentionKind, attention_kinds, build_attention, get_kind, register
from .softmax import MultiheadAttention
from .swap import swap_attention

__all__ = ["AttentionBase", "MGKAttention", "MultiheadAttention", "attention_kinds", "build_attention", "register"]
__all__ += ["LinearAttention", "MLKAttention", "MixtureKeys", "AttentionConfig", "AttentionKind", "get_kind",
            "soft_e_step", "swap_attention", "DecodingCache"]
