"""Figures of ``mgk analyze`` (matplotlib, Agg backend: no display needed). Every function writes one PNG. A run's
series is drawn in its attention kind's colour, read from its label (``"mgk-4"``, :mod:`mgk.figures`), the same in
every figure mgk draws; tick labels that would overlap are dropped."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot is imported)

from ..atomic import save_figure_atomic  # noqa: E402
from ..figures import series_styles, thin_tick_labels  # noqa: E402

__all__ = ["attention_grid", "rank_histograms", "per_layer_lines", "mixture_bars", "pruning_curves"]


def _save(fig, path: Path) -> Path:
    thin_tick_labels(fig)  # the axes keep their sizes at savefig (bbox_inches="tight" only crops)
    return save_figure_atomic(fig, path, dpi=80, bbox_inches="tight")


def _styles(labels) -> dict:
    """Each run label's colour (its kind's) and line style (:func:`mgk.figures.series_styles`)."""
    return series_styles(dict.fromkeys(labels))


def _component_colour(r: int, M: int):
    """Mixture component r of M in greys: components are not attention kinds, whose colours they must not borrow."""
    return plt.cm.Greys(0.3 + 0.55 * r / max(M - 1, 1))


def attention_grid(maps: list, path: Path, title: str) -> Path:
    """A grid of attention matrices: one row per example, one column per head; ``maps`` is a list of (H, n, n)
    tensors (real tokens only). One colour scale per example, from 0 to the largest weight of its heads, shown by
    the colour bar at the end of its row (the heads of an example compare by colour)."""
    rows, cols = len(maps), maps[0].shape[0]
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols + 1.0, 1.6 * rows + 0.5), squeeze=False)
    for r, m in enumerate(maps):
        top = max(float(m.max()), 1e-12)  # an all-zero map still gets a valid scale
        for h in range(cols):
            ax = axes[r][h]
            image = ax.imshow(m[h].numpy(), cmap="viridis", interpolation="nearest", vmin=0.0, vmax=top)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"head {h}", fontsize=8)
        axes[r][0].set_ylabel(f"ex {r} (n={m.shape[-1]})", fontsize=7)
        bar = fig.colorbar(image, ax=list(axes[r]), fraction=0.04, pad=0.02)
        bar.set_label("attention weight", fontsize=6)
        bar.ax.tick_params(labelsize=6)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def rank_histograms(series: dict, path: Path, title: str, xlabel: str) -> Path:
    """Overlaid histograms, one panel per layer: ``series`` maps a label to a list (per layer) of value lists.
    Densities, so runs with different numbers of heads compare."""
    labels = list(series)
    styles = _styles(labels)
    layers = max(len(v) for v in series.values())
    fig, axes = plt.subplots(1, layers, figsize=(4 * layers, 3), squeeze=False)
    for i in range(layers):
        ax = axes[0][i]
        values = [series[lab][i] for lab in labels if i < len(series[lab])]
        lo = min(min(v) for v in values if v)
        hi = max(max(v) for v in values if v)
        bins = _bins(lo, hi)
        for lab in labels:
            if i < len(series[lab]) and series[lab][i]:
                ax.hist(series[lab][i], bins=bins, density=True, alpha=0.5, label=lab, color=styles[lab]["color"])
        ax.set_title(f"layer {i}", fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
    axes[0][0].set_ylabel("density", fontsize=8)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def _bins(lo: float, hi: float):
    if float(lo).is_integer() and float(hi).is_integer() and hi - lo <= 60:
        return [x - 0.5 for x in range(int(lo), int(hi) + 2)]
    return 30


def per_layer_lines(series: dict, path: Path, title: str, ylabel: str) -> Path:
    """One line per label over the layers: ``series`` maps a label to ``(means, stds)`` lists per layer."""
    fig, ax = plt.subplots(figsize=(4.5, 3))
    styles = _styles(series)
    for lab, (means, stds) in series.items():
        x = list(range(len(means)))
        ax.errorbar(x, means, yerr=stds, capsize=3, label=lab, **styles[lab])
    ax.set_xlabel("layer", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_xticks(range(max(len(m) for m, _ in series.values())))
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def mixture_bars(series: dict, path: Path, title: str, ylabel: str) -> Path:
    """Grouped bars per layer: ``series`` maps a label (run) to a list per layer of (H, M) nested lists; each head's
    components are stacked (they sum to 1 for pi and for shares)."""
    labels = list(series)
    layers = max(len(v) for v in series.values())
    fig, axes = plt.subplots(1, layers, figsize=(4.5 * layers, 3), squeeze=False)
    for i in range(layers):
        ax, x0, ticks, names = axes[0][i], 0, [], []
        for lab in labels:
            if i >= len(series[lab]) or series[lab][i] is None:
                continue
            table = series[lab][i]
            for h, row in enumerate(table):
                bottom = 0.0
                for r, v in enumerate(row):
                    ax.bar(x0, v, bottom=bottom, color=_component_colour(r, len(row)),
                           label=f"component {r}" if x0 == 0 else None)
                    bottom += v
                ticks.append(x0)
                names.append(f"{lab}\nh{h}" if h == 0 else f"h{h}")
                x0 += 1
            x0 += 1
        ax.set_xticks(ticks)
        ax.set_xticklabels(names, fontsize=6)
        ax.set_title(f"layer {i}", fontsize=9)
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel(ylabel, fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def pruning_curves(series: dict, path: Path, title: str, ylabel: str, xlabel: str) -> Path:
    """The metric against the units kept: ``series`` maps a run label to ``{"kept": [...], "importance": [...],
    "random_mean": [...], "random_std": [...]}`` (random lists may be empty); importance order solid, random
    order dashed with its std band."""
    fig, ax = plt.subplots(figsize=(5, 3.4))
    styles = _styles(series)
    for lab, s in series.items():
        colour, marker = styles[lab]["color"], styles[lab]["marker"]
        ax.plot(s["kept"], s["importance"], marker=marker, color=colour, label=f"{lab}: by importance")
        if s.get("random_mean"):
            lo = [m - d for m, d in zip(s["random_mean"], s["random_std"])]
            hi = [m + d for m, d in zip(s["random_mean"], s["random_std"])]
            ax.plot(s["kept"], s["random_mean"], ls="--", color=colour, label=f"{lab}: random order")
            ax.fill_between(s["kept"], lo, hi, color=colour, alpha=0.15)
    ax.invert_xaxis()
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)
