"""Run directories as people use them: a new run never clobbers one (unless --overwrite), a live run's directory is
locked against other runs, resumes and evals, a finished run is left alone on resume, a relative --data keeps
working from another directory, a missing device is one line, and evaluation shows its progress."""
import json
import subprocess
import sys
import time

import pytest
import torch
import yaml

from mgk.cli import main
from mgk.data.listops import generate_listops, write_listops_tsv
from mgk.train import evaluate as evaluate_mod

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
LOCK_NAME = ".mgk-lock"


def RunDirLock(*args, **kwargs):  # imported late, so that each test fails alone on a checkout without it
    from mgk.train.rundir import RunDirLock as cls

    return cls(*args, **kwargs)


def holder_pid(run_dir):
    from mgk.train.rundir import holder_pid as fn

    return fn(run_dir)


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def test_new_run_refuses_a_non_empty_directory_and_overwrite_clears_it(tmp_path, th):
    out = tmp_path / "run"
    main(["train", "--steps", "2", "--out", str(out), *th.sets(*th.TINY)])
    first = (out / "results.json").read_text()
    with pytest.raises(SystemExit) as e:
        main(["train", "--steps", "3", "--out", str(out), *th.sets(*th.TINY)])
    msg = _one_line(e)
    assert str(out) in msg and "not empty" in msg and f"--resume {out}" in msg and "--overwrite" in msg
    assert (out / "results.json").read_text() == first  # untouched

    (out / "vocab.txt").write_text("stale\t1\n")  # left by an earlier language-model run in the same folder
    main(["train", "--steps", "3", "--out", str(out), "--overwrite", *th.sets(*th.TINY)])
    assert not (out / "vocab.txt").exists()
    assert json.loads((out / "results.json").read_text())["steps"] == 3
    assert [r["step"] for r in th.metrics(out) if "train/loss" in r] == [1, 2, 3]
    assert (out / "train.log").read_text().count("model:") == 1  # one run's log, not two mixed

    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="did not write.*notes.txt"):
        main(["train", "--steps", "2", "--out", str(out), "--overwrite", *th.sets(*th.TINY)])
    assert (out / "notes.txt").read_text() == "mine" and (out / "results.json").is_file()
    with pytest.raises(SystemExit, match="drop --overwrite"):
        main(["train", "--resume", str(out), "--overwrite"])


def test_an_empty_or_new_directory_is_fine(tmp_path, th):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "nested"):
        main(["train", "--steps", "1", "--out", str(out), *th.sets(*th.TINY)])
        assert (out / "results.json").is_file()


def test_a_locked_directory_is_refused_by_train_resume_and_eval(run_v0_1_0, capsys):
    run_dir, _ = run_v0_1_0
    before = sorted(p.name for p in run_dir.rglob("*"))
    with RunDirLock(run_dir):  # as a live training process holds it
        for argv in (["train", "--out", str(run_dir), "--overwrite"],
                     ["train", "--resume", str(run_dir), "--steps", "6"],
                     ["eval", str(run_dir), "--no-progress"]):
            with pytest.raises(SystemExit) as e:
                main(argv)
            msg = _one_line(e)
            assert f"{run_dir} is in use by another mgk process" in msg, argv
    assert sorted(p.name for p in run_dir.rglob("*") if p.name != LOCK_NAME) == before  # nothing written
    capsys.readouterr()
    main(["eval", str(run_dir), "--no-progress"])  # a finished, unlocked run is readable
    assert json.loads(capsys.readouterr().out)["tokens"] > 0
    with RunDirLock(run_dir, shared=True):  # an evaluation in progress: others may read, no run may write
        main(["eval", str(run_dir), "--no-progress"])
        with pytest.raises(SystemExit, match="in use"):
            main(["train", "--resume", str(run_dir), "--steps", "6"])


def test_lock_is_released_when_its_process_dies(tmp_path, th):
    """flock dies with its process: a SIGKILLed holder leaves no stale lock and no live pid."""
    from mgk.train.rundir import RunDirError

    code = (f"from mgk.train.rundir import RunDirLock; lock = RunDirLock({str(tmp_path)!r}).acquire(); "
            "print('held', flush=True); import time; time.sleep(120)")
    child = subprocess.Popen([sys.executable, "-c", code], env=th.env(), stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert holder_pid(tmp_path) == child.pid
        with pytest.raises(RunDirError, match=f"pid {child.pid}"):
            RunDirLock(tmp_path).acquire()
        with pytest.raises(RunDirError):
            RunDirLock(tmp_path, shared=True).acquire()
    finally:
        child.kill()
        child.wait()
    assert holder_pid(tmp_path) is None
    with RunDirLock(tmp_path):
        assert holder_pid(tmp_path) is not None
    assert holder_pid(tmp_path) is None


def test_two_concurrent_processes_second_refuses_first_finishes(tmp_path, th):
    """Two real `mgk train --out X` at once: the second exits non-zero with one line while the first trains on."""
    out = tmp_path / "dup"
    args = ["train", "--steps", "100", "--out", str(out), *th.sets(*th.TINY)]
    first = subprocess.Popen(th.mgk_cmd(*args), env=th.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.time() + 120
        while holder_pid(out) != first.pid:  # the first holds the lock (read from its file, never probed)
            assert first.poll() is None, first.communicate()
            assert time.time() < deadline, "the first run never took its lock"
            time.sleep(0.05)
        second = subprocess.run(th.mgk_cmd(*args[:-len(th.sets(*th.TINY))], "--attention", "softmax", "--heads", "8",
                                           *th.sets(*th.TINY)), env=th.env(), capture_output=True, text=True,
                                timeout=120)
        assert second.returncode != 0
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{out} is in use by another mgk process (pid {first.pid})" in lines[0], \
            second.stderr
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 100 and results["attention"] == "mgk" and results["num_heads"] == 4
    log = (out / "train.log").read_text()
    assert log.count("model:") == 1 and "softmax" not in log
    assert holder_pid(out) is None  # released at the end


def test_resuming_a_finished_run_changes_nothing(tmp_path, th, capsys):
    out = tmp_path / "run"
    main(["train", "--steps", "3", "--out", str(out), *th.sets(*th.TINY)])
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != LOCK_NAME}
    capsys.readouterr()
    assert main(["train", "--resume", str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing to do" in err[0] and f"--resume {out} --steps" in err[0]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != LOCK_NAME} == files
    assert json.loads((out / "results.json").read_text())["seconds_per_step"] > 0


def test_relative_data_path_works_from_another_directory(tmp_path, th, monkeypatch):
    data = tmp_path / "work" / "lo"
    for split, n in (("train", 64), ("val", 16), ("test", 16)):
        write_listops_tsv(data / f"basic_{split}.tsv", generate_listops(n, seed=1, max_length=30))
    monkeypatch.chdir(tmp_path / "work")
    main(["train", "--data", "lo", "--steps", "2", "--out", "run", *th.sets(*th.TINY, "checkpoint_every=1")])
    cfg = yaml.safe_load((tmp_path / "work" / "run" / "config.yaml").read_text())["data"]
    assert cfg["path"] == str(data) and cfg["path_as_given"] == "lo"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    main(["train", "--resume", "../work/run", "--steps", "4"])
    assert json.loads((tmp_path / "work" / "run" / "results.json").read_text())["steps"] == 4


def test_relative_lm_data_evaluates_from_another_directory(tmp_path, th, monkeypatch, capsys):
    from mgk.data import wikitext as wt

    wt.generate_corpus(tmp_path / "work" / "wt", train_lines=60, valid_lines=10, test_lines=10, num_words=60, seed=1)
    monkeypatch.chdir(tmp_path / "work")
    main(["train", "--task", "lm", "--data", "wt", "--attention", "softmax", "--heads", "2", "--steps", "2",
          "--out", "run", *th.sets("batch_size=4", "segment_len=8", "max_len=8", "d_model=16", "num_layers=1",
                                   "ffn_dim=16", "head_dim=4", "eval_batch_size=8", "progress=false",
                                   "adaptive_cutoffs=[20,40]")])
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    main(["eval", "../work/run", "--split", "test", "--no-progress"])
    assert json.loads(capsys.readouterr().out)["tokens"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_or_bad_device_is_one_line(tmp_path, th, run_v0_1_0):
    run_dir, _ = run_v0_1_0
    for argv in (["train", "--device", "cuda", "--steps", "1", "--out", str(tmp_path / "a"), *th.sets(*th.TINY)],
                 ["eval", str(run_dir), "--device", "cuda", "--no-progress"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert "--device cuda: CUDA is not available on this machine" in _one_line(e)
    for argv in (["train", "--device", "gpu0", "--steps", "1", "--out", str(tmp_path / "b"), *th.sets(*th.TINY)],
                 ["eval", str(run_dir), "--device", "gpu0", "--no-progress"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert "--device 'gpu0' is not a torch device" in _one_line(e)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_evaluation_inside_train_shows_a_progress_bar(tmp_path, th, monkeypatch):
    calls = []

    class Bar:
        def __init__(self, total, *, desc, enabled):
            calls.append({"total": total, "desc": desc, "enabled": enabled, "updates": 0})

        def update(self, n):
            calls[-1]["updates"] += n

        def close(self):
            pass

    monkeypatch.setattr(evaluate_mod, "progress_bar", Bar)
    main(["train", "--steps", "10", "--out", str(tmp_path / "run"), *th.sets(*th.TINY, "progress=true")])
    # 40 validation and 37 test examples in batches of 8
    assert [(c["desc"], c["total"], c["updates"], c["enabled"]) for c in calls] == [("val", 5, 5, True),
                                                                                     ("test", 5, 5, True)]
    calls.clear()
    main(["train", "--steps", "10", "--out", str(tmp_path / "quiet"), *th.sets(*th.TINY)])
    assert [c["enabled"] for c in calls] == [False, False]


def test_progress_bar_shows_only_on_a_terminal(monkeypatch):
    class Stream:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

        def write(self, s):
            pass

        def flush(self):
            pass

    for tty, enabled, shown in ((True, True, True), (False, True, False), (True, False, False)):
        monkeypatch.setattr(sys, "stderr", Stream(tty))
        bar = evaluate_mod.progress_bar(3, desc="val", enabled=enabled)
        assert bar.disable is not shown and bar.leave is False
        bar.close()


def _tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name != LOCK_NAME)


def test_a_run_that_fails_before_its_first_step_leaves_no_run_folder(tmp_path, th):
    """A bad --data, or a mistake found once the data are generated into the run (max_len too short for them), used
    to leave a run folder behind (with the lock file, or the generated data) that the same command, corrected, then
    refused as not empty."""
    nested = tmp_path / "runs" / "a" / "run"  # parents created by this command go with it
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", str(tmp_path / "no-such-data"), "--steps", "1", "--out", str(nested)])
    assert "no-such-data" in _one_line(e)
    assert not (tmp_path / "runs").exists()

    new = tmp_path / "new"
    with pytest.raises(SystemExit, match="max_len"):
        main(["train", "--steps", "1", "--out", str(new), *th.sets(*th.TINY, "max_len=5")])
    assert not new.exists()

    empty = tmp_path / "empty"  # made by the user: it stays, as empty as it was
    empty.mkdir()
    with pytest.raises(SystemExit, match="max_len"):
        main(["train", "--steps", "1", "--out", str(empty), *th.sets(*th.TINY, "max_len=5")])
    assert empty.is_dir() and _tree(empty) == []
    main(["train", "--steps", "1", "--out", str(empty), *th.sets(*th.TINY)])  # no --overwrite needed
    assert (empty / "results.json").is_file()


def test_a_failed_resume_or_overwrite_keeps_the_directory(tmp_path, th, run_v0_1_0):
    run_dir, _ = run_v0_1_0
    (run_dir / "results.json").unlink()
    last = run_dir / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:100])  # damaged: the resume fails in its setup
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != LOCK_NAME}
    with pytest.raises(SystemExit, match="last.pt"):
        main(["train", "--resume", str(run_dir)])
    assert all(p.read_bytes() == data for p, data in before.items())  # (the data cache may have grown)

    mine = tmp_path / "mine"  # an earlier run, replaced by a run that fails once its data reveal a mistake
    main(["train", "--steps", "1", "--out", str(mine), *th.sets(*th.TINY)])
    earlier = {p: p.read_bytes() for p in mine.rglob("*") if p.is_file() and p.name != LOCK_NAME}
    with pytest.raises(SystemExit, match="max_len"):
        main(["train", "--steps", "1", "--out", str(mine), "--overwrite", *th.sets(*th.TINY, "max_len=5")])
    # --overwrite replaces the earlier run only once the new one has started: it is back as it was
    assert {p: p.read_bytes() for p in mine.rglob("*") if p.is_file() and p.name != LOCK_NAME} == earlier


def test_abandon_removes_only_what_the_claim_made(tmp_path):
    from mgk.train import rundir

    lock = rundir.claim(tmp_path / "a" / "b" / "run")
    (tmp_path / "a" / "other-run").mkdir()  # another process's run, under a parent this claim created
    (tmp_path / "a" / "b" / "run" / "config.yaml").write_text("x: 1\n")
    (tmp_path / "a" / "b" / "run" / "notes.txt").write_text("not mgk's")
    rundir.abandon(lock)
    assert _tree(tmp_path) == ["a", "a/b", "a/b/run", "a/b/run/notes.txt", "a/other-run"]
    assert holder_pid(tmp_path / "a" / "b" / "run") is None

    lock = rundir.claim(tmp_path / "a" / "b" / "run2")
    (tmp_path / "a" / "b" / "run2" / "tb").mkdir()
    rundir.abandon(lock)
    assert _tree(tmp_path) == ["a", "a/b", "a/b/run", "a/b/run/notes.txt", "a/other-run"]

    resumed = rundir.claim(tmp_path / "a" / "b" / "run", resume=True)
    rundir.abandon(resumed)
    assert _tree(tmp_path) == ["a", "a/b", "a/b/run", "a/b/run/notes.txt", "a/other-run"]
