"""Sequence classification (the LRA tasks): splits, model, batches, loss and accuracy.

A split is any object with int64 tensors ``tokens`` (N, L) right-padded, ``labels`` (N,) and ``lengths`` (N,)
(real tokens per row), and ``majority_acc()``. Padding is derived from ``lengths``, never from a token value.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import RunConfig, encoder_config
from ..models import EncoderConfig, LRAClassifier
from .base import Task


@dataclass
class ClassificationTask(Task):
    """What ``mgk train`` needs from a classification task.

    Attributes:
        name: task name ("listops", ...).
        splits: "train" / "val" / "test" -> dataset or None (absent split).
        vocab_size, num_classes: model sizes.
        notes: lines for the log (data source, truncation counts, ...).
        tokenizer: text <-> ids of the inputs (:mod:`mgk.data.tokenizers`; set by ``restore``), or None.
    """

    name: str
    splits: dict
    vocab_size: int
    num_classes: int
    notes: list = field(default_factory=list)
    tokenizer: Any = None

    @classmethod
    def restored(cls, cfg: RunConfig, **fields) -> "ClassificationTask":
        """The task of a trained run without its data (no splits), sized by ``cfg`` as a checkpoint holds it
        (``vocab_size``, ``num_classes`` filled in): what :meth:`build_model` and the tokenizer need."""
        return cls(cfg.task, {}, vocab_size=cfg.model.vocab_size, num_classes=cfg.model.num_classes, **fields)

    model_class = LRAClassifier  # subclasses swap in another model built from the same EncoderConfig

    def model_config(self, cfg: RunConfig) -> EncoderConfig:
        """:func:`mgk.config.encoder_config` of ``cfg`` with this task's vocabulary and class count."""
        return dataclasses.replace(encoder_config(cfg), vocab_size=self.vocab_size, num_classes=self.num_classes)

    def build_model(self, cfg: RunConfig) -> nn.Module:
        """``model_class`` (the LRA classifier of Nguyen et al. 2022, Section 4.1) of :meth:`model_config`."""
        return self.model_class(self.model_config(cfg))

    @staticmethod
    def batch(dataset, index: Tensor, device) -> dict:
        """Rows ``index`` of ``dataset``, cut to the longest real length in the batch (padding is inert, so this
        only saves work), with the padding mask (B, L) True = padding."""
        lengths = dataset.lengths[index]
        L = max(1, int(lengths.max()))
        tokens = dataset.tokens[index, :L].long()  # datasets may store uint8/int16 to save memory
        padding = torch.arange(L).unsqueeze(0) >= lengths.unsqueeze(1)
        return {"tokens": tokens.to(device), "padding_mask": padding.to(device),
                "label": dataset.labels[index].to(device)}

    @staticmethod
    def loss(model: nn.Module, batch: dict) -> tuple[Tensor, dict]:
        """Summed cross-entropy over the batch and the sums behind the metrics: ``{"loss", "correct", "count"}``."""
        logits = model(batch["tokens"], batch["padding_mask"])
        labels = batch["label"]
        loss_sum = F.cross_entropy(logits.float(), labels, reduction="sum")
        correct = (logits.argmax(dim=-1) == labels).sum()
        return loss_sum, {"loss": loss_sum.detach(), "correct": correct, "count": labels.numel()}

    best_metric = ("acc", "max")  # validation metric that selects the best checkpoint

    @staticmethod
    def describe(dataset) -> dict:
        """Facts about a split for results.json: the majority-class accuracy (the chance level to beat)."""
        return {"majority_acc": dataset.majority_acc()}

    @staticmethod
    def summarise(sums: dict) -> dict:
        """Per-example metrics from summed statistics: ``{"loss", "acc", "count"}``."""
        n = max(1.0, float(sums["count"]))
        return {"loss": float(sums["loss"]) / n, "acc": float(sums["correct"]) / n, "count": int(sums["count"])}
