"""Learning-rate schedules: linear warm-up, then linear decay to 0, cosine decay to 0 (over the steps after the
warm-up, or of the global step as Transformer-XL's code does), or constant; or torch's OneCycleLR.

- "linear", "cosine", "constant": warm-up ``(s+1)/warmup`` for 0-based step s < warmup, then the decay over the
  remaining ``steps - warmup`` steps.
- "cosine_global": the same warm-up, then ``(1 + cos(pi s / steps)) / 2``: ``CosineAnnealingLR(T_max=max_step,
  eta_min=0)`` stepped with the global step after a linear warm-up, the schedule of the paper's WikiText-103 code
  (Transformer-XL's ``train.py``, used by the authors' ``lmtool-fwms``).
- "onecycle": ``torch.optim.lr_scheduler.OneCycleLR(max_lr=lr, total_steps=steps, pct_start=warmup/steps,
  anneal_strategy="linear")`` with torch's defaults: start at lr/25, end at lr/2.5e5, Adam's beta1 cycling between
  0.95 and 0.85 opposite to the lr; the authors' LRA schedule (``lra/run_tasks.py:202-208``).
"""
from __future__ import annotations

import math

import torch

from ..config import SCHEDULES


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the peak learning rate before optimiser step ``step`` (0-based); "onecycle" is not a factor
    of the peak (use :func:`build_scheduler`)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine_global":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / max(1, total_steps))))
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"schedule must be one of {SCHEDULES[:4]} here, got {schedule!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, *, schedule: str, lr: float, warmup_steps: int,
                    total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """The scheduler of ``schedule`` (stepped once after every optimiser step). ValueError for an unknown name or,
    for "onecycle", unless ``1 <= warmup_steps < total_steps``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "onecycle":
        if not 2 <= warmup_steps < total_steps:  # torch divides by warmup_steps - 1
            raise ValueError(f"schedule onecycle needs 2 <= warmup_steps < steps, got {warmup_steps}, {total_steps}")
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=lr, total_steps=total_steps, pct_start=warmup_steps / total_steps,
            anneal_strategy="linear", cycle_momentum=True, base_momentum=0.85, max_momentum=0.95, div_factor=25.0,
            final_div_factor=1e4, three_phase=False)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule))


def check_resumable(scheduler, state: dict, total_steps: int) -> None:
    """ValueError when a saved OneCycleLR ``state`` was planned for another number of steps: its phases are fixed
    at construction, so the run cannot be lengthened or shortened on resume."""
    saved = state.get("total_steps")
    if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR) and saved is not None and saved != total_steps:
        raise ValueError(f"schedule onecycle was planned for {saved} steps; it cannot resume with steps="
                         f"{total_steps} (start a new run for another length)")


_PHASES = ("schedule", "lr", "warmup_steps", "steps")


def resume_scheduler(scheduler, state: dict, *, saved: dict, now: dict) -> None:
    """Load the saved scheduler ``state`` into ``scheduler`` (built by :func:`build_scheduler` for the resumed run,
    its optimiser already restored), so that the resumed run's schedule sets the lr from its first resumed step.

    ``saved`` and ``now`` are the flat configs (``mgk.config.flat``) of the checkpoint and of the resumed run.
    LambdaLR (every schedule but "onecycle") computes an lr only when stepped: the restored optimiser holds the lr
    the old schedule gave the next step (0 after a finished linear or cosine decay), so the lr of that step is set
    again from the new schedule, its peak ``lr`` (the new base) and its steps and warm-up. With
    nothing changed this is the same float (``base_lr * lambda(step)``, as ``LambdaLR.get_lr``), so resuming stays
    bitwise exact. OneCycleLR's phases, peak and momentum cycle are fixed when it is built: ValueError naming the
    field when ``schedule``, ``lr``, ``warmup_steps`` or ``steps`` changed and either side is "onecycle"."""
    if "onecycle" in (saved["schedule"], now["schedule"]):
        changed = [k for k in _PHASES if saved[k] != now[k]]
        if changed:
            was = ", ".join(f"{k}={saved[k]}" for k in _PHASES)
            raise ValueError(f"the run was trained with {was}; schedule onecycle fixes its phases when it starts, so "
                             f"it cannot resume with {', '.join(f'{k}={now[k]}' for k in changed)} (start a new run "
                             "with --overwrite --out, or resume without changing these)")
        check_resumable(scheduler, state, now["steps"])
        scheduler.load_state_dict(state)
        return
    scheduler.load_state_dict(state)
    step = scheduler.last_epoch
    scheduler.base_lrs = [now["lr"] for _ in scheduler.optimizer.param_groups]
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
