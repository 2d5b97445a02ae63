"""``mgk bench model``: training and inference tokens per second, seconds per step and peak memory of whole preset
models, one row per attention kind, side by side.

The model of a row is the one ``mgk train`` builds for the same preset: the task's own
:meth:`mgk.tasks.base.Task.build_model` with the task's vocabulary and class count (a task built without data:
the sizes are fixed by each task's data format; the language model's vocabulary is WikiText-103's unless
``--set vocab_size=N``). Inputs are random tokens at the preset's full length (the slowest case: no padding to
trim); a training step is the task's own loss, backward and an AdamW step.

Every row is timed in a fresh subprocess under the allocator's defaults, and its peak memory measured in a second one
(``ru_maxrss`` growth on CPU, with glibc told to serve large blocks from mmap so that freed memory leaves the
resident set, which costs every large allocation page faults and would slow the timed steps; ``max_memory_allocated``
on CUDA), so that it belongs to that row alone; a row that dies (out of memory, a signal) becomes a row with an
``error`` naming the exit status and the likely cause instead of stopping the table.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from ..attention.registry import display_label
from .attention import error_cell, machine, variant
from .rows import failure, load_record, run_row  # noqa: F401 - failure: part of this module's interface

# WikiText-103's vocabulary (Merity et al. 2017): the size the LM presets train with.
WT103_VOCAB_SIZE = 267_735

def kind_overrides(kind: str | None, heads: int | None) -> list[str]:
    """``--set`` overrides that select bench kind ``kind`` (a registered kind, ``kind+option=value`` or a variant of
    :data:`mgk.bench.attention.VARIANTS`) with ``heads`` heads (none for None: the preset's)."""
    if kind is None:
        return []
    v = variant(kind)
    return [f"attention={v.kind}", *(f"attention.options.{k}={x}" for k, x in v.options.items()),
            f"num_heads={heads}"]


def with_kind(cfg, kind: str | None, heads: int | None, overrides=(), fixed=()):
    """``cfg`` with bench kind ``kind`` and ``heads`` heads (:func:`kind_overrides`), the bench's own ``fixed``
    ``(pair, what sets it)`` and the user's ``--set`` ``overrides`` applied at once
    (:func:`mgk.config.apply_overrides`). ValueError in one line naming both when an override gives another value to
    a field ``--kinds`` or the bench sets (the kind, its options, num_heads, max_len; values compared as parsed, so
    ``sigma2=0.50`` agrees with 0.5): the row would not be the model its label names. Other mistakes are
    apply_overrides's."""
    from operator import attrgetter

    from ..config import apply_overrides
    from ..config.keys import resolve_key

    own = [*((pair, f"--kinds {kind}") for pair in kind_overrides(kind, heads)), *fixed]
    decided = {resolve_key(pair.split("=", 1)[0]): (pair, source) for pair, source in own}
    base = apply_overrides(cfg, [pair for pair, _ in own])
    for pair in overrides:
        try:
            path = resolve_key(pair.split("=", 1)[0].strip())
            if path not in decided:
                continue
            differs = attrgetter(path)(apply_overrides(base, [pair])) != attrgetter(path)(base)
        except ValueError:
            continue  # a bad pair: apply_overrides below names it
        if differs:
            theirs, source = decided[path]
            raise ValueError(f"--set {pair.strip()} conflicts with {source}, which sets {theirs}; set it there")
    return apply_overrides(cfg, [*(pair for pair, _ in own), *overrides])


def bench_task(cfg):
    """The :class:`~mgk.tasks.base.Task` of ``cfg.task`` without data splits: what ``mgk train`` builds for the
    model (vocabulary size, class count, model class). ValueError for an unknown task."""
    from ..data import image as im
    from ..data import listops as lo
    from ..data import pathfinder as pf
    from ..data import retrieval as rv
    from ..data import text as tx
    from ..data.wikitext import EOS, Vocabulary
    from ..tasks.classification import ClassificationTask
    from ..tasks.lm import LMTask
    from ..tasks.lra_common import LRAClassificationTask
    from ..tasks.retrieval import RetrievalTask

    if cfg.task == "listops":
        return ClassificationTask("listops", {}, vocab_size=len(lo.VOCAB), num_classes=lo.NUM_CLASSES)
    if cfg.task == "text":
        return LRAClassificationTask("text", {}, vocab_size=tx.VOCAB_SIZE, num_classes=len(tx.CLASS_NAMES))
    if cfg.task == "image":
        return LRAClassificationTask("image", {}, vocab_size=im.VOCAB_SIZE, num_classes=len(im.CIFAR10_CLASSES))
    if cfg.task == "pathfinder":
        return LRAClassificationTask("pathfinder", {}, vocab_size=pf.VOCAB_SIZE, num_classes=len(pf.CLASS_NAMES))
    if cfg.task == "retrieval":
        return RetrievalTask("retrieval", {}, vocab_size=rv.VOCAB_SIZE, num_classes=rv.NUM_CLASSES)
    if cfg.task == "lm":
        size = cfg.model.vocab_size or WT103_VOCAB_SIZE
        return LMTask("lm", {}, Vocabulary([EOS, *(f"w{i}" for i in range(1, size))]))
    raise ValueError(f"mgk bench model: no benchmark for task {cfg.task!r}")


def random_batch(task, cfg, device) -> tuple[dict, int]:
    """A batch of random tokens at the preset's full length in the task's batch format, and its token count."""
    B = cfg.optim.batch_size
    if cfg.task == "lm":
        L = cfg.data.segment_len
        # Word ids are ranked by frequency (as the real vocabulary is), so draw them Zipf-like (p ~ 1 / rank): a
        # uniform draw would put most tokens in the adaptive softmax's widest tail clusters, whose logits real
        # text rarely needs, and measure a step no real batch takes.
        weights = 1.0 / torch.arange(1, task.vocab_size + 1, dtype=torch.float64)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.multinomial(weights, B * (L + 1), replacement=True, generator=gen).view(B, L + 1).to(device)
        return {"input": tokens[:, :-1], "target": tokens[:, 1:]}, B * L
    L = cfg.data.max_len
    label = torch.randint(0, task.num_classes, (B,), device=device)
    pad = torch.zeros(B, L, dtype=torch.bool, device=device)
    if cfg.task == "retrieval":
        docs = [torch.randint(0, task.vocab_size, (B, L), device=device) for _ in range(2)]
        return {"tokens1": docs[0], "padding_mask1": pad, "tokens2": docs[1], "padding_mask2": pad,
                "label": label}, 2 * B * L
    return {"tokens": torch.randint(0, task.vocab_size, (B, L), device=device), "padding_mask": pad,
            "label": label}, B * L


def micro_batches(batch: dict, grad_accum: int) -> list[dict]:
    """``batch`` cut along its first dimension into ``grad_accum`` equal parts (ValueError when it does not
    divide), the micro-batches of one optimiser step."""
    size = len(next(iter(batch.values())))
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    if size % grad_accum:
        raise ValueError(f"grad_accum={grad_accum} must divide batch_size={size}")
    step = size // grad_accum
    return [{k: v[i:i + step] for k, v in batch.items()} for i in range(0, size, step)]


def _timed(fn, steps: int) -> float:
    """Median seconds of ``steps`` calls of ``fn``."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(preset: str, overrides: list[str], *, steps: int, device: str, kind: str | None = None,
            heads: int | None = None, peak_memory: bool = True) -> dict:
    """One row (in this process): tokens/s of training and inference, s/step, peak training memory in MB (None
    unless ``peak_memory``; the first training step, untimed either way) and the parameter count of ``preset`` with
    ``overrides`` and bench kind ``kind`` (None: the preset's attention). With ``steps=0`` only the memory is
    measured (:func:`measure_peak_memory`)."""
    import resource

    from ..tasks import all_presets

    cfg = with_kind(all_presets()[preset], kind, heads, overrides)
    task = bench_task(cfg)
    torch.manual_seed(0)
    dev = torch.device(device)
    model = task.build_model(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch, tokens = random_batch(task, cfg, dev)

    def sync():
        """Wait for queued CUDA work, so that a timer measures it (no-op on CPU)."""
        if dev.type == "cuda":
            torch.cuda.synchronize()

    micro = micro_batches(batch, cfg.optim.grad_accum)

    def train_step():
        """Forward, the task's loss and backward over ``grad_accum`` micro-batches (as ``mgk train`` splits the
        batch), then one AdamW step, on the fixed batch."""
        opt.zero_grad(set_to_none=True)
        for part in micro:
            loss, _ = task.loss(model, part)
            (loss / cfg.optim.batch_size).backward()
        opt.step()
        sync()

    def infer():
        """One forward pass on the fixed batch without gradients."""
        with torch.no_grad():
            task.loss(model, batch)
        sync()

    model.train()
    peak = None
    if not peak_memory:
        train_step()
    elif dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        train_step()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        train_step()
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB -> MiB
    if steps == 0:
        return {"train_peak_mem_mb": peak}
    step_s = _timed(train_step, steps)
    model.eval()
    infer()
    infer_s = _timed(infer, steps)
    a = cfg.attention
    return {"kind": kind or a.kind, "label": display_label(a.kind, a.num_heads, a.options), "preset": preset,
            "overrides": overrides, "attention": a.kind, "num_heads": a.num_heads, "attn_dropout": a.dropout,
            "batch": cfg.optim.batch_size,
            "length": cfg.data.segment_len if cfg.task == "lm" else cfg.data.max_len, "tokens_per_step": tokens,
            "params": sum(p.numel() for p in model.parameters()), "train_s_per_step": step_s,
            "train_tokens_per_s": tokens / step_s, "infer_s_per_step": infer_s,
            "infer_tokens_per_s": tokens / infer_s, "train_peak_mem_mb": peak}


def measure_peak_memory(preset: str, overrides: list[str], *, device: str, kind: str | None = None,
                        heads: int | None = None) -> dict:
    """``{"train_peak_mem_mb": ...}`` of one training step of the row's model, in this process (on CPU the growth of
    the peak resident set, which follows live memory only under ``MALLOC_MMAP_THRESHOLD_``, as :func:`run` starts
    it)."""
    return measure(preset, overrides, steps=0, device=device, kind=kind, heads=heads, peak_memory=True)


def run(preset: str, overrides: list[str], *, kinds: list[tuple[str, int]] | None, steps: int, device: str,
        timeout: float) -> dict:
    """:func:`measure` for every ``(kind, heads)`` of ``kinds`` (None: the preset's own attention), each in its
    own subprocess. Returns ``{"rows": [...], "machine", "torch", "settings", "date", "cores", "load_average",
    "busy"}`` (the load as :func:`mgk.bench.rows.load_record` records it); a failed row holds ``kind``, ``preset``
    and ``error``."""
    load_before = os.getloadavg()
    rows = []
    for kind, heads in kinds or [(None, None)]:
        call = f"{preset!r}, {overrides!r}, device={device!r}, kind={kind!r}, heads={heads!r}"
        row = run_row(f"import json; from mgk.bench.model import measure; "
                      f"print(json.dumps(measure({call}, steps={steps}, peak_memory=False)))", timeout, rss=False)
        if "error" not in row:  # the peak memory in a second process (see the module docstring)
            row.update(run_row(f"import json; from mgk.bench.model import measure_peak_memory; "
                               f"print(json.dumps(measure_peak_memory({call})))", timeout, rss=True))
        if "error" in row:
            row = {"kind": kind or "preset", "preset": preset, "num_heads": heads, **row}
        rows.append(row)
    load_after = os.getloadavg()
    return {"rows": rows, "machine": machine(), "torch": torch.__version__,
            "settings": {"preset": preset, "overrides": overrides, "steps": steps, "device": device},
            "date": time.strftime("%Y-%m-%d"), **load_record(load_before, load_after)}


def table(result: dict) -> str:
    """Markdown table of a :func:`run` result; ratios are relative to the first row that succeeded."""
    lines = ["| kind | heads | preset | params | train tok/s | x first | s/step | infer tok/s | x first | "
             "train peak MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    ok = [row for row in result["rows"] if "error" not in row]
    base = ok[0] if ok else None
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['kind']} | {row.get('num_heads') or ''} | {row['preset']} | error: "
                         f"{error_cell(row['error'])} | | | | | | |")
            continue
        lines.append(f"| {row['kind']} | {row['num_heads']} | {row['preset']} | {row['params']:,} | "
                     f"{row['train_tokens_per_s']:,.0f} | {row['train_tokens_per_s'] / base['train_tokens_per_s']:.2f}"
                     f" | {row['train_s_per_step']:.3f} | {row['infer_tokens_per_s']:,.0f} | "
                     f"{row['infer_tokens_per_s'] / base['infer_tokens_per_s']:.2f} | "
                     f"{row['train_peak_mem_mb']:,.0f} |")
    return "\n".join(lines)

