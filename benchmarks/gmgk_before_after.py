"""gMGK against GQA, and MGK / sMGK decoding, before and after a change to the decoding states and kernels: the
``mgk bench`` commands run on the tree of a base commit (``git archive`` into a temporary folder, imported through
PYTHONPATH, as ``decode_state_before_after.py`` does) and on the current tree, alternately, round by round in one
run; every kind of a cell in one process (``--same-process``), so a row's ratio to its reference kind is taken in
the same moments.

Three tables (``--what``, default all three):

* ``decode``: ``mgk bench decode --targets layer`` of ``--kinds`` (default GQA-8 kv 2 and gMGK-8 kv 2 shifted keys)
  at ``--batches`` x ``--contexts``: per tree the prefill through the cache and the decode step of each kind over
  the reference kind's (the first), median over the rounds (the issue's targets: prefill at most 1.6x, a step at
  most 1.2x GQA's);
* ``mgk``: ``mgk bench decode --same-process`` of MGK-4 and sMGK-4 (``--mgk-kinds``, one layer and
  ``--mgk-targets``) at batch 8: ms per token now over base (no slower than before), and each tree's ratio to
  softmax-8 in the same process (its step did not change: a shift of both trees' ratios is the machine's);
* ``attention``: ``mgk bench attention --causal --backward`` at ``--lengths`` of the same kinds as ``decode``: time
  of forward + backward over the reference kind's (same process), and peak memory from separate processes (its own
  mode), per tree (at most 1.6x the time and 1.3x the peak memory at 4,096 tokens).

The run the lead makes, on a quiet machine (one thread, as the issue measured; about 30-40 minutes)::

    OMP_NUM_THREADS=1 python benchmarks/gmgk_before_after.py --base 61c7fc0 --rounds 3

A proof that it runs, in a few minutes::

    python benchmarks/gmgk_before_after.py --contexts 64 --batches 1 --lengths 128 --steps 4 --rounds 1 \\
        --mgk-targets layer

Each tree's C++ kernel is built (or loaded from torch's extension cache) before the first timed round. The 1-minute
load average is printed before and after: figures from a busy machine are not those of a quiet one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_state_before_after import _env, _export, _warm  # noqa: E402  (the base tree and its kernel)

ROOT = Path(__file__).resolve().parents[1]
BASE = "61c7fc0"  # main before the decoding states (one object per kind; gMGK on the fused step)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=BASE, help="the commit to compare against (default: %(default)s)")
    p.add_argument("--what", default="decode,mgk,attention", help="tables to make (default: %(default)s)")
    p.add_argument("--kinds", default="gqa+num_kv_heads=2:8,gmgk+num_kv_heads=2+keys=shifted:8",
                   help="the first is the reference of the ratios (default: %(default)s)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--steps", type=int, default=None, help="mgk bench decode --steps (default: its own)")
    p.add_argument("--mgk-kinds", default="mgk:4,smgk:4,softmax:8")
    p.add_argument("--mgk-targets", default="layer,lm-small")
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--rounds", type=int, default=3, help="alternations base / current (median over them)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per bench run")
    return p.parse_args(argv)


def _mgk(src: Path, argv: list[str], out: Path, timeout: float) -> list[dict]:
    """One ``mgk`` command on the tree at ``src``, writing its rows to ``out``: the rows."""
    cmd = [sys.executable, "-c", "import sys; from mgk.cli import main; sys.exit(main())", *argv, "--json", str(out)]
    done = subprocess.run(cmd, env=_env(src), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"mgk {' '.join(argv[:2])} failed on {src}: {(done.stderr or done.stdout).strip()[-2000:]}")
    return json.loads(out.read_text())["rows"]


def _commands(args) -> dict[str, list[list[str]]]:
    """The bench commands of each table (a table may take several: attention's time and its peak memory)."""
    steps = [] if args.steps is None else ["--steps", str(args.steps)]
    return {
        "decode": [["bench", "decode", "--targets", "layer", "--kinds", args.kinds, "--batches", args.batches,
                    "--contexts", args.contexts, "--same-process", *steps]],
        "mgk": [["bench", "decode", "--targets", args.mgk_targets, "--kinds", args.mgk_kinds, "--batches", "8",
                 "--contexts", args.contexts, "--same-process", *steps]],
        "attention": [["bench", "attention", "--causal", "--backward", "--kinds", args.kinds, "--lengths",
                       args.lengths, "--same-process", "--rounds", "3"],
                      ["bench", "attention", "--causal", "--backward", "--kinds", args.kinds, "--lengths",
                       args.lengths, "--repeats", "3"]],
    }


def _key(table: str, row: dict) -> tuple:
    if table == "attention":
        return (row["kind"], row["length"])
    return (row["target"], row["kind"], row["batch"], row["context"])


def _collect(table: str, which: int, rows: list[dict], cells: dict, tree: str) -> None:
    """Each row's measures into ``cells[key][tree]``: prefill and step ms (decode), ms per token (mgk), time and
    peak memory (attention: the first command times, the second measures memory)."""
    for row in rows:
        cell = cells.setdefault(_key(table, row), {}).setdefault(tree, {})
        if "error" in row:
            cell.setdefault("errors", []).append(row["error"])
        elif table == "decode":
            cell.setdefault("prefill", []).append(row["prefill_ms"])
            cell.setdefault("step", []).append(row["step_ms"])
        elif table == "mgk":
            cell.setdefault("ms", []).append(row["ms_per_token"])
        elif which == 0:
            cell.setdefault("time", []).append(row["time_ms"])
        else:
            cell.setdefault("mem", []).append(row["peak_mem_mb"])


def _med(cell: dict, name: str) -> float | None:
    values = [v for v in cell.get(name, []) if v is not None]
    return statistics.median(values) if values else None


def _ratio(a, b) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def reference_of(cells: dict, target: str, batch: int, context: int) -> str:
    """The reference kind of the mgk table's cell: softmax's row (its step did not change)."""
    return next((k[1] for k in cells if k[0] == target and k[2] == batch and k[3] == context
                 and k[1].startswith("softmax")), "softmax")


def _report(table: str, cells: dict, reference: str) -> str:
    """The table's lines: per cell both trees' medians and the ratios the issue's targets are stated in."""
    lines = []
    if table == "mgk":  # softmax-8, whose step did not change, measured in the same process: the drift's reference
        lines.append("| target | kind | batch | context | base ms/token | now ms/token | now / base | base x ref | "
                     "now x ref |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for (target, kind, batch, context), got in sorted(cells.items()):
            ref = cells.get((target, reference_of(cells, target, batch, context), batch, context), {})
            base, now = _med(got.get("base", {}), "ms"), _med(got.get("now", {}), "ms")
            shown = ["-" if t is None else f"{t:.4f}" for t in (base, now)]
            lines.append(f"| {target} | {kind} | {batch} | {context} | {shown[0]} | {shown[1]} | "
                         f"{_ratio(now, base)} | {_ratio(base, _med(ref.get('base', {}), 'ms'))} | "
                         f"{_ratio(now, _med(ref.get('now', {}), 'ms'))} |")
        return "\n".join(lines)
    measures = ("prefill", "step") if table == "decode" else ("time", "mem")
    lines.append(f"| cell | kind | {' | '.join(f'base {m} / ref | now {m} / ref' for m in measures)} |")
    lines.append("|---|---|" + "---|---|" * len(measures))
    for key, got in sorted(cells.items()):
        kind = key[1] if table == "decode" else key[0]
        if kind.startswith(reference):
            continue
        ref_key = (key[0], reference, *key[2:]) if table == "decode" else (reference, key[1])
        ref = cells.get(ref_key, {})
        parts = []
        for m in measures:
            for tree in ("base", "now"):
                parts.append(_ratio(_med(got.get(tree, {}), m), _med(ref.get(tree, {}), m)))
        cell = f"batch {key[2]}, context {key[3]}" if table == "decode" else f"length {key[1]}"
        lines.append(f"| {cell} | {kind} | {' | '.join(parts)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _args(argv)
    tables = [t.strip() for t in args.what.split(",") if t.strip()]
    commands = _commands(args)
    reference = args.kinds.split(",")[0].rsplit(":", 1)[0]
    print(f"load average before: {os.getloadavg()[0]:.2f}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="mgk-base-") as tmp:
        trees = {"base": _export(args.base, Path(tmp)), "now": ROOT / "src"}
        for src in trees.values():
            _warm(src)
        cells = {t: {} for t in tables}
        for r in range(args.rounds):
            for table in tables:
                for which, argv_ in enumerate(commands[table]):
                    for tree, src in trees.items():
                        out = Path(tmp) / f"{table}-{which}-{tree}-{r}.json"
                        _collect(table, which, _mgk(src, argv_, out, args.timeout), cells[table], tree)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"base {args.base} against the current tree, {args.rounds} rounds alternated; load average after: "
          f"{os.getloadavg()[0]:.2f}")
    for table in tables:
        print(f"\n## {table}\n")
        print(_report(table, cells[table], reference))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
