"""Pure tensor math of every attention family (no nn.Module). The single source of truth for the formulas."""
from .linear import LinearAttentionState, elu_feature_map, linear_attention, linear_attention_step, mlk_attention
from .masks import MaskError, causal_mask
from .mgk import BackendError, gaussian_log_kernel, mgk_attention, mgk_centre, mgk_responsibilities, select_backend
from .mgk_cache import mgk_attention_cached, mgk_cache_centre, mgk_cache_entries
from .softmax import softmax_attention, softmax_attention_cached, softmax_attention_reference

__all__ = [
    "BackendError",
    "LinearAttentionState",
    "MaskError",
    "causal_mask",
    "elu_feature_map",
    "gaussian_log_kernel",
    "linear_attention",
    "linear_attention_step",
    "mgk_attention",
    "mgk_attention_cached",
    "mgk_cache_centre",
    "mgk_cache_entries",
    "mgk_centre",
    "mgk_responsibilities",
    "mlk_attention",
    "select_backend",
    "softmax_attention",
    "softmax_attention_cached",
    "softmax_attention_reference",
]
