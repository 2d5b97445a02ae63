"""ListOps (LRA): the release TSV files, or our generated default when no data folder is given."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..config import RunConfig, run_config, with_forms
from ..data import listops as lo
from ..data.cache import resolve_cache_dir
from ..data.tokenizers import ListOpsTokenizer
from .authors import AUTHORS_LRA, AUTHORS_LRA_FORMS, LRA_TASKS
from .classification import ClassificationTask
from .lra_common import label_line, length_line

PRESETS = {
    # Small CPU preset: generated short ListOps, the default of `mgk train`.
    "listops-small": run_config(task="listops"),
    # Paper, keeping the authors' values (Nguyen et al. 2022, Section 4.1; their code's protocol, each value's source
    # in mgk.tasks.authors): 2 layers, d_model 64, FFN 128, head_dim 32, batch 32, AdamW lr 1e-4 eps 1e-6,
    # OneCycle (1000 of 5000 steps up), fp16 autocast, ReLU head, N(0, 0.02) embeddings, validation every 50
    # steps on 62 dev batches (Nystromformer cfg "listops"); sequences up to 2000 tokens. Deviations:
    # docs/paper-protocol.md. On CPU add --precision 32 --set attn_dropout=0 (SDPA's fused kernel needs no dropout).
    "listops-paper": with_forms(run_config(task="listops", **AUTHORS_LRA, **LRA_TASKS["listops"],
                                           checkpoint_every=500, log_every=50), AUTHORS_LRA_FORMS),
}


def prepare(cfg: RunConfig, run_dir: Path) -> Path:
    """The folder to read: ``cfg.data.path``, or (when it is None) a small generated ListOps written to
    ``run_dir/data`` (sizes and shape from the ``gen_*`` fields; generator seed 0, so every run sees the same data).
    Called on rank 0 only, before :func:`build` runs on every rank."""
    if cfg.data.path is not None:
        return Path(cfg.data.path)
    out = Path(run_dir) / "data"
    if lo.find_split_file(out, "train") is None:
        d = cfg.data
        lo.generate_listops_dir(out, num_train=d.gen_train, num_val=d.gen_val, num_test=d.gen_test, seed=0,
                                max_depth=d.gen_max_depth, max_args=d.gen_max_args, min_length=d.gen_min_length,
                                max_length=d.gen_max_length)
    return out


def build(cfg: RunConfig, data_dir: Path) -> ClassificationTask:
    """Load ``basic_{train,val,test}.tsv[.gz]`` from ``data_dir`` (absent val/test splits are noted, not fatal).

    Raises FileNotFoundError when there is no train split; ListOpsFormatError for malformed rows or (without
    ``truncate``) sequences longer than ``max_len``."""
    cache = resolve_cache_dir(cfg.data.cache_dir, data_dir)
    splits = {s: lo.load_listops_split(data_dir, s, cfg.data.max_len, truncate=cfg.data.truncate, cache_dir=cache)
              for s in lo.SPLITS}
    if splits["train"] is None:
        raise FileNotFoundError(f"no ListOps train split (basic_train.tsv or basic_train.tsv.gz) in {data_dir}")
    notes = []
    for s, ds in splits.items():
        if ds is None:
            notes.append(f"data: {s}: absent in {data_dir}")
            continue
        notes.append(f"data: {s}: {ds.source} ({len(ds)} rows)")
        if ds.num_truncated:
            notes.append(f"data: {s}: {ds.num_truncated} sequences truncated to max_len={cfg.data.max_len}")
    return ClassificationTask("listops", splits, vocab_size=len(lo.VOCAB), num_classes=lo.NUM_CLASSES, notes=notes)


def restore(cfg: RunConfig, vocab=None) -> ClassificationTask:
    """The task of a trained run without its data (:class:`mgk.tasks.base.TaskModule`)."""
    return ClassificationTask.restored(cfg, tokenizer=ListOpsTokenizer())


def check(cfg: RunConfig, data: Path) -> tuple[list[str], list[str]]:
    """Validate the ListOps TSV files: ``(report lines, errors)``; each error names the file and line."""
    lines, errors = [], []
    if not data.is_dir():
        return lines, [f"{data}: not a folder (expected basic_{{train,val,test}}.tsv[.gz])"]
    longest = 0
    for split in lo.SPLITS:
        path = lo.find_split_file(data, split)
        if path is None:
            (errors if split == "train" else lines).append(f"{split}: basic_{split}.tsv[.gz] absent in {data}")
            continue
        try:
            rows = lo.read_listops_tsv(path)
        except lo.ListOpsFormatError as exc:
            errors.append(str(exc))
            continue
        counts = Counter(label for _, label in rows)
        lengths = [len(ids) for ids, _ in rows]
        longest = max([longest, *lengths])
        lines += [f"{split}: {len(rows)} rows ({path})",
                  "  " + label_line([counts.get(k, 0) for k in range(lo.NUM_CLASSES)],
                                    [str(k) for k in range(lo.NUM_CLASSES)]),
                  "  " + length_line(lengths, cfg.data.max_len, "tokens without ( )")]
    if longest > cfg.data.max_len and not cfg.data.truncate:
        lines.append(f"note: training with max_len={cfg.data.max_len} would stop at the first longer row: use "
                     f"--set max_len={longest}" + (" (or the listops-paper preset)" if longest <= lo.RELEASE_MAX_LEN
                                                   else "") + " (cutting a ListOps expression changes its value)")
    return lines, errors
