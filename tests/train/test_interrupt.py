"""SIGINT and SIGTERM during training: the step finishes, last.pt holds it, one line says how to resume, the exit
status is 128 + the signal, and resuming gives bitwise the run that was never interrupted."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from mgk.cli import main
from mgk.train.loop import Trainer

ARGS = ["--attention", "mgk", "--pi", "soft_e", "--steps", "12"]


@pytest.fixture
def stop_args(th):
    return [*ARGS, *th.sets(*th.TINY, "eval_every=5")]  # checkpoint_every stays 250: only the stop writes last.pt


def _assert_same_run(th, a, b):
    """Every logged value and the final weights, optimiser state and loop state are equal, bit for bit."""
    for key in ("train/loss", "train/lr", "val/acc", "val/loss"):
        assert th.series(a, key) == th.series(b, key), key
    sa, sb = th.last_state(a), th.last_state(b)
    for name, tensor in sa["model"].items():
        assert torch.equal(tensor, sb["model"][name]), name
    assert sa["loop_state"] == sb["loop_state"]
    for state_a, state_b in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values()):
        for key in state_a:
            assert torch.equal(torch.as_tensor(state_a[key]), torch.as_tensor(state_b[key]))


def _stop_line(err: str, out, sig, step) -> str:
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line == (f"mgk train: stopped by {sig.name} at step {step} of 12; {out}/checkpoints/last.pt holds step "
                    f"{step}; continue with: mgk train --resume {out}"), err
    return line


@pytest.mark.usefixtures("one_thread")
def test_signal_to_self_stops_after_the_step_and_resumes_exactly(tmp_path, th, stop_args, monkeypatch, capsys):
    """Fast variant of the subprocess test below: the signal is real (os.kill to this process) but sent from
    inside a training step, so the stop step is known exactly; 10 is also a validation step."""
    straight = tmp_path / "straight"
    main(["train", "--out", str(straight), *stop_args])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    step_fn = Trainer.train_step
    for sig, at in ((signal.SIGINT, 10), (signal.SIGTERM, 7)):
        def train_step(self, sig=sig, at=at):
            out = step_fn(self)
            if self.state.step == at:
                os.kill(os.getpid(), sig)
            return out

        monkeypatch.setattr(Trainer, "train_step", train_step)
        out = tmp_path / sig.name
        capsys.readouterr()
        assert main(["train", "--out", str(out), *stop_args]) == 128 + sig
        _stop_line(capsys.readouterr().err, out, sig, at)
        assert th.last_state(out)["loop_state"]["step"] == at
        assert th.metrics(out)[-1]["step"] == at and not (out / "results.json").exists()
        monkeypatch.setattr(Trainer, "train_step", step_fn)
        assert main(["train", "--resume", str(out)]) == 0
        _assert_same_run(th, straight, out)
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # restored after each run


@pytest.mark.usefixtures("one_thread")
def test_signal_after_the_last_step_keeps_a_resumable_run(tmp_path, th, stop_args, monkeypatch, capsys):
    """Stopped after its last step (before the final evaluation): resume writes results.json and trains nothing."""
    step_fn = Trainer.train_step

    def train_step(self):
        out = step_fn(self)
        if self.state.step == 12:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "train_step", train_step)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *stop_args]) == 143
    monkeypatch.setattr(Trainer, "train_step", step_fn)
    assert main(["train", "--resume", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 12 and results["seconds_per_step"] > 0  # the logged figure, not 0.0


def _interrupt(th, args, out, sig, min_step):
    """Start a run, send ``sig`` once its metrics show step >= min_step; (exit status, stderr)."""
    proc = subprocess.Popen(th.mgk_cmd("train", "--out", str(out), *args), env=th.env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    return _act_at_step(th, proc, out, min_step, lambda: proc.send_signal(sig), wait=240, finish=120)


def _act_at_step(th, proc, out, min_step, act, *, wait, finish):
    """Call ``act`` once ``out``'s metrics show step >= min_step (failing if ``proc`` ends first, or after ``wait``
    seconds without acting), then wait up to ``finish`` seconds for ``proc``; (exit status, stderr)."""
    try:
        deadline = time.time() + wait
        while time.time() < deadline:
            steps = th.series(out, "train/loss") if (out / "metrics.jsonl").exists() else []
            if steps and steps[-1][0] >= min_step:
                act()
                break
            if proc.poll() is not None:
                pytest.fail(f"the run ended before it could be interrupted: {proc.stderr.read()}")
            time.sleep(0.02)
        _, err = proc.communicate(timeout=finish)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


@pytest.mark.slow
def test_real_sigint_and_sigterm_then_exact_resume(tmp_path, th):
    args = [*ARGS[:-1], "30", *th.sets(*th.TINY, "eval_every=5")]
    straight = tmp_path / "straight"
    th.run(th.mgk_cmd("train", "--out", str(straight), *args))
    for sig in (signal.SIGINT, signal.SIGTERM):
        out = tmp_path / sig.name
        rc, err = _interrupt(th, args, out, sig, min_step=5)
        assert rc == 128 + sig, err
        step = th.last_state(out)["loop_state"]["step"]
        assert 5 <= step < 30 and th.metrics(out)[-1]["step"] == step
        line = err.strip().splitlines()[-1]
        assert "Traceback" not in err and line.startswith(f"mgk train: stopped by {sig.name} at step {step} of 30;")
        assert line.endswith(f"continue with: mgk train --resume {out}")
        th.run(th.mgk_cmd("train", "--resume", str(out)))
        _assert_same_run(th, straight, out)


def _children(pid):
    """Pids whose parent is ``pid`` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        return int(env.get(b"RANK", b"-1"))
    except (OSError, ValueError):
        return -1


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the torchrun workers through Linux /proc")
def test_torchrun_ranks_agree_on_the_stop_step(tmp_path, th):
    """SIGTERM to rank 1 alone: both ranks stop after the same step (rank 0 writes last.pt and says it), and the
    resumed run equals an uninterrupted one with the same two processes."""
    args = ["train", "--attention", "mgk", "--pi", "soft_e", "--steps", "30",
            *th.sets(*th.TINY, "dropout=0.0", "attn_dropout=0.0", "eval_every=5")]
    straight, out = tmp_path / "straight", tmp_path / "stopped"
    th.run_torchrun(2, [*args, "--out", str(straight)])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "mgk", *args,
           "--out", str(out)]
    proc = subprocess.Popen(cmd, env=th.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def sigterm_rank1():
        rank1 = [p for p in _children(proc.pid) if _rank_of(p) == 1]
        assert len(rank1) == 1, "rank 1 not found among torchrun's children"
        os.kill(rank1[0], signal.SIGTERM)

    returncode, err = _act_at_step(th, proc, out, 5, sigterm_rank1, wait=300, finish=180)
    assert returncode != 0
    step = th.last_state(out)["loop_state"]["step"]
    assert 5 <= step < 30 and th.metrics(out)[-1]["step"] == step
    assert f"mgk train: stopped by SIGTERM at step {step} of 30;" in err
    th.run_torchrun(2, ["train", "--resume", str(out)])
    _assert_same_run(th, straight, out)
