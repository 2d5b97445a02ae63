"""The interface between tasks and the training loop: :class:`Task` (what ``mgk train`` calls on a task object) and
:class:`TaskModule` (what a module in :data:`mgk.tasks.TASKS` provides).

The loop calls only the members declared here; a task that lacks a required one fails when it is defined, not in
the middle of a run.
"""
from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..seeds import torch_seed

__all__ = ["EpochSampler", "Sampler", "Task", "TaskModule"]


class Sampler(Protocol):
    """Global batch indices of each optimiser step, a pure function of the step (so a resumed run needs only it)."""

    def indices(self, step: int) -> Tensor:
        """int64 (global_batch,) example indices of optimiser step ``step``."""


class EpochSampler:
    """Global batch indices for step ``s``: slice ``s mod E`` of the permutation of epoch ``s div E``.

    Epoch e is ``randperm(N)`` drawn from a generator seeded with (seed, e); the incomplete tail batch of an epoch
    is not used. ValueError when there are fewer examples than one batch."""

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        if num_examples < batch_size:
            raise ValueError(f"the train split has {num_examples} examples, fewer than batch_size={batch_size}")
        self.n, self.batch_size, self.seed = num_examples, batch_size, seed
        self.per_epoch = num_examples // batch_size
        self._cache = (None, None)

    def indices(self, step: int) -> Tensor:
        """int64 (batch_size,) example indices of optimiser step ``step``."""
        epoch, pos = divmod(step, self.per_epoch)
        if self._cache[0] != epoch:
            g = torch.Generator().manual_seed(torch_seed(self.seed * 1_000_003 + epoch))
            self._cache = (epoch, torch.randperm(self.n, generator=g))
        return self._cache[1][pos * self.batch_size:(pos + 1) * self.batch_size]


class Task(abc.ABC):
    """A built task: its splits and how to batch, score and describe them.

    Required attributes (set by the subclass, usually as dataclass fields):
        name: task name ("listops", "lm", ...).
        splits: {"train", "val", "test"} -> dataset or None (absent split); ``len(dataset)`` examples.
        vocab_size, num_classes: model sizes (num_classes 0 where meaningless).
        notes: lines for the log (data source, truncation counts, ...).

    Optional (defaults here):
        best_metric: (validation metric, "max" or "min") that selects the best checkpoint; ("acc", "max").
        vocab: a vocabulary learned from the data (a :class:`~mgk.data.wikitext.Vocabulary` with ``save``), which
            the run keeps (vocab.txt) so that it loads without its data; None (token ids fixed by the format).
        tokenizer: text <-> token ids of the task's inputs (``encode(text) -> list[int]``,
            ``decode(ids) -> str``; :mod:`mgk.data.tokenizers`) on the tasks that ``restore`` gives, or None
            (pixels; tasks built for training, which read encoded files).
        sampler(num_examples, global_batch, seed): the training order; :class:`EpochSampler`.
    """

    name: str
    splits: dict
    vocab_size: int
    num_classes: int
    notes: list
    best_metric: tuple[str, str] = ("acc", "max")
    vocab = None
    tokenizer = None

    @abc.abstractmethod
    def model_config(self, cfg) -> Any:
        """The model configuration of run config ``cfg`` with this task's sizes (an
        :class:`~mgk.models.config.EncoderConfig` or :class:`~mgk.models.config.LMConfig`); equal configs are
        required to resume a checkpoint."""

    @abc.abstractmethod
    def build_model(self, cfg) -> nn.Module:
        """The model of :meth:`model_config` ``(cfg)``, freshly initialised from the current torch seed."""

    @abc.abstractmethod
    def batch(self, dataset, index: Tensor, device) -> dict:
        """Examples ``index`` (int64) of ``dataset`` as a dict of tensors on ``device``."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: dict) -> tuple[Tensor, dict]:
        """``(loss_sum, sums)``: the summed loss to back-propagate (the loop divides it by the local batch size)
        and additive statistics (``loss``, ``count``, ...) that are summed over batches and ranks."""

    @abc.abstractmethod
    def summarise(self, sums: dict) -> dict:
        """Metrics (at least ``loss``) from summed statistics."""

    @abc.abstractmethod
    def describe(self, dataset) -> dict:
        """Facts about a split for results.json (e.g. the majority-class accuracy)."""

    def sampler(self, num_examples: int, global_batch: int, seed: int) -> Sampler:
        """The training order over ``num_examples`` train examples (default: :class:`EpochSampler`)."""
        return EpochSampler(num_examples, global_batch, seed)


class TaskModule(Protocol):
    """A task module (``mgk.tasks.<name>``) as ``mgk train`` and ``mgk data check`` use it.

    ``PRESETS``: preset name -> :class:`~mgk.config.RunConfig` (data, not code).
    ``prepare(cfg, run_dir) -> data_dir``: rank 0 only: find or generate the files.
    ``build(cfg, data_dir) -> Task``: every rank.
    ``restore(cfg, vocab=None) -> Task``: the task of a trained run without its data (no splits), from the
    checkpoint's config (sizes filled in) and, for a task with a learned vocabulary, that vocabulary: enough to
    build the model and tokenize inputs (:func:`mgk.load_run`).
    ``check(cfg, data) -> (report lines, errors)``: validate a data folder; every error names the file (and line).
    """

    PRESETS: dict

    def prepare(self, cfg, run_dir: Path) -> Path:
        """Rank 0: find or generate the data files of ``cfg``; returns the data folder."""
        ...

    def build(self, cfg, data_dir: Path) -> Task:
        """Every rank: the :class:`Task` (splits, model builder, loss) over ``data_dir``."""
        ...

    def restore(self, cfg, vocab=None) -> Task:
        """The task of a trained run without its data: sizes from ``cfg``, the vocabulary ``vocab`` when it has one."""
        ...

    def check(self, cfg, data: Path) -> tuple[list[str], list[str]]:
        """``mgk data check``: (report lines, errors) for a data folder; each error names the file (and line)."""
        ...
