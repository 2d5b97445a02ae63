"""The runs an analysis measures: each loaded with :func:`mgk.load_run` and its data, a failed run (its final
evaluation was not finite) refused, and a short label for tables and legends."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import config as config_mod
from ..attention.registry import run_label as registry_label
from ..train.load import LoadedRun, load_run

__all__ = ["FailedRun", "LoadedRun", "load_for_analysis", "loaded_runs", "run_label"]


class FailedRun(ValueError):
    """The run failed (its final evaluation was not finite): its weights are not worth analysing."""


def load_for_analysis(run_dir: str | os.PathLike, *, data: str | os.PathLike | None = None, which: str = "best",
                      device: str | torch.device = "cpu") -> LoadedRun:
    """:func:`mgk.load_run` of ``run_dir`` with its splits read from ``data`` (default: the run's own data).

    Raises FileNotFoundError naming a missing run, checkpoint or data folder (and saying to pass --data);
    ValueError for a damaged file or weights that do not fit the run's model; :class:`FailedRun` for a failed run.
    An unfinished run loads (its :meth:`~mgk.train.load.LoadedRun.status` says so)."""
    if data is not None and not os.path.isdir(data):
        raise FileNotFoundError(f"--data {data}: no such folder")
    run = load_run(run_dir, checkpoint=which, device=device, data=data)
    if run.failure is not None:
        raise FailedRun(f"{run_dir} failed ({run.failure}): its weights are not usable, nothing to analyse")
    return run.with_splits()


def run_label(cfg: config_mod.RunConfig) -> str:
    """Short name of a run for tables and legends: the registry's label of its kind, heads and the options that name
    a variant (:func:`mgk.attention.registry.run_label`), e.g. "softmax-8", "smgk-4 soft_e", "mlk-4 mix=keys"."""
    return registry_label(cfg.attention.kind, cfg.attention.num_heads, cfg.attention.options)


def loaded_runs(run_dirs, *, data=None, which: str = "best", device: str = "cpu", notes: list, left_out: list):
    """Yield ``(label, run)`` for each of ``run_dirs`` (:func:`load_for_analysis`), labelled by :func:`run_label`
    (with the folder's name when two runs share a label). A failed run (final evaluation not finite) is raised
    when it is the only one; in a comparison its reason is appended to ``left_out`` and a line to ``notes``."""
    seen = set()
    for d in run_dirs:
        try:
            run = load_for_analysis(d, data=data, which=which, device=device)
        except FailedRun as e:
            if len(run_dirs) == 1:
                raise
            left_out.append(str(e))
            notes.append(f"left out: {e}")
            continue
        label = run_label(run.cfg)
        if label in seen:
            label = f"{label} ({Path(d).name})"
        seen.add(label)
        yield label, run
