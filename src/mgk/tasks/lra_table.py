"""LRA reporting: the results table of ``mgk table`` and the entry point of ``mgk data check``.

Table: one row per (attention kind, number of heads), the official LRA column order ListOps, Text, Retrieval, Image,
Pathfinder, then Avg. A cell is the accuracy in % of the runs of that setting and task: test accuracy when a run has
a test split, else its validation accuracy (marked †); with several runs (seeds), ``mean ± std`` with the sample
standard deviation (n - 1) and the number of runs. Runs share a cell only when their configs differ in the seed
alone (:func:`mgk.tasks.run_records.cells_by_config`): others get rows of their own, named by what differs, and a
second run of one config and seed is a duplicate, counted once. Avg is the mean of the row's cells that have values,
and says over how many columns when not all five have one. A cell without runs is "—". The attention kind carries
the options that name a variant (:func:`mgk.attention.registry.run_label`, e.g. ``smgk+hard_e``, ``mlk+mix=keys``),
so ablations get rows of their own; rows follow the registry's order of kinds. A failed run (:func:`run_failure`:
its final evaluation was not finite, so the weights went NaN) is left out of the cells and listed below the table.
"""
from __future__ import annotations

import math
from pathlib import Path

from ..config import RunConfig
from .run_records import (
    DASH,
    VARIANT_NOTE,
    cells_by_config,
    empty_row,
    left_out_if_failed,
    left_out_notes,
    run_accuracy,
    run_failure,
    run_metric,
    setting,
)
from .run_records import row_order as _row_order

__all__ = ["COLUMNS", "run_accuracy", "run_metric", "run_failure", "setting", "lra_table", "data_check"]

COLUMNS = (("listops", "ListOps"), ("text", "Text"), ("retrieval", "Retrieval"), ("image", "Image"),
           ("pathfinder", "Pathfinder"))
def _cell(values: list[float]) -> str:
    m = 100 * sum(values) / len(values)
    if len(values) == 1:
        return f"{m:.2f}"
    sd = 100 * math.sqrt(sum((v - m / 100) ** 2 for v in values) / (len(values) - 1))
    return f"{m:.2f} ± {sd:.2f} (n={len(values)})"


def lra_table(results: list[dict], unfinished: list[str] = ()) -> tuple[str, list[str]]:
    """The markdown LRA table of ``results`` (dicts of results.json) and warnings (runs left out), followed by the
    table of the synthetic head-count tasks (:func:`mgk.tasks.synthetic_table.synthetic_table`) when there are runs
    of them; only that table (and the unfinished runs) when there is no LRA run.

    ``unfinished``: one line per run directory without results.json, listed below the footnotes.
    """
    from .synthetic_table import SYNTHETIC_TASKS, synthetic_table

    synthetic = [r for r in results if r.get("task") in SYNTHETIC_TASKS]
    lra = [r for r in results if r.get("task") not in SYNTHETIC_TASKS]
    extra, extra_warnings = synthetic_table(synthetic)
    if not extra:
        table, warnings = _lra_markdown(lra, unfinished)
        return table, warnings + extra_warnings
    if not lra:
        return "\n".join([extra, *left_out_notes([], unfinished)]), extra_warnings
    table, warnings = _lra_markdown(lra, unfinished)
    return table + "\n\n" + extra, warnings + extra_warnings


def _lra_markdown(results: list[dict], unfinished: list[str] = ()) -> tuple[str, list[str]]:
    """The markdown LRA table of ``results`` (dicts of results.json) and warnings (runs left out).

    ``unfinished``: one line per run directory without results.json, listed below the footnotes. Failed runs
    (:func:`run_failure`: the final evaluation was not finite) are left out of the cells and listed there too.

    Returns:
        ``(markdown, warnings)``: the table, a blank line and footnotes; warnings name runs of other tasks,
        without an accuracy, or failed.
    """
    tasks = [t for t, _ in COLUMNS]
    entries, warnings, failed = [], [], []
    for res in results:
        task = res.get("task")
        if task not in tasks:
            warnings.append(f"run of task {task!r} left out (not an LRA task)")
            continue
        if left_out_if_failed(res, warnings, failed):
            continue
        acc, split = run_accuracy(res)
        if acc is None:
            warnings.append(f"run of task {task} ({res.get('attention')} x {res.get('num_heads')}) left out: "
                            "no test or validation accuracy")
            continue
        entries.append((setting(res), task, res, (acc, split)))
    cells, more = cells_by_config(entries)
    warnings += more
    header = "| Attention | Heads | " + " | ".join(name for _, name in COLUMNS) + " | Avg |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 3)]
    any_val = any_partial = any_multi = False
    variants = any(" (" in key[0] for key in cells)
    for key in sorted(cells, key=_row_order):
        row, means = [], []
        for task in tasks:
            runs = cells[key].get(task)
            if not runs:
                row.append(DASH)
                continue
            values = [a for a, _ in runs]
            text = _cell(values)
            if any(s == "val" for _, s in runs):
                text += " †"
                any_val = True
            any_multi |= len(values) > 1
            row.append(text)
            means.append(100 * sum(values) / len(values))
        avg = f"{sum(means) / len(means):.2f}"
        if len(means) < len(tasks):
            avg += f" ({len(means)}/{len(tasks)})"
            any_partial = True
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(row) + f" | {avg} |")
    notes = ["", "Cells: test accuracy (%) of the runs of each setting"
             + ("; mean ± sample std (n - 1) over the n seeds of one config (runs whose configs differ in the seed "
                "alone)" if any_multi else "")
             + f"; {DASH} = no run."]
    if variants:
        notes.append(VARIANT_NOTE)
    if any_val:
        notes.append("† validation accuracy: at least one run of this cell has no test split.")
    notes.append("Avg: mean over the columns that have values"
                 + (" (k/5 = over k of the 5 columns)." if any_partial else " (all five)."))
    notes.extend(left_out_notes(failed, unfinished))
    if not cells:
        lines.append(empty_row(len(COLUMNS) + 3))
    return "\n".join(lines + notes), warnings


# --------------------------------------------------------------------------- mgk data check


def data_check(task: str, cfg: RunConfig, data: str | Path) -> tuple[list[str], list[str]]:
    """Validate the files of ``task`` at ``data``: ``(report lines, errors)``. Each error names the file (and the
    line for text formats). Uses the task module's ``check(cfg, data)``."""
    from . import get_task

    data = Path(data)
    if not data.exists():
        return [], [f"{data}: not found"]
    return get_task(task).check(cfg, data)
