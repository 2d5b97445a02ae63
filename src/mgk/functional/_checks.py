"""Argument checks and the precision policy shared by the attention functions."""
from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(x, name: str, ndim: int, layout: str) -> Tensor:
    """Raise ValueError naming ``name`` unless ``x`` is a floating tensor with ``ndim`` dims (``layout`` names them
    in the message)."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim} dims), got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"{name} must be a floating tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    return x


def check_same(name_a: str, a: int, name_b: str, b: int, what: str) -> None:
    """Raise ValueError when two sizes that must agree differ."""
    if a != b:
        raise ValueError(f"{what}: {name_a} has {a} but {name_b} has {b}")


def check_same_dtype(**tensors: Tensor) -> None:
    """Raise ValueError naming the first two arguments whose dtypes differ (as SDPA refuses mixed dtypes: a silent
    promotion would hide a float64 reference compared against float32 inputs)."""
    (name_a, a), *rest = [(n, t) for n, t in tensors.items() if t is not None]
    for name_b, b in rest:
        if b.dtype != a.dtype:
            raise ValueError(f"{name_a} has dtype {a.dtype} but {name_b} has dtype {b.dtype}; pass tensors of one "
                             "floating dtype")


def check_qkv(query, key, value, *, mixture: bool, grouped: bool = False) -> tuple[int, int, int, int, int, int]:
    """The shape and dtype checks every attention function shares, at the functional boundary.

    query (B, H, L, D); key (B, H, S, D), or (B, H, M, S, D) with ``mixture``; value (B, H, S, Dv) or None. With
    ``grouped`` (grouped-query attention, Ainslie et al. 2023) key and value may have G heads, G dividing H.
    Returns ``(B, H, L, S, M, D)`` (M = 1 without ``mixture``). Raises ValueError naming the argument."""
    check_tensor(query, "query", 4, "(B, H, L, D)")
    check_tensor(key, "key", 5 if mixture else 4, "(B, H, M, S, D)" if mixture else "(B, H, S, D)")
    if value is not None:
        check_tensor(value, "value", 4, "(B, H, S, Dv)")
    check_same_dtype(query=query, key=key, value=value)
    B, H, L, D = query.shape
    M, S = (key.shape[2], key.shape[3]) if mixture else (1, key.shape[2])
    check_same("query", B, "key", key.shape[0], "batch size")
    if not grouped:
        check_same("query", H, "key", key.shape[1], "number of heads")
    elif key.shape[1] < 1 or H % key.shape[1]:
        raise ValueError(f"number of heads: query has {H} but key has {key.shape[1]}; grouped-query attention needs "
                         "key / value heads G that divide the query heads H")
    check_same("query", D, "key", key.shape[-1], "head_dim")
    if value is not None:
        check_same("key", S, "value", value.shape[2], "key length S")
        check_same("key", B, "value", value.shape[0], "batch size")
        check_same("key", key.shape[1], "value", value.shape[1], "number of heads")
    if M < 1:
        raise ValueError("key must have at least one mixture component (M >= 1)")
    return B, H, L, S, M, D


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32: scores, log-sum-exp and sums never run in 16-bit."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def full_precision(device: torch.device):
    """Context that switches autocast off, so the attention core keeps the dtype it was given."""
    if torch.is_autocast_enabled(device.type) if _has_device_autocast() else torch.is_autocast_enabled():
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _has_device_autocast() -> bool:
    try:
        torch.is_autocast_enabled("cpu")
        return True
    except TypeError:  # torch < 2.4 takes no device argument
        return False


# ---- option checks shared by every public function of mgk.functional ------------------------------------------

def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _probability(name: str, value) -> None:
    if not _real(value) or not 0.0 <= value <= 1.0:  # NaN fails both comparisons
        raise ValueError(f"{name} must be a probability, a float in [0, 1], got {value!r}")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int (>= 1), got {value!r}")


def _flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")


def _optional_positive(name: str, value) -> None:
    if value is not None and (not _real(value) or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{name} must be None or a finite float > 0, got {value!r}")


def _non_negative(name: str, value) -> None:
    if not _real(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")


_RULES = {
    "dropout_p": _probability,
    "chunk_size": _positive_int,
    "is_causal": _flag,
    "return_weights": _flag,
    "output_final_state": _flag,
    "scale": _optional_positive,
    "eps": _non_negative,
}


def check_arguments(*, backends: tuple[str, ...] | None = None, **values) -> None:
    """Check the options of a public attention function, one rule per argument name, so every entry point refuses
    a bad value with the same ValueError naming the argument and the accepted range:

    dropout_p a float in [0, 1]; chunk_size an int >= 1; is_causal, return_weights and
    output_final_state bools; scale None or a finite
    float > 0; eps a finite float >= 0; backend None or one of ``backends``.

    Raises ValueError for a bad value; KeyError (a bug of the caller) for a name without a rule."""
    for name, value in values.items():
        if name == "backend":
            if value is not None and value not in backends:
                raise ValueError(f"backend must be None or one of {backends}, got {value!r}")
            continue
        _RULES[name](name, value)
