"""``mgk reproduce --analyze N``: ``mgk analyze --compare`` and ``mgk analyze --prune --compare`` over the finished
rows of each task, linked from REPORT.md.

One run per row (the lowest seed that finished and did not fail), so the figures overlay the rows as the paper's
analysis does (softmax against MGK with fewer heads); written to ``<out>/analysis/<task>/`` (analysis.md and
prune.md).
"""
from __future__ import annotations

from pathlib import Path

from ..tasks.run_records import run_failure
from ..train.rundir import read_results
from .executor import run_state
from .grid import Run

__all__ = ["analyse_grid"]

# The pruning's bounds in a grid: the first 2000 examples of each split (all of the generated heads tasks' test
# split) and 3 random orders, so that an LRA or LM task's pruning stays in minutes on CPU.
_PRUNE_EXAMPLES = 2000


def _failed(run: Run) -> bool:
    """The run finished but its results do not count (final evaluation not finite) or cannot be read."""
    try:
        res = read_results(run.run_dir)
    except (OSError, ValueError):
        return True
    return res is None or run_failure(res) is not None


def analyse_grid(runs: list[Run], out: Path, samples: int, *, progress: bool = False) -> dict:
    """Analyse the finished runs of each task; returns ``{task: entry}`` for report.json, where entry holds
    ``path`` (analysis.md, relative to ``out``), ``runs`` (the row and seed of each analysed run) and
    ``samples``, ``prune_path`` (prune.md: head importance and pruning curves), or ``error`` when the analysis
    could not be made (the report still gets written)."""
    from ..analyze.analysis import Settings
    from ..analyze.cli import analyse_dirs
    from ..analyze.prune import PruneSettings
    from ..analyze.prune_report import prune_dirs

    settings = Settings(samples=samples).check()
    prune_settings = PruneSettings(random_orders=3, importance_examples=_PRUNE_EXAMPLES,
                                   eval_examples=_PRUNE_EXAMPLES).check()
    entries = {}
    for task in dict.fromkeys(r.task for r in runs):
        chosen = {}
        for r in sorted((r for r in runs if r.task == task and run_state(r) in ("finished", "evaluate")
                         and not _failed(r)), key=lambda r: r.seed):
            chosen.setdefault(r.row.key, r)
        if not chosen:
            continue
        where = out / "analysis" / task
        entry = {"samples": samples, "runs": [{"row": r.row.key, "seed": r.seed} for r in chosen.values()]}
        try:
            analyse_dirs([r.run_dir for r in chosen.values()], where, settings, progress=progress)
            entry["path"] = str((where / "analysis.md").relative_to(out))
            prune_dirs([r.run_dir for r in chosen.values()], where, prune_settings)
            entry["prune_path"] = str((where / "prune.md").relative_to(out))
        except (FileNotFoundError, ValueError, RuntimeError) as e:  # reported, not fatal: the table still matters
            entry["error"] = f"{type(e).__name__}: {e}"
        entries[task] = entry
    return entries
