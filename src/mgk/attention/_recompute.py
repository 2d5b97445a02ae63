"""Where a forward runs relative to ``torch.utils.checkpoint``: plain, a checkpointed forward, or its recomputation.

A module that changes state in its forward (Soft-E's E-step writes pi) must apply the change once, in the forward
that produced the loss, and its recomputation during backward must replay that forward's inputs to the state, as
BatchNorm's running statistics should (pytorch/pytorch#96136, "torch.utils.checkpoint should avoid updating
BatchNorm statistics twice"). torch gives no public flag for this, so the checkpoint's own frames are recognised on the
Python
stack; both implementations keep one object alive from the forward to its recomputation, which pairs them:

- ``use_reentrant=True``: ``CheckpointFunction.forward(ctx, ...)`` runs the function under ``no_grad`` and
  ``CheckpointFunction.backward(ctx, ...)`` recomputes it: the key is ``ctx``.
- ``use_reentrant=False``: ``checkpoint()`` drives a generator that holds a ``_CheckpointFrame`` (``new_frame``);
  recomputation runs inside that frame's saved-tensor ``unpack_hook`` (closure variable ``frame``): the key is
  that frame.

Inside a ``torch.compile`` trace nothing is recognised (frames cannot be inspected there).
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as _ckpt


@dataclass(frozen=True)
class Region:
    """The innermost checkpoint around the caller: ``key`` pairs a forward with its recomputation."""

    key: object
    recomputing: bool
    reentrant: bool


def _codes():
    fn = _ckpt.checkpoint
    while hasattr(fn, "__wrapped__"):  # checkpoint() is wrapped to disable dynamo
        fn = fn.__wrapped__
    return (_ckpt.CheckpointFunction.forward.__code__, _ckpt.CheckpointFunction.backward.__code__, fn.__code__,
            _ckpt.__file__)


_FORWARD, _BACKWARD, _CHECKPOINT, _FILE = _codes()


def _classify(frame) -> Region | None:
    code = frame.f_code
    if code is _FORWARD or code is _BACKWARD:
        return Region(frame.f_locals.get("ctx"), code is _BACKWARD, True)
    if code is _CHECKPOINT:
        gen = frame.f_locals.get("gen")  # None when use_reentrant=True (then CheckpointFunction is deeper)
        if isinstance(gen, types.GeneratorType) and gen.gi_frame is not None:
            key = gen.gi_frame.f_locals.get("new_frame")
            if key is not None:
                return Region(key, False, False)
        return None
    if code.co_name == "unpack_hook" and code.co_filename == _FILE:
        key = frame.f_locals.get("frame")
        if key is not None:
            return Region(key, True, False)
    return None


def checkpoint_region(max_depth: int = 200) -> Region | None:
    """The innermost ``torch.utils.checkpoint`` region around the caller, or None (also inside torch.compile)."""
    if torch.compiler.is_compiling():
        return None
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        if frame.f_code.co_filename == _FILE:
            region = _classify(frame)
            if region is not None:
                return region
        frame = frame.f_back
    return None
