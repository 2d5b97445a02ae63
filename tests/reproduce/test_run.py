"""`mgk reproduce` end to end at the smoke scale: the grid runs, resumes, never re-runs a finished run, reports
failures, and runs through submitit's local executor."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mgk.reproduce.executor import record_path

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("MGK_DATA_ROOT", REPO / ".." / "shared" / "data"))
LISTOPS_GRID = ["lra-softmax-family", "--scale", "smoke", "--only", "row=softmax-8,mgk-4", "--only", "task=listops"]


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO / "src")}


def _reproduce(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "mgk", "reproduce", *args], capture_output=True, text=True,
                          cwd=REPO, env=_env(), timeout=timeout)


def _finished(out: Path) -> dict:
    return {p.parent: p.stat().st_mtime_ns for p in (out / "runs").rglob("results.json")}


def _attempts(run_dir: Path) -> list:
    return json.loads((record_path(run_dir)).read_text())["attempts"]


def test_smoke_grid_reports_every_row_and_resumes_without_rerunning(tmp_path):
    out = tmp_path / "out"
    p = _reproduce(*LISTOPS_GRID, "--seeds", "0,1", "--jobs", "2", "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads((out / "report.json").read_text())
    assert {(c["row"], c["task"], c["n"]) for c in rep["rows"]} == {("softmax-8", "listops", 2),
                                                                   ("mgk-4", "listops", 2)}
    md = (out / "REPORT.md").read_text()
    assert "| softmax x 8 |" in md and "| MGK x 4 |" in md and "ListOps (generated, short)" in md
    assert (out / "plots" / "learning_curves_listops.png").is_file()
    assert (out / "plots" / "metric_vs_attention_params.png").is_file()
    done = _finished(out)
    assert len(done) == 4
    # Simulate an interruption: one run lost its results (its checkpoint remains), one never started.
    interrupted, lost, *kept = sorted(done)
    assert (interrupted / "checkpoints" / "last.pt").is_file()
    (interrupted / "results.json").unlink()
    import shutil
    shutil.rmtree(lost)
    record_path(lost).unlink()  # the harness's record lives beside the run directory
    p = _reproduce(*LISTOPS_GRID, "--seeds", "0,1", "--jobs", "2", "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("finished earlier, skipped") == 2
    after = _finished(out)
    assert len(after) == 4
    for d in kept:  # finished runs untouched: same results.json, one attempt
        assert after[d] == done[d] and len(_attempts(d)) == 1
    last = _attempts(interrupted)[-1]
    assert last["state"] == "resume" and "--resume" in last["command"] and len(_attempts(interrupted)) == 2
    assert _attempts(lost)[-1]["state"] == "new" and len(_attempts(lost)) == 1
    # A third pass runs nothing, and --analyze compares the rows (seed 0 of each), linked from REPORT.md.
    p = _reproduce(*LISTOPS_GRID, "--seeds", "0,1", "--out", str(out), "--analyze", "4")
    assert p.returncode == 0 and p.stdout.count("finished earlier, skipped") == 4, p.stdout + p.stderr
    assert _finished(out) == after
    entry = json.loads((out / "report.json").read_text())["analysis"]["listops"]
    assert entry["path"] == "analysis/listops/analysis.md" and entry["samples"] == 4
    assert sorted((r["row"], r["seed"]) for r in entry["runs"]) == [("mgk-4", 0), ("softmax-8", 0)]
    assert "](analysis/listops/analysis.md)" in (out / "REPORT.md").read_text()
    assert f"analysis: listops: {out / 'analysis' / 'listops' / 'analysis.md'}" in p.stdout
    compared = json.loads((out / "analysis" / "listops" / "analysis.json").read_text())["runs"]
    assert sorted(compared) == ["mgk-4", "softmax-8"]
    assert all(layer["rank"]["absolute"]["n"] > 0 for r in compared.values() for layer in r["layers"])
    assert entry["prune_path"] == "analysis/listops/prune.md"
    assert "](analysis/listops/prune.md)" in (out / "REPORT.md").read_text()
    pruned = json.loads((out / "analysis" / "listops" / "prune.json").read_text())["runs"]
    assert sorted(pruned) == ["mgk-4", "softmax-8"] and "component" in pruned["mgk-4"]["units"]
    assert pruned["softmax-8"]["units"]["head"]["curve"]["kept"][0] == 2 * 8  # two layers of 8 heads


def test_a_failed_run_is_reported_and_the_others_go_on(tmp_path):
    bogus = tmp_path / "imdb.tar.gz"
    bogus.write_text("not an archive")
    out = tmp_path / "out"
    p = _reproduce("lra-softmax-family", "--scale", "smoke", "--seeds", "0", "--only", "row=softmax-4",
                   "--only", "task=listops,text", "--data", f"text={bogus}", "--out", str(out))
    assert p.returncode == 1
    rep = json.loads((out / "report.json").read_text())
    status = {r["task"]: r for r in rep["runs"]}
    assert status["listops"]["status"] == "done" and status["text"]["status"] == "failed"
    log = Path(status["text"]["log"])
    assert log.is_file() and "mgk train" in log.read_text()
    md = (out / "REPORT.md").read_text()
    assert "text softmax-4 seed 0: failed" in md and str(log) in md


def test_local_executor_through_submitit(tmp_path):
    pytest.importorskip("submitit")
    out = tmp_path / "out"
    p = _reproduce("lra-softmax-family", "--scale", "smoke", "--seeds", "0", "--only", "row=mgk-4", "--only",
                   "task=listops", "--executor", "submitit-local", "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[1/1] listops mgk-4 seed 0: done" in p.stdout
    assert list((out / "submitit").glob("*_log.out")), "submitit wrote no job log"
    [cell] = json.loads((out / "report.json").read_text())["rows"]
    assert cell["n"] == 1 and cell["row"] == "mgk-4"


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "imdb" / "aclImdb_train.tar.gz").is_file(),
                    reason=f"shared IMDb copy {SHARED}/imdb/aclImdb_train.tar.gz absent (set MGK_DATA_ROOT)")
def test_smoke_on_shared_data_killed_part_way_then_finished(tmp_path):
    """`mgk reproduce` at smoke scale on the shared data (two rows x ListOps and Text x seeds 0,1), killed after its
    first finished runs, then run again: it completes and re-runs none of them."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "mgk", "reproduce", "lra-softmax-family", "--scale", "smoke", "--seeds", "0,1",
            "--only", "row=softmax-8,mgk-4", "--only", "task=listops,text", "--data-root", str(SHARED),
            "--jobs", "2", "--out", str(out)]
    proc = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and len(_finished(out) if (out / "runs").exists() else {}) < 2:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the grid and its training processes
    proc.wait()
    done = _finished(out)
    assert 2 <= len(done) < 8
    p = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout + p.stderr
    after = _finished(out)
    assert len(after) == 8 and all(after[d] == t for d, t in done.items())
    rep = json.loads((out / "report.json").read_text())
    assert {(c["row"], c["task"], c["n"]) for c in rep["rows"]} == {
        (r, t, 2) for r in ("softmax-8", "mgk-4") for t in ("listops", "text")}
