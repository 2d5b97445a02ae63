"""Argument checks and the precision policy shared by the attention functions."""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(x, name: str, ndim: int, layout: str) -> Tensor:
    """Raise ValueError naming ``name`` unless ``x`` is a floating tensor with ``ndim`` dims (layout for the message)."""
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
