"""The grid: experiment x scale x seeds, filtered by ``--only``, expanded into runs with resolved commands.

Each run has the exact ``mgk train`` argument list, and for language modelling the ``mgk eval`` one. Its key is a
hash of the config it trains with, as ``mgk train`` resolves those arguments
(:func:`mgk.train.arguments.train_config`: the preset's values and the defaults included, so an edited preset or
default gives a new key), and of the ``mgk eval`` arguments; its directory is
``<out>/runs/<task>/<row>/seed<k>-<key>``: a changed setting gets a new directory, so a finished run is never
overwritten nor counted for another config.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from .. import config as config_mod
from ..attention import get_kind
from ..choices import did_you_mean
from ..train.rundir import RunFiles
from .experiments import TASK_LABELS, Experiment, Row
from .scales import TaskSetting, task_setting

__all__ = ["Run", "ONLY_KEYS", "parse_only", "parse_data", "expand", "default_data_root"]

ONLY_KEYS = ("row", "task", "seed", "attention", "heads", "pi")


@dataclass(frozen=True)
class Run:
    """One training run of the grid (plus its evaluation for LM)."""

    row: Row
    task: str
    seed: int
    setting: TaskSetting
    data: str | None  # absolute path, or None for generated data
    train_args: tuple  # after ``python -m mgk``, without --out
    eval_args: tuple | None  # after ``python -m mgk``, without RUN_DIR / --json
    key: str
    run_dir: Path
    test_eval: bool = False  # LM data with a test split: also `mgk eval --split test` (same window; not in the key)
    config: dict | None = field(default=None, compare=False)  # config.to_dict of what train_args resolve to

    @property
    def task_label(self) -> str:
        """The task's name in the report (the scale may name a reduced variant)."""
        return self.setting.label or TASK_LABELS.get(self.task, self.task)

    @property
    def eval_json(self) -> Path:
        """Where ``mgk eval --json`` writes the final perplexity."""
        return RunFiles(self.run_dir).eval

    def train_command(self, python: str, resume: bool = False, overwrite: bool = False) -> list[str]:
        """The ``mgk train`` command line; ``resume``: continue the run directory from its last checkpoint;
        ``overwrite``: start over in a directory a failed start left behind."""
        if resume:
            return [python, "-m", "mgk", "train", "--resume", str(self.run_dir), "--set", "progress=false"]
        return [python, "-m", "mgk", *self.train_args, "--out", str(self.run_dir), *(["--overwrite"] * overwrite)]

    @property
    def eval_test_json(self) -> Path:
        """Where ``mgk eval --split test --json`` writes the test perplexity."""
        return RunFiles(self.run_dir).eval_test

    def eval_command(self, python: str) -> list[str] | None:
        """The ``mgk eval`` command line (LM runs), or None."""
        if self.eval_args is None:
            return None
        return [python, "-m", "mgk", "eval", str(self.run_dir), *self.eval_args, "--json", str(self.eval_json)]

    def test_eval_command(self, python: str) -> list[str] | None:
        """The ``mgk eval`` command line on the test split, with the validation's window (None: no test split)."""
        if self.eval_args is None or not self.test_eval:
            return None
        args = list(self.eval_args)
        args[args.index("--split") + 1] = "test"
        return [python, "-m", "mgk", "eval", str(self.run_dir), *args, "--json", str(self.eval_test_json)]

    def describe(self, python: str = "python") -> str:
        """The commands as one shell line each."""
        lines = [shlex.join(self.train_command(python))]
        for ev in (self.eval_command(python), self.test_eval_command(python)):
            if ev is not None:
                lines.append(shlex.join(ev))
        return "\n".join(lines)


def default_data_root() -> Path:
    """``$MGK_DATA_ROOT``, else ``../shared/data`` (relative to the working directory)."""
    return Path(os.environ.get("MGK_DATA_ROOT", "../shared/data"))


def _split_pairs(pairs, flag: str) -> list[tuple[str, str]]:
    out = []
    for pair in pairs:
        if "=" not in pair or not pair.split("=", 1)[0].strip() or not pair.split("=", 1)[1].strip():
            raise ValueError(f"{flag} expects KEY=VALUE, got {pair!r}")
        k, v = pair.split("=", 1)
        out.append((k.strip(), v.strip()))
    return out


def parse_only(pairs) -> dict[str, set[str]]:
    """``--only KEY=V1,V2`` pairs -> {key: values}; repeated keys add values. ValueError for an unknown key."""
    only: dict[str, set[str]] = {}
    for k, v in _split_pairs(pairs, "--only"):
        if k not in ONLY_KEYS:
            raise ValueError(f"--only {k}={v}: unknown key {k!r}{did_you_mean(k, ONLY_KEYS)}; use one of "
                             f"{', '.join(ONLY_KEYS)}")
        only.setdefault(k, set()).update(x.strip() for x in v.split(",") if x.strip())
    return only


def parse_data(pairs, tasks) -> dict[str, str]:
    """``--data TASK=PATH`` pairs -> {task: path}. ValueError for a task the experiment does not have."""
    data = {}
    for k, v in _split_pairs(pairs, "--data"):
        if k not in tasks:
            raise ValueError(f"--data {k}={v}: this experiment has no task {k!r}{did_you_mean(k, tasks)} "
                             f"(tasks: {', '.join(tasks)})")
        data[k] = v
    return data


def _check_only(only: dict, exp: Experiment, tasks, seeds) -> None:
    known = {"row": [r.key for r in exp.rows], "task": list(tasks), "seed": [str(s) for s in seeds],
             "attention": sorted({r.attention for r in exp.rows}), "heads": sorted({str(r.heads) for r in exp.rows}),
             "pi": sorted({r.pi for r in exp.rows})}
    for k, values in only.items():
        bad = sorted(values - set(known[k]))
        if bad:
            raise ValueError(f"--only {k}={','.join(bad)}: not in {exp.name}{did_you_mean(bad[0], known[k])} "
                             f"(choose from {', '.join(known[k])})")


def _resolve(row: Row, task: str, seed: int, setting: TaskSetting, data: str | None) -> tuple[tuple, tuple | None]:
    args = ["train", "--task", setting.task or task, "--preset", setting.preset, "--attention", row.attention,
            "--heads", str(row.heads)]
    if "pi" in get_kind(row.attention).options.names():  # mgk train refuses an option the kind does not take
        args += ["--pi", row.pi]
    args += ["--seed", str(seed)]
    if data is not None:
        args += ["--data", data]
    for pair in (*setting.overrides, *row.overrides, "progress=false"):
        args += ["--set", pair]
    ev = None
    if setting.eval is not None:
        context, stride = setting.eval
        ev = ("--split", "valid", "--context", str(context), "--stride", str(stride), "--no-progress")
    return tuple(args), ev


def _has_test_split(setting: TaskSetting, path: str | None) -> bool:
    """Whether the LM data of a run has a test split: ``wiki.test.tokens`` / ``test.txt`` in its folder, or, for the
    generated corpus, a test line count above 0."""
    if path is not None:
        from ..data.wikitext import find_split_file

        return Path(path).is_dir() and find_split_file(Path(path), "test") is not None
    from .. import config as config_mod
    from ..tasks import all_presets

    return config_mod.apply_overrides(all_presets()[setting.preset], setting.overrides).data.gen_test > 0


def resolved_config(train_args) -> config_mod.RunConfig:
    """The config ``mgk train`` resolves ``train_args`` to (:func:`mgk.train.arguments.train_config`, the one
    resolver)."""
    from ..train.arguments import train_config

    return train_config(list(train_args))


def run_key(config: dict, eval_args) -> str:
    """12 hex digits of sha256 over the resolved config (``config.to_dict``) and the evaluation arguments."""
    blob = json.dumps({"config": config, "eval": list(eval_args or ())}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def expand(exp: Experiment, scale: str, seeds: list, out: Path, *, only=None, data=None, data_root=None) -> list[Run]:
    """Every run of ``exp`` at ``scale`` for ``seeds`` (by task, then seed, then row), filtered by ``only``.

    The optional tasks (Image, Pathfinder) join only when ``--only task=`` names them. ``data`` overrides a task's
    data path; otherwise it is the scale's path under ``data_root``.
    """
    only = only or {}
    data = data or {}
    root = Path(data_root) if data_root is not None else default_data_root()
    all_tasks = (*exp.tasks, *exp.optional_tasks)
    _check_only(only, exp, all_tasks, seeds)
    tasks = [t for t in all_tasks if t in only["task"]] if "task" in only else list(exp.tasks)
    runs = []
    for row in exp.rows:
        values = {"row": row.key, "attention": row.attention, "heads": str(row.heads), "pi": row.pi}
        if any(k in only and v not in only[k] for k, v in values.items()):
            continue
        for task in (t for t in tasks if row.runs_on(t)):
            setting = task_setting(scale, task)
            path = data.get(task) or (str(root / setting.data) if setting.data is not None else None)
            path = str(Path(path).resolve()) if path is not None else None
            for seed in seeds:
                if "seed" in only and str(seed) not in only["seed"]:
                    continue
                train_args, eval_args = _resolve(row, task, seed, setting, path)
                config = config_mod.to_dict(resolved_config(train_args))
                key = run_key(config, eval_args)
                run_dir = Path(out).absolute() / "runs" / task / row.key / f"seed{seed}-{key}"
                test_eval = eval_args is not None and _has_test_split(setting, path)
                runs.append(Run(row, task, seed, setting, path, train_args, eval_args, key, run_dir, test_eval,
                                config))
    # Task by task, seed-major: every row gets seed 0 before any gets seed 1, so a grid stopped part-way (or its
    # report written early) compares rows over the same seeds.
    order = {t: i for i, t in enumerate(tasks)}
    return sorted(runs, key=lambda r: (order[r.task], seeds.index(r.seed)))
