"""Redraw the shipped figures whose data the repository holds, with the plot functions of today (one colour per
attention kind, readable ticks: mgk.figures), without re-running anything:

- docs/decode-ms-per-token.png from benchmarks/results/decode_fused_paired_A2.json (`mgk bench decode --plot`,
  the second batch-1 whole-model run of BENCHMARKS.md);
- results/cpu/analyze-listops/*.png from its analysis.json (`mgk analyze --compare`), and docs/analyze-compare.png,
  which is its rank.png;
- results/cpu/heads-prune/prune_{head,component}.png from its prune.json (`mgk analyze --prune`).

The grids' metric-vs-heads figures, learning curves and retro-fit figures need the runs' folders and report.json,
which the repository does not hold: redraw them with `mgk reproduce ... --report-only` and `python
experiments/retrofit.py ... --report-only` where the runs are.

    python experiments/replot_figures.py
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from mgk.analyze.prune_report import write_outputs
from mgk.analyze.report import write_figures
from mgk.bench.plots import plot_decode

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    decode = json.loads((ROOT / "benchmarks/results/decode_fused_paired_A2.json").read_text())
    print(plot_decode(decode, ROOT / "docs/decode-ms-per-token.png"))
    analysis = ROOT / "results/cpu/analyze-listops"
    figures = write_figures(json.loads((analysis / "analysis.json").read_text())["runs"], analysis)
    print(*(analysis / name for name in figures.values()), sep="\n")
    shutil.copyfile(analysis / "rank.png", ROOT / "docs/analyze-compare.png")
    prune = ROOT / "results/cpu/heads-prune"
    with tempfile.TemporaryDirectory() as tmp:  # write_outputs also writes prune.md / prune.json: keep the shipped
        data = json.loads((prune / "prune.json").read_text())
        for name in write_outputs(data["runs"], Path(tmp), data.get("left_out", ())).values():
            shutil.copyfile(Path(tmp) / name, prune / name)
            print(prune / name)


if __name__ == "__main__":
    main()
