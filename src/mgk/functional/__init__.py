"""Pure tensor math of every attention family (no nn.Module). The single source of truth for the formulas.

One module per op (softmax, MGK, linear / MLK, the MGK decoding step), each a public function beside its explicit
reference, choosing its implementation through one protocol (:mod:`._dispatch`); the mixture algebra every MGK path
shares is written once (:mod:`._mixture_terms`). Each kind's decoding state sits beside its op and keeps one protocol
(:mod:`.decoding_state`): :class:`KVCacheState` (softmax, GQA), :class:`MGKDecodeState` (MGK, sMGK, gMGK),
:class:`LinearCacheState` (linear, MLK)."""
from ._dispatch import BackendError, is_transformed
from ._mixture_flash import available as cpu_kernel_available
from ._soft_e import mgk_attention_soft_e
from .decoding_state import DecodingState
from .kv_state import KVCacheState
from .linear import (
    LinearAttentionState,
    elu_feature_map,
    linear_attention,
    linear_attention_step,
    linear_form,
    mlk_attention,
)
from .linear_cache import LinearCacheState
from .masks import MaskError, causal_mask
from .mgk import gaussian_log_kernel, mgk_attention, mgk_centre, mgk_responsibilities, select_backend
from .mgk_cache import mgk_attention_cached, mgk_cache_centre, mgk_cache_entries, mgk_cache_step
from .mgk_state import MGKDecodeState
from .softmax import softmax_attention, softmax_attention_cached, softmax_attention_reference, softmax_cache_step

__all__ = [
    "BackendError",
    "DecodingState",
    "KVCacheState",
    "LinearAttentionState",
    "LinearCacheState",
    "MGKDecodeState",
    "MaskError",
    "causal_mask",
    "cpu_kernel_available",
    "elu_feature_map",
    "gaussian_log_kernel",
    "is_transformed",
    "linear_attention",
    "linear_attention_step",
    "linear_form",
    "mgk_attention",
    "mgk_attention_cached",
    "mgk_attention_soft_e",
    "mgk_cache_centre",
    "mgk_cache_entries",
    "mgk_cache_step",
    "mgk_centre",
    "mgk_responsibilities",
    "mlk_attention",
    "select_backend",
    "softmax_attention",
    "softmax_attention_cached",
    "softmax_attention_reference",
    "softmax_cache_step",
]
