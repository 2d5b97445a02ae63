"""The arguments of ``mgk train`` and the run config they resolve to: the one resolver, used by the command line
(:mod:`mgk.cli`) and by ``mgk reproduce``, which keys each run by the config it trains with
(:func:`mgk.reproduce.grid.resolved_config`)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from .. import config as config_mod
from ..argtypes import seed, threads
from ..attention import attention_kinds
from ..choices import argparse_type, require
from ..tasks import TASKS, all_presets

__all__ = ["PRESET_TYPE", "TASK_TYPE", "add_train_parser", "resolve_train_config", "train_config"]

TASK_TYPE = argparse_type("task", TASKS)
PRESET_TYPE = argparse_type("preset", lambda: sorted(all_presets()))


def add_train_parser(sub) -> None:
    """Add the ``train`` sub-command to an ``argparse`` sub-parsers object."""
    p = sub.add_parser("train", help="train a model on a task (default: generated ListOps, small CPU preset)",
                       description="Train on a task. Without --data, ListOps is generated (the embedded default).")
    p.add_argument("--task", default=None, type=TASK_TYPE, help=f"task: {', '.join(TASKS)} (default: the preset's "
                                                             "task, listops)")
    p.add_argument("--preset", default=None, type=PRESET_TYPE,
                   help=f"starting configuration: {', '.join(sorted(all_presets()))} (default: <task>-small)")
    p.add_argument("--data", default=None, help="folder with the release files (default: generate)")
    p.add_argument("--attention", default=None, type=argparse_type("attention kind", attention_kinds),
                   help=f"attention kind: {', '.join(attention_kinds())}")
    p.add_argument("--heads", type=int, default=None, help="number of attention heads")
    p.add_argument("--pi", default=None, type=argparse_type("pi mode", config_mod.field_of("attention.options.pi")
                                                            .metadata["choices"]),
                   help="mixture-weight mode of mgk / smgk (mlk / smlk: learned only); an error for other kinds")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps")
    p.add_argument("--seed", type=seed, default=None, help="training seed, 0 to 2**64 - 1 (default: the preset's)")
    p.add_argument("--precision", default=None, choices=["32", "bf16", "fp16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=threads, default=None,
                   help="CPU threads of this process (torch.set_num_threads; default: 1 for models under 1M "
                        "parameters, which lose little on one thread and much when threads spin against another "
                        "busy process, else torch's, one per core or $OMP_NUM_THREADS); with several runs on one "
                        "machine give each at most cores / runs")
    p.add_argument("--out", default=None, help="run directory (default: runs/<task>-<attention><heads>-<time>); "
                                                "must be empty or new")
    p.add_argument("--overwrite", action="store_true",
                   help="clear --out first when it holds an earlier run (never a directory in use)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue RUN_DIR from its last checkpoint")
    p.add_argument("--init-from", default=None, metavar="RUN_DIR",
                   help="start a new run from RUN_DIR's best weights and config (its task, data and sizes), its "
                        "attention converted to --attention / --heads: same heads (the kind's rule: GQA mean-pools "
                        "key/value heads), MGK with half the heads (pairs of heads merged into its two key "
                        "components) or fewer heads (the most important kept); see docs/retrofit.md")
    p.add_argument("--init-pairs", default=None, choices=["similar", "adjacent"],
                   help="with --init-from, the heads merged into one MGK head: 'similar' (default: the most alike "
                        "attention maps on validation examples) or 'adjacent' (0-1, 2-3, ...)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field (repeatable), e.g. --set batch_size=16 --set lr=3e-4")


def resolve_train_config(args) -> tuple[config_mod.RunConfig, Path, bool]:
    """(config, run directory, resume?) of parsed ``mgk train`` arguments, as ``mgk train`` trains them; SystemExit
    in one line for flags a resumed run cannot take, ValueError for a bad preset or value."""
    if args.resume:
        from .rundir import load_config

        run_dir = Path(args.resume)
        flags = [n for n in ("task", "preset", "data", "attention", "heads", "pi", "seed", "out", "init_from",
                             "init_pairs") if getattr(args, n) is not None]
        flags += ["overwrite"] if args.overwrite else []
        if flags:
            raise SystemExit(f"mgk train: --resume takes its config from {run_dir}/config.yaml; "
                             f"drop --{', --'.join(f.replace('_', '-') for f in flags)} (use --set for steps or "
                             "bookkeeping fields)")
        cfg = load_config(run_dir)
        changes = {k: v for k, v in (("steps", args.steps), ("precision", args.precision)) if v is not None}
        return config_mod.apply_overrides(cfg, args.overrides, **changes), run_dir, True
    if args.init_pairs is not None and args.init_from is None:
        raise SystemExit("mgk train: --init-pairs applies to --init-from RUN_DIR only")
    if args.init_from is not None:
        base = _init_base(args)
    else:
        task = args.task or "listops"
        preset = args.preset or f"{task}-small"
        presets = all_presets()
        require("preset", preset, sorted(presets))
        base = presets[preset]
    flags = {"task": args.task, "data": args.data, "attention": args.attention, "num_heads": args.heads,
             "pi": args.pi, "steps": args.steps, "seed": args.seed, "precision": args.precision}
    # Flags and --set at once: an option the chosen kind does not take is an error when set here, while the
    # preset's forms for other kinds (and its learned-weight shape under --pi soft_e) simply do not apply.
    cfg = config_mod.apply_overrides(base, args.overrides,
                                     **{k: v for k, v in flags.items() if v is not None})
    name = f"{cfg.task}-{cfg.attention.kind}{cfg.attention.num_heads}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(args.out) if args.out else Path("runs") / name
    return cfg, out, False


def _init_base(args) -> config_mod.RunConfig:
    """The config of ``--init-from RUN_DIR`` a new run starts from; SystemExit in one line for flags it cannot
    take or a folder that is not a run."""
    from .rundir import load_config

    flags = [n for n in ("resume", "task", "preset") if getattr(args, n) is not None]
    if flags:
        raise SystemExit(f"mgk train: --init-from takes the task, data and sizes from {args.init_from}/config.yaml; "
                         f"drop --{', --'.join(flags)}")
    try:
        return load_config(Path(args.init_from))
    except FileNotFoundError:
        raise SystemExit(f"mgk train: --init-from {args.init_from}: not a run directory (no config.yaml)") from None


def train_config(argv: list[str]) -> config_mod.RunConfig:
    """The validated config that ``mgk train ARGV`` (a new run: ``argv`` starts with ``train``, no ``--resume``)
    trains with, before its data is read: the preset, the flags and every ``--set`` applied as ``mgk train`` applies
    them. ValueError for a value or combination it refuses."""
    parser = argparse.ArgumentParser(prog="mgk")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    cfg, _, resume = resolve_train_config(parser.parse_args(list(argv)))
    if resume:
        raise ValueError("train_config resolves a new run; a --resume run takes its config from its config.yaml")
    return config_mod.validate(cfg)
