"""The training loop's own state, saved in checkpoints under named fields (as nanoGPT saves ``iter_num`` and
``best_val_loss``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class LoopState:
    """Where the loop stands.

    Attributes:
        step: optimiser steps done.
        best: best validation value of the task's ``best_metric`` so far (None before the first validation).
        best_step: the step that reached it.
        best_val: every validation metric measured at ``best_step``.
        skipped: steps skipped for a non-finite loss (``nonfinite=skip``).
    """

    step: int = 0
    best: float | None = None
    best_step: int | None = None
    best_val: dict | None = None
    skipped: int = 0

    def to_dict(self) -> dict:
        """Plain dict (loads with ``torch.load(weights_only=True)``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_checkpoint(cls, ckpt: dict) -> "LoopState":
        """The state of a checkpoint: ``ckpt["loop_state"]``, or the string-keyed ``ckpt["state"]`` of 0.1.0.
        ValueError when neither is there or a field is unknown."""
        raw = ckpt.get("loop_state", ckpt.get("state"))
        if not isinstance(raw, dict):
            raise ValueError("checkpoint has no loop state (neither 'loop_state' nor the 0.1.0 'state')")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"checkpoint loop state has unknown fields {sorted(unknown)}")
        return cls(**raw)
