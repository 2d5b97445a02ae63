"""A trained language model back from its run directory, for ``mgk generate`` and ``mgk bench decode --run``.

This is the one place those two read a run: it stands in for ``mgk.load_run(RUN_DIR)`` (built elsewhere), which has
the same shape (the model in eval mode, the run's config and its vocabulary), so switching to it changes this file
only.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch

from .. import config as config_mod
from ..models import TransformerLM
from ..train import checkpoint
from ..train.distributed import check_device
from ..train.lm_eval import _checkpoint_path, _data_dir, _vocabulary
from ..train.records import read_config

__all__ = ["LoadedRun", "load_lm_run", "read_run_config"]


class LoadedRun(NamedTuple):
    """A run's model (eval mode, on the asked device), its :class:`~mgk.config.RunConfig` and vocabulary."""

    model: TransformerLM
    config: config_mod.RunConfig
    vocab: object


def read_run_config(run_dir: str | os.PathLike) -> config_mod.RunConfig:
    """The RunConfig of ``run_dir/config.yaml``. FileNotFoundError naming it when absent."""
    return config_mod.from_dict(read_config(Path(run_dir)))


def load_lm_run(run_dir: str | os.PathLike, *, which: str = "best", device: str | None = None) -> LoadedRun:
    """The language model of ``run_dir`` from ``checkpoints/<which>.pt`` (best falls back to last), its config and
    its vocabulary (vocab.txt, else rebuilt from the run's train split).

    Raises FileNotFoundError naming what is missing; ValueError for a run of another task (naming it), a vocabulary
    that does not match the checkpoint, an unreadable checkpoint or a device that does not exist here."""
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    if cfg.task != "lm":
        raise ValueError(f"{run_dir} is a {cfg.task!r} run (a classifier): only language-model runs (--task lm) "
                         "generate text")
    if device is not None:
        check_device(device)
    ckpt = checkpoint.load(_checkpoint_path(run_dir, which))
    vocab = _vocabulary(run_dir, cfg, _data_dir(run_dir, cfg, None))
    model = TransformerLM(config_mod.lm_config(cfg, len(vocab)))
    model.load_state_dict(ckpt["model"])
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return LoadedRun(model.to(dev).eval(), cfg, vocab)
