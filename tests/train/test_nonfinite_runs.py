"""A run whose weights went NaN is a failed run, not a result: `mgk train` ends with one line and a non-zero exit,
results.json records it as failed, and `mgk table`, `mgk reproduce`'s report, `mgk eval` and `mgk analyze` leave it
out and list it as failed. A non-finite validation never becomes the best checkpoint."""
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mgk.cli import main
from mgk.tasks.lra_table import lra_table
from mgk.train.loop import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _file(run: Path, name: str) -> Path:
    """A file of a run directory (the paths of the run-directory format)."""
    return Path(run) / {"results": "results.json", "log": "train.log", "metrics": "metrics.jsonl",
                        "best": "checkpoints/best.pt"}[name]


def _poison_weights(monkeypatch, at_step: int):
    """Optimiser step ``at_step`` (1-based) leaves every weight NaN, as a zero ``adam_eps`` or an overflow does."""
    real, calls = torch.optim.AdamW.step, {"n": 0}

    def step(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == at_step:
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)


@pytest.fixture
def small(th):
    return lambda *extra: th.sets(*th.TINY, "eval_every=2", "checkpoint_every=2", "gen_train=64", "gen_val=16",
                                  "gen_test=16", *extra)


@pytest.mark.parametrize("nonfinite,poisoned,skipped", [("stop", 4, 0), ("skip", 1, 3)])
def test_nan_weights_fail_the_run_in_one_line_and_results_say_so(tmp_path, monkeypatch, small, nonfinite, poisoned,
                                                                  skipped):
    """One validation, at the end, on NaN weights: with ``stop`` the NaN comes from the last update (its own loss
    was finite); with ``skip`` from the first, and every later step is skipped."""
    out = tmp_path / "nan"
    _poison_weights(monkeypatch, at_step=poisoned)
    with pytest.raises(SystemExit) as e:
        main(["train", "--steps", "4", "--out", str(out), *small(f"nonfinite={nonfinite}", "eval_every=4")])
    line = str(e.value.code)
    assert line.startswith(f"mgk train: {out}: non-finite val loss (nan) in the final evaluation after 4 steps "
                           f"({skipped} skipped for a non-finite loss)")
    assert "\n" not in line and "results.json records the run as failed" in line
    res = json.loads(_file(out, "results").read_text())
    assert res["failed"].startswith("non-finite val loss (nan)") and math.isnan(res["val"]["loss"])
    assert res["skipped_steps"] == skipped and res["best_step"] is None
    assert not _file(out, "best").exists()  # no finite validation: no best checkpoint
    last_line = _file(out, "log").read_text().splitlines()[-1]
    assert "non-finite val loss" in last_line and last_line.startswith("failed: ")  # never the run's path first
    # resuming it says it failed, in one line
    with pytest.raises(SystemExit, match=rf"^mgk train: {out} failed \(non-finite val loss.*--overwrite"):
        main(["train", "--resume", str(out)])


def test_weights_that_go_nan_after_the_best_validation_report_the_best(tmp_path, monkeypatch, small):
    out = tmp_path / "late"
    _poison_weights(monkeypatch, at_step=4)  # validations at 2 (finite) and 4 (NaN)
    main(["train", "--steps", "4", "--out", str(out), *small("nonfinite=skip")])
    res = json.loads(_file(out, "results").read_text())
    assert "failed" not in res and res["best_step"] == 2 and math.isfinite(res["test"]["loss"])
    val = dict((r["step"], r["val/loss"]) for r in map(json.loads, _file(out, "metrics").read_text().splitlines())
               if "val/loss" in r)
    assert math.isfinite(val[2]) and math.isnan(val[4])


def test_a_huge_learning_rate_fails_the_run_from_the_command_line(tmp_path, th):
    """The real command, no patching: lr 1e30 overflows the weights; stop says so at the step, skip at the end."""
    stop, skip = tmp_path / "stop", tmp_path / "skip"
    args = ["--steps", "3", *th.sets(*th.TINY, "gen_train=64", "gen_val=16", "gen_test=16", "lr=1e30",
                                     "warmup_steps=0")]
    p = subprocess.run(th.mgk_cmd("train", "--out", str(stop), *args), env=th.env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("mgk train: non-finite training loss (nan) at step 2")
    p = subprocess.run(th.mgk_cmd("train", "--out", str(skip), *args, "--set", "nonfinite=skip"), env=th.env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(f"mgk train: {skip}: non-finite val loss")
    assert "(2 skipped for a non-finite loss)" in p.stderr


def test_a_nan_validation_never_becomes_the_best(tmp_path, monkeypatch, small):
    """NaN compares false with everything: a NaN best would block every later, finite one."""
    real, calls = Trainer.evaluate, {"n": 0}

    def evaluate(self, dataset, index=None, desc="eval"):
        m = real(self, dataset, index=index, desc=desc)
        calls["n"] += 1
        return {**m, "loss": float("nan"), "acc": 0.0} if calls["n"] == 1 else m  # the first validation only

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    out = tmp_path / "run"
    main(["train", "--steps", "4", "--out", str(out), *small("eval_every=1")])
    res = json.loads(_file(out, "results").read_text())
    assert res["best_step"] in (2, 3, 4) and "failed" not in res and math.isfinite(res["val"]["loss"])
    assert torch.load(_file(out, "best"), weights_only=True)["step"] == res["best_step"]


def _results(task="listops", acc=0.4, seed=0, **extra):
    return {"task": task, "attention": "mgk", "num_heads": 4, "seed": seed, "pi": "learned",
            "test": {"acc": acc, "loss": 1.0}, **extra}


def test_table_leaves_failed_runs_out_and_lists_them(tmp_path, capsys):
    good = _results(acc=0.40)
    flagged = _results(acc=0.094, seed=1, failed="non-finite val loss (nan) in the final evaluation")
    older = _results(seed=2, test={"acc": 0.094, "loss": float("nan")})  # written before the flag existed
    table, warnings = lra_table([good, flagged, older])
    assert "| mgk | 4 | 40.00 | — | — | — | — | 40.00 (1/5) |" in table  # 9.4 is averaged in nowhere
    assert "Not in the table, failed (final evaluation not finite): 2 run(s)" in table
    assert "- listops mgk x 4 seed 1: non-finite val loss (nan)" in table
    assert "- listops mgk x 4 seed 2: non-finite test loss (nan)" in table
    assert sum("left out: failed" in w for w in warnings) == 2
    for i, res in enumerate((good, flagged, older)):
        d = tmp_path / f"r{i}"
        d.mkdir()
        (d / "results.json").write_text(json.dumps(res))
    assert main(["table", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "| mgk | 4 | 40.00 |" in out and "failed (final evaluation not finite): 2 run(s)" in out
    assert err.count("left out: failed") == 2


def test_run_failure_reads_the_flag_and_non_finite_figures():
    from mgk.tasks.lra_table import run_failure

    assert run_failure(_results()) is None
    assert run_failure(_results(failed="why")) == "why"
    assert run_failure({"ppl": float("inf"), "nll": 800.0}) == "non-finite ppl (inf)"
    assert run_failure({"val": {"loss": 1.0, "acc": float("nan")}}) == "non-finite val acc (nan)"
    assert run_failure({"val": None, "test": {"ppl": 3.0}}) is None


def test_eval_of_nan_weights_fails_and_records_it(run_v0_1_0, tmp_path):
    run_dir, _ = run_v0_1_0
    best = _file(run_dir, "best")
    ckpt = torch.load(best, weights_only=True)
    ckpt["model"] = {k: torch.full_like(v, float("nan")) if v.is_floating_point() and not k.endswith("sigma2")
                     else v for k, v in ckpt["model"].items()}  # the weights an update made NaN, not the buffers
    torch.save(ckpt, best)
    out = tmp_path / "eval.json"
    with pytest.raises(SystemExit, match=rf"^mgk eval: {run_dir}: non-finite nll \(nan\) on valid with best.pt "
                                         rf"\(step 4\).*{out} records the evaluation as failed"):
        main(["eval", str(run_dir), "--json", str(out), "--no-progress", "--device", "cpu"])
    rec = json.loads(out.read_text())
    assert rec["failed"].startswith("non-finite nll (nan)") and math.isnan(rec["nll"])


def test_analyze_refuses_a_failed_run_and_leaves_it_out_of_a_comparison(tmp_path, monkeypatch, small, capsys):
    good, bad = tmp_path / "good", tmp_path / "bad"
    main(["train", "--steps", "2", "--out", str(good), *small()])
    shutil.copytree(good, bad)
    res = json.loads(_file(bad, "results").read_text())
    _file(bad, "results").write_text(json.dumps({**res, "failed": "non-finite val loss (nan)"}))
    with pytest.raises(SystemExit, match=rf"^mgk analyze: {bad} failed \(non-finite val loss \(nan\)\)"):
        main(["analyze", str(bad), "--no-progress", "--samples", "2", "--out", str(tmp_path / "a1")])
    capsys.readouterr()
    main(["analyze", "--compare", str(good), str(bad), "--no-progress", "--samples", "2", "--out",
          str(tmp_path / "a2")])
    assert f"mgk analyze: left out: {bad} failed" in capsys.readouterr().err
    result = json.loads((tmp_path / "a2" / "analysis.json").read_text())
    assert list(result["runs"]) == ["mgk-4"] and len(result["left_out"]) == 1
    assert f"left out, failed: {bad} failed" in (tmp_path / "a2" / "analysis.md").read_text()
