"""Pathfinder-32 (LRA): one difficulty level of the release, or our generated images when no --data is given."""
from __future__ import annotations

from pathlib import Path

from ..config import RunConfig, run_config, with_forms
from ..data import pathfinder as pf
from ..data.cache import resolve_cache_dir, seeded_split
from .authors import AUTHORS_LRA, AUTHORS_LRA_FORMS, LRA_TASKS
from .lra_common import LRAClassificationTask, check_max_len, label_line

PRESETS = {
    # Small CPU preset: 2,000 generated hard images (curv_contour_length_14; about a minute to generate), split
    # 80/10/10 like the release, the paper's model, a few hundred steps; no attention dropout (see image-small).
    "pathfinder-small": run_config(task="pathfinder", max_len=1024, gen_train=1600, gen_val=200, gen_test=200,
                                   lr=5e-4, steps=300, warmup_steps=30, batch_size=32, attn_dropout=0.0,
                                   eval_every=100, checkpoint_every=100, log_every=10),
    # Paper, keeping the authors' values (Nguyen et al. 2022, Section 4.1; sources in mgk.tasks.authors):
    # Pathfinder-32 curv_contour_length_14, 1024 pixels, 2 classes, batch 256, AdamW lr 1e-4 eps 1e-6, OneCycle
    # (312 of 62400 steps up), fp16, ReLU head, N(0, 0.02) embeddings, validation every 312 steps on 312 batches
    # (Nystromformer cfg "pathfinder32"); 2 layers, d_model 64, FFN 128, head_dim 32. Seeded split, pixel 0 not
    # padding (docs/paper-protocol.md).
    "pathfinder-paper": with_forms(run_config(task="pathfinder", **AUTHORS_LRA, **LRA_TASKS["pathfinder"],
                                              checkpoint_every=2000, log_every=100), AUTHORS_LRA_FORMS),
}


def prepare(cfg: RunConfig, run_dir: Path) -> Path:
    """``cfg.data.path``, or (when None) ``gen_train + gen_val + gen_test`` images of level ``cfg.data.level`` made by
    our generator (seed 0, so every run sees the same images) and written in the release layout to ``run_dir/data``
    (kept when already there, e.g. on resume)."""
    if cfg.data.path is not None:
        return Path(cfg.data.path)
    out = Path(run_dir) / "data"
    level = pf.resolve_level(cfg.data.level)
    if not (out / "pathfinder32" / level / "metadata").is_dir():
        num = cfg.data.gen_train + cfg.data.gen_val + cfg.data.gen_test
        images, labels = pf.generate_pathfinder(num, contour_length=pf.contour_length_of(level), seed=0)
        pf.write_pathfinder_level(out, level, images, labels)
    return out


def _level_note(cfg: RunConfig) -> str:
    level = pf.resolve_level(cfg.data.level)
    alias = {v: k for k, v in pf.LEVEL_ALIASES.items()}.get(level)
    default = " (the default level)" if level == pf.DEFAULT_LEVEL else ""
    return f"data: pathfinder level {level}" + (f" = {alias}" if alias else "") + default


def build(cfg: RunConfig, data_dir: Path) -> LRAClassificationTask:
    """Read only the level folder ``cfg.data.level`` (cached), split it with ``split_seed`` into train / val
    (``val_fraction``) / test (10%), and log the level (it is also in the run's config.yaml).

    Raises:
        ValueError: ``max_len < 1024``. FileNotFoundError: no such level folder (the message lists those present).
        PathfinderFormatError: malformed metadata or images (file and line named).
    """
    check_max_len(cfg)
    data_dir = Path(data_dir)
    level = pf.resolve_level(cfg.data.level)
    ds, empty, level_dir, status = pf.load_pathfinder(data_dir, level,
                                                      cache_dir=resolve_cache_dir(cfg.data.cache_dir, data_dir))
    splits = pf.split_pathfinder(ds, val_fraction=cfg.data.val_fraction, split_seed=cfg.data.split_seed)
    sizes = " / ".join(f"{k} {len(v) if v is not None else 0}" for k, v in splits.items())
    notes = [_level_note(cfg), f"data: read only {level_dir}; cache {status}",
             f"data: {len(ds)} images, split with split_seed={cfg.data.split_seed}: {sizes} (test "
             f"{pf.TEST_FRACTION:.0%}, val val_fraction={cfg.data.val_fraction}, train the rest)",
             "data: " + label_line(ds.label_counts(2), pf.CLASS_NAMES)]
    if empty:
        notes.append(f"data: {empty} empty (0-byte) images skipped, as the LRA pipelines do")
    return LRAClassificationTask("pathfinder", splits, vocab_size=pf.VOCAB_SIZE, num_classes=2, notes=notes,
                                 extra={"level": cfg.data.level})


def restore(cfg: RunConfig, vocab=None) -> LRAClassificationTask:
    """The task of a trained run without its data (:class:`mgk.tasks.base.TaskModule`)."""
    return LRAClassificationTask.restored(cfg)


def check(cfg: RunConfig, data: Path) -> tuple[list[str], list[str]]:
    """Validate one level folder (only ``cfg.data.level`` is read): ``(report lines, errors)``."""
    level = pf.resolve_level(cfg.data.level)
    try:
        level_dir = pf.find_level_dir(data, level)
        grey, labels, empty, _ = pf.read_pathfinder_level(level_dir)
    except (FileNotFoundError, pf.PathfinderFormatError) as exc:
        return [], [str(exc)]
    counts = [int((labels == k).sum()) for k in (0, 1)]
    test_idx, val_idx, train_idx = seeded_split(len(labels), [pf.TEST_FRACTION, cfg.data.val_fraction],
                                                cfg.data.split_seed)
    lines = [_level_note(cfg)[len("data: "):] + f" ({level_dir}; no other level folder is read)",
             f"all: {len(labels)} images of 32x32", "  " + label_line(counts, pf.CLASS_NAMES),
             f"  length: 1024 pixel tokens each (grey values 0-255, none is padding); pixel mean "
             f"{float(grey.mean()):.1f}",
             f"split (split_seed={cfg.data.split_seed}): train {len(train_idx)} / val {len(val_idx)} / test "
             f"{len(test_idx)}"]
    if empty:
        lines.append(f"  {empty} empty (0-byte) images skipped")
    return lines, []
