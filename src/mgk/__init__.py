"""mgk: Transformer-MGK attention (mixture of Gaussian keys, Nguyen et al., ICML 2022) and its experiment harness.

Public modules: :class:`MultiheadAttention` (softmax baseline), :class:`MGKAttention` (MGK / sMGK, learned pi,
Soft-E, Hard-E), :class:`LinearAttention` and :class:`MLKAttention`, built by kind name (:func:`build_attention`)
or from an :class:`AttentionConfig`; the math is in :mod:`mgk.functional`.
"""
from .attention import (
    AttentionConfig,
    LinearAttention,
    MGKAttention,
    MLKAttention,
    MultiheadAttention,
    attention_kinds,
    build_attention,
)

__version__ = "0.1.0"
__all__ = ["MGKAttention", "MultiheadAttention", "attention_kinds", "build_attention", "__version__"]
__all__ += ["LinearAttention", "MLKAttention", "AttentionConfig"]
