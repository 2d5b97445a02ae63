"""Attention modules (thin nn.Modules over :mod:`mgk.functional`) and the registry of attention kinds."""
from .base import AttentionBase
from .linear import LinearAttention, MLKAttention
from .mgk import MGKAttention, soft_e_step
from .mixture_keys import MixtureKeys
from .registry import attention_kinds, build_attention, register
from .softmax import MultiheadAttention
from .swap import swap_attention

__all__ = ["AttentionBase", "MGKAttention", "MultiheadAttention", "attention_kinds", "build_attention", "register"]
__all__ += ["LinearAttention", "MLKAttention", "MixtureKeys", "soft_e_step", "swap_attention"]
