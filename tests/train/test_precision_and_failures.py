"""bf16/fp16 runs stay finite; a non-finite loss stops the run and keeps the last good checkpoint."""
import json

import pytest
import torch

from mgk.attention.registry import kind_variants, variant_name
from mgk.cli import main
from mgk.tasks.classification import ClassificationTask


@pytest.fixture
def small(th):
    """--set arguments of a small ListOps run, with ``extra`` key=value pairs."""
    return lambda *extra: th.sets(*th.TINY, "log_every=5", "eval_every=50", "checkpoint_every=50", "gen_train=128",
                                  "gen_val=16", "gen_test=16", *extra)


KINDS = kind_variants()


@pytest.mark.parametrize("kind,options", KINDS, ids=[variant_name(k, v) for k, v in KINDS])
def test_bf16_runs_50_steps_finite(tmp_path, kind, options, small):
    out = tmp_path / kind
    main(["train", "--attention", kind, "--precision", "bf16", "--steps", "50", "--out", str(out),
          *small(*(f"{k}={v}" for k, v in options.items()))])
    losses = [json.loads(x)["train/loss"] for x in (out / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in x]
    assert len(losses) == 10 and all(torch.isfinite(torch.tensor(losses)))
    assert json.loads((out / "results.json").read_text())["skipped_steps"] == 0


def test_fp16_with_grad_scaler_runs(tmp_path, small):
    out = tmp_path / "fp16"
    main(["train", "--precision", "fp16", "--steps", "10", "--out", str(out), *small()])
    ckpt = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["scaler"]["scale"] > 0  # the scaler's state is saved with the checkpoint


def _poison_step(monkeypatch, bad_call):
    calls = {"n": 0}
    real = ClassificationTask.loss

    def loss(model, batch):
        calls["n"] += 1
        value, sums = real(model, batch)
        if calls["n"] == bad_call:
            value = value * float("nan")
            sums = dict(sums, loss=value.detach())
        return value, sums

    monkeypatch.setattr(ClassificationTask, "loss", staticmethod(loss))


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch, small):
    _poison_step(monkeypatch, bad_call=4)  # training step 4 (no evaluation before it)
    out = tmp_path / "nan"
    with pytest.raises(SystemExit, match="^mgk train: non-finite training loss.*step 4.*last.pt"):
        main(["train", "--steps", "8", "--out", str(out), *small("checkpoint_every=1")])
    ckpt = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["loop_state"]["step"] == 3
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values() if t.is_floating_point())


def test_nonfinite_loss_can_be_skipped_and_counted(tmp_path, monkeypatch, small):
    _poison_step(monkeypatch, bad_call=4)
    out = tmp_path / "skip"
    main(["train", "--steps", "8", "--out", str(out), *small("nonfinite=skip")])
    results = json.loads((out / "results.json").read_text())
    assert results["skipped_steps"] == 1 and results["steps"] == 8
    ckpt = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values() if t.is_floating_point())
