"""The `heads` experiment of `mgk reproduce`: its rows and task settings, and its report from run directories
written here by hand (no training): NMSE (lower is better) beside accuracy, the constant predictor's level, the
comparisons of row pairs against the seeds' standard deviations, and the metric-against-heads figures."""
import json
import statistics

import pytest
import yaml

from mgk.attention import get_kind
from mgk.reproduce import expand, get_experiment
from mgk.reproduce.collect import attention_flops
from mgk.reproduce.executor import record_path
from mgk.reproduce.grid import parse_only
from mgk.reproduce.plots import plot_metric_vs_heads
from mgk.reproduce.report import build_report, compare, render


def test_heads_rows_run_on_their_own_tasks():
    exp = get_experiment("heads")
    rows = {r.key: r for r in exp.rows}
    d_rows = {f"softmax-{h}" for h in (1, 2, 4, 8)} | {f"{k}-{h}" for k in ("mgk", "smgk") for h in (1, 2, 4)}
    gqa = {f"gqa-8-kv{g}" for g in (4, 2, 1)}  # the baselines of results/cpu/kv-budget.md
    gmgk = {"gmgk-8-kv2-shifted", "gmgk-8-kv1"}  # results/cpu/mixture-keys-at-gqa-cache.md
    assert {k for k, r in rows.items() if r.runs_on("dretrieval-d8")} == d_rows | {"mgk-1-m4"} | gqa | gmgk
    assert {k for k, r in rows.items() if r.runs_on("mqar-n8")} == (
        {f"linear-{h}" for h in (1, 2, 4, 8)} | {f"mlk-{h}" for h in (1, 2, 4)})
    assert rows["mgk-4"].keys_per_head == 2 and rows["mgk-1-m4"].keys_per_head == 4
    assert rows["softmax-8"].keys_per_head == 1 and rows["mlk-2"].keys_per_head == 2
    assert rows["mgk-1-m4"].label == "MGK x 1, M = 4" and rows["mgk-1"].label == "MGK x 1"  # told apart
    # every comparison names rows of the experiment; the primary pair is M = 2 keys at half the heads
    assert all(a in rows and b in rows for a, b in exp.comparisons) and ("mgk-4", "softmax-8") in exp.comparisons
    assert ("mgk-4", "gqa-8-kv2") in exp.comparisons and ("smgk-4", "gqa-8-kv4") in exp.comparisons
    assert rows["gqa-8-kv2"].label == "GQA x 8 (kv 2)" and rows["gqa-8-kv1"].label == "MQA x 8"
    assert rows["gqa-8-kv2"].options.num_kv_heads == 2 and rows["gqa-8-kv2"].keys_per_head == 1
    shifted, grouped = rows["gmgk-8-kv2-shifted"].options, rows["gmgk-8-kv1"].options
    assert (shifted.num_kv_heads, shifted.keys, grouped.num_kv_heads, grouped.keys) == (2, "shifted", 1, "separate")
    assert ("gmgk-8-kv2-shifted", "gqa-8-kv2") in exp.comparisons and ("gmgk-8-kv1", "gqa-8-kv2") in exp.comparisons


def test_kv_budget_rows_and_their_costs():
    """results/cpu/kv-budget.md: GQA-8 (kv 2) has MGK-4's attention parameters and a third of its cache bytes."""
    from mgk.config import apply_overrides
    from mgk.reproduce.collect import attention_cache_bytes
    from mgk.tasks.lm import PRESETS

    exp = get_experiment("kv-budget")
    assert [r.key for r in exp.rows] == ["softmax-8", "softmax-4", "gqa-8-kv4", "gqa-8-kv2", "gqa-8-kv1", "mgk-4",
                                         "smgk-4", "gmgk-8-kv2-shifted", "gmgk-8-kv1"]
    assert exp.metric == "ppl" and exp.tasks == ("lm",) and ("mgk-4", "gqa-8-kv2") in exp.comparisons
    cache = {}
    for row in exp.rows:
        pi = {"pi": row.pi} if "pi" in get_kind(row.attention).options.names() else {}
        cfg = apply_overrides(PRESETS["lm-small"], row.overrides, attention=row.attention, num_heads=row.heads, **pi)
        cache[row.key] = attention_cache_bytes(cfg)
    D = 16  # lm-small's head_dim
    assert cache["softmax-8"] == 2 * 8 * D * 4 and cache["gqa-8-kv2"] == cache["softmax-8"] // 4
    assert cache["mgk-4"] == 4 * (2 * D + D + 2) * 4 and cache["gqa-8-kv1"] == cache["softmax-8"] // 8
    # results/cpu/mixture-keys-at-gqa-cache.md: GQA-8 (kv 2)'s cache plus M scalars per key, and less than it
    assert cache["gmgk-8-kv2-shifted"] == 2 * (2 * D + 2) * 4 == 272 and cache["gmgk-8-kv1"] == (3 * D + 2) * 4 == 200


def test_heads_grid_commands(tmp_path):
    exp = get_experiment("heads")
    runs = expand(exp, "cpu", [0], tmp_path, only=parse_only(["row=softmax-8,mgk-1-m4,mlk-4"]))
    assert sorted((r.row.key, r.task) for r in runs) == sorted(
        [(k, f"dretrieval-d{d}") for k in ("softmax-8", "mgk-1-m4") for d in (2, 4, 8)] + [("mlk-4", "mqar-n8")])
    by = {(r.row.key, r.task): r.train_command("python") for r in runs}
    cmd = by[("mgk-1-m4", "dretrieval-d8")]
    assert cmd[cmd.index("--task") + 1] == "dretrieval" and cmd[cmd.index("--preset") + 1] == "dretrieval-small"
    assert "gen_features=8" in cmd and "num_keys=4" in cmd and cmd[cmd.index("--heads") + 1] == "1"
    mq = by[("mlk-4", "mqar-n8")]
    assert mq[mq.index("--task") + 1] == "mqar" and "steps=6000" in mq and "--data" not in mq
    assert len({r.key for r in runs}) == len(runs)
    smoke = expand(exp, "smoke", [0], tmp_path, only=parse_only(["row=softmax-8", "task=dretrieval-d4"]))
    assert "steps=6" in smoke[0].train_command("python") and "gen_features=4" in smoke[0].train_command("python")


def _fake(run, value, metric="nmse"):
    d = run.run_dir
    (d / "checkpoints").mkdir(parents=True)
    task = run.setting.task
    (d / "config.yaml").write_text(yaml.safe_dump({"task": task, "attention": run.row.attention,
                                                   "num_heads": run.row.heads, "d_model": 64, "head_dim": 8,
                                                   "num_layers": 1, "steps": 6, "gen_seq_len": 16}))
    split = {"nmse": value, "constant_nmse": 1.0} if metric == "nmse" else {"acc": value, "majority_acc": 0.02}
    res = {"task": task, "attention": run.row.attention, "num_heads": run.row.heads, "params": 1000, "steps": 6,
           "seconds_per_step": 0.1, "val": split, "test": split}
    (d / "results.json").write_text(json.dumps(res))
    key = "val/nmse" if metric == "nmse" else "val/acc"
    (d / "metrics.jsonl").write_text(json.dumps({"step": 6, key: value}) + "\n")
    record_path(d).write_text(json.dumps({"key": run.key, "status": "done"}))


NMSE = {"softmax-8": (0.040, 0.030, 0.050), "softmax-2": (0.170, 0.180, 0.160), "mgk-4": (0.045, 0.035, 0.060),
        "mgk-1": (0.300, 0.310, 0.290)}


def test_heads_report_nmse_comparisons_and_figures(tmp_path):
    exp = get_experiment("heads")
    runs = expand(exp, "smoke", [0, 1, 2], tmp_path, only=parse_only(["row=" + ",".join(NMSE),
                                                                      "task=dretrieval-d8"]))
    for r in runs:
        _fake(r, NMSE[r.row.key][r.seed])
    rep = build_report(exp, "smoke", runs, [{"status": "done"}] * len(runs), "mgk reproduce heads ...")
    cells = {c["row"]: c for c in rep["rows"]}
    assert cells["mgk-4"]["metric"] == "nmse" and cells["mgk-4"]["better"] == "lower"
    assert cells["mgk-4"]["mean"] == pytest.approx(statistics.fmean(NMSE["mgk-4"]))  # NMSE as is, not x 100
    assert cells["mgk-4"]["constant"] == 1.0 and cells["mgk-4"]["keys"] == 2 and cells["mgk-4"]["heads"] == 4
    verdicts = {(c["row"], c["reference"]): c["verdict"] for c in rep["comparisons"]}
    assert verdicts[("softmax-8", "softmax-2")] == "better"  # lower NMSE
    assert verdicts[("mgk-4", "softmax-8")] == "within one std"
    assert verdicts[("mgk-1", "softmax-2")] == "worse"
    assert ("linear-8", "linear-4") not in verdicts  # rows that did not run are not compared
    md = render(rep)
    assert f"| MGK x 4 | {statistics.fmean(NMSE['mgk-4']):.4f} ± {statistics.stdev(NMSE['mgk-4']):.4f} | 3/3 |" in md
    assert "lower is better" in md and "yes (1.000)" in md and "| 4 x 2 |" in md and "## Comparisons" in md
    [png] = plot_metric_vs_heads(tmp_path / "plots", rep)
    assert png.name == "metric_vs_heads_dretrieval-d8.png" and png.read_bytes()[:4] == b"\x89PNG"


def _cell(row, mean, std, n=3, better="higher"):
    return {"row": row, "task": "t", "mean": mean, "std": std, "n": n, "better": better, "metric": "acc"}


def test_compare_uses_the_larger_std_and_the_tasks_direction():
    cells = [_cell("a", 50.0, 1.0), _cell("b", 52.0, 2.0), _cell("c", 55.0, 1.0), _cell("d", 40.0, 5.0, n=1)]
    out = {(c["row"], c["reference"]): c for c in compare(cells, [("a", "b"), ("c", "b"), ("a", "c"), ("a", "d")])}
    assert out[("a", "b")]["verdict"] == "within one std"  # |d| = 2 = the larger std: within
    assert out[("a", "b")]["larger_std"] == 2.0 and out[("a", "b")]["pooled_std"] == pytest.approx((2.5) ** 0.5)
    assert out[("c", "b")]["verdict"] == "better" and out[("a", "c")]["verdict"] == "worse"  # accuracy: higher
    assert ("a", "d") not in out  # one seed has no std
    low = [dict(c, better="lower") for c in cells]
    assert {(c["row"], c["reference"]): c["verdict"] for c in compare(low, [("c", "b")])} == {("c", "b"): "worse"}


def test_attention_flops_of_the_generated_tasks_use_their_own_length():
    from mgk.config import run_config

    sizes = dict(attention="softmax", num_heads=8, max_len=128, d_model=64, head_dim=8, num_layers=1)
    short = attention_flops(run_config(task="dretrieval", gen_seq_len=16, **sizes))
    long = attention_flops(run_config(task="dretrieval", gen_seq_len=32, **sizes))
    assert 0 < short < long  # T + 1 tokens, not max_len (the same for both)
    full = attention_flops(run_config(task="mqar", gen_seq_len=64, **sizes))
    assert full < attention_flops(run_config(task="dretrieval", gen_seq_len=63, **sizes))  # MQAR is causal
