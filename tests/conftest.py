"""Shared pytest fixtures: one thread for tiny tensors, the MGK backends available here, one closeness check;
``th``, the end-to-end training helpers (a tiny config ``th.TINY``, ``th.sets``, subprocess runners ``th.run``,
``th.run_torchrun``, ``th.mgk_cmd``, ``th.env``, ``th.kill_after``, run-directory readers ``th.metrics``,
``th.series``, ``th.last_state``, the experiment drivers ``th.experiment``); ``run_v0_1_0``, a copy of the 0.1.0
run-directory fixture."""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread, so that tests of tiny tensors do not wait on torch's thread pool."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def available_mgk_backends() -> list[str]:
    """The ``mgk_attention`` backends that can run on this machine's CPU: "kernel" once the C++ kernel is built
    (not with MGK_CPU_KERNEL=0), "sdpa" and "explicit" always, "triton" under TRITON_INTERPRET=1 when installed."""
    from mgk.functional import _mixture_flash

    names = ["sdpa", "explicit"]
    if _mixture_flash.available(torch.zeros(1), 0.0):
        names.insert(0, "kernel")
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
        names.insert(0, "triton")
    return names


@pytest.fixture(params=available_mgk_backends())
def backend(request):
    """Each available ``mgk_attention`` backend in turn (the one backend fixture of the suite)."""
    return request.param


def _assert_close(name, ref, got, atol, rtol):
    """``|got - ref| <= atol + rtol |ref|`` elementwise (compared in float64), with a message naming ``name``."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    torch.testing.assert_close(got.to(torch.float64), ref.to(torch.float64), atol=atol, rtol=rtol,
                               msg=lambda m: f"{name}: {m}")


@pytest.fixture
def assert_close():
    """The suite's closeness check: ``assert_close(name, ref, got, atol, rtol)``."""
    return _assert_close


REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"

TINY = ["gen_train=256", "gen_val=40", "gen_test=37", "batch_size=16", "d_model=32", "head_dim=8", "ffn_dim=32",
        "classifier_dim=32", "max_len=64", "gen_max_length=40", "log_every=1", "eval_every=10", "warmup_steps=5",
        "progress=false", "eval_batch_size=8"]


def sets(*pairs):
    """--set arguments for ``pairs`` of key=value; a later pair replaces an earlier one of the same key (a test's own
    values over TINY's), since mgk train refuses one key given two values."""
    last = {p.split("=", 1)[0]: p for p in pairs}
    out = []
    for p in last.values():
        out += ["--set", p]
    return out


def env():
    """Environment for child processes: the package importable from src, one thread each."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO / "src") + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    return e


def mgk_cmd(*args):
    """Command line of ``python -m mgk``."""
    return [sys.executable, "-m", "mgk", *args]


def run(cmd, timeout=300):
    """Run a command and fail with its output if it exits non-zero."""
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p


def run_torchrun(nproc, args, timeout=400, script=None):
    """``torchrun --standalone --nproc_per_node=nproc -m mgk ARGS`` (``SCRIPT ARGS`` when ``script`` is given),
    failing with its output if it exits non-zero.

    One retry, only for gloo's rare abort at process-group set-up or tear-down ("terminate called without an active
    exception", no Python error on either rank), with ``--overwrite`` added for an ``mgk train --out`` run. Any other
    failure, including a collective mismatch (gloo's EnforceNotMet), fails at once."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *(["-m", "mgk"] if script is None else [str(script)]), *args]
    for attempt in range(2):
        p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
        out = p.stderr + p.stdout
        flaky = "terminate called without an active exception" in out and "]: Traceback" not in out
        if p.returncode == 0 or not flaky or attempt == 1:
            break
        print(f"torchrun aborted inside gloo without a Python error; retrying once:\n{p.stderr[-2000:]}")
        if script is None and "--out" in args and "--overwrite" not in args:
            # the aborted attempt may have left its run directory (or finished it before tear-down): start over
            cmd = [*cmd, "--overwrite"]
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p


def metrics(run_dir):
    """All records of a run's metrics.jsonl."""
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x]


def series(run_dir, key):
    """(step, value) pairs of one metric."""
    return [(r["step"], r[key]) for r in metrics(run_dir) if key in r]


def last_state(run_dir):
    """The model state dict of checkpoints/last.pt."""
    return torch.load(Path(run_dir) / "checkpoints" / "last.pt", weights_only=True)


def kill_after(args, out, min_step):
    """Start a run, SIGKILL it once metrics show step >= min_step; return the step the checkpoint holds."""
    proc = subprocess.Popen(mgk_cmd("train", "--out", str(out), *args), env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    try:
        while time.time() < deadline:
            steps = series(out, "train/loss") if (out / "metrics.jsonl").exists() else []
            if steps and steps[-1][0] >= min_step:
                proc.send_signal(signal.SIGKILL)
                break
            if proc.poll() is not None:
                pytest.fail(f"the run ended before it could be killed: {proc.stderr.read()}")
            time.sleep(0.02)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    return int(torch.load(out / "checkpoints" / "last.pt", weights_only=True)["loop_state"]["step"])


def experiment(name: str) -> types.ModuleType:
    """The driver ``experiments/<name>.py`` loaded as a module (experiments/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"experiment_{name}", REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def th():
    """The helpers above as one namespace (tests take them as a fixture instead of importing this file)."""
    return types.SimpleNamespace(TINY=list(TINY), sets=sets, env=env, mgk_cmd=mgk_cmd, run=run,
                                 run_torchrun=run_torchrun, kill_after=kill_after, metrics=metrics, series=series,
                                 last_state=last_state, experiment=experiment)


@pytest.fixture
def run_v0_1_0(tmp_path):
    """(copy of tests/fixtures/run_v0_1_0 in tmp_path, the figures 0.1.0 gave for it): a 4-step LM run of mgk 0.1.0
    with its flat config.yaml, its checkpoints (string-keyed loop state) and its generated corpus."""
    out = tmp_path / "run_v0_1_0"
    shutil.copytree(FIXTURES / "run_v0_1_0", out)
    return out, json.loads((FIXTURES / "run_v0_1_0.expected.json").read_text())


@pytest.fixture
def saved(monkeypatch):
    """The figures that plot functions save (``Figure.savefig``), kept open so a test can read their artists."""
    import matplotlib.figure
    figures = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (figures.append(fig),
                                                                                  real(fig, *a, **k))[1])
    monkeypatch.setattr("matplotlib.pyplot.close", lambda *a: None)
    return figures
