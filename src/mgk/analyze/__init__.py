"""``mgk analyze``: why MGK works, measured on trained runs (the analysis of Nguyen et al., ICML 2022): attention maps
per head, the numerical rank of attention matrices, head redundancy and the mixture weights.

Modules: :mod:`.stats` (pure statistics), :mod:`.weights` (per-layer weights through the modules' ``need_weights``),
:mod:`.mixture` (pi and component shares), :mod:`.run` (loading a run), :mod:`.analysis` (one run), :mod:`.plots`,
:mod:`.report` and :mod:`.cli`.
"""
from .stats import effective_heads, js_divergence, numerical_rank, pairwise_js, pairwise_l2

__all__ = ["effective_heads", "js_divergence", "numerical_rank", "pairwise_js", "pairwise_l2"]
