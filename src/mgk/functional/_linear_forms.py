"""The options that select a form of linear / MLK attention: feature map, normalisation, output scale, eps rule and
where the mixture of keys is taken.

The defaults are the textbook form (Katharopoulos et al. 2020, eq. 6; Nguyen et al. 2022, eq. 14). The other values
give the forms of the Transformer-MGK authors' released code (github.com/minhtannguyen/transformer-mgk):

* LRA linear attention (``lra/attention_linear.py``, ``linear_attn``): ``normalize="length"``, no denominator, the
  feature-mapped queries scaled by L^(-1/4) and keys by S^(-1/4), L and S the tensor lengths (padding included).
* LRA "MLK" (same file, ``key2``): ``mix="keys"``, the raw keys mixed before the feature map, then as above.
* LM linear, ``--attn_type 34`` (``utils/cuda_fast_weight_layer.py``, ``CudaFastWeightSumLinearTransformerLayer``):
  ``feature_map="elu_sum"``, ``output_scale=D**-0.5``, ``eps=1e-5``, ``eps_mode="add"``.
* LM MLK, ``--attn_type 400`` (``mem_transformer.py``, ``CudaFastWeightSumTwoLinearTransformerLayer``): as type 34
  with ``mix="features"`` and un-normalised per-position weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_arguments

FeatureMap = Callable[[Tensor], Tensor]

NORMALIZE = ("row", "length", "none")
FEATURE_MAPS = ("elu", "elu_sum")
EPS_MODES = ("guard", "add")
MIX = ("features", "keys")


def _elu_plus_one(x: Tensor) -> Tensor:
    if torch.compiler.is_compiling():
        # Under torch.compile, aten.elu_backward's traced output strides differ from its kernel's for an input laid
        # out unlike its gradient (a head-split query), so a backward-graph view upstream fails under aot_eager
        # (pytorch/pytorch#120035, the same class). These pointwise ops trace with the kernel's strides; inductor
        # fuses them as it fuses its own decomposition of elu. exp(x) is the value elu + 1 rounds (elu's backward
        # uses exp(x) too); clamp keeps exp finite on the branch where() drops.
        return torch.where(x > 0, x + 1.0, torch.exp(x.clamp(max=0.0)))
    return F.elu(x) + 1.0


def elu_feature_map(x: Tensor) -> Tensor:
    """``elu(x) + 1``, the positive feature map of Katharopoulos et al. (2020); shape-preserving."""
    return _elu_plus_one(x)


def elu_sum_feature_map(x: Tensor) -> Tensor:
    """``(elu(x) + 1) / sum_d (elu(x) + 1)_d``: elu+1 rescaled to sum to one over the last (head) dimension, the
    feature map of the authors' LM linear attention ("normalize k and q", ``cuda_fast_weight_layer.py``,
    ``CudaFastWeightSumLinearTransformerLayer.forward``). The sum is at least D * exp(-max|x|) > 0 for finite x."""
    y = _elu_plus_one(x)
    return y / y.sum(dim=-1, keepdim=True)


@dataclass(frozen=True)
class LinearForm:
    """A checked set of options. ``feature_map`` is the callable; the others as :func:`linear_form`."""

    feature_map: FeatureMap
    normalize: str = "row"
    output_scale: float = 1.0
    eps: float = 1e-6
    eps_mode: str = "guard"
    mix: str = "features"

    def length_scale(self, n: int) -> float | None:
        """The factor n^(-1/4) on query (n = L) or key (n = S) features under ``normalize="length"``, else None."""
        return n ** -0.25 if self.normalize == "length" and n > 0 else None


def _number(value, name: str, *, positive: bool) -> float:
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite float {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _choice(value, name: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def feature_map_of(feature_map) -> FeatureMap:
    """The callable for ``feature_map``: None or "elu" (elu+1), "elu_sum", or a callable (returned as is)."""
    if feature_map is None or feature_map == "elu":
        return elu_feature_map
    if feature_map == "elu_sum":
        return elu_sum_feature_map
    if isinstance(feature_map, str) or not callable(feature_map):
        raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, None or a callable mapping (..., D) to "
                         f"(..., D'), got {feature_map!r}")
    return feature_map


def linear_form(*, eps=1e-6, feature_map=None, normalize="row", output_scale=1.0, eps_mode="guard",
                mix="features", chunk_size: int = 1) -> LinearForm:
    """Check the options of linear / MLK attention and bundle them; ValueError naming the first bad one.

    normalize: "row" (divide by ``phi(q_i) . sum_j phi~(k_j)``, eq. 6 / eq. 14), "length" (no denominator; query
    features times L^(-1/4), key features times S^(-1/4)) or "none" (no denominator, no scale).
    eps_mode: "guard" (``eps`` replaces only a denominator that is exactly zero) or "add" (``den + eps`` on every
    row, as Katharopoulos et al. and the authors' LM code). Unused unless normalize="row".
    output_scale: a finite float > 0 multiplying the output. mix: "features" (``sum_r pi_r phi(k_r)``, eq. 14) or
    "keys" (``phi(sum_r pi_r k_r)``)."""
    check_arguments(eps=eps, chunk_size=chunk_size)
    return LinearForm(feature_map=feature_map_of(feature_map), normalize=_choice(normalize, "normalize", NORMALIZE),
                      output_scale=_number(output_scale, "output_scale", positive=True), eps=float(eps),
                      eps_mode=_choice(eps_mode, "eps_mode", EPS_MODES), mix=_choice(mix, "mix", MIX))


def denominator(den: Tensor, form: LinearForm, empty: Tensor | None) -> Tensor:
    """The divisor of a "row"-normalised output.

    "guard": ``den`` where it is not zero and ``eps`` (1 for eps = 0) where it is exactly zero. "add": ``den + eps``
    (1 where that is still zero). Either way 1 on rows that see no key: their numerators are exactly 0 (so are those
    of a zero denominator, the features being non-negative), so they give exactly 0 with finite gradients."""
    one = torch.ones((), dtype=den.dtype, device=den.device)
    if form.eps_mode == "add":
        den = den + form.eps
        den = torch.where(den == 0, one, den)
    else:
        guard = torch.full((), form.eps if form.eps > 0 else 1.0, dtype=den.dtype, device=den.device)
        den = torch.where(den == 0, guard, den)
    return den if empty is None else torch.where(empty, one, den)
