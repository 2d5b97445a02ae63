"""Getting a trained run back: :func:`load_run` gives its model (weights loaded, eval mode, on a device), its config,
its tokenizer and where it stands, from the run directory alone; the data is read only when asked for
(:meth:`LoadedRun.with_splits`). ``mgk eval``, ``mgk analyze`` and scripts all load runs through it.

Use::

    run = mgk.load_run("runs/lm-mgk4", checkpoint="best", device="cuda")
    ids = torch.tensor([run.tokenizer.encode("the meaning of")])
    nll = run.model(ids[:, :-1], ids[:, 1:])      # the model of the run's task (here a TransformerLM)
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import RunConfig
from ..data import wikitext as wt
from ..tasks import get_task
from ..tasks.base import Task
from ..tasks.run_records import run_failure
from . import rundir
from .checkpoint import load as load_checkpoint
from .checkpoint import step_of
from .distributed import check_device

__all__ = ["LoadedRun", "load_run"]


@dataclass
class LoadedRun:
    """A trained run, ready to use.

    Attributes:
        run_dir: the run directory.
        model: the task's model with the checkpoint's weights, in eval mode, on the requested device.
        cfg: its :class:`~mgk.config.RunConfig` as the checkpoint holds it (sizes filled in).
        task: the task object (:mod:`mgk.tasks`): without splits (``task.splits == {}``) until
            :meth:`with_splits` reads the data.
        tokenizer: text <-> token ids of the inputs (:mod:`mgk.data.tokenizers`: the run's word vocabulary for a
            language model, ListOps symbols, UTF-8 bytes for text and retrieval), or None (image, pathfinder).
        checkpoint: the file the weights came from (best.pt, or last.pt).
        step: the optimiser step of that checkpoint; ``steps``: the steps the run was configured for.
        finished: the run wrote results.json (it trained all its steps and was evaluated).
        failure: why its results do not count (a final evaluation that was not finite), or None.
        data_dir: the data folder of the run (or the one given to :func:`load_run`); may not exist.
    """

    run_dir: Path
    model: nn.Module
    cfg: RunConfig
    task: Task
    tokenizer: object | None
    checkpoint: Path
    step: int | None
    steps: int
    finished: bool
    failure: str | None
    data_dir: Path

    def with_splits(self) -> "LoadedRun":
        """This run with its task built from :attr:`data_dir` (train / val / test splits, as training read them).
        FileNotFoundError saying to pass the data folder when it does not exist (moved, or on another machine)."""
        if not self.data_dir.exists():
            raise FileNotFoundError(f"the data folder {self.data_dir} of run {self.run_dir} does not exist (moved?): "
                                    "pass its new place with --data (load_run(..., data=...))")
        task = get_task(self.cfg.task).build(self.cfg, self.data_dir)
        return dataclasses.replace(self, task=task)

    def status(self) -> str:
        """``"finished"``, ``"failed: <reason>"``, or ``"unfinished: checkpoint at step S of N"``."""
        if self.failure is not None:
            return f"failed: {self.failure}"
        if self.finished:
            return "finished"
        return f"unfinished: {self.checkpoint.name} at step {self.step} of {self.steps}"


def load_run(run_dir: str | os.PathLike, checkpoint: str = "best", device: str | torch.device = "cpu",
             data: str | os.PathLike | None = None) -> LoadedRun:
    """Load the run in ``run_dir`` (made by ``mgk train``; 0.1.0 run directories included) without reading its data.

    Args:
        checkpoint: "best" (best validation; last.pt when the run has no best.pt) or "last".
        device: where the model goes.
        data: the run's data folder, when it is not where the run had it; used for :meth:`LoadedRun.with_splits`
            and, for a language model without vocab.txt, to rebuild the vocabulary from its train split.

    Returns: a :class:`LoadedRun`.

    Raises:
        FileNotFoundError: naming a missing run directory, checkpoint or vocabulary.
        ValueError: a damaged config.yaml, results.json or checkpoint (naming the file), weights that do not fit the
            run's model, a vocabulary of another size than the trained one, a device that does not exist.
    """
    run_dir = Path(run_dir)
    files = rundir.RunFiles(run_dir)
    saved = rundir.load_config(run_dir)  # FileNotFoundError for a folder that is not a run
    path = files.existing_checkpoint(checkpoint)
    device = check_device(str(device), "device")
    ckpt = load_checkpoint(path, map_location="cpu")
    cfg = _config_of(ckpt, path, saved)
    # config.yaml's data folder, not the checkpoint's copy: the file a user edits when the data moved
    data_dir = Path(data) if data is not None else Path(saved.data.path) if saved.data.path is not None else files.data
    vocab = _vocabulary(files, cfg, data_dir) if cfg.task == "lm" else None
    task = get_task(cfg.task).restore(cfg, vocab)
    model = task.build_model(cfg)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise ValueError(f"{path}: its weights do not fit the model of {files.config}: {first}") from None
    model.to(device).eval()
    results = rundir.read_results(run_dir)
    return LoadedRun(run_dir=run_dir, model=model, cfg=cfg, task=task, tokenizer=task.tokenizer, checkpoint=path,
                     step=step_of(ckpt), steps=saved.optim.steps, finished=results is not None,
                     failure=None if results is None else run_failure(results), data_dir=data_dir)


def _config_of(ckpt: dict, path: Path, saved: RunConfig) -> RunConfig:
    """The checkpoint's resolved config (vocab_size, num_classes filled in), else config.yaml's."""
    from .. import config as config_mod

    if "config" not in ckpt:
        return saved
    try:
        return config_mod.from_dict(ckpt["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: its config does not load: {e}") from None


def _vocabulary(files: rundir.RunFiles, cfg: RunConfig, data_dir: Path) -> wt.Vocabulary:
    """The run's vocab.txt, else the vocabulary of the data's train split (runs whose vocab.txt was lost); ValueError
    when its size is not the trained one, FileNotFoundError when there is neither."""
    from ..tasks.lm import cache_dir

    if files.vocab.is_file():
        vocab, source = wt.Vocabulary.load(files.vocab), files.vocab
    else:
        train = wt.find_split_file(data_dir, "train") if data_dir.is_dir() else None
        if train is None:
            raise FileNotFoundError(f"{files.vocab} is missing and {data_dir} has no train split to rebuild the "
                                    "vocabulary from: pass --data with the run's data folder")
        vocab, source = wt.load_vocabulary(train, cache_dir(cfg, data_dir)), train
    if cfg.model.vocab_size and len(vocab) != cfg.model.vocab_size:
        raise ValueError(f"the vocabulary from {source} has {len(vocab)} words but the run was trained with "
                         f"{cfg.model.vocab_size}: pass --data with the run's own train split")
    return vocab
