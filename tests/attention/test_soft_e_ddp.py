"""Soft-E under DDP, 2 gloo processes under torchrun: ``mgk.soft_e_step`` all-reduces the statistics of every
micro-batch of every rank (ranks with different lengths included), so pi is bitwise equal on both ranks and equals
one process over all the data; with activation checkpointing and ``no_sync`` accumulation it equals the plain DDP
run (pi and gradients, 3 steps), with DDP's buffer broadcast on or off and with every micro-batch synchronised."""
import json
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("ddp_soft_e_worker.py")


def test_soft_e_under_ddp(tmp_path, th):
    th.run_torchrun(2, [str(tmp_path)], timeout=600, script=WORKER)  # fails with the output; gloo's abort retried
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert results[0]["pi"] == results[1]["pi"]  # bitwise: the same all-reduced statistics on every rank
    assert results[0]["pi_no_broadcast"] == results[0]["pi"] == results[1]["pi_no_broadcast"]
    assert (torch.tensor(results[0]["pi"][-1]) - 0.5).abs().max() > 1e-3  # pi was updated
    for rank, result in enumerate(results):
        assert result["one_process"]["pi"] < 1e-6, (rank, result["one_process"])
        assert result["one_process"]["grad"] < 1e-6, (rank, result["one_process"])
        for mode in ("non_reentrant", "reentrant"):
            assert result[mode]["pi"] == 0.0, (rank, mode, result[mode])
            assert result[mode]["grad"] < 1e-6, (rank, mode, result[mode])
        # two gradient all-reduces per step instead of one: the parameters, hence pi, move by rounding only
        assert result["every_micro_batch_synced"]["pi"] < 1e-6, (rank, result["every_micro_batch_synced"])
        assert result["every_micro_batch_synced"]["grad"] < 1e-6, (rank, result["every_micro_batch_synced"])
