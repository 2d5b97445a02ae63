"""``mgk reproduce EXPERIMENT``: a paper table as one resumable grid of ``mgk train`` runs, then its report."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..argtypes import THREADS_MAX, number
from ..argtypes import seed as seed_type
from ..choices import argparse_type
from .experiments import EXPERIMENTS, get_experiment
from .grid import ONLY_KEYS, expand, parse_data, parse_only
from .scales import SCALES

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Register ``mgk reproduce`` on the ``mgk`` sub-command parser."""
    p = sub.add_parser(
        "reproduce", help="run one of the paper's tables as a resumable grid and write its report",
        description="Expand EXPERIMENT x scale x seeds into `mgk train` runs (one directory each, keyed by the "
                    "resolved config), run the unfinished ones (finished runs are skipped, interrupted ones "
                    "resumed from their last checkpoint), then write <out>/REPORT.md, <out>/report.json and "
                    "<out>/plots/. Experiments: " + ", ".join(EXPERIMENTS) + ".")
    p.add_argument("experiment", metavar="EXPERIMENT", type=argparse_type("experiment", EXPERIMENTS),
                   help="one of: " + ", ".join(EXPERIMENTS))
    p.add_argument("--scale", default="cpu", type=argparse_type("scale", SCALES),
                   help="paper (the *-paper presets, for GPUs), cpu (reduced: minutes a run on one core; default) "
                        "or smoke (seconds a run)")
    p.add_argument("--seeds", default="0,1,2", type=_seeds,
                   help="comma-separated training seeds, each 0 to 2**64 - 1 (default: 0,1,2)")
    p.add_argument("--data", action="append", default=[], metavar="TASK=PATH",
                   help="data of a task (repeatable); default: the scale's path under --data-root")
    p.add_argument("--data-root", default=None,
                   help="folder holding imdb/, listops/, wikitext-103/, ... (default: $MGK_DATA_ROOT or "
                        "../shared/data)")
    p.add_argument("--out", default=None, help="output folder (default: runs/reproduce/<experiment>-<scale>)")
    p.add_argument("--only", action="append", default=[], metavar="KEY=V1,V2",
                   help=f"restrict the grid (repeatable; keys {', '.join(ONLY_KEYS)}), e.g. --only row=mgk-4,"
                        "softmax-8 --only task=listops; --only task=image adds an optional task")
    p.add_argument("--jobs", type=number(int, 1), default=1, help="runs at once (default 1)")
    p.add_argument("--threads", type=number(int, 0, THREADS_MAX), default=1,
                   help="OMP/MKL threads of each run (default 1; 0 leaves the environment as it is)")
    p.add_argument("--executor", default="local", choices=["local", "submitit-local", "slurm"],
                   help="local: subprocesses here; submitit-local: submitit's local executor; slurm: one submitit "
                        "job per run")
    p.add_argument("--slurm", action="append", default=[], metavar="KEY=VALUE",
                   help="submitit/sbatch parameter (repeatable): timeout_min, mem_gb, cpus_per_task, "
                        "gpus_per_node, partition, account, qos, constraint, ...")
    p.add_argument("--dry-run", action="store_true", help="print the runs, their state and commands; run nothing")
    p.add_argument("--report-only", action="store_true", help="write the report from what exists; run nothing")
    p.add_argument("--analyze", type=number(int, 0), default=0, metavar="N",
                   help="also run `mgk analyze --compare` on each task's finished rows (one seed each) with N "
                        "examples, into <out>/analysis/<task>/, linked from REPORT.md (default 0: no analysis)")


def _seeds(text: str) -> list[int]:
    """argparse type of --seeds: distinct comma-separated seeds, each in the range of ``mgk train --seed`` (checked
    here, so that a bad one is this flag's error, not the usage of the `mgk train` each run would be)."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct integers, e.g. 0,1,2")
    for s in seeds:
        try:
            seed_type(str(s))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"every seed {e}") from None
    return seeds


def _dry_run(runs, args, out: Path, params, tasks) -> None:
    from .executor import run_state, sbatch_preview

    print(f"{len(runs)} runs in {out}")
    for t in tasks:
        print(f"# task {t.describe()}" + "".join(f"\n#   note: {n}" for n in t.notes))
        if t.problem:
            print(f"#   WARNING: {t.problem}")
            print(f"mgk reproduce: warning: {t.problem} (a real run stops here before running anything)",
                  file=sys.stderr)
    for run in runs:
        print(f"\n# {run.task} {run.row.key} seed {run.seed} [{run_state(run)}] key {run.key}")
        print(run.describe(sys.executable))
    if params is not None:
        print(f"\n# submitit {args.executor} parameters (AutoExecutor.update_parameters): {params}")
        if args.executor == "slurm":
            print("# sbatch script of each job (command: submitit's runner of execute_run for that run):")
            print(sbatch_preview(params, out / "submitit", "python -u -m submitit.core._submit <folder>"))


def run(args) -> int:
    """Handler of ``mgk reproduce``."""
    from . import executor as ex

    try:
        exp = get_experiment(args.experiment)
        seeds = args.seeds  # the numeric flags are checked by their argparse types, each naming itself
        only = parse_only(args.only)
        data = parse_data(args.data, (*exp.tasks, *exp.optional_tasks))
        out = Path(args.out or f"runs/reproduce/{exp.name}-{args.scale}").absolute()
        runs = expand(exp, args.scale, seeds, out, only=only, data=data, data_root=args.data_root)
        params = ex.slurm_parameters(args.slurm) if args.executor != "local" else None
        if args.slurm and args.executor != "slurm":
            raise ValueError("--slurm needs --executor slurm")
    except (ValueError, ImportError) as e:
        raise SystemExit(f"mgk reproduce: {e}") from None
    if not runs:
        raise SystemExit("mgk reproduce: --only leaves no run")
    for line in (line for r in runs for line in ex.stale_run_dirs(r)):
        print(f"mgk reproduce: {line}", file=sys.stderr)
    from .data_check import check_data

    tasks = check_data(runs, args.scale, data) if not args.report_only else []
    if args.dry_run:
        _dry_run(runs, args, out, params, tasks)
        return 0
    problems = [t.problem for t in tasks if t.problem]
    if problems:  # before any run starts or any job is submitted
        raise SystemExit("mgk reproduce: " + "; ".join(problems) + " (nothing was run)")
    threads = args.threads or None
    todo = [r for r in runs if r.data is None or Path(r.data).exists()]
    missing = [r for r in runs if r.data is not None and not Path(r.data).exists()]
    for r in dict.fromkeys((r.task, r.data) for r in missing):
        print(f"mgk reproduce: no data for {r[0]} at {r[1]}: its runs are reported as not run "
              f"(pass --data {r[0]}=PATH)", file=sys.stderr)
    records = {}
    from .report import write_report  # with torch, before any run starts: a stopped grid reports at once
    from .stopping import GridStop

    with GridStop() as stop:  # held until the report is written: a signal stops the runs, never the report
        if not args.report_only:
            print(f"mgk reproduce {exp.name}: {len(todo)} runs, {sum(ex.run_state(r) == 'finished' for r in todo)} "
                  f"finished earlier; out {out}", flush=True)
            if args.executor == "local":
                done = ex.run_local(todo, args.jobs, threads, stop)
            else:
                done = ex.run_submitit(todo, args.executor, out / "submitit", jobs=args.jobs, params=params,
                                       threads=threads, stop=stop)
            # An interrupted or never-started run is reported by the state of its directory (resume / not started).
            records = {id(r): rec for r, rec in zip(todo, done) if rec is not None and rec["status"] != "interrupted"}
        return _report(args, exp, out, runs, records, stop, write_report)


def _report(args, exp, out: Path, runs, records: dict, stop, write_report) -> int:
    from . import executor as ex

    recs = []
    for r in runs:
        if id(r) in records:
            recs.append(records[id(r)])
        elif r.data is not None and not Path(r.data).exists():
            recs.append({"status": "not run", "error": f"no data at {r.data}"})
        else:
            state = ex.run_state(r)
            recs.append({**ex.read_record(r.run_dir), "log": str(ex.log_path(r.run_dir)),
                         "status": "skipped" if state == "finished" else state})
    command = "mgk reproduce " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["reproduce"] else sys.argv[1:])
    analysis = None
    if args.analyze and not stop.signum:
        from .analysis import analyse_grid

        print(f"mgk reproduce: analysing the finished rows of each task ({args.analyze} examples)", flush=True)
        analysis = analyse_grid(runs, out, args.analyze)
        for task, entry in analysis.items():
            print(f"analysis: {task}: " + (f"{out / entry['path']}" if "path" in entry else entry["error"]))
    rep = write_report(out, exp, args.scale, runs, recs, command, analysis=analysis)
    failed = [r for r in rep["runs"] if r["status"] not in ("done", "skipped")]
    print(f"report: {out / 'REPORT.md'} ({len(runs) - len(failed)}/{len(runs)} runs finished)")
    if stop.signum:
        print(f"mgk reproduce: interrupted by {stop.name}; resume with: {command}", file=sys.stderr, flush=True)
        return 128 + stop.signum
    return 1 if failed else 0
