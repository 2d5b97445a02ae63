"""Checkpoints carry a format version, load with weights_only=True through one owner, and older or newer formats are
handled by name: 0.1.0's checkpoints load in today's field names, a later format is refused."""
import shutil

import pytest
import torch

from mgk.cli import main
from mgk.train import checkpoint
from mgk.train.rundir import RunFiles

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def run(tmp_path_factory, th):
    out = tmp_path_factory.mktemp("fmt") / "run"
    main(["train", "--steps", "4", "--out", str(out), *th.sets(*th.TINY, "eval_every=2", "checkpoint_every=2")])
    return out


def test_every_checkpoint_of_a_run_carries_the_format_and_loads_with_weights_only(run):
    for kind in ("last", "best"):
        raw = torch.load(RunFiles(run).checkpoint(kind), weights_only=True)  # no pickled code in it
        assert raw["format"] == checkpoint.FORMAT == 2 and raw["kind"] == kind and raw["step"] in (2, 4)
        assert isinstance(raw["mgk"], str) and raw["config"]["task"] == "listops"
    last = checkpoint.load(RunFiles(run).checkpoint("last"))
    assert last["step"] == last["loop_state"]["step"] == 4 and len(last["rng"]) == 1


def test_a_0_1_0_checkpoint_loads_in_todays_field_names(run_v0_1_0):
    run_dir, _ = run_v0_1_0
    files = RunFiles(run_dir)
    raw = torch.load(files.checkpoint("last"), weights_only=True)
    assert "format" not in raw and "state" in raw and "step" not in raw  # the 0.1.0 layout
    last = checkpoint.load(files.checkpoint("last"))
    assert last["format"] == 1 and last["kind"] == "last" and "state" not in last
    assert last["loop_state"] == raw["state"] and checkpoint.step_of(last) == 4
    best = checkpoint.load(files.checkpoint("best"))
    assert best["format"] == 1 and best["kind"] == "best" and checkpoint.step_of(best) == 4


def test_a_later_format_or_a_foreign_file_is_refused_naming_it(run, tmp_path):
    newer = tmp_path / "newer.pt"
    ckpt = checkpoint.load(RunFiles(run).checkpoint("best"))
    torch.save({**ckpt, "format": checkpoint.FORMAT + 1}, newer)
    with pytest.raises(ValueError, match=rf"{newer} has checkpoint format 3, newer than .*upgrade mgk"):
        checkpoint.load(newer)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    with pytest.raises(ValueError, match=rf"{foreign} is not an mgk checkpoint"):
        checkpoint.load(foreign)
    pickled = tmp_path / "pickled.pt"
    torch.save({"model": {}, "cfg": object()}, pickled)  # arbitrary objects: refused by weights_only loading
    with pytest.raises(ValueError, match=rf"{pickled} is not a readable mgk checkpoint"):
        checkpoint.load(pickled)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "absent.pt")


def test_resume_and_eval_read_a_newer_run_as_an_error_of_one_line(run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    last = RunFiles(copy).checkpoint("last")
    torch.save({**checkpoint.load(last), "format": 99}, last)
    with pytest.raises(SystemExit, match=r"^mgk train: .*last.pt has checkpoint format 99") as e:
        main(["train", "--resume", str(copy), "--steps", "6"])
    assert "\n" not in str(e.value.code)
