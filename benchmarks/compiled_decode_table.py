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


def _line(runs: list[dict], t, c, k) -> str:
    def both(values, fmt="{:.2f}"):
        return " / ".join(fmt.format(v) for v in values)

    eager = [run[t, c, k, False] for run in runs]
    compiled = [run[t, c, k, True] for run in runs]
    soft_eager = [run[t, c, "softmax", False] for run in runs]
    soft_compiled = [run[t, c, "softmax", True] for run in runs]
    return (f"| {t[0]}, {t[1]}, {c}, {k} | {both(r['step_ms'] for r in eager)} | "
            f"{both(r['step_ms'] for r in compiled)} | {both(map(_paired, compiled, eager))} | "
            f"{both(map(_paired, eager, soft_eager))} | {both(map(_paired, compiled, soft_compiled))} | "
            f"{both((r['compile_ms'] / 1000 for r in compiled), '{:.1f}')} |")


def main(paths: list[str]) -> str:
    runs = [cells(p) for p in paths]
    keys = sorted(dict.fromkeys((t, c, k) for run in runs for (t, c, k, _) in run),
                  key=lambda key: (key[0], key[1]))  # a stable sort: kinds in the bench's order
    lines = ["| target, batch, context, kind | eager ms | compiled ms | compiled x eager | eager x softmax-8 | "
             "compiled x softmax-8 (compiled) | compile s |", "|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [_line(runs, *key) for key in keys])


if __name__ == "__main__":
    print(main(sys.argv[1:]))
