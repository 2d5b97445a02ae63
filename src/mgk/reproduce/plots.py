"""Plots of a grid: validation curves of every row overlaid per task, the metric against attention parameters, and
per task the metric against the heads h, the keys h x M, the attention parameters and FLOPs."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from ..atomic import save_figure_atomic
from ..figures import MARKERS, kind_colour, log2_axis, log10_axis, series_styles, thin_tick_labels
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
    band of ± 1 sample std where two or more seeds logged that step); each row in its kind's colour
    (:mod:`mgk.figures`), rows of one kind told apart by line style."""
    from .collect import task_metric

    plt = _pyplot()
    written = []
    for task in dict.fromkeys(r.task for r in runs):
        name = "val/" + task_metric(next(r for r in runs if r.task == task), metric)[0]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        drawn = False
        styles = series_styles({r.row.key: r.row.attention for r in runs if r.task == task})
        for key, label in dict.fromkeys((r.row.key, r.row.label) for r in runs if r.task == task):
            curves = [_curve(r, name) for r in runs if r.task == task and r.row.key == key]
            steps = sorted(set().union(*curves)) if curves else []
            at = [[c[s] for c in curves if s in c] for s in steps]
            mean = [statistics.fmean(v) for v in at]
            if mean:
                line, = ax.plot(steps, mean, label=label, markersize=3, **styles[key])
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
        thin_tick_labels(fig)
        written.append(save_figure_atomic(fig, folder / f"learning_curves_{task}.png", dpi=72))
    return written


def plot_accuracy_vs_params(folder: Path, rep: dict) -> Path | None:
    """``metric_vs_attention_params.png``: one point per row and task (mean over seeds, error bar ± 1 sample std;
    none with one seed), in its kind's colour (:mod:`mgk.figures`) with one marker per task."""
    cells = [c for c in rep["rows"] if c["n"] and c.get("attention_params")]
    if not cells:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    labels = {t["task"]: t["label"] for t in rep["tasks"]}
    markers = {task: MARKERS[i % len(MARKERS)] for i, task in enumerate(dict.fromkeys(c["task"] for c in cells))}
    for task, kind in dict.fromkeys((c["task"], c.get("kind")) for c in cells):
        mine = [c for c in cells if (c["task"], c.get("kind")) == (task, kind)]
        name = f"{kind} ({labels.get(task, task)})" if len(markers) > 1 else kind
        ax.errorbar([c["attention_params"] for c in mine], [c["mean"] for c in mine], linestyle="none", capsize=3,
                    yerr=[c["std"] or 0.0 for c in mine], label=name, color=kind_colour(kind),
                    marker=markers[task])  # ± 1 std over seeds
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
    thin_tick_labels(fig)
    return save_figure_atomic(fig, folder / "metric_vs_attention_params.png", dpi=72)


# (row field, axis label, scale): log2 for counts that double (powers of two as plain numbers), log10 for sizes
_AXES = (("heads", "heads h", log2_axis), ("keys_total", "keys h x M", log2_axis),
         ("attention_params", "attention parameters", log10_axis),
         ("flops", "attention FLOPs per sequence (forward)", log10_axis),
         ("cache_bytes", "decoding cache, bytes per token and layer", log2_axis))


def plot_metric_vs_heads(folder: Path, rep: dict) -> list[Path]:
    """``metric_vs_heads_<task>.png`` per task: five panels, the metric (mean ± sample std over seeds) against h,
    h x M, the attention parameters, the attention FLOPs and the decoding cache's bytes per token and layer, one line
    per kind and M (softmax, MGK M=2, GQA-8 over its key/value heads, ...): each kind in its colour
    (:mod:`mgk.figures`), several M of one kind told apart by line style and marker; tick labels never overlap."""
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
        styles = series_styles({s: s[0] for s in series})
        for (kind, m) in series:
            pts = sorted((c for c in mine if (c["kind"], c.get("keys", 1)) == (kind, m)), key=lambda c: c["heads"])
            name = kind if m == 1 else f"{kind} M={m}"
            for ax, (key, _, _) in zip(axes, _AXES):
                xs = [c.get(key) for c in pts]
                if any(x is None for x in xs):
                    continue
                ax.errorbar(xs, [c["mean"] for c in pts], yerr=[c["std"] or 0.0 for c in pts], capsize=2,
                            label=name, **styles[(kind, m)])
        for ax, (key, xlabel, scale) in zip(axes, _AXES):
            xs = [c.get(key) for c in mine if c.get(key)]
            if xs and scale is log2_axis:
                log2_axis(ax, xs)
            elif xs:
                log10_axis(ax)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
        c0 = mine[0]
        axes[0].set_ylabel(c0.get("metric_label", "metric") + (" (lower is better)" if c0.get("better") == "lower"
                                                                else ""))
        axes[0].legend(fontsize=7)
        fig.suptitle(labels.get(task, task), fontsize=9)
        fig.tight_layout()
        thin_tick_labels(fig)
        written.append(save_figure_atomic(fig, folder / f"metric_vs_heads_{task}.png", dpi=72))
    return written
