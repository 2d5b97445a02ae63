"""A run records its protocol (results.json, config.yaml, the first log line) and resumes exactly under the authors'
OneCycle schedule with fixed-size validations."""
import json

import pytest
import torch
import yaml

from mgk import config as config_mod
from mgk.train.schedule import build_scheduler

PROTOCOL_SETS = ["schedule=onecycle", "init=paper", "classifier_activation=relu", "attn_bias=false",
                 "eval_batches=2", "checkpoint_every=3", "dropout=0.1", "attn_dropout=0.1"]


@pytest.fixture
def args(th):
    return ["--attention", "mgk", "--steps", "15", *th.sets(*th.TINY, *PROTOCOL_SETS)]


def test_protocol_is_recorded_and_onecycle_resumes_exactly(tmp_path, th, args):
    straight = tmp_path / "straight"
    th.run(th.mgk_cmd("train", "--out", str(straight), *args))
    results = json.loads((straight / "results.json").read_text())
    proto = results["protocol"]
    assert {k: proto[k] for k in ("init", "schedule", "attn_bias", "classifier_activation", "eval_batches")} == \
        {"init": "paper", "schedule": "onecycle", "attn_bias": False, "classifier_activation": "relu",
         "eval_batches": 2}
    assert results["params_attention"] > 0 and results["val"]["count"] == 40  # final val: the whole split
    cfg = config_mod.flat(config_mod.from_dict(yaml.safe_load((straight / "config.yaml").read_text())))
    assert (cfg["schedule"], cfg["init"], cfg["eval_batches"]) == ("onecycle", "paper", 2)
    log = (straight / "train.log").read_text()
    assert f"{results['params']:,} parameters in total, {results['params_attention']:,} in attention" in log
    logged = th.series(straight, "train/lr")
    assert max(v for _, v in logged) == pytest.approx(1e-3) and logged[-1][1] < 1e-3 / 25  # OneCycle: up, then down
    # Each step's lr is the one that step used: torch's OneCycleLR after step - 1 scheduler steps.
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    ref = build_scheduler(opt, schedule="onecycle", lr=1e-3, warmup_steps=cfg["warmup_steps"], total_steps=15)
    used = []
    for _ in range(15):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    assert [v for _, v in logged] == [used[s - 1] for s, _ in logged]
    assert logged[0] == (1, pytest.approx(1e-3 / 25)) and logged[-1] == (15, pytest.approx(1e-3 / 25 / 1e4))
    assert min(v for _, v in logged) > 0

    killed = tmp_path / "killed"
    th.kill_after(args, killed, min_step=6)
    step = int(torch.load(killed / "checkpoints" / "last.pt", weights_only=True)["loop_state"]["step"])
    assert 3 <= step < 15
    th.run(th.mgk_cmd("train", "--resume", str(killed)))
    for key in ("train/loss", "train/lr", "val/acc", "val/loss"):
        assert th.series(killed, key) == th.series(straight, key), key
    a, b = th.last_state(straight), th.last_state(killed)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["optimizer"]["param_groups"][0]["betas"] == b["optimizer"]["param_groups"][0]["betas"]
    assert a["scheduler"] == b["scheduler"]
    assert json.loads((killed / "results.json").read_text())["val"] == results["val"]
