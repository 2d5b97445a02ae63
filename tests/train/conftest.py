"""Fixtures of the end-to-end training tests: ``th``, a namespace with a tiny config (``th.TINY``), ``th.sets``,
subprocess runners (``th.run``, ``th.run_torchrun``, ``th.mgk_cmd``, ``th.env``) and run-directory readers
(``th.metrics``, ``th.series``, ``th.last_state``); ``run_v0_1_0``, a copy of the 0.1.0 run-directory fixture."""
import json
import shutil
import types
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"

TINY = ["gen_train=256", "gen_val=40", "gen_test=37", "batch_size=16", "d_model=32", "head_dim=8", "ffn_dim=32",
        "classifier_dim=32", "max_len=64", "gen_max_length=40", "log_every=1", "eval_every=10", "warmup_steps=5",
        "progress=false", "eval_batch_size=8"]


def sets(*pairs):
    """--set arguments for ``pairs`` of key=value."""
    out = []
    for p in pairs:
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


def run_torchrun(nproc, args, timeout=400):
    """``torchrun --standalone --nproc_per_node=nproc -m mgk ARGS``, failing with its output if it exits non-zero.

    One retry, only for gloo's rare abort at process-group set-up or tear-down on this kind of VM ("terminate called
    without an active exception", no Python error on either rank; seen about once in ten launches). Any other
    failure, including a collective mismatch (gloo's EnforceNotMet), fails at once."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "mgk",
           *args]
    for attempt in range(2):
        p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
        out = p.stderr + p.stdout
        flaky = "terminate called without an active exception" in out and "]: Traceback" not in out
        if p.returncode == 0 or not flaky or attempt == 1:
            break
        print(f"torchrun aborted inside gloo without a Python error; retrying once:\n{p.stderr[-2000:]}")
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


@pytest.fixture(scope="session")
def th():
    """The helpers above as one namespace (tests take them as a fixture instead of importing this file)."""
    return types.SimpleNamespace(TINY=list(TINY), sets=sets, env=env, mgk_cmd=mgk_cmd, run=run,
                                 run_torchrun=run_torchrun, metrics=metrics, series=series, last_state=last_state)


@pytest.fixture
def run_v0_1_0(tmp_path):
    """(copy of tests/fixtures/run_v0_1_0 in tmp_path, the figures 0.1.0 gave for it): a 4-step LM run of mgk 0.1.0
    with its flat config.yaml, its checkpoints (string-keyed loop state) and its generated corpus."""
    out = tmp_path / "run_v0_1_0"
    shutil.copytree(FIXTURES / "run_v0_1_0", out)
    return out, json.loads((FIXTURES / "run_v0_1_0.expected.json").read_text())
