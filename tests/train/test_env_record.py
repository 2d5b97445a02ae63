"""env.json says which commit ran and whether the working tree had uncommitted changes (``git_dirty``), and neither
can fail a run: outside a git checkout, or without git, both are null."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from mgk.train import records

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_git_dirty_is_true_only_with_uncommitted_changes_to_tracked_files(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # never the checkout tmp_path may sit in
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("1\n")
    _git(repo, "add", "a.py")
    _git(repo, "commit", "-q", "-m", "one")
    assert records.git_dirty(repo) is False and len(records.git_commit(repo)) == 40
    (repo / "untracked.txt").write_text("a run's output\n")
    assert records.git_dirty(repo) is False
    (repo / "a.py").write_text("2\n")
    assert records.git_dirty(repo) is True
    outside = tmp_path / "not_a_checkout"
    outside.mkdir()
    assert records.git_dirty(outside) is None and records.git_commit(outside) is None


def test_env_json_records_git_dirty_and_null_without_git(tmp_path, monkeypatch):
    records.write_env(tmp_path, seed=0, world_size=1, device="cpu")
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["git_dirty"] in (True, False, None) and (env["git_dirty"] is None) == (env["git_commit"] is None)

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(records.subprocess, "run", no_git)
    records.write_env(tmp_path, seed=0, world_size=1, device="cpu")
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["git_commit"] is None and env["git_dirty"] is None


def test_env_json_records_the_cpu_and_torchs_vector_kernels(tmp_path):
    """Another CPU family changes floating-point sums under the same seed, code and torch (a run re-trained on an
    AMD EPYC VM did not match its Intel Xeon original), so env.json names the CPU and torch's kernel set."""
    import torch

    records.write_env(tmp_path, seed=0, world_size=1, device="cpu")
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and env["cpu_capability"]
    assert env["cpu"] == records.cpu_model()


def test_cpu_model_reads_the_first_model_name_and_falls_back(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B14\n\n"
                    "processor\t: 1\nmodel name\t: other\n")
    assert records.cpu_model(info) == "AMD EPYC 9B14"
    monkeypatch.setattr(records.platform, "processor", lambda: "arm")
    assert records.cpu_model(tmp_path / "absent") == "arm"
    info.write_text("processor\t: 0\nmodel name\t:\n")
    assert records.cpu_model(info) == "arm"
    monkeypatch.setattr(records.platform, "processor", lambda: "")
    assert records.cpu_model(tmp_path / "absent") is None
