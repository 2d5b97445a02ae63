"""The grid of `mgk reproduce`: experiments as data, --only / --data / --seeds, run keys, dry runs (no training)."""
import subprocess
import sys
from pathlib import Path

import pytest

from mgk.reproduce import EXPERIMENTS, expand, get_experiment
from mgk.reproduce.executor import sbatch_preview, slurm_parameters
from mgk.reproduce.grid import parse_data, parse_only

REPO = Path(__file__).resolve().parents[2]


def _rows(name):
    return {r.key: r for r in get_experiment(name).rows}


def test_experiments_hold_the_papers_tables():
    soft = _rows("lra-softmax-family")
    assert set(soft) == {f"softmax-{h}" for h in (8, 4, 2, 1)} | {f"{k}-{h}" for k in ("mgk", "smgk")
                                                                   for h in (4, 2, 1)}
    assert soft["softmax-8"].paper == {"listops": 37.03, "text": 65.71, "retrieval": 81.74}
    assert soft["smgk-4"].paper["retrieval"] == 82.79 and soft["mgk-4"].heads == 4
    lin = _rows("lra-linear-family")
    assert {r.attention for r in lin.values()} == {"linear", "mlk", "smlk"} and lin["mlk-4"].paper["listops"] == 20.06
    pi = _rows("lra-pi-ablation")
    assert {(r.attention, r.heads, r.pi) for r in pi.values()} == {
        (a, 1, p) for a in ("mgk", "smgk") for p in ("learned", "soft_e", "hard_e")}
    assert pi["smgk-1-hard_e"].paper["text"] == 64.7
    wt = _rows("wt103")
    assert set(wt) == {"softmax-8", "mgk-4", "smgk-8", "mgk-8", "linear-8", "mlk-4", "mlk-8"}
    assert wt["mgk-8"].paper == {"valid": 32.74, "test": 33.93}
    for exp in EXPERIMENTS.values():
        assert len({r.key for r in exp.rows}) == len(exp.rows)


def test_expand_filters_and_keys(tmp_path):
    exp = get_experiment("lra-softmax-family")
    runs = expand(exp, "smoke", [0, 1], tmp_path, only=parse_only(["row=softmax-8,mgk-4", "task=listops,text"]),
                  data_root=tmp_path)
    assert [(r.row.key, r.task, r.seed) for r in runs] == [
        (row, task, s) for task in ("listops", "text") for s in (0, 1) for row in ("softmax-8", "mgk-4")]
    assert len({r.key for r in runs}) == len(runs)  # every resolved config differs (seed, task, model)
    again = expand(exp, "smoke", [0, 1], tmp_path / "elsewhere", only=parse_only(["row=softmax-8,mgk-4",
                                                                                  "task=listops,text"]),
                   data_root=tmp_path)
    assert [r.key for r in again] == [r.key for r in runs]  # the output folder is not part of the config
    cpu = expand(exp, "cpu", [0], tmp_path, only=parse_only(["row=softmax-8", "task=listops"]), data_root=tmp_path)
    assert cpu[0].key != runs[0].key and cpu[0].task_label == "ListOps (generated, short)"
    r = runs[4]  # softmax-8, text, seed 0
    cmd = r.train_command("python")
    assert cmd[:4] == ["python", "-m", "mgk", "train"] and cmd[-2:] == ["--out", str(r.run_dir)]
    assert ["--heads", "8"] == cmd[cmd.index("--heads"):cmd.index("--heads") + 2]
    assert cmd[cmd.index("--data") + 1] == str((tmp_path / "imdb/aclImdb_train.tar.gz").resolve())
    assert r.run_dir.name == f"seed0-{r.key}"
    assert r.train_command("python", resume=True)[3:6] == ["train", "--resume", str(r.run_dir)]
    # optional tasks only when named; --data overrides the root
    img = expand(exp, "smoke", [0], tmp_path, only=parse_only(["task=image", "row=mgk-1"]),
                 data=parse_data(["image=/x/cifar"], exp.tasks + exp.optional_tasks))
    assert [(r.task, r.data) for r in img] == [("image", "/x/cifar")]
    assert {r.task for r in expand(exp, "smoke", [0], tmp_path)} == {"listops", "text", "retrieval"}


def test_lm_runs_carry_the_sliding_window_evaluation(tmp_path):
    runs = expand(get_experiment("wt103"), "paper", [0], tmp_path, data_root=tmp_path)
    assert len(runs) == 7
    ev = runs[0].eval_command("python")
    assert ev[3:5] == ["eval", str(runs[0].run_dir)]
    assert ev[ev.index("--context") + 1] == "256" and ev[ev.index("--stride") + 1] == "1"


@pytest.mark.parametrize("bad, match", [
    (["rows=x"], "unknown key 'rows'"), (["row=softmax-9"], "softmax-9"), (["task=lm"], "task=lm"),
    (["seed=7"], "seed=7"), (["row"], "KEY=VALUE")])
def test_only_errors_name_the_argument(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        expand(get_experiment("lra-softmax-family"), "smoke", [0, 1], tmp_path, only=parse_only(bad))


def test_slurm_parameters_and_sbatch_preview(tmp_path):
    params = slurm_parameters(["partition=gpu", "timeout_min=600", "gpus_per_node=2", "mem_gb=32"])
    assert params["slurm_partition"] == "gpu" and params["timeout_min"] == 600 and params["gpus_per_node"] == 2
    text = sbatch_preview(params, tmp_path, "python -m x")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --time=600", "#SBATCH --gpus-per-node=2", "#SBATCH --mem=32GB"):
        assert line in text
    with pytest.raises(ValueError, match="unknown option 'partitoin'"):
        slurm_parameters(["partitoin=gpu"])


def _cli(*args, cwd=REPO):
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "mgk", "reproduce", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def test_dry_run_lists_exact_commands_and_slurm_parameters(tmp_path):
    p = _cli("lra-softmax-family", "--scale", "smoke", "--seeds", "0,1", "--only", "row=mgk-4",
             "--only", "task=listops", "--out", str(tmp_path), "--dry-run")
    assert p.returncode == 0, p.stderr
    runs = expand(get_experiment("lra-softmax-family"), "smoke", [0, 1], tmp_path,
                  only=parse_only(["row=mgk-4", "task=listops"]))
    for r in runs:
        assert r.describe(sys.executable) in p.stdout
    assert "[new]" in p.stdout and not (tmp_path / "runs").exists()
    p = _cli("lra-softmax-family", "--scale", "paper", "--only", "row=smgk-4", "--out", str(tmp_path),
             "--executor", "slurm", "--slurm", "partition=a100", "--slurm", "timeout_min=2880", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "'slurm_partition': 'a100'" in p.stdout and "#SBATCH --partition=a100" in p.stdout
    assert "#SBATCH --time=2880" in p.stdout and "--preset listops-paper" in p.stdout


def test_cli_refuses_bad_arguments(tmp_path):
    for args, msg in ((["--seeds", "0,a"], "--seeds"), (["--jobs", "0"], "--jobs"), (["--analyze", "-1"], "--analyze"),
                      (["--data", "lm=/x"], "no task 'lm'"), (["--slurm", "partition=x"], "--executor slurm")):
        p = _cli("lra-softmax-family", "--scale", "smoke", "--out", str(tmp_path), "--dry-run", *args)
        assert p.returncode != 0 and msg in p.stderr, (args, p.stderr)
