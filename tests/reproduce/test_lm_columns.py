"""WikiText-103 (the paper's Table 3) is reported with a validation and a test column, each with its evaluation
window: the grid evaluates the test split (same window as validation) when the data has one, the report and
`mgk table` show both. No training here: run directories are written by hand."""
import json
import subprocess
import sys
from pathlib import Path

import yaml

from mgk.reproduce import expand, get_experiment
from mgk.reproduce.executor import record_path, run_state
from mgk.reproduce.grid import parse_only
from mgk.reproduce.report import build_report, render

REPO = Path(__file__).resolve().parents[2]
PPL = {("softmax-8", 0): (34.0, 35.5), ("softmax-8", 1): (36.0, 36.5), ("mgk-4", 0): (33.0, 34.0)}


def _wikitext(folder: Path, splits) -> Path:
    folder.mkdir(parents=True)
    for s in splits:
        (folder / f"wiki.{s}.tokens").write_text(" = Title = \n the cat sat on the mat . \n" * 20)
    return folder


def _lm_run(d: Path, attention: str, heads: int, seed: int, valid: float, test: float, key: str | None = None,
            window=(256, 1)) -> None:
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"task": "lm", "attention": attention, "num_heads": heads}))
    res = {"task": "lm", "attention": attention, "num_heads": heads, "seed": seed, "params": 1000, "steps": 6,
           "protocol": {"segment_len": 512}, "val": {"ppl": valid + 5, "loss": 3.7}, "test": {"ppl": test + 5}}
    (d / "results.json").write_text(json.dumps(res))
    for name, split, ppl in (("eval.json", "valid", valid), ("eval_test.json", "test", test)):
        (d / name).write_text(json.dumps({"ppl": ppl, "split": split, "context": window[0], "stride": window[1],
                                          "protocol": "sliding"}))
    if key is not None:
        record_path(d).write_text(json.dumps({"key": key, "status": "done"}))


def test_a_test_split_in_the_data_adds_a_test_evaluation_with_the_validation_window(tmp_path):
    exp = get_experiment("wt103")
    full = _wikitext(tmp_path / "full", ("train", "valid", "test"))
    [run] = expand(exp, "paper", [0], tmp_path / "out", only=parse_only(["row=mgk-4"]), data={"lm": str(full)})
    assert run.test_eval
    lines = run.describe("python").splitlines()
    assert len(lines) == 3 and "--split valid --context 256 --stride 1" in lines[1]
    assert "--split test --context 256 --stride 1" in lines[2] and lines[2].endswith(str(run.eval_test_json))
    no_test = _wikitext(tmp_path / "no_test", ("train", "valid"))
    [run] = expand(exp, "paper", [0], tmp_path / "out", only=parse_only(["row=mgk-4"]), data={"lm": str(no_test)})
    assert not run.test_eval and len(run.describe("python").splitlines()) == 2
    [smoke] = expand(exp, "smoke", [0], tmp_path / "out", only=parse_only(["row=mgk-4"]))
    assert smoke.test_eval  # the generated corpus has a test split


def test_a_run_evaluated_on_valid_only_is_evaluated_on_test_before_it_counts_as_finished(tmp_path):
    exp = get_experiment("wt103")
    [run] = expand(exp, "smoke", [0], tmp_path, only=parse_only(["row=mgk-4"]))
    _lm_run(run.run_dir, "mgk", 4, 0, 33.0, 34.0, key=run.key)
    assert run_state(run) == "finished"
    run.eval_test_json.unlink()
    assert run_state(run) == "evaluate"


def test_report_has_a_valid_and_a_test_column_each_with_its_window(tmp_path):
    exp = get_experiment("wt103")
    runs = expand(exp, "smoke", [0, 1], tmp_path, only=parse_only(["row=softmax-8,mgk-4"]))
    records = []
    for r in runs:
        if (r.row.key, r.seed) in PPL:
            _lm_run(r.run_dir, r.row.attention, r.row.heads, r.seed, *PPL[(r.row.key, r.seed)], key=r.key)
            records.append({"status": "done"})
        else:
            records.append({"status": "failed", "error": "`mgk train` exited with 1"})
    rep = build_report(exp, "smoke", runs, records, "cmd")
    cells = {c["row"]: c for c in rep["rows"]}
    soft = cells["softmax-8"]
    assert soft["mean"] == 35.0 and soft["test"]["n"] == 2 and soft["test"]["mean"] == 36.0
    assert soft["test"]["paper"] == 34.29 and soft["paper"] == 33.15
    assert soft["window"] == ["context 256, stride 1"] and soft["test_window"] == ["context 256, stride 1"]
    assert cells["mgk-4"]["test"]["n"] == 1
    md = render(rep)
    assert "(valid perplexity) | n | paper | test perplexity | n | paper | evaluation window |" in md
    assert ("| softmax x 8 | 35.00 ± 1.41 | 2/2 | 33.15 | 36.00 ± 0.71 | 2/2 | 34.29 | valid: context 256, stride 1; "
            "test: context 256, stride 1 |") in md


def test_mgk_table_of_lm_runs_shows_valid_and_test_perplexity_with_their_windows(tmp_path):
    _lm_run(tmp_path / "a", "softmax", 8, 0, 34.0, 35.5)
    _lm_run(tmp_path / "b", "softmax", 8, 1, 36.0, 36.5)
    _lm_run(tmp_path / "c", "mgk", 4, 0, 33.0, 34.0, window=(64, 64))
    (tmp_path / "c" / "eval_test.json").unlink()  # no mgk eval on test: the training's final test figure
    p = subprocess.run([sys.executable, "-m", "mgk", "table", str(tmp_path)], capture_output=True, text=True,
                       cwd=REPO, env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "| Attention | Heads | Valid ppl | valid window | Test ppl | test window |" in p.stdout
    assert "| softmax | 8 | 35.00 ± 1.41 (n=2) | context 256, stride 1 | 36.00 ± 0.71 (n=2) | context 256, stride 1 |" \
        in p.stdout
    assert "| mgk | 4 | 33.00 | context 64, stride 64 | 39.00 | context 512, stride 512 |" in p.stdout
    assert "not an LRA task" not in p.stderr and "ListOps" not in p.stdout
