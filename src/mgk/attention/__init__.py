"""Attention modules (thin nn.Modules over :mod:`mgk.functional`), one file per kind, and the registry of kinds."""
from . import kinds  # noqa: F401  (the index: each kind's file registers it)
from .base import AttentionBase
from .cache import DecodingCache, LayerCache
from .config import AttentionConfig
from .gmgk import GroupedMGKAttention
from .gqa import GroupedQueryAttention
from .linear import LinearAttention, MLKAttention
from .mgk import MGKAttention, soft_e_step
from .mixture_keys import MixtureKeys
from .registry import AttentionKind, attention_kinds, build_attention, get_kind, register
from .softmax import MultiheadAttention

__all__ = ["AttentionBase", "MGKAttention", "MultiheadAttention", "attention_kinds", "build_attention", "register"]
__all__ += ["LinearAttention", "MLKAttention", "MixtureKeys", "AttentionConfig", "AttentionKind", "get_kind",
            "soft_e_step", "DecodingCache", "LayerCache", "GroupedQueryAttention",
            "GroupedMGKAttention"]


def __getattr__(name: str):
    # swap_attention converts models (mgk.convert, mgk.integrations) and lives above them: mgk.swap_attention
    if name == "swap_attention":
        raise AttributeError("mgk.attention.swap_attention moved to mgk.swap_attention "
                             "(from mgk import swap_attention)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
