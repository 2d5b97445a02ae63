"""The figure of `mgk bench decode --plot`: milliseconds per generated token against the context length, one line
per attention kind, one panel per (target, batch) (llama-bench and gpt-fast report the same per depth)."""
from __future__ import annotations

from pathlib import Path

from ..atomic import save_figure_atomic
from ..figures import kind_of, log2_axis, log10_axis, series_styles, thin_tick_labels

__all__ = ["plot_decode"]


def plot_decode(result: dict, path: str | Path) -> Path:
    """Write ``path`` (PNG) from a :func:`mgk.bench.decode.run` result: per (target, batch) a panel of ms per token
    (log scale) against the context (log2 scale) for every kind that has rows there, with the rounds' min-max as
    error bars where there were several rounds, each kind in its colour (:mod:`mgk.figures`). Failed rows are left out
    (the table names them). Returns the path; ValueError when no row succeeded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in result["rows"] if "error" not in r]
    if not good:
        raise ValueError("no row succeeded: nothing to plot")
    panels = list(dict.fromkeys((r["target"], r["batch"]) for r in good))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (target, batch) in zip(axes[0], panels):
        rows = [r for r in good if (r["target"], r["batch"]) == (target, batch)]
        # a row's kind is a variant name ("gqa+num_kv_heads=2"): its kind is the name it starts with
        styles = series_styles({r.get("label") or r["kind"]: kind_of(r["kind"]) for r in rows})
        for label in styles:
            line = sorted((r for r in rows if (r.get("label") or r["kind"]) == label), key=lambda r: r["context"])
            x = [r["context"] for r in line]
            y = [r["ms_per_token"] for r in line]
            lo = [r["ms_per_token"] - r.get("step_ms_min", r["step_ms"]) / batch for r in line]
            hi = [r.get("step_ms_max", r["step_ms"]) / batch - r["ms_per_token"] for r in line]
            ax.errorbar(x, y, yerr=[lo, hi], capsize=3, label=label, **styles[label])
        log2_axis(ax, [r["context"] for r in rows])
        log10_axis(ax, "y")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per token")
        ax.set_title(f"{target}, batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"mgk bench decode, {result.get('date', '')}: {result.get('machine', '')}", fontsize=8)
    fig.tight_layout()
    thin_tick_labels(fig)
    return save_figure_atomic(fig, path, dpi=120)
