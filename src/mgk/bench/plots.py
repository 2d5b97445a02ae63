"""The figure of `mgk bench decode --plot`: milliseconds per generated token against the context length, one line
per attention kind, one panel per (target, batch) (issue 34; llama-bench and gpt-fast report the same per depth)."""
from __future__ import annotations

from pathlib import Path

from ..atomic import save_figure_atomic

__all__ = ["plot_decode"]


def plot_decode(result: dict, path: str | Path) -> Path:
    """Write ``path`` (PNG) from a :func:`mgk.bench.decode.run` result: per (target, batch) a panel of ms per token
    (log scale) against the context (log2 scale) for every kind that has rows there, with the rounds' min-max as
    error bars where there were several rounds. Failed rows are left out (the table names them). Returns the path;
    ValueError when no row succeeded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    good = [r for r in result["rows"] if "error" not in r]
    if not good:
        raise ValueError("no row succeeded: nothing to plot")
    panels = list(dict.fromkeys((r["target"], r["batch"]) for r in good))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (target, batch) in zip(axes[0], panels):
        rows = [r for r in good if (r["target"], r["batch"]) == (target, batch)]
        for label in dict.fromkeys(r.get("label") or r["kind"] for r in rows):
            line = sorted((r for r in rows if (r.get("label") or r["kind"]) == label), key=lambda r: r["context"])
            x = [r["context"] for r in line]
            y = [r["ms_per_token"] for r in line]
            lo = [r["ms_per_token"] - r.get("step_ms_min", r["step_ms"]) / batch for r in line]
            hi = [r.get("step_ms_max", r["step_ms"]) / batch - r["ms_per_token"] for r in line]
            ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(ticker.ScalarFormatter())
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per token")
        ax.set_title(f"{target}, batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"mgk bench decode, {result.get('date', '')}: {result.get('machine', '')}", fontsize=8)
    fig.tight_layout()
    return save_figure_atomic(fig, path, dpi=120)
