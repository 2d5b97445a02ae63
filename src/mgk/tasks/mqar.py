"""Multi-query associative recall (Zoology, Arora et al. 2023; :mod:`mgk.data.mqar`): recall the value bound to each
queried key, scored at the answer positions only (cross-entropy and accuracy over the n answers of a sequence).

Model: :class:`~mgk.models.tagger.TokenTagger`, the LRA encoder run causally with a linear read-out over the whole
vocabulary at every position (Zoology trains causal sequence models; the answer to a query is predicted at the
query's last token). Two layers: one layer of attention cannot bind a value to the key before it and match the
query in the same step. Positions without an answer carry no loss and no count, so a model that always predicts
one token scores about ``1 / n_values`` (chance), whatever it does elsewhere.

Without ``--data`` the splits are generated into ``<run>/data`` from the ``gen_*`` settings with generator seed 0.
The compositional form is the task ``cmqar`` (:mod:`mgk.tasks.cmqar`), which shares this code.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import RunConfig, encoder_config, run_config
from ..data import mqar as mq
from ..models import EncoderConfig, TokenTagger
from .base import Task
from .synthetic_splits import SPLIT_PAIRS, present_splits, shared_inputs

__all__ = ["PRESETS", "TokenSplit", "MQARTask", "prepare", "build", "restore", "check", "spec_of", "small_preset"]


def small_preset(task: str, **overrides) -> RunConfig:
    """The CPU preset of ``task`` ("mqar" or "cmqar"): two causal layers, fixed d_model and head_dim (attention width
    num_heads x head_dim), no dropout, fresh-per-run generated data. How the sizes were chosen (softmax runs only):
    results/cpu/heads-exploration.md."""
    base = dict(task=task, num_layers=2, d_model=64, head_dim=16, ffn_dim=128, dropout=0.0, attn_dropout=0.0,
                num_heads=4, steps=2000, batch_size=64, lr=1e-3, warmup_steps=200, schedule="linear",
                eval_every=500, checkpoint_every=500, log_every=100, eval_batch_size=250, max_len=64,
                gen_train=20000, gen_val=1000, gen_test=1000, gen_seq_len=64, gen_vocab=128, gen_kv_pairs=8)
    return run_config(**{**base, **overrides})


PRESETS = {"mqar-small": small_preset("mqar")}


def spec_of(cfg: RunConfig, *, compositional: bool = False) -> mq.MQARSpec:
    """The task of the ``gen_*`` settings; ValueError naming them when they are out of range."""
    try:
        d = cfg.data
        return mq.MQARSpec(vocab=d.gen_vocab, seq_len=d.gen_seq_len, num_kv_pairs=d.gen_kv_pairs,
                           power_a=d.gen_power_a, compositional=compositional)
    except ValueError as exc:
        raise ValueError(f"{exc} (settings gen_vocab, gen_seq_len, gen_kv_pairs, gen_power_a)") from None


def prepare(cfg: RunConfig, run_dir: Path, *, compositional: bool = False) -> Path:
    """``cfg.data``, or the splits of :func:`spec_of` written to ``run_dir/data`` (generator seed 0; kept when
    already there, as on resume). Rank 0 only."""
    if cfg.data.path is not None:
        return Path(cfg.data.path)
    out = Path(run_dir) / "data"
    if not mq.split_path(out, "train").is_file():
        d = cfg.data
        mq.generate_dir(out, spec_of(cfg, compositional=compositional), num_train=d.gen_train,
                        num_val=d.gen_val, num_test=d.gen_test, seed=0)
    return out


@dataclass
class TokenSplit:
    """One split as tensors: ``inputs`` int64 (N, L), ``targets`` int64 (N, L) (-100 = no answer), ``spec``,
    ``source``."""

    inputs: Tensor
    targets: Tensor
    spec: mq.MQARSpec
    source: str

    @classmethod
    def of(cls, split: mq.MQARSplit) -> "TokenSplit":
        """The tensors of a generated or read split (int64 copies of its arrays)."""
        return cls(torch.from_numpy(split.inputs.astype(np.int64)), torch.from_numpy(split.targets.astype(np.int64)),
                   split.spec, split.source)

    def __len__(self) -> int:
        return int(self.inputs.shape[0])


@dataclass
class MQARTask(Task):
    """What ``mgk train`` needs for MQAR: answer-only cross-entropy, accuracy over answers. ``vocab_size`` V is
    also the number of classes (the read-out scores every token; the answer is one of the values). ``spec`` is the
    data's settings (None for a task restored without its data)."""

    name: str
    splits: dict
    vocab_size: int
    spec: mq.MQARSpec | None = None
    notes: list = field(default_factory=list)
    best_metric = ("acc", "max")

    @property
    def num_classes(self) -> int:
        """V: the read-out scores every token."""
        return self.vocab_size

    def model_config(self, cfg: RunConfig) -> EncoderConfig:
        """:func:`mgk.config.encoder_config` of ``cfg`` with V tokens and V classes."""
        return dataclasses.replace(encoder_config(cfg), vocab_size=self.vocab_size, num_classes=self.num_classes)

    def build_model(self, cfg: RunConfig) -> nn.Module:
        """The causal :class:`~mgk.models.tagger.TokenTagger` of :meth:`model_config`."""
        return TokenTagger(self.model_config(cfg), causal=True)

    @staticmethod
    def batch(dataset: TokenSplit, index: Tensor, device) -> dict:
        """``{"tokens", "target"}``: int64 (B, L) each, target -100 where there is no answer."""
        return {"tokens": dataset.inputs[index].to(device), "target": dataset.targets[index].to(device)}

    @staticmethod
    def loss(model: nn.Module, batch: dict) -> tuple[Tensor, dict]:
        """Cross-entropy summed over the answer positions, divided by the answers per sequence (so that the loop's
        division by the batch size gives the mean per answer), and the sums ``{"loss", "correct", "count"}`` over
        answers."""
        target = batch["target"]
        answer = target != mq.IGNORE_INDEX
        logits = model(batch["tokens"])[answer].float()
        y = target[answer]
        total = F.cross_entropy(logits, y, reduction="sum")
        per_row = max(1, int(answer.sum()) // max(1, target.shape[0]))
        correct = (logits.argmax(dim=-1) == y).sum()
        return total / per_row, {"loss": total.detach(), "correct": correct, "count": y.numel()}

    @staticmethod
    def summarise(sums: dict) -> dict:
        """``{"loss": cross-entropy per answer (nats), "acc": share of answers right, "count": answers}``."""
        n = max(1.0, float(sums["count"]))
        return {"loss": float(sums["loss"]) / n, "acc": float(sums["correct"]) / n, "count": int(sums["count"])}

    @staticmethod
    def describe(dataset: TokenSplit) -> dict:
        """Split facts for results.json: the settings and ``majority_acc``, the accuracy of always answering the
        split's most common answer (the chance level to beat)."""
        y = dataset.targets[dataset.targets != mq.IGNORE_INDEX]
        majority = float(torch.bincount(y).max()) / y.numel() if y.numel() else float("nan")
        s = dataset.spec
        return {"majority_acc": majority, "vocab": s.vocab, "seq_len": s.seq_len, "num_kv_pairs": s.num_kv_pairs,
                "compositional": s.compositional}


def build(cfg: RunConfig, data_dir: Path, *, name: str = "mqar", compositional: bool = False) -> MQARTask:
    """The splits of ``data_dir`` (absent val/test are noted). Raises FileNotFoundError without a train split,
    MQARFormatError for a malformed file, ValueError for splits of different settings, data of the other form
    (plain / compositional) than the task, or ``max_len`` shorter than the sequences."""
    splits = {s: mq.load_split(data_dir, s) for s in mq.SPLITS}
    if splits["train"] is None:
        raise FileNotFoundError(f"no {name} train split ({mq.split_path(data_dir, 'train').name}) in {data_dir}")
    spec = splits["train"].spec
    if spec.compositional != compositional:
        raise ValueError(f"{splits['train'].source}: {'compositional' if spec.compositional else 'plain'} MQAR data, "
                         f"but task {name} is the {'compositional' if compositional else 'plain'} form")
    for split in splits.values():
        if split is not None and split.spec != spec:
            raise ValueError(f"{split.source}: settings {split.spec} differ from the train split's {spec}")
    if cfg.data.max_len < spec.seq_len:
        raise ValueError(f"task {name}: sequences have {spec.seq_len} tokens; set max_len >= {spec.seq_len} "
                         f"(got {cfg.data.max_len})")
    notes = [f"data: {name} V={spec.vocab}, L={spec.seq_len}, {spec.num_kv_pairs} key-value pairs, power_a "
             f"{spec.power_a}; loss and accuracy on the answers only"]
    for s, split in splits.items():
        notes.append(f"data: {s}: absent in {data_dir}" if split is None
                     else f"data: {s}: {split.source} ({len(split)} rows)")
    out = {s: None if split is None else TokenSplit.of(split) for s, split in splits.items()}
    return MQARTask(name, out, spec.vocab, spec, notes)


def restore(cfg: RunConfig, vocab=None) -> MQARTask:
    """The task of a trained run without its data (:class:`mgk.tasks.base.TaskModule`): V from the checkpoint's
    config; no tokenizer (the inputs are token ids)."""
    return MQARTask(cfg.task, {}, vocab_size=cfg.model.vocab_size)


def check(cfg: RunConfig, data: Path, *, compositional: bool = False) -> tuple[list[str], list[str]]:
    """``mgk data check --task mqar|cmqar``: each split's rows and settings; errors (naming the file) for malformed
    files, a missing train split, the other form of the task, differing settings and inputs shared between splits."""
    if not data.is_dir():
        return [], [f"{data}: not a folder (expected mqar_{{train,val,test}}.npz)"]
    lines, errors, splits = [], [], {}
    for name, split in present_splits(data, mq, mq.MQARFormatError, lines, errors):
        splits[name] = split
        s = split.spec
        lines.append(f"{name}: {len(split)} rows ({split.source}); V={s.vocab}, L={s.seq_len}, "
                     f"{s.num_kv_pairs} pairs, power_a {s.power_a}, {'compositional' if s.compositional else 'plain'}")
        if s.compositional != compositional:
            errors.append(f"{split.source}: {'compositional' if s.compositional else 'plain'} data for the "
                          f"{'compositional' if compositional else 'plain'} task")
    for a, b in SPLIT_PAIRS:
        if a in splits and b in splits:
            if splits[a].spec != splits[b].spec:
                errors.append(f"{splits[b].source}: settings differ from {splits[a].source}")
            if shared := shared_inputs(splits, a, b):
                errors.append(shared)
    return lines, errors
