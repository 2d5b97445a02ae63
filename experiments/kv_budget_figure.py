"""The README's figure: quality against decoding-cache bytes per token and layer, from results/cpu/kv-budget.md and
results/cpu/mixture-keys-at-gqa-cache.md.

Reads results/cpu/kv-budget-summary.csv (the rows of those files' tables, copied; tests/test_doc_snippets.py checks
each number against them) and writes docs/kv-budget-cache.png: one panel per task, softmax and GQA / MQA as curves
over their cache sizes, MGK-4, sMGK-4 and the grouped mixture keys (gMGK) as points, each with its seed std as an
error bar.

    python experiments/kv_budget_figure.py [--data CSV] [--out PNG]
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = {"dretrieval-d8": "D-retrieval, D = 8: test NMSE", "lm-small": "WikiText-103 lm-small: valid perplexity"}
STYLE = {"softmax": ("tab:blue", "o-"), "gqa": ("tab:green", "s-"), "mgk": ("tab:red", "D"),
         "smgk": ("tab:orange", "^"), "gmgk": ("tab:purple", "v"), "gmgk-shifted": ("tab:brown", "P")}
SHORT = {"gmgk": "gMGK kv1", "gmgk-shifted": "gMGK kv2 shifted"}  # point labels short enough not to overlap
OFFSET = {"gmgk": (-20, 12), "gmgk-shifted": (4, -11)}  # the gMGK points sit beside GQA-8 (kv 2)'s label
LABEL = {"softmax": "softmax-H (H heads)", "gqa": "GQA-8 (kv 4, 2, 1)", "mgk": "MGK-4", "smgk": "sMGK-4",
         "gmgk": "gMGK-8 (kv 1)", "gmgk-shifted": "gMGK-8 (kv 2, shifted)"}


def read_rows(path: Path) -> list[dict]:
    """The CSV's rows, numbers parsed; lines starting with # are comments."""
    with path.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    for row in rows:
        row.update(mean=float(row["mean"]), std=float(row["std"]), cache_bytes=int(row["cache_bytes"]))
    return rows


def draw(rows: list[dict], out: Path) -> None:
    fig, axes = plt.subplots(1, len(TASKS), figsize=(10, 3.8))
    for ax, (task, title) in zip(axes, TASKS.items()):
        for family, (colour, fmt) in STYLE.items():
            cells = sorted((r for r in rows if r["task"] == task and r["family"] == family),
                           key=lambda r: r["cache_bytes"])
            ax.errorbar([r["cache_bytes"] for r in cells], [r["mean"] for r in cells], [r["std"] for r in cells],
                        fmt=fmt, color=colour, capsize=3, label=LABEL[family])
            for r in cells:
                point = f'{SHORT.get(family, r["row"])} ({r["cache_bytes"]} B)'
                name = r["row"] if family in ("softmax", "gqa") else point
                ax.annotate(name, (r["cache_bytes"], r["mean"]), textcoords="offset points",
                            xytext=OFFSET.get(family, (4, 4)), fontsize=7)
        ax.set_xscale("log", base=2)
        # the curves' sizes as plain numbers; the points carry theirs in their labels
        ticks = sorted({r["cache_bytes"] for r in rows if r["task"] == task and r["family"] in ("softmax", "gqa")})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("decoding cache, bytes per token and layer (log)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Lower is better on both: no mixture-key row beats GQA-8 (kv 2), at its cache or above it",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "results/cpu/kv-budget-summary.csv")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/kv-budget-cache.png")
    args = parser.parse_args()
    draw(read_rows(args.data), args.out)
    print(args.out)


if __name__ == "__main__":
    main()
