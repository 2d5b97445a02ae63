"""The data of a grid is checked per task before anything runs: a missing path or WikiText split (a warning in a
dry run, one error line in a real one), and data given to a scale whose setting was sized for generated data; the
preset of each task is named in the dry run. No training here."""
import subprocess
import sys
from pathlib import Path

from mgk.data.listops import generate_listops, write_listops_tsv
from mgk.reproduce import expand, get_experiment
from mgk.reproduce.data_check import check_data
from mgk.reproduce.report import build_report, render

REPO = Path(__file__).resolve().parents[2]


def _cli(*args):
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "mgk", "reproduce", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)


def _wikitext(folder: Path, splits) -> Path:
    folder.mkdir(parents=True)
    for s in splits:
        (folder / f"wiki.{s}.tokens").write_text(" = Title = \n the cat sat on the mat . \n" * 20)
    return folder


def test_dry_run_warns_per_task_about_a_missing_data_path_and_a_real_run_refuses(tmp_path):
    missing = tmp_path / "no" / "wikitext-103"
    p = _cli("wt103", "--scale", "paper", "--data", f"lm={missing}", "--executor", "slurm", "--dry-run",
             "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    assert "21 runs" in p.stdout and "#SBATCH" in p.stdout  # the dry run still shows everything
    assert f"WARNING: lm: no data at {missing}" in p.stdout
    assert f"warning: lm: no data at {missing}" in p.stderr
    p = _cli("wt103", "--scale", "paper", "--data", f"lm={missing}", "--only", "row=softmax-8", "--seeds", "0",
             "--out", str(tmp_path / "out"))
    assert p.returncode != 0 and p.stderr.count("\n") == 1, p.stderr
    assert f"no data at {missing}" in p.stderr and "nothing was run" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()


def test_a_wikitext_folder_without_train_split_is_refused_and_one_without_test_is_noted(tmp_path):
    exp = get_experiment("wt103")
    no_train = _wikitext(tmp_path / "a", ("valid", "test"))
    runs = expand(exp, "paper", [0], tmp_path / "out", data={"lm": str(no_train)})
    [task] = check_data(runs, "paper", {"lm": str(no_train)})
    assert task.problem is not None and "no train split" in task.problem and str(no_train) in task.problem
    no_test = _wikitext(tmp_path / "b", ("train", "valid"))
    runs = expand(exp, "paper", [0], tmp_path / "out", data={"lm": str(no_test)})
    [task] = check_data(runs, "paper", {"lm": str(no_test)})
    assert task.problem is None and task.notes and "no test split" in task.notes[0]
    assert task.preset == "wt103-paper" and task.runs == len(exp.rows)


def test_paper_scale_of_wt103_runs_the_paper_preset_and_the_dry_run_names_it(tmp_path):
    p = _cli("wt103", "--scale", "paper", "--seeds", "0", "--dry-run", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "# task lm (WikiText-103): 7 runs, preset wt103-paper" in p.stdout
    assert p.stdout.count("--preset wt103-paper") == 7 and "wt103-small" not in p.stdout
    exp = get_experiment("wt103")  # the report names it too
    runs = expand(exp, "paper", [0], tmp_path / "out")
    rep = build_report(exp, "paper", runs, [{"status": "new"}] * len(runs), "cmd")
    assert rep["tasks"][0]["preset"] == "wt103-paper" and "Protocol: preset `wt103-paper`" in render(rep)
    p = _cli("lra-softmax-family", "--scale", "cpu", "--only", "task=listops", "--seeds", "0", "--dry-run",
             "--out", str(tmp_path))
    assert "# task listops (ListOps (generated, short)): 10 runs, preset listops-small with --set steps=800" in p.stdout


def test_lra_release_listops_at_the_smoke_scale_is_refused_once_before_anything_runs(tmp_path):
    """The LRA release (sequences of hundreds of tokens) given to the smoke scale, whose ListOps setting (max_len
    128) was sized for the generated data: one line naming the scale and the setting, no run started."""
    data = tmp_path / "listops"
    rows = generate_listops(40, seed=0, min_length=200, max_length=400, max_depth=6)
    for split in ("train", "val", "test"):
        write_listops_tsv(data / f"basic_{split}.tsv", rows)
    out = tmp_path / "out"
    p = _cli("lra-softmax-family", "--scale", "smoke", "--seeds", "0,1", "--only", "task=listops",
             "--data", f"listops={data}", "--out", str(out))
    assert p.returncode != 0 and p.stderr.count("\n") == 1, p.stderr
    for part in ("smoke scale", "listops-small", "max_len 128", "--scale paper (preset listops-paper)",
                 "nothing was run"):
        assert part in p.stderr, (part, p.stderr)
    assert not out.exists()
    p = _cli("lra-softmax-family", "--scale", "smoke", "--seeds", "0", "--only", "task=listops",
             "--data", f"listops={data}", "--out", str(out), "--dry-run")
    assert p.returncode == 0 and "WARNING: --data listops=" in p.stdout and "smoke scale" in p.stderr


def test_short_listops_data_that_fits_the_smoke_setting_passes_the_check(tmp_path):
    data = tmp_path / "listops"
    rows = generate_listops(40, seed=0, min_length=10, max_length=100)
    for split in ("train", "val", "test"):
        write_listops_tsv(data / f"basic_{split}.tsv", rows)
    runs = expand(get_experiment("lra-softmax-family"), "smoke", [0], tmp_path / "out",
                  only={"task": {"listops"}, "row": {"mgk-4"}}, data={"listops": str(data)})
    [task] = check_data(runs, "smoke", {"listops": str(data)})
    assert task.problem is None and task.path == str(data.resolve())
