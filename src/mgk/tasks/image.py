"""Image (LRA): CIFAR-10 as sequences of 1,024 grey pixels (python batches or image folders, plain or archived)."""
from __future__ import annotations

from pathlib import Path

from ..config import RunConfig, run_config, with_forms
from ..data import image as im
from ..data.cache import resolve_cache_dir, seeded_split
from .authors import AUTHORS_LRA, AUTHORS_LRA_FORMS, LRA_TASKS
from .lra_common import LRAClassificationTask, check_max_len, label_line, require_data

PRESETS = {
    # Small CPU preset: the paper's model on 1024-pixel sequences, a few hundred steps (needs --data). No attention
    # dropout: with it SDPA leaves its fused kernel, which at 1024 tokens costs about 1.3-2x per step on CPU.
    "image-small": run_config(task="image", max_len=im.SEQ_LEN, lr=5e-4, steps=300, warmup_steps=30, batch_size=32,
                              attn_dropout=0.0, eval_every=100, checkpoint_every=100, log_every=10),
    # Paper, keeping the authors' values (Nguyen et al. 2022, Section 4.1; sources in mgk.tasks.authors): CIFAR-10
    # grey, 1024 pixels, 10 classes, batch 256, AdamW lr 1e-4 eps 1e-6, OneCycle (175 of 35000 steps up), fp16,
    # ReLU head, N(0, 0.02) embeddings, validation every 175 steps on 20 batches (Nystromformer cfg "image");
    # 2 layers, d_model 64, FFN 128, head_dim 32. Pixel 0 is a pixel, not padding (docs/paper-protocol.md).
    "image-paper": with_forms(run_config(task="image", **AUTHORS_LRA, **LRA_TASKS["image"],
                                         checkpoint_every=1000, log_every=100), AUTHORS_LRA_FORMS),
}

_WHAT = ("cifar-10-batches-py (data_batch_1..5, test_batch), an image folder {train,test}/<class>/*.png|jpg, or a "
         ".tar.gz of either")


def prepare(cfg: RunConfig, run_dir: Path) -> Path:
    """``cfg.data.path`` (required: there is no generated CIFAR). FileNotFoundError when absent."""
    return require_data(cfg, _WHAT)


def build(cfg: RunConfig, data_dir: Path) -> LRAClassificationTask:
    """Decode to grey pixel tokens (cached); validation carved out of train with ``split_seed``/``val_fraction``
    (never out of test); an absent test split is noted.

    Raises:
        ValueError: ``max_len < 1024``. FileNotFoundError / ImageFormatError: as
        :func:`mgk.data.image.read_image_source`.
    """
    check_max_len(cfg)
    data_dir = Path(data_dir)
    splits, status = im.load_images(data_dir, cache_dir=resolve_cache_dir(cfg.data.cache_dir, data_dir))
    full, test = splits["train"], splits["test"]
    val_idx, train_idx = seeded_split(len(full), [cfg.data.val_fraction], cfg.data.split_seed)
    train = full.subset(train_idx)
    val = full.subset(val_idx) if cfg.data.val_fraction > 0 else None
    notes = [f"data: image (CIFAR-10 grey, ITU-R 601-2 luma, 1024 pixel tokens, no padding) from {data_dir}; "
             f"cache {status}",
             f"data: classes {', '.join(full.class_names)}",
             f"data: train {len(train)} / val {len(val) if val else 0} images: validation carved from the train split "
             f"(split_seed={cfg.data.split_seed}, val_fraction={cfg.data.val_fraction}), never from test",
             "data: test: " + (f"{len(test)} images" if test is not None
                               else f"absent in {data_dir} (no test split: results report val only)")]
    return LRAClassificationTask("image", {"train": train, "val": val, "test": test}, vocab_size=im.VOCAB_SIZE,
                                 num_classes=len(full.class_names), notes=notes)


def restore(cfg: RunConfig, vocab=None) -> LRAClassificationTask:
    """The task of a trained run without its data (:class:`mgk.tasks.base.TaskModule`)."""
    return LRAClassificationTask.restored(cfg)


def check(cfg: RunConfig, data: Path) -> tuple[list[str], list[str]]:
    """Validate an image source: ``(report lines, errors)``; every error names the file or member."""
    lines: list[str] = []
    try:
        splits = im.read_image_source(data)
    except (FileNotFoundError, im.ImageFormatError) as exc:
        return lines, [str(exc)]
    for split, sp in splits.items():
        if sp is None:
            lines.append(f"{split}: absent")
            continue
        counts = [int((sp.labels == k).sum()) for k in range(len(sp.class_names))]
        lines += [f"{split}: {len(sp)} images of 32x32 ({sp.source})", "  " + label_line(counts, sp.class_names),
                  f"  length: {im.SEQ_LEN} pixel tokens each (grey values 0-255, none is padding); "
                  f"pixel mean {float(sp.grey.mean()):.1f}"]
        if split == "train":
            val_idx, _ = seeded_split(len(sp), [cfg.data.val_fraction], cfg.data.split_seed)
            lines.append(f"  validation: {len(val_idx)} of these carved out with split_seed={cfg.data.split_seed}, "
                         f"val_fraction={cfg.data.val_fraction}")
    return lines, []
