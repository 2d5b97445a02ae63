"""The six attention kinds of the paper (Nguyen et al., ICML 2022), registered: softmax, MGK and sMGK (Tables 1,
3, 4), linear, MLK and sMLK (Tables 2, 3)."""
from __future__ import annotations

from functools import partial

from . import flops
from .cache import KVCache, MixtureKeyCache, RecurrentCache, ShiftedKeyCache
from .cache_spec import CacheSpec
from .linear import LinearAttention, MLKAttention
from .mgk import MGKAttention
from .options import LinearOptions, MGKOptions, MLKOptions, SoftmaxOptions
from .registry import AttentionKind, register
from .softmax import MultiheadAttention

_PI_VARIANTS = ({}, {"pi": "soft_e"}, {"pi": "hard_e"})  # the paper's Table 4 ablation
_MGK_VARIANTS = _PI_VARIANTS + ({"sigma2": "learned"},)  # variances trained per head and component
_RECURRENT = CacheSpec(recurrent=True, layer_cache=RecurrentCache)

register(AttentionKind("softmax", "softmax", "softmax", SoftmaxOptions, MultiheadAttention, flops.softmax,
                       CacheSpec(keys_per_token=1, layer_cache=KVCache)))
# MGK keeps its M keys per token, sMGK the one unshifted key; both one scalar per component (mgk.functional.mgk_cache)
register(AttentionKind("mgk", "mixture", "MGK", MGKOptions, partial(MGKAttention, keys="separate"),
                       partial(flops.mixture, separate=True),
                       CacheSpec(keys_per_token="num_keys", scalars_per_token="num_keys", layer_cache=MixtureKeyCache),
                       _MGK_VARIANTS))
register(AttentionKind("smgk", "mixture", "sMGK", MGKOptions, partial(MGKAttention, keys="shifted"),
                       partial(flops.mixture, separate=False),
                       CacheSpec(keys_per_token=1, scalars_per_token="num_keys", layer_cache=ShiftedKeyCache),
                       _PI_VARIANTS))
register(AttentionKind("linear", "linear", "linear", LinearOptions, LinearAttention, flops.linear, _RECURRENT))
register(AttentionKind("mlk", "linear", "MLK", MLKOptions, partial(MLKAttention, keys="separate"),
                       partial(flops.mlk, separate=True), _RECURRENT, ({}, {"mix": "keys"})))
register(AttentionKind("smlk", "linear", "sMLK", MLKOptions, partial(MLKAttention, keys="shifted"),
                       partial(flops.mlk, separate=False), _RECURRENT))
