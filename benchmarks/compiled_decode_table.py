"""The compiled-decoding table of BENCHMARKS.md from `mgk bench decode --same-process --compile` JSON files (two runs
of one command): per target, batch, context and kind, ms per step eager and compiled, the compiled step against the same
kind's eager step, and each kind against softmax-8 in the same mode; ratios are medians over the rounds of per-round
ratios (the kinds of a cell alternate round by round in one process).

    python benchmarks/compiled_decode_table.py RUN1.json RUN2.json
"""
from __future__ import annotations

import json
import statistics
import sys


def _paired(a: dict, b: dict) -> float:
    return statistics.median(x / y for x, y in zip(a["round_ms"], b["round_ms"]))


def cells(path: str) -> dict:
    """{((target, batch), context, kind, compiled): row} of one run."""
    rows = json.load(open(path))["rows"]
    return {((r["target"], r["batch"]), r["context"], r["kind"], r["compiled"]): r for r in rows if "error" not in r}


def main(paths: list[str]) -> str:
    runs = [cells(p) for p in paths]
    keys = sorted(dict.fromkeys((t, c, k) for run in runs for (t, c, k, _) in run),
                  key=lambda key: (key[0], key[1]))  # a stable sort: kinds in the bench's order
    lines = ["| target, batch, context, kind | eager ms | compiled ms | compiled x eager | eager x softmax-8 | "
             "compiled x softmax-8 (compiled) | compile s |", "|---|---|---|---|---|---|---|"]
    for t, c, k in keys:
        def cell(fn, fmt="{:.2f}"):
            return " / ".join(fmt.format(fn(run)) for run in runs)
        lines.append(
            f"| {t[0]}, {t[1]}, {c}, {k} | {cell(lambda r: r[t, c, k, False]['step_ms'])} | "
            f"{cell(lambda r: r[t, c, k, True]['step_ms'])} | "
            f"{cell(lambda r: _paired(r[t, c, k, True], r[t, c, k, False]))} | "
            f"{cell(lambda r: _paired(r[t, c, k, False], r[t, c, 'softmax', False]))} | "
            f"{cell(lambda r: _paired(r[t, c, k, True], r[t, c, 'softmax', True]))} | "
            f"{cell(lambda r: r[t, c, k, True]['compile_ms'] / 1000, '{:.1f}')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
