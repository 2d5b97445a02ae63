"""The results table of the synthetic head-count tasks (dretrieval, mqar, cmqar), which ``mgk table`` prints below the
LRA table.

One row per (attention setting, heads, keys per head M), one column per task setting (``dretrieval D=4, T=16``,
``mqar n=8, L=64``, ...), read from each run's results.json. The attention setting is the registry's label of the
kind with the options that name a variant (:func:`mgk.tasks.run_records.setting`, e.g. ``smgk+hard_e``), and rows
follow the registry's order of kinds. A cell is the test metric of the runs of that row and column (the validation
metric, marked †, for a run without a test split): NMSE for dretrieval (lower is better), accuracy in % for mqar and
cmqar (higher is better); with several runs (seeds), ``mean ± std`` with the sample standard deviation (n - 1) and
the number of runs; runs share a cell only when their configs differ in the seed alone
(:func:`mgk.tasks.run_records.cells_by_config`). A failed run (:func:`mgk.tasks.run_records.run_failure`: its final
evaluation was not finite) is left out of the cells and listed below the table.
"""
from __future__ import annotations

import math

from ..attention import attention_kinds
from .run_records import (
    VARIANT_NOTE,
    base_kind,
    cells_by_config,
    empty_row,
    left_out_if_failed,
    left_out_notes,
    run_metric,
    setting,
)

__all__ = ["SYNTHETIC_TASKS", "METRICS", "column", "row_key", "synthetic_table", "metric_of"]

SYNTHETIC_TASKS = ("dretrieval", "mqar", "cmqar")
# task -> (metric in results.json, shown as, factor, better)
METRICS = {"dretrieval": ("nmse", "NMSE", 1.0, "lower"), "mqar": ("acc", "acc %", 100.0, "higher"),
           "cmqar": ("acc", "acc %", 100.0, "higher")}
DASH = "—"


def metric_of(task: str) -> tuple[str, str, float, str]:
    """``(metric in results.json, name in tables, factor to the shown unit, "lower" or "higher" is better)`` of a
    synthetic task; ``("acc", "accuracy %", 100, "higher")`` for every other task."""
    return METRICS.get(task, ("acc", "accuracy %", 100.0, "higher"))


def column(res: dict, split: dict) -> str:
    """The column of a run: its task and the data settings of the split (``dretrieval D=4, T=16``)."""
    task = res["task"]
    if task == "dretrieval":
        return f"dretrieval D={split.get('num_features', '?')}, T={split.get('seq_len', '?')}"
    return f"{task} n={split.get('num_kv_pairs', '?')}, L={split.get('seq_len', '?')}"


def row_key(res: dict) -> tuple[str, int, int | None]:
    """``(setting, heads, M)``: the setting as :func:`mgk.tasks.run_records.setting` names it (``smgk+hard_e``); M is
    ``num_keys`` of the kinds that take it (None for softmax and linear)."""
    label, heads = setting(res)
    keys = (res.get("attention_options") or {}).get("num_keys")
    return label, heads, None if keys is None else int(keys)


def _order(key):
    kind, heads, m = key
    base, order = base_kind(kind), attention_kinds()
    return (order.index(base) if base in order else len(order), kind, heads, m or 0)


def _value(res: dict) -> tuple[float | None, str | None, dict]:
    value, split = run_metric(res, METRICS[res["task"]][0])
    if value is None or not math.isfinite(value):
        return None, None, {}
    return value, split, res.get(split) or {}


def _cell(values: list[float], task: str) -> str:
    _, _, factor, _ = METRICS[task]
    digits = 2 if factor != 1.0 else 4
    m = factor * sum(values) / len(values)
    if len(values) == 1:
        return f"{m:.{digits}f}"
    sd = factor * math.sqrt(sum((v - m / factor) ** 2 for v in values) / (len(values) - 1))
    return f"{m:.{digits}f} ± {sd:.{digits}f} (n={len(values)})"


def synthetic_table(results: list[dict]) -> tuple[str, list[str]]:
    """Markdown table of the runs of :data:`SYNTHETIC_TASKS` in ``results`` (results.json dicts; others are
    ignored) and warnings for runs without the metric. Returns ``("", [])`` when there is none."""
    entries, tasks_of = [], {}
    warnings, failed = [], []
    for res in results:
        if res.get("task") not in SYNTHETIC_TASKS:
            continue
        if left_out_if_failed(res, warnings, failed):
            continue
        value, split, facts = _value(res)
        if value is None:
            warnings.append(f"run of task {res['task']} ({res.get('attention')} x {res.get('num_heads')}) left out: "
                            f"no test or validation {METRICS[res['task']][0]}")
            continue
        col = column(res, facts)
        tasks_of[col] = res["task"]
        entries.append((row_key(res), col, res, (value, split)))
    cells, more = cells_by_config(entries)
    warnings += more
    if not cells and not failed:
        return "", warnings
    cols = sorted(tasks_of, key=lambda c: (SYNTHETIC_TASKS.index(tasks_of[c]), c))
    lines = ["| Attention | Heads | M | " + " | ".join(f"{c} ({METRICS[tasks_of[c]][1]})" for c in cols) + " |",
             "|" + "---|" * (len(cols) + 3)]
    any_val = False
    for key in sorted(cells, key=_order):
        row = []
        for c in cols:
            runs = cells[key].get(c)
            text = DASH if not runs else _cell([v for v, _ in runs], tasks_of[c])
            if runs and any(s == "val" for _, s in runs):
                text, any_val = text + " †", True
            row.append(text)
        lines.append(f"| {key[0]} | {key[1]} | {DASH if key[2] is None else key[2]} | " + " | ".join(row) + " |")
    notes = ["", "Synthetic head-count tasks: test metric of the runs of each setting; NMSE (dretrieval) lower is "
                 "better, accuracy % (mqar, cmqar) higher is better; mean ± sample std (n - 1) over the n seeds "
                 f"of one config (runs whose configs differ in the seed alone); M = keys per head; {DASH} = no run."]
    if any(" (" in key[0] for key in cells):
        notes.append(VARIANT_NOTE)
    if any_val:
        notes.append("† validation metric: at least one run of this cell has no test split.")
    notes.extend(left_out_notes(failed))
    if not cells:
        lines.append(empty_row(len(cols) + 3))
    return "\n".join(lines + notes), warnings
