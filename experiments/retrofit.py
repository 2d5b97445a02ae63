"""Retro-fitting experiment (pre-registered in results/cpu/kv-budget.md, "Retro-fitting"): trained
softmax-8 runs converted by ``mgk train --init-from`` to GQA-8 (kv 2), MGK-4 (similar pairs, and adjacent pairs as
the control) and softmax-4 (pruned), each trained on for 5%, 10% and 20% of the source's steps; then the table, the
verdicts of ``mgk reproduce``'s rule and a figure against the from-scratch rows of the same grid.

Usage (the sources are the softmax-8 runs of ``mgk reproduce heads``, one folder per seed)::

    python experiments/retrofit.py --sources runs/reproduce/heads-cpu/runs/dretrieval-d8/softmax-8 \\
        --scratch runs/reproduce/heads-cpu/report.json --task-label "D-retrieval D=8 (T=16, V=64)" \\
        --out runs/retrofit-d8 --jobs 2

Continued runs keep the source's learning rate and schedule shape, with warm-up over 10% of the continued steps,
and are validated once, at their end (their best checkpoint is their last); the step-0 validation of the converted
weights is logged by ``--init-from`` itself. Finished runs (results.json) are skipped, so the command resumes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TARGETS = {  # label: mgk train flags
    "gqa-8-kv2": ["--attention", "gqa", "--heads", "8", "--set", "num_kv_heads=2"],
    "mgk-4-similar": ["--attention", "mgk", "--heads", "4", "--init-pairs", "similar"],
    "mgk-4-adjacent": ["--attention", "mgk", "--heads", "4", "--init-pairs", "adjacent"],
    "softmax-4": ["--attention", "softmax", "--heads", "4"],
    "gmgk-8-kv2-shifted": ["--attention", "gmgk", "--heads", "8", "--set", "num_kv_heads=2", "--set", "keys=shifted"],
    "gmgk-8-kv1": ["--attention", "gmgk", "--heads", "8", "--set", "num_kv_heads=1"],
}
FRACTIONS = (0.05, 0.10, 0.20)
# The pre-registered comparisons (row, reference) at each budget.
PAIRS = (("mgk-4-similar", "gqa-8-kv2"), ("mgk-4-similar", "mgk-4-adjacent"), ("mgk-4-adjacent", "gqa-8-kv2"),
         ("softmax-4", "gqa-8-kv2"), ("gmgk-8-kv2-shifted", "gqa-8-kv2"), ("gmgk-8-kv1", "gqa-8-kv2"))
SCRATCH_ROWS = {"gqa-8-kv2": "gqa-8-kv2", "mgk-4-similar": "mgk-4", "mgk-4-adjacent": "mgk-4",
                "softmax-4": "softmax-4", "softmax-8 (source)": "softmax-8",
                "gmgk-8-kv2-shifted": "gmgk-8-kv2-shifted", "gmgk-8-kv1": "gmgk-8-kv1"}


def _sources(folder: Path) -> list[tuple[int, Path]]:
    out = []
    for run in sorted(p for p in folder.iterdir() if p.is_dir() and (p / "results.json").is_file()):
        out.append((int(json.loads((run / "results.json").read_text())["seed"]), run))
    if not out:
        raise SystemExit(f"retrofit: no finished run (results.json) in {folder}")
    return out


def _steps_of(run: Path) -> int:
    return int(json.loads((run / "results.json").read_text())["steps"])


def _command(src: Path, target: str, steps: int, out: Path) -> list[str]:
    warmup = max(1, steps // 10)
    return [sys.executable, "-m", "mgk", "train", "--init-from", str(src), *TARGETS[target], "--steps", str(steps),
            "--set", f"warmup_steps={warmup}", "--set", f"eval_every={steps}", "--set", f"checkpoint_every={steps}",
            "--set", f"log_every={max(1, steps // 4)}", "--set", "progress=false", "--threads", "1",
            "--out", str(out)]


def _run(job) -> str:
    cmd, out = job
    if (out / "results.json").is_file():
        return f"{out}: finished earlier"
    if out.exists():
        cmd = cmd + ["--overwrite"]
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    return f"{out}: {'done' if rc == 0 else f'FAILED ({rc}), see {log}'}"


def _metric(results: dict) -> tuple[str, float, str]:
    """(metric, value, split): the test split's, or the validation split's where the data has no test split (the
    shared WikiText-103 copy), named so that the report says which."""
    split = "test" if results.get("test") else "validation"
    scores = results.get("test") or results.get("val")
    for key in ("nmse", "ppl", "acc"):
        if key in scores:
            return key, float(scores[key]), split
    raise KeyError(f"no metric in {results}")


def _start(run: Path, key: str) -> float | None:
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("step") == 0 and f"val/{key}" in rec:
            return float(rec[f"val/{key}"])
    return None


def _cell(row: str, task: str, values: list[float], key: str) -> dict:
    return {"row": row, "task": task, "n": len(values), "mean": statistics.mean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "values": values, "metric": key,
            "better": "higher" if key == "acc" else "lower"}


def collect(out: Path, sources, fractions, task: str) -> dict:
    """Per (target, budget): the test metric and the step-0 validation metric of every seed."""
    from mgk.reproduce.report import compare

    table, cells_by_budget = [], {}
    key, splits = None, set()
    for frac in fractions:
        cells = []
        for target in TARGETS:
            vals, starts = [], []
            for seed, _ in sources:
                run = out / target / f"f{frac:.2f}" / f"seed{seed}"
                if not (run / "results.json").is_file():
                    continue
                results = json.loads((run / "results.json").read_text())
                key, v, split = _metric(results)
                splits.add(split)
                vals.append(v)
                starts.append(_start(run, key))
            cell = _cell(target, task, vals, key or "nmse")
            cell.update(fraction=frac, start=starts)
            cells.append(cell)
            table.append(cell)
        cells_by_budget[frac] = compare(cells, PAIRS)
    return {"cells": table, "comparisons": {str(k): v for k, v in cells_by_budget.items()}, "metric": key,
            "split": " and ".join(sorted(splits)) or "test"}


def _fmt(c: dict) -> str:
    if not c["n"]:
        return "—"
    return f"{c['mean']:.4f} ± {c['std']:.4f} ({c['n']})"


def figure(result: dict, scratch: dict, task: str, source_steps: int, ylabel: str):
    """The figure of retrofit.png (a matplotlib Figure): each target's metric against the continued steps, in its
    attention kind's colour (mgk.figures, as every figure mgk draws; the two MGK targets told apart by line style
    and marker), its from-scratch row dashed and the softmax-8 source dotted, in the same colours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mgk.figures import series_styles, thin_tick_labels

    styles = series_styles({target: flags[flags.index("--attention") + 1] for target, flags in TARGETS.items()})
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for target in TARGETS:
        cells = [c for c in result["cells"] if c["row"] == target and c["n"]]
        xs = [round(c["fraction"] * source_steps) for c in cells]
        ax.errorbar(xs, [c["mean"] for c in cells], yerr=[c["std"] for c in cells], capsize=3,
                    label=f"{target} (converted)", **styles[target])
        sc = scratch.get(SCRATCH_ROWS[target])
        if sc and target != "mgk-4-adjacent":
            ax.axhline(sc["mean"], color=styles[target]["color"], linestyle="--", linewidth=1,
                       label=f"{SCRATCH_ROWS[target]} from scratch ({source_steps} steps)")
    src = scratch.get("softmax-8")
    if src:
        ax.axhline(src["mean"], color=styles["softmax-4"]["color"], linestyle=":", linewidth=1.5,
                   label="softmax-8 (source)")
    ax.set_xticks(sorted({round(f * source_steps) for f in FRACTIONS}))
    ax.set_xlabel("continued steps")
    ax.set_ylabel(ylabel)
    ax.set_title(f"Retro-fitting softmax-8: {task}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    thin_tick_labels(fig)
    return fig


def report(result: dict, scratch: dict, out: Path, task: str, source_steps: int, command: str) -> Path:
    """REPORT.md and retrofit.png in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, split = result["metric"], result.get("split", "test")
    lines = [f"# Retro-fitting softmax-8 on {task}", "", f"Command: `{command}`", "",
             f"{split.capitalize()} {key} (mean ± sample std (n)), continued steps as a fraction of the source's "
             f"{source_steps}; "
             "step 0 = the converted weights before training (validation split).", "",
             "| target | " + " | ".join(f"{f:.0%} ({round(f * source_steps)} steps)" for f in FRACTIONS)
             + " | step 0 (val) | from scratch |", "|---" * (len(FRACTIONS) + 3) + "|"]
    for target in TARGETS:
        cells = [c for c in result["cells"] if c["row"] == target]
        starts = [s for s in cells[0]["start"] if s is not None] if cells else []
        start = f"{statistics.mean(starts):.4f}" if starts else "—"
        sc = scratch.get(SCRATCH_ROWS[target])
        lines.append(f"| {target} | " + " | ".join(_fmt(c) for c in cells) + f" | {start} | "
                     + (f"{sc['mean']:.4f} ± {sc['std']:.4f} ({sc['n']})" if sc else "—") + " |")
    lines += ["", "Comparisons (`mgk reproduce`'s rule: |difference| against the larger std):", "",
              "| budget | row | reference | difference | larger std | verdict |", "|---|---|---|---|---|---|"]
    for frac, comps in result["comparisons"].items():
        for c in comps:
            lines.append(f"| {float(frac):.0%} | {c['row']} | {c['reference']} | {c['difference']:+.4f} | "
                         f"{c['larger_std']:.4f} | {c['verdict']} |")
    fig = figure(result, scratch, task, source_steps, f"{split} {key}")
    fig.savefig(out / "retrofit.png", dpi=120)
    plt.close(fig)
    lines += ["", "![retro-fit](retrofit.png)", ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines))
    (out / "report.json").write_text(json.dumps(result, indent=2))
    return path


def _scratch(path: Path | None, task: str) -> dict:
    if path is None or not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {c["row"]: c for c in data["rows"] if c["task"] == task and c["n"]}


def _targets(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise SystemExit(f"retrofit: --targets: unknown target(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(TARGETS)}")
    return names


def plan(sources, total: int, out: Path, targets) -> list[tuple[list[str], Path]]:
    """(command, run folder) of every continued run: each budget of ``FRACTIONS`` of the source's ``total`` steps,
    for each of ``targets`` and each (seed, source run), in that order (the shortest budgets first)."""
    return [(_command(src, t, max(1, round(f * total)), out / t / f"f{f:.2f}" / f"seed{seed}"),
             out / t / f"f{f:.2f}" / f"seed{seed}")
            for f in FRACTIONS for t in targets for seed, src in sources]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", required=True, type=Path, help="folder of the softmax-8 runs, one per seed")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--scratch", type=Path, default=None, help="report.json of the grid with the from-scratch rows")
    p.add_argument("--task", default="dretrieval-d8", help="task name of the rows in --scratch")
    p.add_argument("--task-label", default=None, help="title of the report (default: --task)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"comma-separated targets to run (default: all of {', '.join(TARGETS)}); the report "
                        "covers every target with finished runs")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    sources = _sources(args.sources)
    steps = {_steps_of(src) for _, src in sources}
    if len(steps) != 1:
        raise SystemExit(f"retrofit: the sources were trained for different steps: {sorted(steps)}")
    total = steps.pop()
    jobs = plan(sources, total, args.out, _targets(args.targets))
    if not args.report_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            for line in pool.map(_run, jobs):
                print(line, flush=True)
    result = collect(args.out, sources, FRACTIONS, args.task)
    command = "python experiments/retrofit.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(report(result, _scratch(args.scratch, args.task), args.out, args.task_label or args.task, total,
                 command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
