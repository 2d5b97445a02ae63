"""Decoding speed before and after a change to MGK's decoding state: ``mgk bench decode`` run on the tree of a base
commit (``git archive`` into a temporary folder, imported through PYTHONPATH) and on the current tree, alternately,
round by round in one run, and a table of the median ms per token of each and their ratio (current / base).

The run the lead makes (quietly: nothing else on the machine; a few minutes a round)::

    python benchmarks/decode_state_before_after.py --base a79bc261034c95c3b1227a06b50dbb0e4dc3faca \\
        --targets layer,lm-small --kinds mgk:4,smgk:4,softmax:8 --batch 8 --contexts 1024,4096 --rounds 3

(a79bc26: the commit before the bias formula left the C++ step.) A proof that it runs, in about a minute::

    python benchmarks/decode_state_before_after.py --targets layer --kinds mgk:4,softmax:8 --contexts 64 \\
        --steps 5 --rounds 1 --set vocab_size=1000

softmax-8 is the reference row: its step does not change, so its ratio shows the machine's drift between the
trees' turns. Each tree's C++ kernel is built (or loaded from torch's extension cache) before the first timed round.
Not a test: the figures go to the report of the change that needs them.
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

ROOT = Path(__file__).resolve().parents[1]
BASE = "a79bc261034c95c3b1227a06b50dbb0e4dc3faca"


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=BASE, help="the commit to compare against (default: %(default)s)")
    p.add_argument("--targets", default="layer,lm-small")
    p.add_argument("--kinds", default="mgk:4,smgk:4,softmax:8")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--steps", type=int, default=None, help="mgk bench decode --steps (default: its own)")
    p.add_argument("--rounds", type=int, default=3, help="alternations base / current (median over them)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="mgk bench decode --set (LM preset fields)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per bench run")
    return p.parse_args(argv)


def _export(base: str, folder: Path) -> Path:
    """The base commit's tree under ``folder`` (git archive); returns its src folder."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", base], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / "src"


def _env(src: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(src)}


def _warm(src: Path) -> None:
    """Build or load the tree's C++ kernel before anything is timed (a build inside a row would hit its timeout)."""
    code = "from mgk.functional import _mixture_flash; print(_mixture_flash._load() is not None)"
    subprocess.run([sys.executable, "-c", code], env=_env(src), check=True, timeout=1800)


def _bench(src: Path, args, out: Path) -> list[dict]:
    """One ``mgk bench decode`` run on the tree at ``src``: its rows (the JSON it writes)."""
    cmd = [sys.executable, "-c", "import sys; from mgk.cli import main; sys.exit(main())", "bench", "decode",
           "--targets", args.targets, "--kinds", args.kinds, "--contexts", args.contexts,
           "--batches", str(args.batch), "--json", str(out)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    for item in args.overrides:
        cmd += ["--set", item]
    done = subprocess.run(cmd, env=_env(src), capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"mgk bench decode failed on {src}: {(done.stderr or done.stdout).strip()[-2000:]}")
    return json.loads(out.read_text())["rows"]


def _table(times: dict) -> str:
    """Rows: target, kind, context, batch, base and current ms per token (median of the rounds), current / base."""
    lines = [f"{'target':<10} {'kind':<12} {'context':>7} {'batch':>5} {'base ms/tok':>12} {'now ms/tok':>12} "
             f"{'now/base':>8}"]
    for (target, kind, context, batch), got in sorted(times.items()):
        if not got["base"] or not got["now"]:
            lines.append(f"{target:<10} {kind:<12} {context:>7} {batch:>5} failed: {got['errors'][:1]}")
            continue
        base, now = statistics.median(got["base"]), statistics.median(got["now"])
        lines.append(f"{target:<10} {kind:<12} {context:>7} {batch:>5} {base:>12.4f} {now:>12.4f} {now / base:>8.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _args(argv)
    with tempfile.TemporaryDirectory(prefix="mgk-base-") as tmp:
        trees = {"base": _export(args.base, Path(tmp)), "now": ROOT / "src"}
        for src in trees.values():
            _warm(src)
        times: dict = {}
        for r in range(args.rounds):
            for name, src in trees.items():
                for row in _bench(src, args, Path(tmp) / f"{name}-{r}.json"):
                    key = (row["target"], row["kind"], row["context"], row["batch"])
                    cell = times.setdefault(key, {"base": [], "now": [], "errors": []})
                    if "error" in row:
                        cell["errors"].append(row["error"])
                    else:
                        cell[name].append(row["ms_per_token"])
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"base {args.base[:12]} against the current tree; batch {args.batch}, {args.rounds} rounds alternated")
    print(_table(times))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
