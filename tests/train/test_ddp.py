"""torchrun with 2 CPU processes (gloo) equals one process with the same global batch."""
import json

import pytest
import torch


@pytest.fixture
def ddp_args(th):
    return ["train", "--attention", "mgk", "--pi", "soft_e", "--steps", "8",
            *th.sets(*th.TINY, "dropout=0.0", "attn_dropout=0.0", "eval_every=4", "checkpoint_every=4")]


def test_two_processes_match_one(tmp_path, th, ddp_args):
    one, two = tmp_path / "one", tmp_path / "two"
    th.run(th.mgk_cmd(*ddp_args, "--out", str(one)))
    th.run_torchrun(2, [*ddp_args, "--out", str(two)])

    loss1, loss2 = th.series(one, "train/loss"), th.series(two, "train/loss")
    assert [s for s, _ in loss1] == [s for s, _ in loss2] == list(range(1, 9))
    for (_, a), (_, b) in zip(loss1, loss2):
        assert abs(a - b) / abs(a) < 1e-4, (a, b)

    s1, s2 = th.last_state(one)["model"], th.last_state(two)["model"]
    pis = [k for k in s1 if k.endswith(".pi")]
    assert pis, "the Soft-E model has pi buffers"
    for k in pis:
        torch.testing.assert_close(s1[k], s2[k], atol=1e-6, rtol=0)
        assert not torch.allclose(s1[k], torch.full_like(s1[k], 0.5)), "pi was updated"

    r1 = json.loads((one / "results.json").read_text())
    r2 = json.loads((two / "results.json").read_text())
    assert r2["world_size"] == 2
    # 40 val and 37 test examples: 37 is not divisible by 2, yet every example is counted exactly once
    for split in ("val", "test"):
        assert r1[split]["count"] == r2[split]["count"]
        assert abs(r1[split]["acc"] - r2[split]["acc"]) < 1e-9
    assert r2["test"]["count"] == len((two / "data" / "basic_test.tsv").read_text().splitlines()) - 1
