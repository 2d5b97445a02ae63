"""`mgk bench model`: the JSON schema, the model the training task builds, and rows whose subprocess dies.
(No timing is asserted: speed claims live in BENCHMARKS.md.)"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mgk.bench.model import bench_task, failure, measure, run_row, table
from mgk.config import apply_overrides
from mgk.tasks import all_presets, listops

TINY = ["max_len=16", "batch_size=2", "d_model=16", "ffn_dim=16", "head_dim=4", "classifier_dim=8"]


def test_cli_writes_one_json_row_per_kind_with_its_figures(tmp_path):
    out = tmp_path / "model.json"
    cmd = [sys.executable, "-m", "mgk", "bench", "model", "--preset", "listops-small", "--kinds",
           "softmax:2,mgk:2", "--steps", "1", "--json", str(out), *(x for kv in TINY for x in ("--set", kv))]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    assert [(r["kind"], r["num_heads"]) for r in result["rows"]] == [("softmax", 2), ("mgk", 2)]
    for row in result["rows"]:
        assert row["preset"] == "listops-small"
        for key in ("train_tokens_per_s", "infer_tokens_per_s", "train_peak_mem_mb", "train_s_per_step",
                    "infer_s_per_step", "params"):
            assert isinstance(row[key], (int, float)) and row[key] >= 0, key
        assert row["train_tokens_per_s"] > 0 and row["tokens_per_step"] == 2 * 16
    assert {"machine", "torch", "settings", "date"} <= set(result)
    assert "| softmax | 2 | listops-small |" in p.stdout and "| mgk | 2 | listops-small |" in p.stdout


def test_parameter_count_is_that_of_the_model_the_training_task_builds(tmp_path):
    """The benchmark builds the model `mgk train` builds (135,706 parameters for listops-small MGK-4), with the
    vocabulary of the task built from (generated) data, not a vocabulary of its own."""
    cfg = apply_overrides(all_presets()["listops-small"],
                          ["gen_train=8", "gen_val=2", "gen_test=2", "attention=mgk", "num_heads=4"])
    trained = listops.build(cfg, listops.prepare(cfg, tmp_path)).build_model(cfg)
    expected = sum(p.numel() for p in trained.parameters())
    assert expected == 135_706
    assert measure("listops-small", [], steps=1, device="cpu", kind="mgk", heads=4)["params"] == expected


@pytest.mark.parametrize("preset", ["text-small", "retrieval-small", "image-small", "pathfinder-small",
                                    "lm-small"])
def test_every_task_has_a_bench_model_with_its_own_sizes(preset):
    cfg = all_presets()[preset]
    task = bench_task(cfg)
    assert task.name == cfg.task and task.vocab_size > 0
    assert task.model_config(cfg).vocab_size == task.vocab_size


def test_a_row_killed_by_sigkill_names_the_signal_and_out_of_memory():
    row = run_row("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", timeout=120)
    assert row["error"].startswith("killed by SIGKILL (exit -9): likely out of memory"), row


def test_a_row_that_exits_without_output_reports_its_status():
    row = run_row("import os; os._exit(3)", timeout=120)
    assert row["error"] == "exit status 3; no error output"
    row = run_row("raise MemoryError('cannot allocate 23 GB')", timeout=120)
    assert row["error"].startswith("exit status 1: out of memory; last error line: MemoryError"), row


@pytest.mark.parametrize("code,expected", [(137, "killed by SIGKILL (exit 137)"), (-11, "killed by SIGSEGV"),
                                           (-15, "killed by SIGTERM (exit -15): terminated")])
def test_failure_text_is_never_empty(code, expected):
    assert failure(code, "").startswith(expected)


def test_table_shows_a_failed_row_with_its_error():
    result = {"rows": [{"kind": "softmax", "num_heads": 8, "preset": "p", "error": "killed by SIGKILL (exit -9)"}]}
    assert "error: killed by SIGKILL (exit -9)" in table(result)


def test_lm_batch_is_frequency_ranked_like_real_text():
    """Word ids are frequency ranks: most tokens of a bench batch fall in the adaptive softmax's head shortlist
    (20,000 of 267,735 ids), as in WikiText-103, not in its widest tail cluster as a uniform draw would put them."""
    from mgk.bench.model import random_batch

    cfg = apply_overrides(all_presets()["wt103-paper"], ["batch_size=4", "segment_len=256"])
    task = bench_task(cfg)
    batch, tokens = random_batch(task, cfg, "cpu")
    assert tokens == 4 * 256 and batch["input"].shape == (4, 256)
    assert torch.equal(batch["input"][:, 1:], batch["target"][:, :-1])
    head = (batch["target"] < 20000).double().mean().item()
    assert 0.7 < head < 0.9, head  # Zipf over 267,735 ranks: about 79% below 20,000 (uniform: 7.5%)
    assert int(batch["target"].max()) < task.vocab_size


def test_micro_batches_split_the_step_as_training_does():
    from mgk.bench.model import micro_batches

    batch = {"tokens": torch.arange(12).view(6, 2), "label": torch.arange(6)}
    parts = micro_batches(batch, 3)
    assert [p["label"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert torch.equal(torch.cat([p["tokens"] for p in parts]), batch["tokens"])
    with pytest.raises(ValueError, match="grad_accum=4 must divide batch_size=6"):
        micro_batches(batch, 4)
    with pytest.raises(ValueError, match="grad_accum must be >= 1, got 0"):
        micro_batches(batch, 0)
