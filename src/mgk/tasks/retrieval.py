"""Retrieval (LRA): byte-level AAN citation matching with the two-tower model (shared encoder weights)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import RunConfig, run_config, with_forms
from ..data import retrieval as rv
from ..data.cache import resolve_cache_dir, seeded_split
from ..data.tokenizers import ByteTokenizer
from ..models import RetrievalModel
from .authors import AUTHORS_LRA, AUTHORS_LRA_FORMS, LRA_TASKS
from .classification import ClassificationTask
from .lra_common import label_line, length_line, require_data

PRESETS = {
    # Small CPU preset: 256 bytes per document, the paper's model, a few hundred steps (needs --data).
    "retrieval-small": run_config(task="retrieval", max_len=256, lr=5e-4, steps=600, warmup_steps=60, batch_size=32,
                                 eval_every=200, checkpoint_every=200, log_every=20),
    # Paper, keeping the authors' values (Nguyen et al. 2022, Section 4.1; sources in mgk.tasks.authors): AAN bytes,
    # 4000 per document (2 x 4000), batch 24, AdamW lr 1e-4 eps 1e-6, OneCycle (8000 of 30000 steps up; the
    # authors' lra/README.md commands), fp16, ReLU head, N(0, 0.02) embeddings, validation every 300 steps on 565
    # batches; two towers sharing the 2-layer encoder (d_model 64, FFN 128, head_dim 32), head on
    # [x0, x1, x0*x1, x0-x1] (lra/model_wrapper.py:116-125).
    "retrieval-paper": with_forms(run_config(task="retrieval", **AUTHORS_LRA, **LRA_TASKS["retrieval"],
                                             checkpoint_every=1000, log_every=100), AUTHORS_LRA_FORMS),
}


@dataclass
class RetrievalTask(ClassificationTask):
    """Pairs of documents -> cites / does not cite. Batches hold both documents with their padding masks:
    ``{"tokens1", "padding_mask1", "tokens2", "padding_mask2", "label"}``; the model is
    :class:`~mgk.models.RetrievalModel`, called as ``model(tokens1, padding_mask1, tokens2, padding_mask2)``."""

    extra: dict = field(default_factory=dict)

    model_class = RetrievalModel  # same constructor as LRAClassifier; the base class builds it

    @staticmethod
    def batch(dataset, index: Tensor, device) -> dict:
        """Rows ``index``; each document cut to the longest real length of its side of the batch, with its padding
        mask (B, L) True = padding (from the lengths, never from token values)."""
        out = {"label": dataset.labels[index].to(device)}
        for k, (tokens, lengths) in enumerate(((dataset.tokens1, dataset.lengths1),
                                               (dataset.tokens2, dataset.lengths2)), start=1):
            lens = lengths[index]
            L = max(1, int(lens.max()))
            out[f"tokens{k}"] = tokens[index, :L].long().to(device)
            out[f"padding_mask{k}"] = (torch.arange(L).unsqueeze(0) >= lens.unsqueeze(1)).to(device)
        return out

    @staticmethod
    def loss(model: nn.Module, batch: dict) -> tuple[Tensor, dict]:
        """Summed cross-entropy over the batch's pairs and the sums behind the metrics:
        ``{"loss", "correct", "count"}``."""
        logits = model(batch["tokens1"], batch["padding_mask1"], batch["tokens2"], batch["padding_mask2"])
        labels = batch["label"]
        loss_sum = F.cross_entropy(logits.float(), labels, reduction="sum")
        correct = (logits.argmax(dim=-1) == labels).sum()
        return loss_sum, {"loss": loss_sum.detach(), "correct": correct, "count": labels.numel()}

    def describe(self, dataset) -> dict:
        """Split facts for results.json: majority-class accuracy, documents cut to max_len (both sides counted), and
        ``extra``. ValueError for an empty split."""
        return {"majority_acc": dataset.majority_acc(), "num_truncated": int(dataset.num_truncated), **self.extra}


_WHAT = "a folder with new_aan_pairs.{train,eval,test}.tsv (or tsv_data/ holding them)"


def prepare(cfg: RunConfig, run_dir: Path) -> Path:
    """``cfg.data.path`` (required: there is no generated AAN). FileNotFoundError when absent."""
    return require_data(cfg, _WHAT)


def build(cfg: RunConfig, data_dir: Path) -> RetrievalTask:
    """Encode the three files (cached); ``eval`` is validation. Without an eval file, validation is carved out of
    train with ``split_seed``/``val_fraction``. An absent test file is noted, not fatal.

    Raises:
        FileNotFoundError: no train file. RetrievalFormatError: a malformed row (file and line named).
    """
    data_dir = Path(data_dir)
    cache = resolve_cache_dir(cfg.data.cache_dir, data_dir)
    splits, statuses = {}, []
    for split in rv.SPLITS:
        splits[split], st = rv.load_aan_split(data_dir, split, cfg.data.max_len, cache_dir=cache)
        statuses.append(f"{split} {st}")
    if splits["train"] is None:
        raise FileNotFoundError(f"{data_dir}: no {rv.FILE_NAMES['train']} (expected {_WHAT})")
    notes = [f"data: retrieval (byte-level AAN) from {data_dir}; cache: " + "; ".join(statuses)]
    if splits["val"] is None and cfg.data.val_fraction > 0:
        full = splits["train"]
        val_idx, train_idx = seeded_split(len(full), [cfg.data.val_fraction], cfg.data.split_seed)
        splits["train"], splits["val"] = full.subset(train_idx), full.subset(val_idx)
        notes.append(f"data: no {rv.FILE_NAMES['val']}: validation carved out of train (split_seed="
                     f"{cfg.data.split_seed}, val_fraction={cfg.data.val_fraction})")
    for split, ds in splits.items():
        notes.append(f"data: {split}: " + (f"{ds.source} ({len(ds)} pairs)" if ds is not None else "absent"))
    cut = ", ".join(f"{n} {ds.num_truncated}" for n, ds in splits.items() if ds is not None)
    notes.append(f"data: documents longer than max_len={cfg.data.max_len} bytes are cut to their first "
                 f"{cfg.data.max_len} bytes (the LRA task definition): {cut}")
    return RetrievalTask("retrieval", splits, vocab_size=rv.VOCAB_SIZE, num_classes=rv.NUM_CLASSES, notes=notes,
                         extra={"max_len": cfg.data.max_len})


def restore(cfg: RunConfig, vocab=None) -> RetrievalTask:
    """The task of a trained run without its data (:class:`mgk.tasks.base.TaskModule`)."""
    return RetrievalTask.restored(cfg, tokenizer=ByteTokenizer())


def check(cfg: RunConfig, data: Path) -> tuple[list[str], list[str]]:
    """Validate the AAN files: ``(report lines, errors)``; each error names the file and line."""
    lines, errors = [], []
    if not Path(data).is_dir():
        return lines, [f"{data}: not a folder (expected {_WHAT})"]
    for split in rv.SPLITS:
        path = rv.find_aan_file(data, split)
        if path is None:
            msg = f"{split}: {rv.FILE_NAMES[split]} absent in {data}"
            (errors if split == "train" else lines).append(msg)
            continue
        try:
            labels, t1, t2, _ = rv.read_aan_tsv(path)
        except rv.RetrievalFormatError as exc:
            errors.append(str(exc))
            continue
        lines += [f"{split}: {len(labels)} pairs ({path})",
                  "  " + label_line([labels.count(0), labels.count(1)], ("unrelated (0)", "cites (1)")),
                  "  text1 " + length_line([len(t) for t in t1], cfg.data.max_len, "bytes"),
                  "  text2 " + length_line([len(t) for t in t2], cfg.data.max_len, "bytes")]
        empty = sum(1 for t in t1 + t2 if not t)
        if empty:
            lines.append(f"  {empty} empty documents")
    return lines, errors
