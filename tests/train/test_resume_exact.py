"""A run killed with SIGKILL and resumed equals an uninterrupted run, bit for bit, on CPU."""
import json
import subprocess

import pytest
import torch


@pytest.fixture
def resume_args(th):
    return ["--attention", "mgk", "--pi", "soft_e", "--steps", "30",
            *th.sets(*th.TINY, "checkpoint_every=3", "dropout=0.1", "attn_dropout=0.1")]


def test_sigkill_then_resume_is_bitwise_identical(tmp_path, th, resume_args):
    straight = tmp_path / "straight"
    th.run(th.mgk_cmd("train", "--out", str(straight), *resume_args))

    killed = tmp_path / "killed"
    ckpt_step = th.kill_after(resume_args, killed, min_step=10)
    assert 3 <= ckpt_step < 30
    assert not (killed / "results.json").exists()
    th.run(th.mgk_cmd("train", "--resume", str(killed)))

    assert th.series(killed, "train/loss") == th.series(straight, "train/loss")  # every step, exact floats
    assert th.series(killed, "train/lr") == th.series(straight, "train/lr")
    assert th.series(killed, "val/acc") == th.series(straight, "val/acc")
    a, b = th.last_state(straight), th.last_state(killed)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert any(name.endswith(".pi") for name in a["model"])  # Soft-E buffers are part of it
    assert a["loop_state"] == b["loop_state"]
    for group_a, group_b in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        for key in group_a:
            assert torch.equal(torch.as_tensor(group_a[key]), torch.as_tensor(group_b[key]))
    ra = json.loads((straight / "results.json").read_text())
    rb = json.loads((killed / "results.json").read_text())
    for key in ("val", "test", "params", "steps", "best_step"):
        assert ra[key] == rb[key], key


def test_resume_refuses_another_model_config(tmp_path, th):
    out = tmp_path / "run"
    th.run(th.mgk_cmd("train", "--out", str(out), "--steps", "3", *th.sets(*th.TINY)))
    p = subprocess.run(th.mgk_cmd("train", "--resume", str(out), "--set", "num_heads=2"), env=th.env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "num_heads: 4 != 2" in p.stderr


def test_two_epochs_visit_different_orders():
    from mgk.train.loop import EpochSampler

    s = EpochSampler(10, 3, seed=0)  # 3 batches per epoch, one example unused per epoch
    epoch0 = torch.cat([s.indices(i) for i in range(3)])
    epoch1 = torch.cat([s.indices(i) for i in range(3, 6)])
    assert len(set(epoch0.tolist())) == 9 and len(set(epoch1.tolist())) == 9
    assert not torch.equal(epoch0, epoch1)
    assert torch.equal(EpochSampler(10, 3, seed=0).indices(4), s.indices(4))  # pure function of (seed, step)
