"""Issue 16.2 under DDP: Soft-E with activation checkpointing and ``no_sync`` gradient accumulation, 2 gloo
processes under torchrun, equals the same DDP model without checkpointing (pi and gradients, 3 steps)."""
import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("ddp_soft_e_worker.py")


def test_checkpointed_soft_e_under_ddp_no_sync(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["pi_changed"]
        for mode in ("non_reentrant", "reentrant"):
            assert result[mode]["pi"] == 0.0, (rank, mode, result[mode])
            assert result[mode]["grad"] < 1e-6, (rank, mode, result[mode])
