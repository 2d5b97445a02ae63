"""LRA reporting: the results table of ``mgk table`` and the entry point of ``mgk data check``.

Table: one row per (attention kind, number of heads), the official LRA column order ListOps, Text, Retrieval,
Image, Pathfinder, then Avg. A cell is the accuracy in % of the runs of that setting and task: test accuracy when a
run has a test split, else its validation accuracy (marked †); with several runs (seeds), ``mean ± std`` with the
sample standard deviation (n - 1) and the number of runs. Avg is the mean of the row's cells that have values, and
says over how many columns when not all five have one. A cell without runs is "—". The attention kind of an
MGK-family run carries its mixture-weight mode when it is not the default ``learned`` (e.g. ``smgk+hard_e``), so
ablations get rows of their own.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..config import RunConfig
from .synthetic_table import SYNTHETIC_TASKS, synthetic_table

__all__ = ["COLUMNS", "KIND_ORDER", "find_runs", "find_results", "read_results", "run_accuracy", "setting",
           "lra_table", "data_check"]

COLUMNS = (("listops", "ListOps"), ("text", "Text"), ("retrieval", "Retrieval"), ("image", "Image"),
           ("pathfinder", "Pathfinder"))
KIND_ORDER = ("softmax", "mgk", "smgk", "linear", "mlk", "smlk")
_NO_MIXTURE = ("softmax", "linear")
DASH = "—"


def find_runs(paths) -> tuple[list[Path], list[Path]]:
    """``(results.json files, unfinished run directories)`` of ``paths``: each a run directory, a results.json file,
    or a folder whose sub-folders (any depth) are run directories. A run directory (it has config.yaml) without
    results.json is unfinished: failed, stopped or still running.

    Raises:
        FileNotFoundError: a path that does not exist or holds no run at all (the message names it).
    """
    done: list[Path] = []
    unfinished: list[Path] = []
    for p in map(Path, paths):
        if p.is_file() and p.name == "results.json":
            done.append(p)
        elif (p / "results.json").is_file():
            done.append(p / "results.json")
        elif (p / "config.yaml").is_file():
            unfinished.append(p)
        elif p.is_dir() and (runs := sorted({c.parent for c in p.rglob("config.yaml")}
                                            | {r.parent for r in p.rglob("results.json")})):
            done.extend(r / "results.json" for r in runs if (r / "results.json").is_file())
            unfinished.extend(r for r in runs if not (r / "results.json").is_file())
        elif not p.exists():
            raise FileNotFoundError(f"{p}: no such run directory")
        else:
            raise FileNotFoundError(f"{p / 'results.json'} not found: is {p} a finished `mgk train` run?")
    return done, unfinished


def find_results(paths) -> list[Path]:
    """The results.json files of :func:`find_runs` (unfinished runs left out)."""
    return find_runs(paths)[0]


def read_results(paths, files: list[Path] | None = None) -> list[tuple[Path, dict]]:
    """``(results.json path, its dict)`` for :func:`find_results` of ``paths`` (or for ``files`` when given).

    Raises:
        ValueError: a results.json that is not valid JSON or lacks task/attention/num_heads (names the file).
    """
    out = []
    for f in find_results(paths) if files is None else files:
        try:
            res = json.loads(f.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{f}: not valid JSON ({exc})") from None
        missing = [k for k in ("task", "attention", "num_heads") if k not in res]
        if missing:
            raise ValueError(f"{f}: missing {', '.join(missing)} (not written by `mgk train`?)")
        out.append((f, res))
    return out


def run_accuracy(res: dict) -> tuple[float | None, str | None]:
    """``(accuracy in [0, 1], "test" or "val")``: test when the run has it, else validation; (None, None) when
    neither has an accuracy."""
    for split in ("test", "val"):
        m = res.get(split)
        if isinstance(m, dict) and isinstance(m.get("acc"), (int, float)):
            return float(m["acc"]), split
    return None, None


def setting(res: dict) -> tuple[str, int]:
    """Row key ``(attention kind, num_heads)``; the kind carries ``+<pi>`` for MGK-family runs whose pi mode is not
    ``learned``."""
    kind, pi = str(res["attention"]), res.get("pi", "learned")
    if kind not in _NO_MIXTURE and pi not in (None, "learned"):
        kind = f"{kind}+{pi}"
    return kind, int(res["num_heads"])


def _row_order(key):
    kind, heads = key
    base = kind.split("+")[0]
    rank = KIND_ORDER.index(base) if base in KIND_ORDER else len(KIND_ORDER)
    return rank, base, kind, -heads


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
    synthetic = [r for r in results if r.get("task") in SYNTHETIC_TASKS]
    lra = [r for r in results if r.get("task") not in SYNTHETIC_TASKS]
    extra, extra_warnings = synthetic_table(synthetic)
    if not extra:
        table, warnings = _lra_markdown(lra, unfinished)
        return table, warnings + extra_warnings
    if not lra:
        tail = [f"Not in the table, unfinished (no results.json): {len(unfinished)} run(s)"] if unfinished else []
        return "\n".join([extra, *tail, *(f"- {line}" for line in unfinished)]), extra_warnings
    table, warnings = _lra_markdown(lra, unfinished)
    return table + "\n\n" + extra, warnings + extra_warnings


def _lra_markdown(results: list[dict], unfinished: list[str] = ()) -> tuple[str, list[str]]:
    """The markdown LRA table of ``results`` (dicts of results.json) and warnings (runs left out).

    ``unfinished``: one line per run directory without results.json, listed below the footnotes.

    Returns:
        ``(markdown, warnings)``: the table, a blank line and footnotes; warnings name runs of other tasks or
        without an accuracy.
    """
    tasks = [t for t, _ in COLUMNS]
    cells: dict[tuple, dict[str, list]] = {}
    warnings = []
    for res in results:
        task = res.get("task")
        if task not in tasks:
            warnings.append(f"run of task {task!r} left out (not an LRA task)")
            continue
        acc, split = run_accuracy(res)
        if acc is None:
            warnings.append(f"run of task {task} ({res.get('attention')} x {res.get('num_heads')}) left out: "
                            "no test or validation accuracy")
            continue
        cells.setdefault(setting(res), {}).setdefault(task, []).append((acc, split))
    header = "| Attention | Heads | " + " | ".join(name for _, name in COLUMNS) + " | Avg |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 3)]
    any_val = any_partial = any_multi = False
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
             + ("; mean ± sample std (n - 1) over the n runs (seeds) that share a setting" if any_multi else "")
             + f"; {DASH} = no run."]
    if any_val:
        notes.append("† validation accuracy: at least one run of this cell has no test split.")
    notes.append("Avg: mean over the columns that have values"
                 + (" (k/5 = over k of the 5 columns)." if any_partial else " (all five)."))
    if unfinished:
        notes.append(f"Not in the table, unfinished (no results.json): {len(unfinished)} run(s)")
        notes.extend(f"- {line}" for line in unfinished)
    if not cells:
        lines.append("| " + " | ".join([DASH] * (len(COLUMNS) + 3)) + " |")
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
