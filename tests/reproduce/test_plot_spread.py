"""The plots of `mgk reproduce` show the seed spread, read from the matplotlib objects (not pixels): a band of
± 1 sample std around each row's mean learning curve, and error bars of ± 1 std on the metric-vs-parameters
points. Run directories are written by hand (no training)."""
import json
import statistics

import numpy as np
import pytest
import yaml
from matplotlib.collections import PolyCollection

from mgk.reproduce import expand, get_experiment
from mgk.reproduce.executor import record_path
from mgk.reproduce.grid import parse_only
from mgk.reproduce.plots import plot_accuracy_vs_params, plot_learning_curves
from mgk.reproduce.report import build_report

ACC = {"softmax-8": (0.30, 0.34, 0.38), "mgk-4": (0.31, 0.29, 0.33)}


def _fake_run(run, acc):
    d = run.run_dir
    (d / "checkpoints").mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"task": run.task, "attention": run.row.attention,
                                                   "num_heads": run.row.heads, "max_len": 128}))
    res = {"task": run.task, "attention": run.row.attention, "num_heads": run.row.heads, "pi": run.row.pi,
           "params": 1000, "params_attention": 100 * run.row.heads, "steps": 6,
           "val": {"acc": acc, "majority_acc": 0.2}, "test": {"acc": acc, "majority_acc": 0.2}}
    (d / "results.json").write_text(json.dumps(res))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 3, "val/acc": acc / 2}) + "\n"
                                     + json.dumps({"step": 6, "val/acc": acc}) + "\n")
    record_path(d).write_text(json.dumps({"key": run.key, "status": "done"}))



def _runs(tmp_path):
    exp = get_experiment("lra-softmax-family")
    runs = expand(exp, "smoke", [0, 1, 2], tmp_path, only=parse_only(["row=softmax-8,mgk-4", "task=listops"]))
    for r in runs:
        _fake_run(r, ACC[r.row.key][r.seed])
    return exp, runs


def test_learning_curves_have_a_band_of_one_std_over_seeds(tmp_path, saved):
    exp, runs = _runs(tmp_path)
    plot_learning_curves(tmp_path / "plots", runs, "acc")
    [fig] = saved
    [ax] = fig.axes
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert set(lines) == {"softmax x 8", "MGK x 4"} and len(bands) == 2
    for (key, accs), band in zip(ACC.items(), bands):
        line = lines["softmax x 8" if key == "softmax-8" else "MGK x 4"]
        assert list(line.get_xdata()) == [3, 6]
        assert line.get_ydata()[1] == pytest.approx(statistics.fmean(accs))
        verts = band.get_paths()[0].vertices
        at6 = verts[np.isclose(verts[:, 0], 6.0)][:, 1]
        sd = statistics.stdev(accs)
        assert min(at6) == pytest.approx(statistics.fmean(accs) - sd) and max(at6) == pytest.approx(
            statistics.fmean(accs) + sd)


def test_metric_vs_parameters_has_error_bars_of_one_std_over_seeds(tmp_path, saved):
    exp, runs = _runs(tmp_path)
    rep = build_report(exp, "smoke", runs, [{"status": "done"}] * len(runs), "cmd")
    saved.clear()
    plot_accuracy_vs_params(tmp_path / "plots", rep)
    [fig] = saved
    [ax] = fig.axes
    assert len(ax.containers) == 2  # one errorbar container per task and kind (one task, two kinds)
    segments = {round(float(s[0][0])): (float(s[0][1]), float(s[1][1]))
                for _, _, (yerr,) in ax.containers for s in yerr.get_segments()}
    for key, heads in (("softmax-8", 8), ("mgk-4", 4)):
        mean, sd = 100 * statistics.fmean(ACC[key]), 100 * statistics.stdev(ACC[key])
        lo, hi = segments[100 * heads]
        assert lo == pytest.approx(mean - sd) and hi == pytest.approx(mean + sd)


def test_one_seed_draws_no_band(tmp_path, saved):
    exp = get_experiment("lra-softmax-family")
    [run] = expand(exp, "smoke", [0], tmp_path, only=parse_only(["row=mgk-4", "task=listops"]))
    _fake_run(run, 0.3)
    plot_learning_curves(tmp_path / "plots", [run], "acc")
    [fig] = saved
    assert not [c for c in fig.axes[0].collections if isinstance(c, PolyCollection)]
