"""Command line: argument parsing and dispatch only (``mgk ...`` or ``python -m mgk ...``).

Every error a user can cause (a bad flag, a missing or damaged file, a run that went NaN, a permission problem)
ends the command with one line on stderr, ``mgk <command>: <what is wrong and what to do>``, and a non-zero exit
status (2 for a bad command line); set ``MGK_TRACEBACK=1`` to see the Python traceback instead.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from . import __version__
from . import config as config_mod
from .analyze import cli as analyze_cli
from .bench import cli as bench_cli
from .choices import require
from .generate import cli as generate_cli
from .recovery import cli as recovery_cli
from .reproduce import cli as reproduce_cli
from .tasks import TASKS, all_presets
from .train.arguments import (
    PRESET_TYPE,
    TASK_TYPE,
    add_train_parser,
    resolve_train_config,
    train_config,  # noqa: F401  (mgk.cli.train_config, as before)
)


def _run_train(args) -> int:
    from .train.loop import Interrupted, fit

    cfg, run_dir, resume = resolve_train_config(args)
    config_mod.validate(cfg)
    if args.threads is not None:  # a setting of this process, not of the run: env.json records it
        import torch

        torch.set_num_threads(args.threads)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--{'resume' if resume else 'out'} {run_dir} is a file, not a run directory")
    initialise = None
    if args.init_from is not None:
        from . import retrofit

        init = retrofit.InitFrom(args.init_from, pairs=args.init_pairs)
        init.check(cfg.task, out=run_dir, steps=cfg.optim.steps, warmup_steps=cfg.optim.warmup_steps)

        def initialise(model, task):
            """The Trainer's hook: ``model``'s weights from ``--init-from``, converted (mgk.retrofit)."""
            return retrofit.initialise(init, model, task, cfg.seed)
    try:
        fit(cfg, run_dir, resume=resume, device=args.device, overwrite=args.overwrite,
            small_model_threads=args.threads is None and "OMP_NUM_THREADS" not in os.environ, initialise=initialise)
    except Interrupted as e:  # SIGINT / SIGTERM: one line with the --resume command, exit 128 + signal
        if e.is_main:
            print(f"mgk train: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="perplexity of a trained language model (lm runs) on a split",
                       description="Perplexity = exp(total NLL / predicted tokens) of RUN_DIR's best checkpoint "
                                   "(last.pt when there is no best.pt); every token after the first is predicted "
                                   "once. Default: non-overlapping segments of the training segment length. "
                                   "--context C --stride S: windows of C input tokens moved by S, each scoring "
                                   "its last S predictions (--context 256 --stride 1 is the paper's protocol).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory made by `mgk train --task lm`")
    p.add_argument("--split", default="valid", choices=["valid", "val", "test"],
                   help="split to score: wiki.<split>.tokens or <split>.txt (default: valid)")
    p.add_argument("--data", default=None,
                   help="data folder (default: the run's --data, or the corpus it generated)")
    p.add_argument("--context", type=int, default=None, help="input tokens per window (default: segment_len)")
    p.add_argument("--stride", type=int, default=None, help="tokens between windows (default: context)")
    p.add_argument("--batch-size", type=int, default=None, help="windows per model call (default: eval_batch_size)")
    p.add_argument("--checkpoint", default="best", choices=["best", "last"], help="which checkpoint (default: best)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON to FILE")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_eval(args) -> int:
    import json

    from .train.lm_eval import evaluate_run

    for name in ("context", "stride", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"mgk eval: --{name.replace('_', '-')} must be >= 1, got {value}")
    if args.json is not None and Path(args.json).is_dir():
        raise SystemExit(f"mgk eval: --json {args.json} is a folder; give the file to write")
    result = evaluate_run(args.run_dir, split=args.split, data=args.data, context=args.context,
                          stride=args.stride, batch_size=args.batch_size, device=args.device,
                          which=args.checkpoint, json_path=args.json, progress=not args.no_progress)
    if result is not None:
        print(json.dumps({k: result[k] for k in ("split", "ppl", "nll", "tokens", "protocol", "context", "stride",
                                                 "checkpoint")}))
    return 0


def _data_parser(sub) -> None:
    p = sub.add_parser("data", help="inspect data files (mgk data check)",
                       description="Inspect the data files of a task.")
    dsub = p.add_subparsers(dest="data_command", required=True)
    c = dsub.add_parser("check", help="validate a task's files and print counts, label balance and lengths",
                        description="Validate the files of a task: counts per split, label balance, length "
                                    "statistics. Every malformed or missing file is an error naming it (and the line "
                                    "for text formats); the exit status is 1 when there is any.")
    c.add_argument("--task", required=True, type=TASK_TYPE, help=", ".join(TASKS))
    c.add_argument("--data", required=True, help="the folder or archive to check (as for mgk train --data)")
    c.add_argument("--preset", default=None, type=PRESET_TYPE, help="configuration the check assumes (max_len, level, "
                                                  "val_fraction, ...; default: <task>-small)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set max_len=1000 --set level=curv_baseline")


def _run_data(args) -> int:
    from .tasks import get_task
    from .tasks.lra_table import data_check

    t0 = time.perf_counter()
    try:
        get_task(args.task)
        presets = all_presets()
        preset = require("preset", args.preset or f"{args.task}-small", sorted(presets))
        cfg = config_mod.apply_overrides(presets[preset], args.overrides, task=args.task, data=args.data)
        lines, errors = data_check(args.task, cfg, args.data)
    except ValueError as e:
        raise SystemExit(f"mgk data check: {e}") from None
    print(f"mgk data check: task {args.task}, data {args.data} (preset {preset}, max_len {cfg.data.max_len})")
    for line in lines:
        print(line)
    for e in errors:
        print(f"mgk data check: error: {e}", file=sys.stderr)
    verdict = f"{len(errors)} error(s)" if errors else "ok"
    print(f"{verdict} ({time.perf_counter() - t0:.1f} s)")
    return 1 if errors else 0


def _table_parser(sub) -> None:
    p = sub.add_parser("table", help="print the LRA results table of finished runs",
                       description="Read results.json of each run directory (or of every run below a folder) and "
                                   "print the LRA table (ListOps, Text, Retrieval, Image, Pathfinder, Avg) as "
                                   "markdown: one row per (attention kind, heads), mean ± std over the seeds of "
                                   "one config (runs whose configs differ in more get rows of their own). Language-"
                                   "modelling runs: validation and test perplexity (the paper's Table 3), each with "
                                   "its evaluation window (mgk eval's, else the training's segments).")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="run directories (or folders holding them); among several, one that holds no run is skipped "
                        "with a warning")


def _lm_evals(run_dir: Path) -> dict:
    """The ``mgk eval --json`` results of an LM run directory: ``{"val": eval.json, "test": eval_test.json}``
    (None where absent)."""
    from .train.rundir import RunFiles, read_json

    files = RunFiles(run_dir)
    return {split: read_json(path) if path.is_file() else None for split, path in (("val", files.eval),
                                                                                    ("test", files.eval_test))}


def _table_runs(paths: list[str]) -> tuple[list[Path], list[Path], list[str]]:
    """``(results.json files, unfinished run directories, warnings)`` of the paths given to ``mgk table``."""
    from .train.rundir import find_runs

    # `mgk table runs/*` is how the docs put it, and the shell's glob then also names the folders beside the runs
    # (an `mgk analyze --out runs/x` folder, notes): among several paths, one that exists but holds no run is
    # skipped with a warning. A single path that holds none is surely a mistake, and stays an error, as does a path
    # that does not exist (a glob never yields one).
    done, unfinished, warnings = [], [], []
    for path in paths:
        try:
            found, waiting = find_runs([path])
        except FileNotFoundError:
            if len(paths) == 1 or not Path(path).exists():
                raise
            what = ("holds no `mgk train` run (no config.yaml or results.json in it or below)" if Path(path).is_dir()
                    else "a file, not a run directory")
            warnings.append(f"skipped {path}: {what}")
            continue
        done += [f for f in found if f not in done]
        unfinished += [d for d in waiting if d not in unfinished]
    if not done and not unfinished:
        raise FileNotFoundError(f"none of the {len(paths)} paths given holds an `mgk train` run (results.json or "
                                "config.yaml in it or below)")
    return done, unfinished, warnings


def _with_config(results_file: Path, res: dict, warnings: list[str]) -> dict:
    """``res`` with the run directory and the flat resolved config of its config.yaml, which the tables compare
    (mgk.tasks.run_records.cells_by_config); a run without a readable config.yaml is compared by results.json."""
    from .tasks.run_records import RUN_CONFIG, RUN_DIR
    from .train.rundir import RunFiles, load_config

    run_dir = results_file.parent
    res = {**res, RUN_DIR: str(run_dir)}
    if not RunFiles(run_dir).config.is_file():
        return res
    try:
        return {**res, RUN_CONFIG: config_mod.flat(load_config(run_dir))}
    except (ValueError, OSError) as e:
        warnings.append(f"{_describe(e)}; that run is compared with others by its results.json alone")
        return res


def _run_table(args) -> int:
    from .tasks.lra_table import lra_table
    from .train.records import run_status
    from .train.rundir import read_run_results

    done, unfinished, warnings = _table_runs(args.runs)
    results = [(f, _with_config(f, r, warnings)) for f, r in read_run_results(done)]
    lm = [r for _, r in results if r.get("task") == "lm"]
    others = [r for _, r in results if r.get("task") != "lm"]  # lm runs have a table of their own below
    tables = []
    if others or not lm:
        table, more = lra_table(others, [run_status(d) for d in unfinished])
        tables.append(table)
        warnings += more
    else:
        warnings += [f"unfinished (no results.json): {run_status(d)}" for d in unfinished]
    if lm:  # WikiText-103 (Table 3): valid and test perplexity, each with its window
        from .tasks.lm_table import lm_table

        table, more = lm_table([(r, _lm_evals(Path(f).parent)) for f, r in results if r.get("task") == "lm"])
        tables += [table] if table else []
        warnings += more
    print("\n\n".join(tables))
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad command line answered in one line naming the command (not the usage block)."""

    def error(self, message: str):
        """Exit 2 with ``prog: message (see prog --help)`` on stderr, one line."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``mgk`` argument parser with its sub-commands."""
    parser = _Parser(prog="mgk", description="Transformer-MGK: attention with a mixture of Gaussian keys, and the "
                                             "paper's experiments.")
    parser.add_argument("--version", action="version", version=f"mgk {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    bench_cli.add_parser(sub)
    _eval_parser(sub)
    generate_cli.add_parser(sub)
    _data_parser(sub)
    _table_parser(sub)
    analyze_cli.add_parser(sub)
    reproduce_cli.add_parser(sub)
    recovery_cli.add_parsers(sub)
    return parser


def _user_errors() -> tuple:
    """The exceptions a user can cause: bad values and paths, damaged or foreign files, a busy run directory, a
    run whose loss or final evaluation is not finite, a model too big for the device."""
    import torch

    from .train.loop import NonFiniteLoss, NonFiniteResult
    from .train.rundir import RunDirError

    return ValueError, OSError, RunDirError, NonFiniteLoss, NonFiniteResult, torch.cuda.OutOfMemoryError


def _describe(e: BaseException) -> str:
    """The message of ``e`` for the one error line: an OSError as ``path: reason``."""
    if isinstance(e, OSError) and e.strerror and (e.filename2 or e.filename):
        return f"{e.filename2 or e.filename}: {e.strerror}"
    return str(e) or type(e).__name__


def _one_line(command: str, text: str) -> str:
    """``mgk <command>: text`` on one line (``text`` may already carry the prefix)."""
    text = " ".join(str(text).split())
    return text if text.startswith("mgk ") else f"mgk {command}: {text}"


def _command_words(argv: list[str]) -> str:
    """The command of ``argv`` as typed (``train``, ``bench attention``, ``data check``), for errors raised while
    the command line itself is parsed."""
    words = [w for w in argv[:2] if not w.startswith("-")]
    return " ".join(words[:2] if words[:1] in (["bench"], ["data"]) else words[:1])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mgk`` console script. Errors end in one line (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as e:  # a flag type that refuses its value by exiting (bench --kinds)
        if isinstance(e.code, str):
            raise SystemExit(_one_line(_command_words(argv), e.code)) from None
        raise
    name = " ".join(filter(None, (args.command, getattr(args, "bench_command", None),
                                  getattr(args, "data_command", None))))
    if extra:
        parser.exit(2, f"mgk {name}: unrecognized arguments: {' '.join(extra)} (see mgk {name} --help)\n")
    handlers = {"train": _run_train, "bench": bench_cli.run, "eval": _run_eval, "generate": generate_cli.run,
                "data": _run_data, "table": _run_table, "analyze": analyze_cli.run, "reproduce": reproduce_cli.run,
                "convert": recovery_cli.run_convert, "score": recovery_cli.run_score}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which saves and reports on its own)
        print(f"mgk {name}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:
        if isinstance(e.code, str):
            raise SystemExit(_one_line(name, e.code)) from None
        raise
    except Exception as e:
        if not isinstance(e, _user_errors()) or os.environ.get("MGK_TRACEBACK"):
            raise
        raise SystemExit(_one_line(name, _describe(e))) from None


if __name__ == "__main__":
    sys.exit(main())
