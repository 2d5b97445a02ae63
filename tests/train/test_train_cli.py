"""`mgk train` end to end on the generated ListOps: run records, results.json, errors."""
import json
import subprocess

import pytest
import yaml

from mgk import config as config_mod
from mgk.cli import main


def test_train_writes_every_record(tmp_path, th):
    out = tmp_path / "run"
    main(["train", "--steps", "20", "--out", str(out), *th.sets(*th.TINY)])
    results = json.loads((out / "results.json").read_text())
    for key in ("task", "attention", "num_heads", "params", "steps", "val", "test"):
        assert key in results
    assert results["steps"] == 20 and results["attention"] == "mgk" and results["num_heads"] == 4
    assert 0.0 <= results["val"]["acc"] <= 1.0 and 0.0 < results["test"]["majority_acc"] <= 1.0
    assert results["test"]["count"] == len((out / "data" / "basic_test.tsv").read_text().splitlines()) - 1
    recs = th.metrics(out)
    assert [r["step"] for r in recs if "train/loss" in r] == list(range(1, 21))
    assert [r["step"] for r in recs if "val/acc" in r] == [10, 20]
    cfg = config_mod.flat(config_mod.from_dict(yaml.safe_load((out / "config.yaml").read_text())))
    assert cfg["steps"] == 20 and cfg["d_model"] == 32
    env = json.loads((out / "env.json").read_text())
    assert env["seed"] == 0 and "torch" in env
    assert (out / "checkpoints" / "last.pt").is_file() and (out / "checkpoints" / "best.pt").is_file()
    assert (out / "plots" / "learning_curves.png").stat().st_size > 1000
    assert any((out / "tb").iterdir())


def test_missing_splits_are_reported_not_fatal(tmp_path, th):
    from mgk.data.listops import generate_listops, write_listops_tsv

    data = tmp_path / "data"
    write_listops_tsv(data / "basic_train.tsv", generate_listops(64, seed=1, max_length=30))
    out = tmp_path / "run"
    main(["train", "--data", str(data), "--steps", "4", "--out", str(out), *th.sets(*th.TINY)])
    results = json.loads((out / "results.json").read_text())
    assert results["val"] is None and results["test"] is None
    assert results["missing_splits"] == ["val", "test"]
    assert "test split absent" in (out / "train.log").read_text()


def test_set_rejects_unknown_fields_and_bad_values(tmp_path):
    with pytest.raises(SystemExit, match="unknown config field"):
        main(["train", "--out", str(tmp_path), "--set", "batchsize=3"])
    with pytest.raises(SystemExit, match="batch_size"):
        main(["train", "--out", str(tmp_path), "--set", "batch_size=many"])
    with pytest.raises(SystemExit, match="precision"):
        main(["train", "--out", str(tmp_path), "--set", "precision=8"])


def test_too_long_sequence_is_an_error_unless_truncated(tmp_path, th):
    with pytest.raises(SystemExit, match=r"max_len=12.*--set max_len=\d+") as info:
        main(["train", "--steps", "2", "--out", str(tmp_path / "a"), *th.sets(*th.TINY, "max_len=12")])
    assert "truncate" not in str(info.value)  # cutting a ListOps expression changes its answer: never suggested
    out = tmp_path / "b"
    main(["train", "--steps", "2", "--out", str(out), *th.sets(*th.TINY, "max_len=12", "truncate=true")])
    assert "truncated to max_len=12" in (out / "train.log").read_text()


def test_gradient_accumulation_matches_one_big_batch(tmp_path, th):
    common = ["--steps", "6", *th.sets(*th.TINY, "dropout=0.0", "attn_dropout=0.0")]
    main(["train", "--out", str(tmp_path / "one"), *common])
    main(["train", "--out", str(tmp_path / "acc"), *common, "--set", "grad_accum=4"])
    a = [r["train/loss"] for r in th.metrics(tmp_path / "one") if "train/loss" in r]
    b = [r["train/loss"] for r in th.metrics(tmp_path / "acc") if "train/loss" in r]
    assert len(a) == 6
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x)


def test_cli_errors_are_one_line_and_name_the_cause(tmp_path, th, capsys):
    with pytest.raises(SystemExit):  # argparse's type: one line on stderr, exit 2
        main(["train", "--attention", "nosuch", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown attention kind 'nosuch'; choose from softmax, mgk" in err
    with pytest.raises(SystemExit, match="lr must be a finite number > 0"):
        main(["train", "--set", "lr=nan", "--out", str(tmp_path / "b")])
    with pytest.raises(SystemExit, match="no ListOps train split"):
        main(["train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "c")])
    run = tmp_path / "corrupt"
    main(["train", "--steps", "2", "--out", str(run), *th.sets(*th.TINY)])
    (run / "checkpoints" / "last.pt").write_bytes(b"junk")
    with pytest.raises(SystemExit, match=r"last.pt is not a readable mgk checkpoint"):
        main(["train", "--resume", str(run), "--steps", "4"])  # a finished run is not touched: train it longer


def test_threads_sets_the_runs_cpu_threads_and_refuses_zero_in_one_line(tmp_path, th):
    """`--threads` is the documented way to size a run's thread pool; env.json records it."""
    import subprocess as _subprocess

    out = tmp_path / "run"
    th.run(th.mgk_cmd("train", "--attention", "softmax", "--steps", "1", "--threads", "2", "--out", str(out),
                      *th.sets(*th.TINY)))
    assert json.loads((out / "env.json").read_text())["threads"] == 2
    p = _subprocess.run(th.mgk_cmd("train", "--threads", "0", "--out", str(tmp_path / "r0")), env=th.env(),
                        capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--threads" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    help_text = _subprocess.run(th.mgk_cmd("train", "--help"), env=th.env(), capture_output=True, text=True,
                                timeout=120).stdout
    assert "--threads" in help_text


@pytest.mark.parametrize("omp, want", [(None, 1), ("2", 2)])
def test_a_small_model_trains_on_one_thread_unless_threads_are_given(tmp_path, th, omp, want):
    """Threads of a small model spun against another busy process (the main job took 53 minutes on
    a busy machine against 1.6 quiet); without --threads and $OMP_NUM_THREADS, a model under
    mgk.train.loop.SMALL_MODEL_PARAMS trains on one thread; $OMP_NUM_THREADS (or --threads) is obeyed."""
    env = {k: v for k, v in th.env().items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    out = tmp_path / "run"
    done = subprocess.run(th.mgk_cmd("train", "--attention", "softmax", "--steps", "1", "--out", str(out),
                                     *th.sets(*th.TINY)), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "env.json").read_text())["threads"] == want


def test_the_small_model_rule_leaves_larger_models_and_library_calls_alone(tmp_path, th, monkeypatch):
    """Only `mgk train` (a process of its own) applies the rule: fit() called as a library leaves the caller's
    threads alone, and a model at or above the limit keeps torch's threads."""
    import torch

    from mgk.train import loop

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the caller's setting, which only the small-model rule may change
        cfg = config_mod.validate(config_mod.apply_overrides(config_mod.RunConfig(), [*th.TINY, "steps=1"],
                                                             attention="softmax"))
        loop.fit(cfg, tmp_path / "lib")
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(loop, "SMALL_MODEL_PARAMS", 1)
        loop.fit(cfg, tmp_path / "big", small_model_threads=True)
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(loop, "SMALL_MODEL_PARAMS", 10**12)
        loop.fit(cfg, tmp_path / "small", small_model_threads=True)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
