"""``mgk analyze``: argument parsing and the two entry points (one run, or ``--compare`` several)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ..argtypes import seed

__all__ = ["add_parser", "run", "analyse_dirs"]


def add_parser(sub) -> None:
    """Add the ``analyze`` sub-command to an ``argparse`` sub-parsers object."""
    p = sub.add_parser("analyze", help="attention maps, rank, head redundancy and mixture weights of trained runs",
                       description="Measure why MGK works on a run's best checkpoint: attention maps per layer "
                                   "(PNG), the numerical rank of attention matrices, head redundancy (Jensen-Shannon "
                                   "divergence, L2 distance, effective number of heads) and the mixture weights. "
                                   "Writes analysis.json, analysis.md and the figures. With --compare, the same "
                                   "for several runs, figures overlaid.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directory (several with --compare)")
    p.add_argument("--compare", action="store_true", help="analyse every RUN_DIR and overlay them")
    p.add_argument("--split", default="val", choices=["val", "test"], help="split to draw examples from")
    p.add_argument("--samples", type=int, default=100, help="examples drawn at random (default 100); every head "
                                                            "of every layer is measured on each")
    p.add_argument("--seed", type=seed, default=0, help="seed of the example draw, 0 to 2**64 - 1 (default 0)")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/analysis; with --compare: "
                                               "./analysis-compare)")
    p.add_argument("--data", default=None, help="data folder (default: the run's own)")
    p.add_argument("--rank-tol", type=float, default=1e-6, help="singular values <= this are dropped (1e-6)")
    p.add_argument("--rank-mode", default="absolute", choices=["absolute", "relative"],
                   help="tolerance absolute (paper) or relative to the largest singular value; both are recorded")
    p.add_argument("--batch-size", type=int, default=8, help="examples per model call (bounds memory)")
    p.add_argument("--examples", type=int, default=3, help="examples drawn as attention-map grids (default 3)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"], help="model precision")
    p.add_argument("--checkpoint", default="best", choices=["best", "last"], help="which checkpoint")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--prune", action="store_true",
                   help="instead: head importance (Michel et al. 2019: |dL/d gate| per head, and per mixture "
                        "component for MGK/MLK, per key group's component for gMGK) on the validation split, "
                        "iterative pruning of the least important 10%% (importance recomputed), a random-order "
                        "baseline and the one-head ablation, scored on the test split; writes prune.json, "
                        "prune.md, prune_head.png (prune_component.png)")
    p.add_argument("--prune-random", type=int, default=5, help="random pruning orders of the baseline (default 5)")
    p.add_argument("--prune-examples", type=int, default=0,
                   help="examples of each split the pruning reads (default 0: all)")


def _settings(args):
    from .analysis import Settings

    return Settings(split=args.split, samples=args.samples, seed=args.seed, batch_size=args.batch_size,
                    rank_tol=args.rank_tol, rank_mode=args.rank_mode, examples=args.examples,
                    dtype=args.dtype).check()


def analyse_dirs(run_dirs, out: Path, settings, *, data=None, which="best", device="cpu",
                 progress=True, notes: list | None = None) -> dict:
    """Analyse each run of ``run_dirs`` and write analysis.json, analysis.md and the figures into ``out``.
    Returns {label: result}. Labels are "<attention>-<heads>", with the folder name added when two coincide.

    A failed run (its final evaluation was not finite) is refused alone (:class:`~mgk.analyze.run.FailedRun`) and
    left out of a comparison, listed in analysis.md; an unfinished run is analysed and marked. ``notes`` (when
    given) receives one line per run left out or unfinished."""
    from .analysis import analyse
    from .report import write_figures, write_json, write_markdown
    from .run import FailedRun, loaded_runs

    results, maps, left_out = {}, {}, []
    notes = [] if notes is None else notes
    for label, run in loaded_runs(run_dirs, data=data, which=which, device=device, notes=notes, left_out=left_out):
        result = analyse(run, settings, progress=progress)
        result.update(steps=run.steps, run_status=run.status())
        if not run.finished:
            notes.append(f"{run.run_dir} is {run.status()} (no results.json yet): the figures describe a model "
                         "still in training")
        maps[label] = result.pop("_maps")
        results[label] = result
    if not results:
        raise FailedRun("every run failed (final evaluation not finite): " + "; ".join(left_out))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figs = write_figures(results, out, maps)
    single = len(results) == 1 and len(run_dirs) == 1
    payload = next(iter(results.values())) if single else {"runs": results, "left_out": left_out}
    payload = {**payload, "figures": figs}
    write_json(payload, out / "analysis.json")
    title = f"mgk analyze: {next(iter(results))}" if single else "mgk analyze --compare: " + " vs ".join(results)
    write_markdown(results, figs, out / "analysis.md", title, left_out=left_out)
    return results


def run(args) -> int:
    """Handler of ``mgk analyze``."""
    from ..train.distributed import check_device

    if len(args.runs) > 1 and not args.compare:
        raise SystemExit("mgk analyze: several RUN_DIRs need --compare")
    if args.compare and len(args.runs) < 2:
        raise SystemExit("mgk analyze: --compare needs at least two RUN_DIRs")
    try:
        settings = _settings(args)
        check_device(args.device)
        if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
            raise ValueError(f"--out {args.out} is a file, not a folder")
        out = Path(args.out) if args.out else (Path("analysis-compare") if args.compare
                                               else Path(args.runs[0]) / "analysis")
        t0 = time.perf_counter()
        notes: list[str] = []
        if args.prune:
            return _prune(args, out, notes, t0)
        results = analyse_dirs(args.runs, out, settings, data=args.data, which=args.checkpoint,
                               device=args.device, progress=not args.no_progress, notes=notes)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"mgk analyze: {e}") from None
    for line in notes:
        print(f"mgk analyze: {line}", file=sys.stderr)
    from .report import effective_heads_text

    for label, r in results.items():
        for layer in r["layers"]:
            rk = layer["rank"][settings.rank_mode]
            red = layer["redundancy"]
            print(f"{label} layer {layer['layer']}: rank {rk['mean']:.2f} (median {rk['median']:g}), JS "
                  f"{red['js'].get('mean', float('nan')):.3f}, effective heads "
                  f"{effective_heads_text(red['effective_heads'], layer['num_heads'], spread=False)}")
    print(f"mgk analyze: wrote {out}/analysis.md, analysis.json and figures ({time.perf_counter() - t0:.1f} s)")
    return 0


def _prune(args, out: Path, notes: list, t0: float) -> int:
    """``mgk analyze --prune``: :func:`mgk.analyze.prune_report.prune_dirs` and one line per run and unit."""
    from .prune import PruneSettings
    from .prune_report import prune_dirs

    for flag, value in (("--prune-random", args.prune_random), ("--prune-examples", args.prune_examples)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    settings = PruneSettings(random_orders=args.prune_random, batch_size=args.batch_size,
                             importance_examples=args.prune_examples, eval_examples=args.prune_examples,
                             seed=args.seed).check()
    results = prune_dirs(args.runs, out, settings, data=args.data, which=args.checkpoint, device=args.device,
                         notes=notes)
    for line in notes:
        print(f"mgk analyze: {line}", file=sys.stderr)
    for label, r in results.items():
        for unit, u in r["units"].items():
            c = u["curve"]
            print(f"{label} {unit}s: {r['metric']} {c['metric'][0]:.4f} with all {c['units']}, "
                  f"{c['metric'][-1]:.4f} with {c['kept'][-1]} kept")
    print(f"mgk analyze: wrote {out}/prune.md, prune.json and figures ({time.perf_counter() - t0:.1f} s)")
    return 0
