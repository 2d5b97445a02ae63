"""The report of `mgk reproduce` from run directories written here by hand (no training): aggregation over seeds,
the paper's number, the split, the majority class, failures and the state of each run directory."""
import json
import statistics

import pytest
import yaml

from mgk.reproduce import expand, get_experiment
from mgk.reproduce.executor import execute_run, record_path, run_state
from mgk.reproduce.grid import parse_only
from mgk.reproduce.report import build_report, render

ACC = {("softmax-8", 0): 0.30, ("softmax-8", 1): 0.34, ("softmax-8", 2): 0.35, ("mgk-4", 0): 0.31,
       ("mgk-4", 1): 0.29}


def _fake_run(run, acc):
    d = run.run_dir
    (d / "checkpoints").mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"task": run.task, "attention": run.row.attention,
                                                   "num_heads": run.row.heads, "pi": run.row.pi, "max_len": 128,
                                                   "d_model": 64, "head_dim": 32, "num_layers": 2, "num_keys": 2,
                                                   "lr": 1e-3, "steps": 6}))
    res = {"task": run.task, "attention": run.row.attention, "num_heads": run.row.heads, "pi": run.row.pi,
           "params": 1000, "steps": 6, "seconds_per_step": 0.5,
           "val": {"acc": acc + 0.01, "majority_acc": 0.2}, "test": {"acc": acc, "majority_acc": 0.25}}
    (d / "results.json").write_text(json.dumps(res))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 3, "val/acc": acc / 2}) + "\n"
                                     + json.dumps({"step": 6, "val/acc": acc}) + "\n")
    (record_path(d)).write_text(json.dumps({"key": run.key, "peak_rss_mb": 400.0, "status": "done"}))


def test_report_aggregates_seeds_beside_the_paper(tmp_path):
    exp = get_experiment("lra-softmax-family")
    runs = expand(exp, "smoke", [0, 1, 2], tmp_path, only=parse_only(["row=softmax-8,mgk-4", "task=listops"]))
    records = []
    for r in runs:
        if (r.row.key, r.seed) in ACC:
            _fake_run(r, ACC[(r.row.key, r.seed)])
            records.append({"status": "done"})
        else:  # mgk-4 seed 2 failed
            records.append({"status": "failed", "error": "`mgk train` exited with 1", "log": "/x/reproduce.log"})
    assert [run_state(r) for r in runs].count("finished") == 5
    rep = build_report(exp, "smoke", runs, records, "mgk reproduce ...")
    cells = {c["row"]: c for c in rep["rows"]}
    soft = [100 * ACC[("softmax-8", s)] for s in range(3)]
    assert cells["softmax-8"]["n"] == 3 and cells["softmax-8"]["planned"] == 3
    assert abs(cells["softmax-8"]["mean"] - statistics.fmean(soft)) < 1e-9
    assert abs(cells["softmax-8"]["std"] - statistics.stdev(soft)) < 1e-9
    assert cells["mgk-4"]["n"] == 2 and cells["mgk-4"]["planned"] == 3
    assert cells["softmax-8"]["paper"] == 37.03 and cells["mgk-4"]["paper"] == 36.98
    assert cells["softmax-8"]["splits"] == ["test"] and cells["softmax-8"]["majority_acc"] == 25.0
    assert cells["softmax-8"]["peak_rss_mb"] == 400.0 and cells["softmax-8"]["flops"] > cells["mgk-4"]["flops"]
    md = render(rep)
    assert f"| softmax x 8 | {statistics.fmean(soft):.2f} ± {statistics.stdev(soft):.2f} | 3/3 | 37.03 | test |" in md
    assert "| MGK x 4 | 30.00 ± 1.41 | 2/3 | 36.98 |" in md
    assert "listops mgk-4 seed 2: failed" in md and "/x/reproduce.log" in md
    assert "yes (25.0)" in md


def test_validation_is_used_without_a_test_split(tmp_path):
    exp = get_experiment("lra-softmax-family")
    [run] = expand(exp, "smoke", [0], tmp_path, only=parse_only(["row=mgk-4", "task=text"]), data_root=tmp_path)
    _fake_run(run, 0.6)
    res = json.loads((run.run_dir / "results.json").read_text())
    res["test"] = None
    (run.run_dir / "results.json").write_text(json.dumps(res))
    rep = build_report(exp, "smoke", [run], [{"status": "done"}], "cmd")
    [cell] = rep["rows"]
    assert cell["splits"] == ["val"] and abs(cell["mean"] - 61.0) < 1e-9 and cell["std"] is None
    assert cell["majority_acc"] == 20.0


def test_run_states_and_a_foreign_directory_is_left_alone(tmp_path):
    [run] = expand(get_experiment("lra-softmax-family"), "smoke", [0], tmp_path,
                   only=parse_only(["row=mgk-4", "task=listops"]))
    assert run_state(run) == "new"
    (run.run_dir / "checkpoints").mkdir(parents=True)
    (run.run_dir / "checkpoints" / "last.pt").write_bytes(b"x")
    assert run_state(run) == "resume"
    _results = run.run_dir / "results.json"
    _results.write_text("{}")
    (record_path(run.run_dir)).write_text(json.dumps({"key": "something-else"}))
    assert run_state(run) == "conflict"
    before = _results.stat().st_mtime_ns
    rec = execute_run(run, "/nonexistent/python")  # would fail loudly if it tried to run anything
    assert rec["status"] == "failed" and "another config" in rec["error"]
    assert _results.stat().st_mtime_ns == before
    (record_path(run.run_dir)).write_text(json.dumps({"key": run.key}))
    assert run_state(run) == "finished" and execute_run(run, "/nonexistent/python")["status"] == "skipped"


def test_a_harness_killed_after_the_run_finished_leaves_its_key(tmp_path, monkeypatch):
    """The run writes results.json, then the harness dies before its own record: the next pass must see a finished
    run of this config, not a foreign directory (the record with the key is written before any command runs)."""
    from mgk.reproduce import executor

    [run] = expand(get_experiment("lra-softmax-family"), "smoke", [0], tmp_path,
                   only=parse_only(["row=mgk-4", "task=listops"]))

    def finish_then_die(cmd, log, env, stop=None):
        run.run_dir.mkdir(parents=True, exist_ok=True)
        (run.run_dir / "results.json").write_text("{}")
        raise KeyboardInterrupt  # as a SIGKILL of the harness right after the training process exits

    monkeypatch.setattr(executor, "_spawn", finish_then_die)
    with pytest.raises(KeyboardInterrupt):
        execute_run(run, "/nonexistent/python")
    assert run_state(run) == "finished"


def test_failed_and_damaged_runs_are_left_out_and_listed(tmp_path):
    """A run whose final evaluation was not finite reports an accuracy (argmax of NaN logits): it must not be averaged
    in as a seed. Nor may a damaged results.json be skipped in silence; a damaged env.json is named."""
    exp = get_experiment("lra-softmax-family")
    runs = expand(exp, "smoke", [0, 1, 2, 3], tmp_path, only=parse_only(["row=mgk-4", "task=listops"]))
    for r, acc in zip(runs, (0.31, 0.29, 0.094, 0.094)):
        _fake_run(r, acc)
    nan = runs[2].run_dir / "results.json"
    nan.write_text(json.dumps({**json.loads(nan.read_text()), "failed": "non-finite val loss (nan) in the final "
                                                                        "evaluation after 6 steps"}))
    older = runs[3].run_dir / "results.json"  # no flag (written before it existed), but a NaN loss
    res = json.loads(older.read_text())
    older.write_text(json.dumps({**res, "test": {**res["test"], "loss": float("nan")}}))
    (runs[1].run_dir / "env.json").write_text('{"mgk": ')
    rep = build_report(exp, "smoke", runs, [{"status": "done"}] * 4, "cmd")
    [cell] = rep["rows"]
    assert cell["n"] == 2 and cell["planned"] == 4 and abs(cell["mean"] - 30.0) < 1e-9
    status = {r["seed"]: (r["status"], r["error"]) for r in rep["runs"]}
    assert status[0] == ("done", None) and status[1] == ("done", None)
    assert status[2][0] == "failed" and "non-finite val loss (nan)" in status[2][1] and str(nan) in status[2][1]
    assert status[3][0] == "failed" and "non-finite test loss (nan)" in status[3][1]
    assert "env.json: line 1: not valid JSON" in rep["runs"][1]["problems"][0]
    md = render(rep)
    assert "| MGK x 4 | 30.00 ± 1.41 | 2/4 |" in md and "2 failed or not run" in md
    assert "listops mgk-4 seed 2: failed: " in md and "damaged file: " in md
    assert "Not in the table, failed (final evaluation not finite): 2 run(s)" in rep["mgk_table"]
    # a damaged results.json: the run is failed, its file named; the report is still written
    (runs[0].run_dir / "results.json").write_text('{"task": "listops", "atte')
    rep = build_report(exp, "smoke", runs, [{"status": "done"}] * 4, "cmd")
    assert rep["rows"][0]["n"] == 1 and rep["runs"][0]["status"] == "failed"
    assert "results.json: line 1: not valid JSON" in rep["runs"][0]["error"]
