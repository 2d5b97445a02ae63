"""Sequence classification (the LRA tasks): splits, model, batches, loss and accuracy.

A split is any object with int64 tensors ``tokens`` (N, L) right-padded, ``labels`` (N,) and ``lengths`` (N,)
(real tokens per row), and ``majority_acc()``. Padding is derived from ``lengths``, never from a token value.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import RunConfig
from ..models import LRAClassifier


@dataclass
class ClassificationTask:
    """What ``mgk train`` needs from a classification task.

    Attributes:
        name: task name ("listops", ...).
        splits: "train" / "val" / "test" -> dataset or None (absent split).
        vocab_size, num_classes: model sizes.
        notes: lines for the log (data source, truncation counts, ...).
    """

    name: str
    splits: dict
    vocab_size: int
    num_classes: int
    notes: list = field(default_factory=list)

    model_class = LRAClassifier  # subclasses swap in another model with the same constructor

    def build_model(self, cfg: RunConfig) -> nn.Module:
        """``model_class`` (the LRA classifier of SPEC section 2) with ``cfg``'s sizes and attention."""
        options = {"num_keys": cfg.num_keys, "pi": cfg.pi, "pi_shape": cfg.pi_shape, "sigma2": cfg.sigma2,
                   "max_len": cfg.max_len}
        return self.model_class(self.vocab_size, self.num_classes, cfg.max_len, pooling=cfg.pooling,
                                classifier_dim=cfg.classifier_dim, d_model=cfg.d_model, num_layers=cfg.num_layers,
                                ffn_dim=cfg.ffn_dim, attention=cfg.attention, num_heads=cfg.num_heads,
                                head_dim=cfg.head_dim, dropout=cfg.dropout, attn_dropout=cfg.attn_dropout,
                                attention_options=options)

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
