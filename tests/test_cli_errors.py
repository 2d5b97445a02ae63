"""Every command answers a user's mistake with one line ``mgk <command>: ...`` and a non-zero exit, never a
traceback: bad flags, missing or unreadable paths, a folder where a file is expected (and the reverse), wrong or
damaged run directories (truncated config.yaml, a torn metrics.jsonl line, damaged checkpoints, results, vocabulary),
runs that went NaN. A torn last line of the append-only metrics log is expected after a crash: resume drops it with
a one-line warning."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mgk.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FIXTURE_LM = Path(__file__).resolve().parent / "fixtures" / "run_v0_1_0"


@pytest.fixture(scope="module")
def listops_run(tmp_path_factory, th):
    """A finished 2-step ListOps run (generated data in it)."""
    out = tmp_path_factory.mktemp("cli") / "lo"
    main(["train", "--steps", "2", "--out", str(out), *th.sets(*th.TINY, "eval_every=2", "gen_train=64",
                                                             "gen_val=16", "gen_test=16")])
    return out


@dataclass
class Ctx:
    """What a case may use: a scratch folder and fresh copies of a ListOps run and of the 0.1.0 LM run."""

    tmp: Path
    source: Path

    def lo(self, unfinished: bool = False) -> Path:
        d = self.tmp / "lo"
        if not d.exists():
            shutil.copytree(self.source, d)
        if unfinished:
            _file(d, "results").unlink()
        return d

    def lm(self) -> Path:
        d = self.tmp / "lm"
        if not d.exists():
            shutil.copytree(FIXTURE_LM, d)
        return d

    def file(self) -> Path:
        (self.tmp / "a.txt").write_text("x\n")
        return self.tmp / "a.txt"


def _edit_config(run: Path, data=None, **fields) -> Path:
    """``run`` with config.yaml edited by hand: ``data`` the data folder (``data.path``, or ``data`` in a flat 0.1.0
    file), ``fields`` top-level keys."""
    cfg = yaml.safe_load(_file(run, "config").read_text())
    if data is not None and isinstance(cfg.get("data"), dict):
        cfg["data"]["path"] = data
    elif data is not None:  # a flat 0.1.0 config.yaml
        cfg["data"] = data
    _file(run, "config").write_text(yaml.safe_dump({**cfg, **fields}))
    return run


FILES = {"config": "config.yaml", "results": "results.json", "vocab": "vocab.txt", "metrics": "metrics.jsonl",
         "log": "train.log", "last": "checkpoints/last.pt", "best": "checkpoints/best.pt"}


def _file(run: Path, name: str) -> Path:
    """A file of a run directory, by its short name (the paths of the run-directory format)."""
    return Path(run) / FILES[name]


def _truncated(run: Path, name: str, keep: int = 200) -> Path:
    """``run`` with its file ``name`` (config, results, vocab, last, best) cut to ``keep`` bytes, as a crash leaves
    a file written in place. config.yaml is cut inside a value, where what is left still parses as YAML (the case
    a YAML parser cannot see)."""
    path = _file(run, name)
    data = path.read_bytes()
    if name == "config":
        keep = data.index(b": ", keep) + 3
    path.write_bytes(data[:keep])
    return run


def _with(run: Path, name: str, text: str) -> Path:
    _file(run, name).write_text(text)
    return run


def _without(run: Path, name: str) -> Path:
    _file(run, name).unlink()
    return run


def _metrics_damaged_in_the_middle(run: Path) -> Path:
    lines = _file(run, "metrics").read_text().splitlines()
    _file(run, "metrics").write_text("\n".join([lines[0], '{"step": 1, "tra', *lines[1:]]) + "\n")
    return run


def _failed(run: Path) -> Path:
    res = json.loads(_file(run, "results").read_text())
    _file(run, "results").write_text(json.dumps({**res, "failed": "non-finite val loss (nan)"}))
    return run


# (command as printed, case name, argv from a Ctx, a fragment the line must hold)
CASES = [
    # train
    ("train", "not-an-int", lambda c: ["train", "--steps", "x"], "argument --steps: invalid int value"),
    ("train", "unknown-flag", lambda c: ["train", "--bogus"], "unrecognized arguments: --bogus"),
    ("train", "bad-choice", lambda c: ["train", "--precision", "64"], "argument --precision: invalid choice"),
    ("train", "unknown-set-field", lambda c: ["train", "--set", "nosuch=1", "--out", str(c.tmp / "o")], "nosuch"),
    ("train", "set-without-value", lambda c: ["train", "--set", "lr", "--out", str(c.tmp / "o")], "lr"),
    ("train", "out-is-a-file", lambda c: ["train", "--out", str(c.file())], "is a file"),
    ("train", "out-not-empty", lambda c: ["train", "--out", str(c.lo())], "is not empty"),
    ("train", "data-is-a-file", lambda c: ["train", "--data", str(c.file()), "--out", str(c.tmp / "o")],
     "no ListOps train split"),
    ("train", "data-missing", lambda c: ["train", "--data", str(c.tmp / "none"), "--out", str(c.tmp / "o")],
     "none"),
    ("train", "resume-missing", lambda c: ["train", "--resume", str(c.tmp / "none")],
     "is not a run directory made by `mgk train` (no such folder)"),
    ("train", "resume-a-file", lambda c: ["train", "--resume", str(c.file())], "is not a run directory"),
    ("train", "resume-not-a-run", lambda c: ["train", "--resume", str(c.tmp)], "(no config.yaml)"),
    ("train", "resume-truncated-config", lambda c: ["train", "--resume", str(_truncated(c.lo(), "config"))],
     "config.yaml: cut short: its last line ("),
    ("train", "resume-config-not-yaml", lambda c: ["train", "--resume", str(_with(c.lo(), "config", "a: [b\n"))],
     "config.yaml: line 2: not valid YAML"),
    ("train", "resume-config-not-a-mapping", lambda c: ["train", "--resume", str(_with(c.lo(), "config", "- a\n"))],
     "config.yaml: holds a list, not a mapping"),
    ("train", "resume-config-foreign-field", lambda c: ["train", "--resume", str(_edit_config(c.lo(), bogus=1))],
     "config.yaml: "),
    ("train", "resume-damaged-last", lambda c: ["train", "--resume", str(_truncated(c.lo(unfinished=True), "last",
                                                                                   64))],
     "last.pt is not a readable mgk checkpoint"),
    ("train", "resume-missing-last", lambda c: ["train", "--resume", str(_without(c.lo(unfinished=True), "last"))],
     "no checkpoint at"),
    ("train", "resume-damaged-metrics", lambda c: ["train", "--resume",
                                                  str(_metrics_damaged_in_the_middle(c.lo(unfinished=True)))],
     "metrics.jsonl: line 2: not a metrics record"),
    ("train", "resume-a-failed-run", lambda c: ["train", "--resume", str(_failed(c.lo()))], "failed"),
    ("train", "resume-with-a-flag", lambda c: ["train", "--resume", str(c.lo()), "--heads", "2"],
     "drop --heads"),
    ("train", "non-finite-loss", lambda c: ["train", "--steps", "3", "--out", str(c.tmp / "o"), "--set", "lr=1e30",
                                           "--set", "warmup_steps=0", "--set", "gen_train=64", "--set",
                                           "batch_size=16", "--set", "d_model=16", "--set", "head_dim=4",
                                           "--set", "ffn_dim=16", "--set", "progress=false"],
     "non-finite training loss (nan) at step 2"),
    # eval
    ("eval", "missing", lambda c: ["eval", str(c.tmp / "none")], "is not a run directory"),
    ("eval", "a-file", lambda c: ["eval", str(c.file())], "(a file)"),
    ("eval", "truncated-config", lambda c: ["eval", str(_truncated(c.lm(), "config"))], "config.yaml: cut short"),
    ("eval", "damaged-best", lambda c: ["eval", str(_truncated(c.lm(), "best", 100))],
     "best.pt is not a readable mgk checkpoint"),
    ("eval", "damaged-vocab", lambda c: ["eval", str(_with(c.lm(), "vocab", "a b\n"))], "vocab.txt: line 1"),
    ("eval", "a-listops-run", lambda c: ["eval", str(c.lo())], "'listops' run"),
    ("eval", "data-moved", lambda c: ["eval", str(_edit_config(c.lm(), data=str(c.tmp / "moved")))],
     "does not exist (moved?): pass its new place with --data"),
    ("eval", "data-missing", lambda c: ["eval", str(c.lm()), "--data", str(c.tmp / "none")], "no such folder"),
    ("eval", "json-is-a-folder", lambda c: ["eval", str(c.lm()), "--json", str(c.tmp)], "is a folder"),
    ("eval", "bad-split", lambda c: ["eval", str(c.lm()), "--split", "train2"], "invalid choice"),
    ("eval", "context-zero", lambda c: ["eval", str(c.lm()), "--context", "0"], "--context must be >= 1"),
    ("eval", "stride-over-context", lambda c: ["eval", str(c.lm()), "--context", "4", "--stride", "8"], "stride"),
    ("eval", "no-run-dir", lambda c: ["eval"], "required: RUN_DIR"),
    ("eval", "a-failed-run", lambda c: ["eval", str(_failed(c.lm()))], "failed in training"),
    # data check
    ("data check", "unknown-task", lambda c: ["data", "check", "--task", "nope", "--data", str(c.tmp)],
     "unknown task"),
    ("data check", "bad-set", lambda c: ["data", "check", "--task", "listops", "--data", str(c.tmp), "--set", "x"],
     "--set expects key=value"),
    ("data check", "unknown-preset", lambda c: ["data", "check", "--task", "listops", "--data", str(c.tmp),
                                                "--preset", "nope"], "unknown preset 'nope'"),
    ("data check", "no-task", lambda c: ["data", "check", "--data", str(c.tmp)], "required: --task"),
    # table
    ("table", "missing", lambda c: ["table", str(c.tmp / "none")], "no such run directory"),
    ("table", "no-runs", lambda c: ["table", str(c.tmp)], "results.json not found"),
    ("table", "damaged-results", lambda c: ["table", str(_truncated(c.lo(), "results", 30))],
     "results.json: line 3: not valid JSON"),
    ("table", "results-a-list", lambda c: ["table", str(_with(c.lo(), "results", "[1]"))],
     "results.json: holds a JSON list"),
    ("table", "results-of-another-program", lambda c: ["table", str(_with(c.lo(), "results", "{}"))],
     "missing task"),
    # bench
    ("bench attention", "bad-kinds", lambda c: ["bench", "attention", "--kinds", "zzz"], "is not NAME:HEADS"),
    ("bench attention", "json-is-a-folder", lambda c: ["bench", "attention", "--json", str(c.tmp)],
     "is a directory"),
    ("bench attention", "bad-lengths", lambda c: ["bench", "attention", "--lengths", "x"], "--lengths"),
    ("bench attention", "zero-length", lambda c: ["bench", "attention", "--lengths", "0"],
     "argument --lengths: every value must be positive (>= 1)"),
    ("bench decode", "zero-context", lambda c: ["bench", "decode", "--contexts", "8,0"],
     "argument --contexts: every value must be positive (>= 1)"),
    ("bench decode", "bad-contexts", lambda c: ["bench", "decode", "--contexts", "many"],
     "argument --contexts: 'many'"),
    ("bench decode", "zero-batch", lambda c: ["bench", "decode", "--batches", "0"],
     "argument --batches: every value must be positive (>= 1)"),
    ("bench decode", "run-with-targets", lambda c: ["bench", "decode", "--run", str(c.lm()), "--targets", "layer"],
     "--run measures the run's own model (its kind, heads and sizes): drop --targets"),
    ("bench decode", "run-with-kinds-and-set",
     lambda c: ["bench", "decode", "--run", str(c.lm()), "--kinds", "mgk:2", "--set", "vocab_size=10"],
     "drop --kinds and --set"),
    ("bench model", "unknown-preset", lambda c: ["bench", "model", "--preset", "nope"], "unknown preset 'nope'"),
    ("bench model", "bad-set", lambda c: ["bench", "model", "--set", "nosuch=1"], "nosuch"),
    ("bench", "no-kind", lambda c: ["bench"], "required"),
    # analyze
    ("analyze", "missing", lambda c: ["analyze", str(c.tmp / "none")], "is not a run directory"),
    ("analyze", "truncated-config", lambda c: ["analyze", str(_truncated(c.lo(), "config"))],
     "config.yaml: cut short"),
    ("analyze", "damaged-best", lambda c: ["analyze", str(_truncated(c.lo(), "best", 100))],
     "best.pt is not a readable mgk checkpoint"),
    ("analyze", "damaged-results", lambda c: ["analyze", str(_truncated(c.lo(), "results", 30))],
     "results.json: line 3: not valid JSON"),
    ("analyze", "data-missing", lambda c: ["analyze", str(c.lo()), "--data", str(c.tmp / "none")], "no such folder"),
    ("analyze", "data-moved", lambda c: ["analyze", str(_edit_config(c.lo(), data=str(c.tmp / "moved")))],
     "does not exist (moved?): pass its new place with --data"),
    ("analyze", "out-is-a-file", lambda c: ["analyze", str(c.lo()), "--out", str(c.file())], "is a file"),
    ("analyze", "failed-run", lambda c: ["analyze", str(_failed(c.lo()))], "nothing to analyse"),
    ("analyze", "bad-samples", lambda c: ["analyze", str(c.lo()), "--samples", "0"], "samples must be >= 1"),
    # reproduce
    ("reproduce", "unknown-experiment", lambda c: ["reproduce", "nope"], "unknown experiment 'nope'"),
    ("reproduce", "bad-seeds", lambda c: ["reproduce", "lra-softmax-family", "--seeds", "a"], "--seeds"),
    ("reproduce", "bad-only", lambda c: ["reproduce", "lra-softmax-family", "--only", "nope=1"], "nope"),
    ("reproduce", "bad-data", lambda c: ["reproduce", "lra-softmax-family", "--data", "listops"], "listops"),
    ("reproduce", "no-jobs", lambda c: ["reproduce", "lra-softmax-family", "--jobs", "0"],
     "argument --jobs: must be >= 1"),
]


@pytest.mark.parametrize("command,case,argv,fragment", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_a_user_mistake_is_one_line_naming_the_command(listops_run, tmp_path, capsys, command, case, argv,
                                                        fragment):
    args = argv(Ctx(tmp_path, listops_run))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    # A string exit code is printed by Python itself as the last line of stderr; an int one has printed already.
    line = e.value.code if isinstance(e.value.code, str) else err.strip().splitlines()[-1]
    assert e.value.code not in (0, None), (case, e.value.code)
    assert "\n" not in line and line.startswith(f"mgk {command}: "), line
    assert fragment in line, (fragment, line)
    assert "Traceback" not in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
@pytest.mark.parametrize("command", ["table", "eval", "analyze"])
def test_an_unreadable_file_is_one_line(listops_run, tmp_path, command):
    c = Ctx(tmp_path, listops_run)
    run = c.lm() if command == "eval" else c.lo()
    target = _file(run, "results") if command == "table" else _file(run, "config")
    target.chmod(0)
    with pytest.raises(SystemExit, match=rf"^mgk {command}: {target}: Permission denied$"):
        main([command, str(run)])


def test_a_torn_last_metrics_line_is_dropped_with_a_warning_and_the_run_resumes(run_v0_1_0, th, capsys):
    """A crash in the middle of appending metrics.jsonl leaves half a line: resume drops it, says so once, and the
    log reads as one uninterrupted run."""
    run_dir, expected = run_v0_1_0
    metrics = _file(run_dir, "metrics")
    metrics.write_text(metrics.read_text() + '{"step": 5, "train/lo')
    main(["train", "--resume", str(run_dir), "--steps", "6", "--device", "cpu"])
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert warnings == [f"warning: {metrics}: dropped its last line, cut short by the crash that stopped the run "
                        "('{\"step\": 5, \"train/lo')"]
    losses = dict(th.series(run_dir, "train/loss"))
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[6] == pytest.approx(expected["resume_steps_6_train_loss"]["6"], rel=1e-6)
    assert warnings[0] in _file(run_dir, "log").read_text()


def test_a_torn_last_line_does_not_stop_the_table_of_unfinished_runs(listops_run, tmp_path, capsys):
    run = Ctx(tmp_path, listops_run).lo(unfinished=True)
    metrics = _file(run, "metrics")
    metrics.write_text(metrics.read_text() + '{"step": 3, "tr')
    assert main(["table", str(run)]) == 0
    assert f"- {run}: listops mgk x 4, step 2 of 2, failed or stopped" in capsys.readouterr().out


@pytest.mark.parametrize("args,fragment", [
    (["train", "--resume", "{bad}"], "config.yaml: cut short"),
    (["eval", "{bad}"], "config.yaml: cut short"),
    (["table", "{missing}"], "no such run directory"),
])
def test_errors_are_one_line_and_no_traceback_in_a_real_process(tmp_path, th, args, fragment):
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURE_LM, bad)
    _truncated(bad, "config")
    argv = [a.format(bad=bad, missing=tmp_path / "none") for a in args]
    p = subprocess.run(th.mgk_cmd(*argv), env=th.env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mgk {args[0]}: ") and fragment in lines[0], p.stderr


def test_mgk_traceback_shows_the_traceback(tmp_path, th):
    p = subprocess.run(th.mgk_cmd("table", str(tmp_path / "none")), env={**th.env(), "MGK_TRACEBACK": "1"},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" in p.stderr and "FileNotFoundError" in p.stderr
