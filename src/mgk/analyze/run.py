"""Load a finished run for analysis: its config, task, data split and model with the best checkpoint's weights.

``mgk eval`` (:func:`mgk.train.lm_eval.evaluate_run`) loads language-model runs only; this is the same sequence for
every task (the checkpoint's resolved config, the task's ``build``, the task's ``build_model``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import config as config_mod
from ..attention.registry import run_label as registry_label
from ..tasks import get_task
from ..train import checkpoint
from ..train.records import read_config

__all__ = ["LoadedRun", "load_run", "run_label"]


@dataclass
class LoadedRun:
    """A run ready to analyse: ``cfg`` (RunConfig), ``task`` (the object of :mod:`mgk.tasks`), ``model`` (eval mode,
    best weights), ``checkpoint`` (path), ``step`` (optimiser step of the checkpoint) and ``data_dir``."""

    run_dir: Path
    cfg: config_mod.RunConfig
    task: object
    model: nn.Module
    checkpoint: Path
    step: int | None
    data_dir: Path


def _data_dir(run_dir: Path, cfg, data) -> Path:
    if data is not None:
        return Path(data)
    if cfg.data.path is not None:
        return Path(cfg.data.path)
    return run_dir / "data"  # where a run without --data generated its data


def load_run(run_dir: str | os.PathLike, *, data: str | os.PathLike | None = None, which: str = "best",
             device: str | torch.device = "cpu") -> LoadedRun:
    """Load ``run_dir`` (config.yaml, checkpoints/best.pt, else last.pt) with its task and data.

    Args:
        data: data folder (default: the run's ``data``, or the data it generated in ``run_dir/data``).
        which: "best" (falls back to "last" when there is no best.pt) or "last".
    Raises FileNotFoundError naming a missing run, checkpoint or data folder; ValueError for an unreadable checkpoint
    or one whose weights do not fit the run's model.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    if which not in ("best", "last"):
        raise ValueError(f"which must be 'best' or 'last', got {which!r}")
    path = run_dir / "checkpoints" / f"{which}.pt"
    if which == "best" and not path.is_file():
        path = run_dir / "checkpoints" / "last.pt"
    ckpt = checkpoint.load(path, map_location="cpu")
    # The checkpoint holds the config resolved by the task (vocab_size, num_classes filled in).
    cfg = config_mod.from_dict(ckpt["config"]) if "config" in ckpt else config_mod.from_dict(read_config(run_dir))
    data_dir = _data_dir(run_dir, cfg, data)
    if not data_dir.exists():
        if data is not None:
            raise FileNotFoundError(f"--data {data}: no such folder")
        raise FileNotFoundError(f"data folder {data_dir} of run {run_dir} does not exist; pass --data")
    task = get_task(cfg.task).build(cfg, data_dir)
    cfg = config_mod.replace(cfg, vocab_size=task.vocab_size, num_classes=task.num_classes)
    model = task.build_model(cfg)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise ValueError(f"{path}: weights do not fit the model of {run_dir}/config.yaml: {e}") from None
    model.to(device).eval()
    step = ckpt.get("step", ckpt.get("state", {}).get("step"))
    return LoadedRun(run_dir, cfg, task, model, path, step, data_dir)


def run_label(cfg: config_mod.RunConfig) -> str:
    """Short name of a run for tables and legends: the registry's label of its kind, heads and the options that name
    a variant (:func:`mgk.attention.registry.run_label`), e.g. "softmax-8", "smgk-4 soft_e", "mlk-4 mix=keys"."""
    return registry_label(cfg.attention.kind, cfg.attention.num_heads, cfg.attention.options)
