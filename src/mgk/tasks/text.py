"""Text (LRA): byte-level IMDb sentiment, from an ``aclImdb`` folder or its ``.tar.gz``."""
from __future__ import annotations

from pathlib import Path

from ..config import RunConfig, run_config, with_forms
from ..data import text as tx
from ..data.cache import resolve_cache_dir, seeded_split
from ..data.tokenizers import ByteTokenizer
from .authors import AUTHORS_LRA, AUTHORS_LRA_FORMS, LRA_TASKS
from .lra_common import LRAClassificationTask, label_line, length_line, require_data

__all__ = ["PRESETS", "LRAClassificationTask", "prepare", "build", "restore", "check"]

PRESETS = {
    # Small CPU preset: 512 bytes per review, the paper's model, a few hundred steps (needs --data).
    "text-small": run_config(task="text", max_len=512, lr=5e-4, steps=600, warmup_steps=60, batch_size=32,
                             eval_every=200, checkpoint_every=200, log_every=20),
    # Paper, keeping the authors' values (Nguyen et al. 2022, Section 4.1; sources in mgk.tasks.authors): IMDb bytes,
    # 1000 per review, batch 32, AdamW lr 1e-4 eps 1e-6, OneCycle (8000 of 20000 steps up), fp16, ReLU head,
    # N(0, 0.02) embeddings, validation every 500 steps on 781 batches (Nystromformer cfg "text"); 2 layers,
    # d_model 64, FFN 128, head_dim 32. Validates on our held-out part of train, not on test (docs/paper-protocol.md).
    "text-paper": with_forms(run_config(task="text", **AUTHORS_LRA, **LRA_TASKS["text"], checkpoint_every=1000,
                                        log_every=100), AUTHORS_LRA_FORMS),
    # The same with 4000 bytes per review (the paper's second Text setting).
    "text-4k": run_config(task="text", max_len=4000, lr=1e-4, steps=20000, warmup_steps=8000, batch_size=32,
                          eval_every=1000, checkpoint_every=1000, log_every=100),
}


# --------------------------------------------------------------------------- protocol

_WHAT = "an aclImdb folder ({train,test}/{pos,neg}/*.txt) or its .tar.gz"


def prepare(cfg: RunConfig, run_dir: Path) -> Path:
    """``cfg.data.path`` (required: there is no generated IMDb). FileNotFoundError when absent."""
    return require_data(cfg, _WHAT)


def build(cfg: RunConfig, data_dir: Path) -> LRAClassificationTask:
    """Encode the reviews (cached), carve validation out of train with ``split_seed``/``val_fraction`` (never out of
    test), and note the source, the split sizes and how many reviews were cut to ``max_len`` bytes.

    Raises:
        FileNotFoundError / TextFormatError: as :func:`mgk.data.text.read_imdb`.
    """
    data_dir = Path(data_dir)
    splits, status = tx.load_imdb(data_dir, cfg.data.max_len, cache_dir=resolve_cache_dir(cfg.data.cache_dir, data_dir))
    full, test = splits["train"], splits["test"]
    val_idx, train_idx = seeded_split(len(full), [cfg.data.val_fraction], cfg.data.split_seed)
    train = full.subset(train_idx)
    val = full.subset(val_idx) if cfg.data.val_fraction > 0 else None
    notes = [f"data: text (byte-level IMDb) from {data_dir}; cache {status}",
             f"data: train {len(train)} / val {len(val) if val else 0} reviews: validation carved from the train "
             f"split (split_seed={cfg.data.split_seed}, val_fraction={cfg.data.val_fraction}), never from test",
             "data: test: " + (f"{len(test)} reviews ({test.source})" if test is not None
                               else f"absent in {data_dir} (no test split: results report val only)")]
    cut = ", ".join(f"{n} {ds.num_truncated} of {len(ds)}" for n, ds in (("train", train), ("val", val),
                                                                          ("test", test)) if ds is not None)
    notes.append(f"data: reviews longer than max_len={cfg.data.max_len} bytes are cut to their first "
                 f"{cfg.data.max_len} bytes (the LRA task definition): {cut}")
    return LRAClassificationTask("text", {"train": train, "val": val, "test": test}, vocab_size=tx.VOCAB_SIZE,
                                 num_classes=len(tx.CLASS_NAMES), notes=notes, extra={"max_len": cfg.data.max_len})


def restore(cfg: RunConfig, vocab=None) -> LRAClassificationTask:
    """The task of a trained run without its data (:class:`mgk.tasks.base.TaskModule`)."""
    return LRAClassificationTask.restored(cfg, tokenizer=ByteTokenizer())


def check(cfg: RunConfig, data: Path) -> tuple[list[str], list[str]]:
    """Validate an IMDb source: ``(report lines, errors)``; every error names the file or member."""
    lines: list[str] = []
    try:
        raw = tx.read_imdb(data)
    except (FileNotFoundError, tx.TextFormatError) as exc:
        return lines, [str(exc)]
    for split, sp in raw.items():
        if sp is None:
            lines.append(f"{split}: absent")
            continue
        lens = [len(t) for t in sp.texts]
        lines += [f"{split}: {len(sp)} reviews ({sp.source})",
                  "  " + label_line([sp.labels.count(0), sp.labels.count(1)], tx.CLASS_NAMES),
                  "  " + length_line(lens, cfg.data.max_len, "bytes") + " (cut to their first max_len bytes)"]
        non_utf8 = sum(1 for t in sp.texts if not _is_utf8(t))
        if non_utf8:
            lines.append(f"  {non_utf8} reviews are not valid UTF-8 (their bytes are used as they are)")
        if split == "train":
            val_idx, _ = seeded_split(len(sp), [cfg.data.val_fraction], cfg.data.split_seed)
            lines.append(f"  validation: {len(val_idx)} of these carved out with split_seed={cfg.data.split_seed}, "
                         f"val_fraction={cfg.data.val_fraction}")
    return lines, []


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
