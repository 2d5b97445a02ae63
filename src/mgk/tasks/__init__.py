"""Tasks selectable by ``mgk train --task``. Each task module has ``prepare(cfg, run_dir) -> data_dir`` (rank 0
only: find or generate the files) and ``build(cfg, data_dir) -> task`` (every rank: splits, model, metric)."""
from __future__ import annotations

from . import listops

TASKS = {"listops": listops}


def get_task(name: str):
    """The task module named ``name``; ValueError for an unknown name."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {tuple(TASKS)}")
    return TASKS[name]
