"""Plots of a grid: validation curves of every row overlaid per task, the metric against attention parameters, and
per task the metric against the heads h, the keys h x M, the attention parameters and FLOPs."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from ..atomic import save_figure_atomic
from .grid import Run

__all__ = ["plot_learning_curves", "plot_accuracy_vs_params", "plot_metric_vs_heads"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _curve(run: Run, name: str) -> dict[int, float]:
    """The finite values of ``name`` by step (none from a damaged metrics.jsonl: the report names damaged runs)."""
    from ..train.rundir import read_metrics

    try:
        records = read_metrics(run.run_dir)
    except (OSError, ValueError):
        return {}
    return {r["step"]: r[name] for r in records if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])}


def plot_learning_curves(folder: Path, runs: list[Run], metric: str) -> list[Path]:
    """``learning_curves_<task>.png``: per row, the validation metric (mean over seeds at each logged step, with a
    band of ± 1 sample std where two or more seeds logged that step)."""
    from .collect import task_metric

    plt = _pyplot()
    written = []
    for task in dict.fromkeys(r.task for r in runs):
        name = "val/" + task_metric(next(r for r in runs if r.task == task), metric)[0]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        drawn = False
        for key, label in dict.fromkeys((r.row.key, r.row.label) for r in runs if r.task == task):
            curves = [_curve(r, name) for r in runs if r.task == task and r.row.key == key]
            steps = sorted(set().union(*curves)) if curves else []
            at = [[c[s] for c in curves if s in c] for s in steps]
            mean = [statistics.fmean(v) for v in at]
            if mean:
                line, = ax.plot(steps, mean, marker=".", label=label)
                drawn = True
            if any(len(v) > 1 for v in at):  # the seed spread: mean ± sample std where two or more seeds logged
                std = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in at]
                ax.fill_between(steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                                color=line.get_color(), alpha=0.2, linewidth=0)
        if not drawn:
            plt.close(fig)
            continue
        ax.set_xlabel("optimiser step")
        ax.set_ylabel(f"{name} (mean; band: ± 1 std over seeds)")
        ax.set_title(runs[[r.task for r in runs].index(task)].task_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(save_figure_atomic(fig, folder / f"learning_curves_{task}.png", dpi=72))
    return written


def plot_accuracy_vs_params(folder: Path, rep: dict) -> Path | None:
    """``metric_vs_attention_params.png``: one point per row and task (mean over seeds, error bar ± 1 sample std;
    none with one seed)."""
    cells = [c for c in rep["rows"] if c["n"] and c.get("attention_params")]
    if not cells:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    labels = {t["task"]: t["label"] for t in rep["tasks"]}
    for task in dict.fromkeys(c["task"] for c in cells):
        mine = [c for c in cells if c["task"] == task]
        ax.errorbar([c["attention_params"] for c in mine], [c["mean"] for c in mine], fmt="o", capsize=3,
                    yerr=[c["std"] or 0.0 for c in mine], label=labels.get(task, task))  # ± 1 std over seeds
        for c in mine:
            ax.annotate(c["row"], (c["attention_params"], c["mean"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("attention parameters")
    ax.set_ylabel(" / ".join(dict.fromkeys(c.get("metric_label") or ("accuracy %" if rep["metric"] == "acc"
                                                                     else "perplexity") for c in cells))
                  + " (mean ± 1 std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure_atomic(fig, folder / "metric_vs_attention_params.png", dpi=72)


_AXES = (("heads", "heads h", False), ("keys_total", "keys h x M", False),
         ("attention_params", "attention parameters", True), ("flops", "attention FLOPs per sequence (forward)", True),
         ("cache_bytes", "decoding cache, bytes per token and layer", True))


def plot_metric_vs_heads(folder: Path, rep: dict) -> list[Path]:
    """``metric_vs_heads_<task>.png`` per task: five panels, the metric (mean ± sample std over seeds) against h,
    h x M, the attention parameters, the attention FLOPs and the decoding cache's bytes per token and layer, one line
    per kind and M (softmax, MGK M=2, GQA-8 over its key/value heads, ...)."""
    cells = [c for c in rep["rows"] if c["n"] and c.get("heads")]
    if not cells:
        return []
    plt = _pyplot()
    labels = {t["task"]: t["label"] for t in rep["tasks"]}
    written = []
    for task in dict.fromkeys(c["task"] for c in cells):
        mine = [{**c, "keys_total": c["heads"] * c.get("keys", 1)} for c in cells if c["task"] == task]
        fig, axes = plt.subplots(1, len(_AXES), figsize=(17, 3.4), sharey=True)
        series = dict.fromkeys((c["kind"], c.get("keys", 1)) for c in mine)
        for (kind, m) in series:
            pts = sorted((c for c in mine if (c["kind"], c.get("keys", 1)) == (kind, m)), key=lambda c: c["heads"])
            name = kind if m == 1 else f"{kind} M={m}"
            for ax, (key, _, _) in zip(axes, _AXES):
                xs = [c.get(key) for c in pts]
                if any(x is None for x in xs):
                    continue
                ax.errorbar(xs, [c["mean"] for c in pts], yerr=[c["std"] or 0.0 for c in pts], marker="o",
                            capsize=2, label=name)
        for ax, (_, xlabel, log) in zip(axes, _AXES):
            ax.set_xscale("log", base=2 if not log else 10)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
        c0 = mine[0]
        axes[0].set_ylabel(c0.get("metric_label", "metric") + (" (lower is better)" if c0.get("better") == "lower"
                                                                else ""))
        axes[0].legend(fontsize=7)
        fig.suptitle(labels.get(task, task), fontsize=9)
        fig.tight_layout()
        written.append(save_figure_atomic(fig, folder / f"metric_vs_heads_{task}.png", dpi=72))
    return written
