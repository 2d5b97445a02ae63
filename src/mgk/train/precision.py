"""``--precision 32|bf16|fp16``: autocast contexts and the fp16 gradient scaler.

The attention functions run their scores, log-sum-exp, Soft-E statistics and linear-attention sums in float32
whatever autocast says (see :mod:`mgk.functional`), so only projections and feed-forward layers run in 16 bits.
"""
from __future__ import annotations

import contextlib

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    """Autocast context for ``precision`` ("32" = none)."""
    if precision == "32":
        return contextlib.nullcontext()
    if precision not in _DTYPES:
        raise ValueError(f"precision must be '32', 'bf16' or 'fp16', got {precision!r}")
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """A GradScaler that is enabled only for fp16 (its state is saved in checkpoints either way)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
