"""Attention modules (thin nn.Modules over :mod:`mgk.functional`), one file per kind, and the registry of kinds
(:mod:`mgk.attention.registry`: what a kind declares, and the one list of them).

This package is the index of the kinds: importing a kind's file registers it (its ``register(...)`` calls sit at its
bottom). Registration order is the order of :func:`mgk.attention.attention_kinds`, of tables and of reports: the
paper's six kinds (Nguyen et al., ICML 2022: softmax, MGK and sMGK, Tables 1, 3, 4; linear, MLK and sMLK, Tables 2,
3), then the baselines added since. A new kind is a new file, and one line below."""
# isort: skip_file
from . import softmax  # noqa: F401  softmax
from . import mgk  # noqa: F401  mgk, smgk
from . import linear  # noqa: F401  linear, mlk, smlk
from . import gqa  # noqa: F401  gqa (grouped-query and multi-query attention)
from . import gmgk  # noqa: F401  gmgk (grouped mixture keys: MGK keys shared by groups of query heads)
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
