"""Tasks selectable by ``mgk train --task``.

Each task module follows :class:`mgk.tasks.base.TaskModule` (``PRESETS``, ``prepare``, ``build``, ``check``) and
``build`` returns a :class:`mgk.tasks.base.Task`, the only interface the training loop uses. What the LRA task
modules share lives in :mod:`mgk.tasks.lra_common`.
"""
from __future__ import annotations

from ..choices import require
from . import cmqar, dretrieval, image, listops, lm, mqar, pathfinder, retrieval, text
from .base import EpochSampler, Task, TaskModule

TASKS: dict[str, TaskModule] = {"listops": listops, "lm": lm, "text": text, "retrieval": retrieval, "image": image,
                                "pathfinder": pathfinder, "dretrieval": dretrieval, "mqar": mqar, "cmqar": cmqar}

__all__ = ["TASKS", "Task", "TaskModule", "EpochSampler", "all_presets", "get_task"]


def all_presets() -> dict:
    """Every task's presets by name (``mgk train --preset NAME``)."""
    return {name: cfg for module in TASKS.values() for name, cfg in module.PRESETS.items()}


def get_task(name: str) -> TaskModule:
    """The task module named ``name``; ValueError naming the tasks (and the close matches) for an unknown name."""
    return TASKS[require("task", name, TASKS)]
