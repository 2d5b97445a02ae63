"""A run directory is written safely: --overwrite clears only what a run of mgk provably wrote (its marker), and only
once the new run has started; writing never follows a link out of the run directory, nor starts a log line with text
taken from a path; the temporary files that a kill during an atomic write leaves go at the next start."""
import json
import shutil
import signal
import subprocess
import sys

import pytest

from mgk.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
LOCK_NAME = ".mgk-lock"


def _snapshot(folder):
    """Every path under ``folder`` (but the lock file) with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*")) if p.name != LOCK_NAME}


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def test_overwrite_never_clears_a_folder_that_mgk_did_not_mark(tmp_path, th):
    """A folder of the user's whose names are those of run files (config.yaml, data/, plots/) was taken for a run:
    refused with a hint to use --overwrite, which then deleted all three, even for a run failing on a bad --data."""
    mine = tmp_path / "project"
    (mine / "data").mkdir(parents=True)
    (mine / "plots").mkdir()
    (mine / "config.yaml").write_text("lr: 0.1\n")
    (mine / "data" / "train.csv").write_text("1,2\n")
    (mine / "plots" / "figure.png").write_bytes(b"mine")
    (mine / ".mgk-previous").mkdir()  # the name of mgk's set-aside run, without its marker: not mgk's either
    (mine / ".mgk-previous" / "notes.txt").write_text("mine")
    before = _snapshot(mine)
    with pytest.raises(SystemExit) as e:
        main(["train", "--steps", "1", "--out", str(mine), *th.sets(*th.TINY)])
    msg = _one_line(e)
    assert "not empty" in msg and "--overwrite" not in msg and "--resume" not in msg, msg
    for data in (["--data", str(tmp_path / "no-such-data")], []):  # a run that fails at once, and one that trains
        with pytest.raises(SystemExit) as e:
            main(["train", "--steps", "1", "--out", str(mine), "--overwrite", *data, *th.sets(*th.TINY)])
        assert "has no .mgk-run" in _one_line(e)
    assert _snapshot(mine) == before


def test_overwrite_keeps_the_earlier_run_until_the_new_one_has_started(tmp_path, th):
    out = tmp_path / "run"
    main(["train", "--steps", "2", "--out", str(out), *th.sets(*th.TINY)])
    before = _snapshot(out)
    with pytest.raises(SystemExit, match="no-such-data"):  # validation fails: nothing of the earlier run is lost
        main(["train", "--steps", "1", "--out", str(out), "--overwrite", "--data", str(tmp_path / "no-such-data"),
              *th.sets(*th.TINY)])
    assert _snapshot(out) == before
    main(["train", "--steps", "3", "--out", str(out), "--overwrite", *th.sets(*th.TINY)])
    assert json.loads((out / "results.json").read_text())["steps"] == 3
    assert (out / ".mgk-run").is_file() and not (out / ".mgk-previous").exists()
    assert not (out / ".mgk-discarded").exists()


def test_a_killed_overwrite_gets_the_earlier_run_back_at_the_next_start(tmp_path, th):
    from mgk.train import rundir

    out = tmp_path / "run"
    main(["train", "--steps", "1", "--out", str(out), *th.sets(*th.TINY)])
    before = _snapshot(out)
    lock = rundir.claim(out, overwrite=True)  # `mgk train --overwrite`, SIGKILLed before its first step:
    (out / "config.yaml").write_text("half: written\n")
    (out / "data").mkdir()
    lock.release()  # the kernel drops a killed process's lock, and nothing else runs
    with pytest.raises(SystemExit, match="not empty.*--resume"):
        main(["train", "--steps", "1", "--out", str(out), *th.sets(*th.TINY)])
    assert _snapshot(out) == before

    (out / ".mgk-discarded" / "checkpoints").mkdir(parents=True)  # a kill while a started run deleted the earlier
    rundir.claim(out, resume=True).release()
    assert _snapshot(out) == before and not (out / ".mgk-discarded").exists()


# A short lm-small run: what `mgk generate` reads, and what eval, table and resume read too.
LM = ["--preset", "lm-small", "--heads", "2", *(x for kv in ("batch_size=4", "segment_len=16", "max_len=16",
      "d_model=16", "num_layers=1", "ffn_dim=32", "head_dim=8", "eval_every=2", "eval_batch_size=8", "warmup_steps=1",
      "progress=false", "gen_train=80", "gen_val=12", "gen_test=12") for x in ("--set", kv))]
# `mgk train --overwrite` SIGKILLed as soon as this function of mgk.train.rundir returns: the earlier run has been
# moved into .mgk-previous (and, for write_config, the new run has written its config.yaml)
KILLED = ("import os, signal, sys\nfrom mgk.train import rundir\nfrom mgk.cli import main\n"
          "real = getattr(rundir, sys.argv[1])\n"
          "def killed(*args, **kwargs):\n    real(*args, **kwargs)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
          "setattr(rundir, sys.argv[1], killed)\nmain(sys.argv[2:])\n")
OPENERS = {"table": ["table", "{run}"], "eval": ["eval", "{run}", "--no-progress"],
           "generate": ["generate", "{run}", "--prompt", "the", "--max-new-tokens", "2"],
           "resume": ["train", "--resume", "{run}"]}


def _run_files(folder):
    """:func:`_snapshot` without the token caches under data/.mgk-cache, which reading the data (re)writes."""
    return {k: v for k, v in _snapshot(folder).items() if ".mgk-cache" not in k}


@pytest.mark.parametrize("moment", ["_set_aside", "write_config"])
def test_a_killed_overwrite_is_put_back_by_the_next_command_that_opens_the_run(tmp_path, th, capsys, moment):
    """Killed just after it set the finished run aside, `mgk train --overwrite` left a folder that train --resume,
    eval and generate called "not a run directory (no config.yaml)" and that table did not list; only a new
    `mgk train --out` put the run back. Each of them now puts it back first, byte for byte, then reads it."""
    finished = tmp_path / "finished"
    main(["train", "--steps", "2", "--out", str(finished), *LM])
    before = _run_files(finished)
    killed = tmp_path / "killed"
    shutil.copytree(finished, killed, symlinks=True)
    child = subprocess.run([sys.executable, "-c", KILLED, moment, "train", "--steps", "2", "--out", str(killed),
                            "--overwrite", *LM], env=th.env(), capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert (killed / ".mgk-previous" / "config.yaml").is_file()
    assert (killed / "config.yaml").is_file() == (moment == "write_config")
    capsys.readouterr()
    for name, argv in OPENERS.items():
        run = tmp_path / name
        shutil.copytree(killed, run, symlinks=True)
        assert main([a.format(run=run) for a in argv]) in (0, None), name
        assert _run_files(run) == before, name
    out = capsys.readouterr()
    assert "| mgk | 2 |" in out.out and f"mgk train --resume {tmp_path / 'resume'} --steps N" in out.err


def test_a_resume_never_writes_through_a_link_out_of_the_run(tmp_path, th):
    """Someone else's run whose logs were links: the resume appended its lines to the file they pointed to."""
    out = tmp_path / "run"
    main(["train", "--steps", "2", "--out", str(out), *th.sets(*th.TINY, "checkpoint_every=1")])
    (out / "results.json").unlink()  # unfinished: a resume trains on
    outside = tmp_path / "profile.sh"
    outside.write_text("echo hi\n")
    for name in ("train.log", "metrics.jsonl"):
        (out / name).unlink()
        (out / name).symlink_to(outside)
    with pytest.raises(SystemExit) as e:
        main(["train", "--resume", str(out), "--steps", "3"])
    assert f"{out / 'metrics.jsonl'} is a symbolic link" in _one_line(e)
    assert outside.read_text() == "echo hi\n"


def test_the_lock_and_the_logs_are_never_opened_through_a_link(tmp_path):
    from mgk.train import rundir

    outside = tmp_path / "profile.sh"
    outside.write_text("echo hi\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).symlink_to(outside)
    with pytest.raises(rundir.RunDirError, match=f"{LOCK_NAME} is a symbolic link"):
        rundir.RunDirLock(run).acquire()
    (run / "train.log").symlink_to(outside)
    with pytest.raises(rundir.RunFileError, match="train.log is a symbolic link"):
        rundir.append_line(run / "train.log", "done")
    assert outside.read_text() == "echo hi\n"  # the lock's pid never truncated it


def test_no_line_of_the_log_starts_with_text_from_the_run_folder_name(tmp_path, th):
    out = tmp_path / "run\ntouch pwned #"
    main(["train", "--steps", "1", "--out", str(out), *th.sets(*th.TINY)])
    lines = (out / "train.log").read_text().splitlines()
    assert not [line for line in lines if line.startswith("touch")], lines
    assert any(line.endswith("run\\ntouch pwned #") for line in lines), lines  # the name is there, escaped

    from mgk.train.rundir import log_text

    assert log_text("a\tb \x1b[2J\r\u2028é") == "a\tb \\x1b[2J\\r\\u2028é"


def test_the_temporary_files_of_a_killed_checkpoint_write_go_at_the_next_start(tmp_path, th):
    out = tmp_path / "run"
    main(["train", "--steps", "2", "--out", str(out), *th.sets(*th.TINY, "checkpoint_every=1")])
    (out / "results.json").unlink()
    checkpoints = out / "checkpoints"
    kill = ("import os, torch; from mgk.train import checkpoint; "
            "torch.save = lambda obj, f: (f.write(b'half'), os._exit(9)); "
            f"checkpoint.save({{'model': {{}}}}, {str(checkpoints / 'last.pt')!r}, kind='last')")
    assert subprocess.run([sys.executable, "-c", kill], env=th.env()).returncode == 9
    left = list(checkpoints.glob(".last.pt.*.tmp"))
    assert len(left) == 1  # what a kill leaves behind
    others = [checkpoints / ".last.pt.mine.tmp", checkpoints / ".other.pt.abcdefgh.tmp", out / "notes.tmp"]
    for path in others:  # not our writer's temporaries of run files: kept
        path.write_text("mine")
    main(["train", "--resume", str(out), "--steps", "3"])
    assert not left[0].exists() and all(path.read_text() == "mine" for path in others)
    assert json.loads((out / "results.json").read_text())["steps"] == 3
