"""Ctrl-C (SIGINT) and SIGTERM stop `mgk reproduce`: a real signal to a real grid of queued runs (smoke scale)
stops the running child, starts no queued run, writes the report, prints the command that resumes and exits
128 + signal within seconds, whether the signal reaches the whole process group (a terminal's Ctrl-C) or the
harness alone; the rerun then finishes the grid."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GRID = ["lra-softmax-family", "--scale", "smoke", "--seeds", "0", "--only", "task=listops",
        "--only", "row=softmax-8,mgk-4,softmax-4,mgk-2", "--jobs", "1"]


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}


def _started(out: Path) -> list[Path]:
    """Runs the harness started: each gets its log beside its directory before its first command."""
    return sorted((out / "runs").rglob("*.reproduce.log")) if (out / "runs").is_dir() else []


def _stop_grid(tmp_path: Path, signum: int, group: bool) -> tuple[Path, subprocess.CompletedProcess, float]:
    out = tmp_path / "out"
    args = [sys.executable, "-m", "mgk", "reproduce", *GRID, "--out", str(out)]
    proc = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group: the group signal reaches nothing else
    deadline = time.monotonic() + 120
    while not _started(out) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert _started(out), "the grid started no run"
    time.sleep(0.5)  # the first child is up
    t0 = time.monotonic()
    (os.killpg if group else os.kill)(proc.pid, signum)
    try:
        stdout, stderr = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"mgk reproduce still running 10 s after {signal.Signals(signum).name}:\n{stdout}\n{stderr}")
    took = time.monotonic() - t0
    return out, subprocess.CompletedProcess(args, proc.returncode, stdout, stderr), took


def _check_stopped(out: Path, p, signum: int) -> None:
    assert p.returncode == 128 + signum, (p.returncode, p.stdout, p.stderr)
    assert len(_started(out)) == 1, "a queued run started after the signal"
    time.sleep(1.0)
    assert len(_started(out)) == 1, "a run started after the harness exited"
    assert f"interrupted by {signal.Signals(signum).name}; resume with: mgk reproduce lra-softmax-family" in p.stderr
    assert "Traceback" not in p.stderr
    rep = json.loads((out / "report.json").read_text())
    assert len(rep["runs"]) == 4 and not any(r["status"] in ("done", "failed") for r in rep["runs"]), rep["runs"]
    assert "4 planned, 0 finished" in (out / "REPORT.md").read_text()


def test_sigint_to_the_harness_alone_stops_the_grid_within_seconds(tmp_path):
    out, p, took = _stop_grid(tmp_path, signal.SIGINT, group=False)
    _check_stopped(out, p, signal.SIGINT)
    assert took < 10


@pytest.mark.slow
@pytest.mark.parametrize("signum,group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_a_stopped_grid_resumes_on_the_rerun(tmp_path, signum, group):
    out, p, took = _stop_grid(tmp_path, signum, group)
    _check_stopped(out, p, signum)
    p = subprocess.run([sys.executable, "-m", "mgk", "reproduce", *GRID, "--out", str(out)], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert len(list((out / "runs").rglob("results.json"))) == 4
    rep = json.loads((out / "report.json").read_text())
    assert [r["status"] for r in rep["runs"]] == ["done"] * 4


def test_an_error_of_the_harness_in_one_run_fails_that_run_and_the_others_go_on(tmp_path, monkeypatch):
    from mgk.reproduce import executor, expand, get_experiment
    from mgk.reproduce.grid import parse_only

    runs = expand(get_experiment("lra-softmax-family"), "smoke", [0, 1, 2], tmp_path,
                  only=parse_only(["row=mgk-4", "task=listops"]))

    def fake(run, python, threads, stop):
        if run.seed == 1:
            raise PermissionError(f"cannot write {run.run_dir}")
        return {"status": "done"}

    monkeypatch.setattr(executor, "execute_run", fake)
    records = executor.run_local(runs, jobs=2)
    assert [r["status"] for r in records] == ["done", "failed", "done"]
    assert "PermissionError: cannot write" in records[1]["error"]


def test_a_child_that_lost_the_signal_gets_it_again_long_before_the_grace_kill():
    """A child can lose the first signal (a library's import code catching everything swallows the KeyboardInterrupt
    of a Ctrl-C that comes while it starts) and would then train on until the grace kill: it gets it again."""
    import threading

    from mgk.reproduce.stopping import GridStop

    script = ("import signal, sys, time\nseen = []\n"
              "signal.signal(signal.SIGINT, lambda s, f: seen.append(s) if not seen else sys.exit(130))\n"
              "print('ready', flush=True)\nwhile True:\n    time.sleep(0.05)\n")
    with GridStop(grace=30.0, resend=0.5) as stop:
        child = stop.popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        codes = []
        waiter = threading.Thread(target=lambda: codes.append(stop.wait(child)[0]))
        waiter.start()
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)  # a real signal to this process: the handler forwards it
        while waiter.is_alive() and time.monotonic() - t0 < 10:
            time.sleep(0.1)
            stop.enforce_grace()
        waiter.join(timeout=5)
        child.stdout.close()
    assert stop.name == "SIGINT" and codes == [130] and time.monotonic() - t0 < 5
    assert stop.popen([sys.executable, "-c", "pass"]) is None  # stopped: nothing new starts
