"""Language-modelling results table of ``mgk table``: validation and test perplexity, each with its window.

The two columns of the paper's Table 3 (WikiText-103 valid and test perplexity, Nguyen et al., ICML 2022). One row
per (attention setting, heads), as the LRA table (:func:`mgk.tasks.run_records.setting`). A run's figure on a split is
its ``mgk eval`` result in the run directory when there is one (``eval.json`` for valid, ``eval_test.json`` for
test, as a reproduce grid writes them; e.g. the paper's stride-1 window of 256 tokens), else the final evaluation
that ``mgk train`` wrote into results.json (non-overlapping segments of ``segment_len``). The window column names
the windows of the figures averaged, so figures of different windows are never mixed without saying so. Cells:
mean ± sample standard deviation (n - 1) over the runs, with n; "—" without a figure. Runs share a row only when
their configs differ in the seed alone (:func:`mgk.tasks.run_records.cells_by_config`). A failed run
(:func:`mgk.tasks.run_records.run_failure`) is left out and named in the warnings.
"""
from __future__ import annotations

import math
import statistics

from .run_records import DASH, VARIANT_NOTE, cells_by_config, left_out_if_failed, run_failure, setting
from .run_records import row_order as _row_order

__all__ = ["lm_table", "run_perplexities"]

_SPLITS = (("val", "Valid"), ("test", "Test"))


def _window(context, stride) -> str:
    return f"context {context}, stride {stride}"


def run_perplexities(res: dict, evals: dict) -> dict[str, tuple[float, str]]:
    """``{"val" | "test": (perplexity, window)}`` of one LM run: ``evals[split]`` (its ``mgk eval`` result, or None)
    when given and not failed, else the figure of its results.json ``res``."""
    out = {}
    segment = (res.get("protocol") or {}).get("segment_len")
    for split, _ in _SPLITS:
        ev = evals.get(split)
        if ev is not None:
            if run_failure(ev) is None and isinstance(ev.get("ppl"), (int, float)):
                out[split] = (float(ev["ppl"]), _window(ev.get("context"), ev.get("stride")))
            continue
        figures = res.get(split)
        if isinstance(figures, dict) and isinstance(figures.get("ppl"), (int, float)):
            out[split] = (float(figures["ppl"]), _window(segment, segment) if segment else "segments")
    return out


def _cell(values: list[float]) -> str:
    if not values:
        return DASH
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f} (n={len(values)})"


def lm_table(results: list[tuple[dict, dict]]) -> tuple[str, list[str]]:
    """The markdown table of LM runs and warnings (runs left out).

    Args:
        results: ``(results.json dict, evals)`` of each LM run (``task == "lm"``); ``evals``: ``{"val": the
            run's eval.json dict or None, "test": its eval_test.json dict or None}``.

    Returns:
        ``(markdown, warnings)``: one row per (attention, heads) with Valid ppl, its window, Test ppl, its window
        (markdown "" when no run has a perplexity).
    """
    entries, warnings = [], []
    for res, evals in results:
        if left_out_if_failed(res, warnings, task="lm"):
            continue
        what = f"lm {res.get('attention')} x {res.get('num_heads')} seed {res.get('seed')}"
        figures = {k: v for k, v in run_perplexities(res, evals).items() if math.isfinite(v[0])}
        if not figures:
            warnings.append(f"run of {what} left out: no validation or test perplexity")
            continue
        entries.append((setting(res), "lm", res, figures))
    runs, more = cells_by_config(entries)
    warnings += more
    cells: dict[tuple, dict[str, list]] = {}
    for key, row in runs.items():
        for figures in row["lm"]:
            for split, value in figures.items():
                cells.setdefault(key, {}).setdefault(split, []).append(value)
    lines = ["| Attention | Heads | Valid ppl | valid window | Test ppl | test window |", "|---|---|---|---|---|---|"]
    for key in sorted(cells, key=_row_order):
        parts = []
        for split, _ in _SPLITS:
            got = cells[key].get(split, [])
            parts += [_cell([v for v, _ in got]), " / ".join(sorted({w for _, w in got})) or DASH]
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(parts) + " |")
    if not cells:  # nothing to show: the warnings say why
        return "", warnings
    notes = ["", "Cells: perplexity of the runs of each setting (mean ± sample std (n - 1) over n runs); window: "
             "context and stride of the evaluation (`mgk eval --json` in the run directory, else the segments of "
             f"results.json); {DASH} = no figure; runs share a row only when their configs differ in the seed alone."]
    if any(" (" in key[0] for key in cells):
        notes.append(VARIANT_NOTE)
    return "\n".join(lines + notes), warnings
