"""`mgk reproduce` keys a run by the config it trains with, not by its arguments: after a preset or a
default changes, the arguments are the same but the config is not, so a "finished" run of the old config must not
count as the new one's, and its directory is named in one line."""
import json

import pytest

from mgk import config as config_mod
from mgk.cli import main
from mgk.reproduce import expand, get_experiment
from mgk.reproduce.executor import record_path, run_state
from mgk.reproduce.grid import parse_only
from mgk.tasks import TASKS
from mgk.train import rundir

ONLY = ["row=mgk-4", "task=listops"]


def _run(tmp_path):
    [run] = expand(get_experiment("lra-softmax-family"), "smoke", [0], tmp_path, only=parse_only(ONLY))
    return run


def _finish(run):
    """A run directory as a finished `mgk train` of ``run`` leaves it (config.yaml, results.json, the record)."""
    run.run_dir.mkdir(parents=True)
    rundir.write_config(run.run_dir, run.config)
    (run.run_dir / "results.json").write_text(json.dumps({"steps": 1}))
    record_path(run.run_dir).write_text(json.dumps({"key": run.key, "status": "done"}))


def _edit_preset(monkeypatch, run, **values):
    """Change the values of the preset ``run`` starts from, as an edit of the source would."""
    presets = TASKS[run.task].PRESETS
    monkeypatch.setitem(presets, run.setting.preset, config_mod.replace(presets[run.setting.preset], **values))


@pytest.mark.parametrize("change", [{"lr": 5e-4}, {"d_model": 48}, {"weight_decay": 0.01}, {"num_keys": 3}])
def test_an_edited_preset_gives_a_new_key_and_the_old_run_is_not_finished(tmp_path, monkeypatch, change):
    old = _run(tmp_path)
    _edit_preset(monkeypatch, old, **change)
    new = _run(tmp_path)
    assert new.train_args == old.train_args  # the same command line ...
    assert new.key != old.key and new.run_dir != old.run_dir  # ... but another config
    from mgk.reproduce.executor import stale_run_dirs

    _finish(old)
    assert run_state(old) == "finished" and stale_run_dirs(old) == []
    assert run_state(new) == "new"
    [line] = stale_run_dirs(new)
    (name, value), = change.items()
    assert str(old.run_dir) in line and "not counted as finished" in line and new.run_dir.name in line
    assert f"{name}: {config_mod.flat(config_mod.from_dict(old.config))[name]!r} != {value!r}" in line
    assert "\n" not in line


def test_the_cli_names_an_old_run_dir_in_one_line_and_trains_anew(tmp_path, monkeypatch, capsys):
    old = _run(tmp_path)
    _finish(old)
    _edit_preset(monkeypatch, old, lr=5e-4)
    args = ["reproduce", "lra-softmax-family", "--scale", "smoke", "--seeds", "0", "--out", str(tmp_path),
            *[x for o in ONLY for x in ("--only", o)], "--dry-run"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if str(old.run_dir) in line]
    assert len(lines) == 1 and lines[0].startswith("mgk reproduce: ") and "lr: 0.001 != 0.0005" in lines[0]
    assert "[new]" in out and f"[finished] key {old.key}" not in out
