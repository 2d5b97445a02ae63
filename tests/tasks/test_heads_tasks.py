"""The synthetic head-count tasks (dretrieval, mqar, cmqar): answer-only scoring, chance levels of constant
predictors, NMSE sums, the best checkpoint by the lowest NMSE, `mgk data check`, `mgk table`, and tiny
`mgk train` runs end to end."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from mgk.attention import AttentionConfig
from mgk.cli import main
from mgk.config import run_config
from mgk.data import dretrieval as dr
from mgk.data import mqar as mq
from mgk.models import EncoderConfig
from mgk.models.tagger import TokenTagger
from mgk.tasks import cmqar, dretrieval, get_task, mqar
from mgk.tasks.lra_table import lra_table
from mgk.tasks.synthetic_table import synthetic_table
from mgk.train.rundir import read_metrics

TINY = ["batch_size=8", "d_model=16", "head_dim=4", "ffn_dim=16", "classifier_dim=16", "log_every=1",
        "eval_every=2", "warmup_steps=1", "progress=false", "eval_batch_size=16", "gen_train=64", "gen_val=16",
        "gen_test=16"]


def sets(*pairs):
    return [x for p in pairs for x in ("--set", p)]


class Constant(nn.Module):
    """A 'model' whose logits favour one token at every position (or output one number)."""

    def __init__(self, num_classes: int, token: int = 0, value: float = 0.0):
        super().__init__()
        self.num_classes, self.token, self.value = num_classes, token, value

    def forward(self, tokens, padding_mask=None):
        if self.num_classes == 1:
            return torch.full((tokens.shape[0], 1), self.value)
        out = torch.zeros(*tokens.shape, self.num_classes)
        out[..., self.token] = 5.0
        return out


def _mqar_task(tmp_path, compositional=False, **gen):
    cfg = run_config(task="cmqar" if compositional else "mqar", gen_vocab=64, gen_seq_len=32, gen_kv_pairs=4,
                    gen_train=400, gen_val=100, gen_test=100, max_len=32, **gen)
    module = cmqar if compositional else mqar
    return module.build(cfg, module.prepare(cfg, tmp_path)), cfg


def _evaluate(task, model, split):
    ds = task.splits[split]
    _, sums = task.loss(model, task.batch(ds, torch.arange(len(ds)), "cpu"))
    return task.summarise(sums)


@pytest.mark.parametrize("compositional", [False, True])
def test_a_model_predicting_the_majority_token_gets_chance_accuracy(tmp_path, compositional):
    task, _ = _mqar_task(tmp_path, compositional)
    ds = task.splits["test"]
    inputs_majority = int(torch.bincount(ds.inputs.reshape(-1)).argmax())
    answers = ds.targets[ds.targets != mq.IGNORE_INDEX]
    answer_majority = int(torch.bincount(answers).argmax())
    lo, hi = task.spec.pools()["value"]
    assert _evaluate(task, Constant(64, answer_majority), "test")["acc"] == pytest.approx(
        task.describe(ds)["majority_acc"])
    assert task.describe(ds)["majority_acc"] < 4 / (hi - lo)  # chance: 1 / number of values, up to sampling
    if not lo <= inputs_majority < hi:
        assert _evaluate(task, Constant(64, inputs_majority), "test")["acc"] == 0.0


def test_loss_and_accuracy_ignore_every_position_without_an_answer(tmp_path):
    task, _ = _mqar_task(tmp_path)
    batch = task.batch(task.splits["train"], torch.arange(16), "cpu")
    answer = batch["target"] != mq.IGNORE_INDEX

    class Oracle(nn.Module):  # right at the answers; anything (random) elsewhere
        def __init__(self, noise):
            super().__init__()
            self.noise = noise

        def forward(self, tokens, padding_mask=None):
            out = torch.randn(*tokens.shape, 64, generator=torch.Generator().manual_seed(self.noise))
            out[answer] = 0.0
            out[answer, batch["target"][answer]] = 10.0
            return out

    (l1, s1), (l2, s2) = (task.loss(Oracle(k), batch) for k in (1, 2))
    assert s1["correct"] == s1["count"] == int(answer.sum()) == 16 * 4
    assert torch.equal(l1, l2) and float(s1["loss"]) == float(s2["loss"])
    expected = torch.nn.functional.cross_entropy(Oracle(1)(batch["tokens"])[answer], batch["target"][answer],
                                                 reduction="sum")
    assert float(s1["loss"]) == pytest.approx(float(expected)) and float(l1) == pytest.approx(float(expected) / 4)


def _dretrieval_task(tmp_path, **gen):
    cfg = run_config(task="dretrieval", gen_seq_len=8, gen_features=3, gen_vocab=32, gen_train=400, gen_val=100,
                    gen_test=100, **gen)
    return dretrieval.build(cfg, dretrieval.prepare(cfg, tmp_path)), cfg


def test_predicting_the_train_mean_gives_the_constant_nmse_near_one(tmp_path):
    task, _ = _dretrieval_task(tmp_path)
    m = _evaluate(task, Constant(1, value=0.0), "test")  # 0 in standardised units = the train mean
    facts = task.describe(task.splits["test"])
    assert m["nmse"] == pytest.approx(facts["constant_nmse"], rel=1e-5) and 0.9 < m["nmse"] < 1.2


def test_nmse_from_batch_sums_equals_the_nmse_of_the_whole_split(tmp_path):
    task, _ = _dretrieval_task(tmp_path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(task.vocab_size, 4), nn.Flatten(), nn.Linear(4 * 9, 1))
    ds = task.splits["test"]
    totals = {}
    for part in torch.arange(len(ds)).split(37):  # uneven batches: the statistics must be additive
        _, sums = task.loss(model, task.batch(ds, part, "cpu"))
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    with torch.no_grad():
        pred = model(ds.tokens)[:, 0].double() * task.target_std + task.target_mean
    assert task.summarise(totals)["nmse"] == pytest.approx(dr.nmse(pred.numpy(), ds.targets.numpy()), rel=1e-4)


def test_batches_put_the_class_token_first(tmp_path):
    task, cfg = _dretrieval_task(tmp_path)
    b = task.batch(task.splits["val"], torch.tensor([0, 5]), "cpu")
    assert b["tokens"].shape == (2, 9) and (b["tokens"][:, 0] == 32).all() and b["tokens"][:, 1:].max() < 32
    assert task.best_metric == ("nmse", "min") and task.vocab_size == 33 and task.num_classes == 1
    with pytest.raises(ValueError, match="max_len >= 9"):
        dretrieval.build(run_config(task="dretrieval", max_len=8), tmp_path / "data")


def test_mqar_build_refuses_the_other_form_and_a_short_max_len(tmp_path):
    _, cfg = _mqar_task(tmp_path)
    with pytest.raises(ValueError, match="plain MQAR data, but task cmqar is the compositional form"):
        cmqar.build(cfg, tmp_path / "data")
    with pytest.raises(ValueError, match="max_len >= 32"):
        mqar.build(run_config(task="mqar", max_len=16), tmp_path / "data")
    with pytest.raises(ValueError, match="gen_kv_pairs"):
        mqar.spec_of(run_config(task="mqar", gen_vocab=64, gen_seq_len=8, gen_kv_pairs=4))


def test_the_tagger_is_causal():
    torch.manual_seed(0)
    cfg = EncoderConfig(vocab_size=20, num_classes=20, max_len=12, d_model=16, num_layers=2, ffn_dim=16,
                        dropout=0.0, attention=AttentionConfig(kind="softmax", num_heads=2, head_dim=8))
    m = TokenTagger(cfg, causal=True).eval()
    x = torch.randint(0, 20, (3, 12))
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % 20
    with torch.no_grad():
        a, b = m(x), m(y)
    assert a.shape == (3, 12, 20)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


# ----------------------------------------------------------------- end to end through the CLI


def test_dretrieval_trains_and_keeps_the_lowest_validation_nmse(tmp_path):
    out = tmp_path / "run"
    main(["train", "--task", "dretrieval", "--attention", "softmax", "--heads", "2", "--steps", "6", "--out",
          str(out), *sets(*TINY, "gen_seq_len=6", "gen_features=2", "gen_vocab=16", "lr=1e-2")])
    res = json.loads((out / "results.json").read_text())
    assert res["task"] == "dretrieval" and set(res["test"]) >= {"nmse", "loss", "constant_nmse", "num_features"}
    assert res["test"]["num_features"] == 2 and res["test"]["count"] == len(dr.load_split(out / "data", "test"))
    vals = {r["step"]: r["val/nmse"] for r in read_metrics(out) if "val/nmse" in r}
    assert res["best_step"] == min(vals, key=vals.get) and res["val"]["nmse"] == pytest.approx(min(vals.values()))


@pytest.mark.parametrize("task", ["mqar", "cmqar"])
def test_mqar_trains_end_to_end(tmp_path, task):
    out = tmp_path / task
    kv = "gen_kv_pairs=4"
    main(["train", "--task", task, "--attention", "linear", "--heads", "2", "--steps", "3", "--out", str(out),
          *sets(*TINY, "gen_vocab=48", "gen_seq_len=32", kv, "max_len=32")])
    res = json.loads((out / "results.json").read_text())
    assert res["task"] == task and 0.0 <= res["test"]["acc"] <= 1.0
    assert res["test"]["count"] == 4 * len(mq.load_split(out / "data", "test"))  # answers only
    assert res["test"]["compositional"] is (task == "cmqar")


def test_data_check_accepts_generated_data_and_names_a_broken_file(tmp_path, capsys):
    task, _ = _dretrieval_task(tmp_path / "d")
    _mqar_task(tmp_path / "m")
    assert main(["data", "check", "--task", "dretrieval", "--data", str(tmp_path / "d" / "data")]) == 0
    assert main(["data", "check", "--task", "mqar", "--data", str(tmp_path / "m" / "data")]) == 0
    out = capsys.readouterr().out
    assert "T=8, D=3, V=32" in out and "V=64, L=32, 4 pairs" in out
    val = dr.split_path(tmp_path / "d" / "data", "val")
    train = dr.load_split(tmp_path / "d" / "data", "train")
    with np.load(val) as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(inputs=train.inputs[:5], targets=train.targets[:5], features=train.features[:5])
    np.savez(val, **arrays)  # val now repeats train rows
    assert main(["data", "check", "--task", "dretrieval", "--data", str(tmp_path / "d" / "data")]) == 1
    assert "dretrieval_val.npz: 5 input sequences also in train" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["dretrieval", "mqar"])
def test_data_check_names_shared_inputs_and_missing_splits_alike_for_both_tasks(task, tmp_path, capsys):
    """Both synthetic tasks read their splits through one helper: a test split repeating val's inputs is an error
    naming both files, a missing val split a note, a missing train split an error."""
    module = dr if task == "dretrieval" else mq
    (_dretrieval_task if task == "dretrieval" else _mqar_task)(tmp_path)
    data = tmp_path / "data"
    val = module.load_split(data, "val")
    test = module.split_path(data, "test")
    with np.load(test) as z, np.load(module.split_path(data, "val")) as zv:
        arrays = {k: z[k].copy() for k in z.files}
        for k in z.files:  # the first 3 rows of every per-row array become val's (a valid file repeating val)
            if arrays[k].ndim and arrays[k].shape[0] == len(module.load_split(data, "test")):
                arrays[k][:3] = zv[k][:3]
    np.savez(test, **arrays)
    assert main(["data", "check", "--task", task, "--data", str(data)]) == 1
    assert f"{test.name}: 3 input sequences also in val ({val.source})" in capsys.readouterr().err
    module.split_path(data, "val").unlink()
    main(["data", "check", "--task", task, "--data", str(data)])
    assert f"val: {task}_val.npz absent in {data}" in capsys.readouterr().out
    module.split_path(data, "train").unlink()
    assert main(["data", "check", "--task", task, "--data", str(data)]) == 1
    assert f"train: {task}_train.npz absent in {data}" in capsys.readouterr().err


def test_table_has_a_row_per_kind_heads_and_keys(tmp_path, capsys):
    def run(name, task, kind, heads, nmse=None, acc=None, keys=None, seed=0):
        d = tmp_path / name
        d.mkdir()
        split = ({"nmse": nmse, "num_features": 4, "seq_len": 16} if task == "dretrieval"
                 else {"acc": acc, "num_kv_pairs": 8, "seq_len": 64})
        res = {"task": task, "attention": kind, "num_heads": heads, "seed": seed, "pi": "learned" if keys else None,
               "attention_options": {"num_keys": keys} if keys else {}, "test": split, "val": None}
        (d / "results.json").write_text(json.dumps(res))
        return str(d)

    dirs = [run("a", "dretrieval", "softmax", 8, nmse=0.01), run("b", "dretrieval", "softmax", 8, nmse=0.03, seed=1),
            run("c", "dretrieval", "mgk", 1, nmse=0.2, keys=2), run("d", "dretrieval", "mgk", 1, nmse=0.1, keys=4),
            run("e", "mqar", "linear", 4, acc=0.5), run("f", "listops", "softmax", 8, acc=0.3)]
    assert main(["table", *dirs]) == 0
    out = capsys.readouterr().out
    assert "| softmax | 8 | — | 0.0200 ± 0.0141 (n=2) | — |" in out
    assert "| mgk | 1 | 2 | 0.2000 | — |" in out and "| mgk | 1 | 4 | 0.1000 | — |" in out
    assert "| linear | 4 | — | — | 50.00 |" in out and "dretrieval D=4, T=16 (NMSE)" in out
    assert "| Attention | Heads | ListOps |" in out  # the LRA table is still there for the ListOps run
    assert synthetic_table([{"task": "listops"}]) == ("", [])
    _, warnings = lra_table([{"task": "mqar", "attention": "linear", "num_heads": 4, "test": {"loss": 1.0}}])
    assert warnings == ["run of task mqar (linear x 4) left out: no test or validation acc"]


def test_every_synthetic_task_is_registered_with_a_small_preset():
    for name in ("dretrieval", "mqar", "cmqar"):
        module = get_task(name)
        assert f"{name}-small" in module.PRESETS and module.PRESETS[f"{name}-small"].task == name


@pytest.mark.parametrize("task", ["dretrieval", "mqar"])
def test_load_run_gives_back_the_trained_model_without_the_data(tmp_path, task):
    import mgk

    out = tmp_path / task
    gen = ["gen_seq_len=6", "gen_features=2", "gen_vocab=16"] if task == "dretrieval" else \
        ["gen_vocab=48", "gen_seq_len=32", "gen_kv_pairs=4", "max_len=32"]
    main(["train", "--task", task, "--attention", "mgk", "--heads", "2", "--steps", "2", "--out", str(out),
          *sets(*TINY, *gen)])
    run = mgk.load_run(out)
    assert run.task.splits == {} and run.tokenizer is None and run.finished and run.failure is None
    full = run.with_splits()
    ds = full.task.splits["test"]
    batch = full.task.batch(ds, torch.arange(4), "cpu")
    with torch.no_grad():
        again = full.task.summarise(full.task.loss(run.model, full.task.batch(ds, torch.arange(len(ds)), "cpu"))[1])
    res = json.loads((out / "results.json").read_text())
    metric = "nmse" if task == "dretrieval" else "acc"
    assert again[metric] == pytest.approx(res["test"][metric], rel=1e-5)  # the best checkpoint's test figure
    assert batch["tokens"].shape[0] == 4
    if task == "dretrieval":
        with pytest.raises(ValueError, match="train split's mean and std"):
            run.task.batch(ds, torch.arange(2), "cpu")


def test_a_failed_synthetic_run_is_left_out_of_the_table_and_listed():
    ok = {"task": "dretrieval", "attention": "softmax", "num_heads": 2, "seed": 0,
          "test": {"nmse": 0.1, "loss": 0.1, "num_features": 4, "seq_len": 16}}
    bad = {**ok, "seed": 1, "failed": "non-finite loss at step 40",
           "test": {"nmse": 0.5, "loss": float("nan"), "num_features": 4, "seq_len": 16}}
    table, warnings = synthetic_table([ok, bad])
    assert "| softmax | 2 | — | 0.1000 |" in table and "0.3000" not in table
    assert "failed (final evaluation not finite): 1 run(s)" in table and "seed 1: non-finite loss at step 40" in table
    assert warnings == ["run of dretrieval softmax x 2 seed 1 left out: failed (non-finite loss at step 40)"]
    only_bad, _ = synthetic_table([bad])
    assert "failed (final evaluation not finite): 1 run(s)" in only_bad


def test_table_rows_carry_the_registry_label_of_a_variant():
    base = {"task": "mqar", "num_heads": 1, "seed": 0, "test": {"acc": 0.5, "loss": 1.0, "num_kv_pairs": 8,
                                                               "seq_len": 64}}
    rows = [{**base, "attention": "smgk", "pi": "hard_e", "attention_options": {"num_keys": 2, "pi": "hard_e"}},
            {**base, "attention": "mlk", "pi": "learned", "attention_options": {"num_keys": 2, "mix": "keys"}},
            {**base, "attention": "softmax", "pi": None, "attention_options": {}}]
    table, _ = synthetic_table(rows)
    body = [line for line in table.splitlines() if line.startswith("| ") and "Attention" not in line]
    assert [line.split(" | ")[0] for line in body] == ["| softmax", "| smgk+hard_e", "| mlk+mix=keys"]
