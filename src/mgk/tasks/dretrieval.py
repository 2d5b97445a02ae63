"""Generalized D-retrieval (Yu et al., ICLR 2026; :mod:`mgk.data.dretrieval`): regression of a target that combines
D features retrieved from a sequence, scored by NMSE (lower is better); the head-count task of the paper.

Model (the paper's setting): the LRA encoder with a class token (id V) put before the T input tokens, its output read
at the class token (``pooling="cls"``) through the MLP head to one number. The model predicts the standardised
target ``(y - mean) / std`` with the train split's mean and std (the NMSE is the same in either scale); the loss is
the squared error summed over the batch (the loop divides by the batch size: the mean squared error).

Without ``--data`` the three splits are generated into ``<run>/data`` from the ``gen_*`` settings with generator seed
0 (the same data for every run; the training seed varies the model and the order only).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..config import RunConfig, encoder_config, run_config
from ..data import dretrieval as dr
from ..models import EncoderConfig, LRAClassifier
from .base import Task
from .synthetic_splits import SPLIT_PAIRS, present_splits, shared_inputs

__all__ = ["PRESETS", "RegressionSplit", "DRetrievalTask", "prepare", "build", "restore", "check", "spec_of"]

# One layer, fixed d_model and head_dim (the attention width is num_heads x head_dim, as in the LRA presets),
# no dropout (fresh synthetic data; the paper's model has none). How the sizes were chosen, on softmax runs only:
# results/cpu/heads-exploration.md.
PRESETS = {
    "dretrieval-small": run_config(task="dretrieval", num_layers=1, d_model=64, head_dim=8, ffn_dim=128,
                                  classifier_dim=128, pooling="cls", dropout=0.0, attn_dropout=0.0, num_heads=4,
                                  steps=2000, batch_size=64, lr=3e-3, warmup_steps=200, schedule="linear",
                                  eval_every=500, checkpoint_every=500, log_every=100, eval_batch_size=500,
                                  gen_train=20000, gen_val=2000, gen_test=2000, gen_seq_len=16, gen_features=4,
                                  gen_vocab=64),
}


def spec_of(cfg: RunConfig) -> dr.DRetrievalSpec:
    """The task of the ``gen_*`` settings; ValueError naming them when they are out of range."""
    try:
        d = cfg.data
        return dr.DRetrievalSpec(seq_len=d.gen_seq_len, num_features=d.gen_features, vocab=d.gen_vocab)
    except ValueError as exc:
        raise ValueError(f"{exc} (settings gen_seq_len, gen_features, gen_vocab)") from None


def prepare(cfg: RunConfig, run_dir: Path) -> Path:
    """``cfg.data``, or the splits of :func:`spec_of` ``(cfg)`` written to ``run_dir/data`` (generator seed 0;
    kept when already there, as on resume). Rank 0 only."""
    if cfg.data.path is not None:
        return Path(cfg.data.path)
    out = Path(run_dir) / "data"
    if not dr.split_path(out, "train").is_file():
        d = cfg.data
        dr.generate_dir(out, spec_of(cfg), num_train=d.gen_train, num_val=d.gen_val, num_test=d.gen_test, seed=0)
    return out


@dataclass
class RegressionSplit:
    """One split as tensors: ``tokens`` int64 (N, T + 1) (the class token V first), ``targets`` float64 (N,), the
    ``spec`` and the ``source`` file."""

    tokens: Tensor
    targets: Tensor
    spec: dr.DRetrievalSpec
    source: str

    @classmethod
    def of(cls, split: dr.DRetrievalSplit) -> "RegressionSplit":
        """The model's view of a generated split: the class token (id V) put before every sequence."""
        inputs = torch.from_numpy(split.inputs.astype(np.int64))
        cls_column = torch.full((len(split), 1), split.spec.vocab, dtype=torch.int64)
        return cls(torch.cat([cls_column, inputs], dim=1), torch.from_numpy(split.targets), split.spec, split.source)

    def __len__(self) -> int:
        return int(self.targets.shape[0])


@dataclass
class DRetrievalTask(Task):
    """What ``mgk train`` needs for D-retrieval: standardised targets, squared-error loss, NMSE.

    ``spec``, ``target_mean`` and ``target_std`` come from the train split; a task restored without its data
    (:func:`restore`) has None there and builds the model only (its :meth:`batch` refuses: the scale of the targets
    is the train split's)."""

    name: str
    splits: dict
    vocab_size: int  # V grid tokens and the class token
    spec: dr.DRetrievalSpec | None = None
    target_mean: float | None = None
    target_std: float | None = None
    notes: list = field(default_factory=list)
    num_classes: int = 1  # one output: the regression target
    best_metric = ("nmse", "min")

    def model_config(self, cfg: RunConfig) -> EncoderConfig:
        """:func:`mgk.config.encoder_config` of ``cfg`` with V + 1 tokens and one output."""
        return dataclasses.replace(encoder_config(cfg), vocab_size=self.vocab_size, num_classes=1)

    def build_model(self, cfg: RunConfig) -> nn.Module:
        """The LRA encoder-classifier of :meth:`model_config` (one output; ``pooling`` "cls" reads the class
        token)."""
        return LRAClassifier(self.model_config(cfg))

    def batch(self, dataset: RegressionSplit, index: Tensor, device) -> dict:
        """``{"tokens": int64 (B, T + 1), "target": float32 (B,) standardised}`` of examples ``index``. ValueError
        for a task restored without its data (the standardisation is the train split's)."""
        if self.target_mean is None or self.target_std is None:
            raise ValueError("dretrieval: the targets are standardised with the train split's mean and std: build "
                             "the task from its data (mgk.load_run(...).with_splits())")
        target = (dataset.targets[index] - self.target_mean) / self.target_std
        return {"tokens": dataset.tokens[index].to(device), "target": target.float().to(device)}

    @staticmethod
    def loss(model: nn.Module, batch: dict) -> tuple[Tensor, dict]:
        """Summed squared error and the sums behind the NMSE: ``{"loss", "sum_y", "sum_y2", "count"}``."""
        y = batch["target"]
        err = model(batch["tokens"])[:, 0].float() - y
        sse = (err * err).sum()
        return sse, {"loss": sse.detach(), "sum_y": y.sum(), "sum_y2": (y * y).sum(), "count": y.numel()}

    @staticmethod
    def summarise(sums: dict) -> dict:
        """``{"loss": mean squared error (standardised units), "nmse": loss / Var(y) of the examples, "count"}``;
        nmse is nan when the targets do not vary."""
        n = max(1.0, float(sums["count"]))
        mse = float(sums["loss"]) / n
        var = float(sums["sum_y2"]) / n - (float(sums["sum_y"]) / n) ** 2
        return {"loss": mse, "nmse": mse / var if var > 0 else float("nan"), "count": int(sums["count"])}

    def describe(self, dataset: RegressionSplit) -> dict:
        """Split facts for results.json: T, D, V and ``constant_nmse``, the NMSE of predicting the train mean (the
        baseline to beat, 1 up to the split's mean shift)."""
        y = dataset.targets.double()
        var = float(y.var(unbiased=False))
        const = float(((y - self.target_mean) ** 2).mean()) / var if var > 0 else float("nan")
        return {"seq_len": dataset.spec.seq_len, "num_features": dataset.spec.num_features,
                "vocab": dataset.spec.vocab, "constant_nmse": const}


def _load(data_dir: Path) -> dict:
    splits = {s: dr.load_split(data_dir, s) for s in dr.SPLITS}
    if splits["train"] is None:
        raise FileNotFoundError(f"no D-retrieval train split ({dr.split_path(data_dir, 'train').name}) in {data_dir}")
    for split in splits.values():
        if split is not None and (split.spec != splits["train"].spec
                                  or not np.array_equal(split.tables, splits["train"].tables)):
            raise ValueError(f"{split.source}: another task than the train split ({split.spec} != "
                             f"{splits['train'].spec})")
    return splits


def build(cfg: RunConfig, data_dir: Path) -> DRetrievalTask:
    """The splits of ``data_dir`` (absent val/test are noted). Raises FileNotFoundError without a train split,
    DRetrievalFormatError for a malformed file, ValueError for splits of different tasks or ``max_len`` shorter than
    T + 1 (the class token and the sequence)."""
    splits = _load(Path(data_dir))
    spec = splits["train"].spec
    if cfg.data.max_len < spec.seq_len + 1:
        raise ValueError(f"task dretrieval: sequences have {spec.seq_len} tokens and a class token; set "
                         f"max_len >= {spec.seq_len + 1} (got {cfg.data.max_len})")
    y = splits["train"].targets
    notes = [f"data: dretrieval T={spec.seq_len}, D={spec.num_features}, V={spec.vocab} (task seed "
             f"{spec.task_seed}); targets standardised with the train mean {y.mean():.5f} and std {y.std():.5f}"]
    out = {}
    for name, split in splits.items():
        out[name] = None if split is None else RegressionSplit.of(split)
        notes.append(f"data: {name}: absent in {data_dir}" if split is None
                     else f"data: {name}: {split.source} ({len(split)} rows)")
    return DRetrievalTask("dretrieval", out, spec.vocab + 1, spec, float(y.mean()), float(y.std()) or 1.0, notes)


def restore(cfg: RunConfig, vocab=None) -> DRetrievalTask:
    """The task of a trained run without its data (:class:`mgk.tasks.base.TaskModule`): the model's sizes from the
    checkpoint's config (``vocab_size`` = V + 1 filled in by training); no tokenizer (the inputs are grid ids)."""
    return DRetrievalTask(cfg.task, {}, vocab_size=cfg.model.vocab_size)


def check(cfg: RunConfig, data: Path) -> tuple[list[str], list[str]]:
    """``mgk data check --task dretrieval``: each split's rows, task and target statistics; errors (naming the
    file) for malformed files, a missing train split, splits of another task, and inputs shared between splits."""
    if not data.is_dir():
        return [], [f"{data}: not a folder (expected dretrieval_{{train,val,test}}.npz)"]
    lines, errors, splits = [], [], {}
    for name, split in present_splits(data, dr, dr.DRetrievalFormatError, lines, errors):
        splits[name] = split
        s, y = split.spec, split.targets
        lines.append(f"{name}: {len(split)} rows ({split.source}); T={s.seq_len}, D={s.num_features}, V={s.vocab}; "
                     f"target mean {y.mean():.4f}, std {y.std():.4f}")
    if "train" in splits:
        for split in splits.values():
            if split.spec != splits["train"].spec or not np.array_equal(split.tables, splits["train"].tables):
                errors.append(f"{split.source}: another task than the train split")
    for a, b in SPLIT_PAIRS:
        if a in splits and b in splits and (shared := shared_inputs(splits, a, b)):
            errors.append(shared)
    if "train" in splits and cfg.data.max_len < splits["train"].spec.seq_len + 1:
        lines.append(f"note: training needs max_len >= {splits['train'].spec.seq_len + 1} (got {cfg.data.max_len})")
    return lines, errors
