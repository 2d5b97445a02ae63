"""`mgk data check` (report and errors naming files) and `mgk table` (the LRA table from results.json files)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mgk.cli import main
from mgk.data.samples import (
    cifar_pickle_files,
    imdb_files,
    make_aan_dir,
    make_imdb_dir,
    make_pathfinder_tree,
    write_files,
    write_tar,
)
from mgk.tasks.lra_table import lra_table

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"  # the shared data copy next to the repository


def check(capsys, task, data, *extra):
    rc = main(["data", "check", "--task", task, "--data", str(data), *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ----------------------------------------------------------------- mgk data check


def test_check_text_reports_counts_labels_lengths(tmp_path, capsys):
    rc, out, err = check(capsys, "text", make_imdb_dir(tmp_path), "--set", "max_len=20")
    assert rc == 0 and err == ""
    assert "train: 12 reviews" in out and "test: 12 reviews" in out
    assert "labels: neg 6 (50.0%), pos 6 (50.0%)" in out and "longer than max_len=20" in out
    assert "validation: 1 of these carved out with split_seed=0" in out and out.rstrip().splitlines()[-1][:2] == "ok"


def test_check_text_errors_name_the_file(tmp_path, capsys):
    files = imdb_files()
    files["aclImdb/test/pos/5_7.txt"] = b""
    rc, out, err = check(capsys, "text", write_tar(tmp_path / "imdb.tar.gz", files))
    assert rc == 1 and "imdb.tar.gz:aclImdb/test/pos/5_7.txt: empty review" in err and "1 error(s)" in out
    rc, _, err = check(capsys, "text", tmp_path / "nowhere")
    assert rc == 1 and "nowhere: not found" in err


def test_check_retrieval_collects_an_error_per_file(tmp_path, capsys):
    data = make_aan_dir(tmp_path, n=8)
    rc, out, err = check(capsys, "retrieval", data, "--set", "max_len=16")
    assert rc == 0 and "train: 8 pairs" in out and "text2 length (bytes)" in out and "cites (1) 4 (50.0%)" in out
    (data / "new_aan_pairs.eval.tsv").write_text("1\ta\tb\tx\ty\n0\ta\tb\tonly four\n")
    (data / "new_aan_pairs.test.tsv").write_text("3\ta\tb\tx\ty\n")
    rc, out, err = check(capsys, "retrieval", data)
    assert rc == 1 and "2 error(s)" in out and "train: 8 pairs" in out
    assert "new_aan_pairs.eval.tsv: line 2: 4 tab-separated columns" in err
    assert "new_aan_pairs.test.tsv: line 1: label '3' is not 0 or 1" in err
    (data / "new_aan_pairs.train.tsv").unlink()
    rc, _, err = check(capsys, "retrieval", data)
    assert rc == 1 and "new_aan_pairs.train.tsv absent" in err


def test_check_image_and_pathfinder(tmp_path, capsys):
    rc, out, _ = check(capsys, "image", write_files(tmp_path / "c", cifar_pickle_files(n=2)))
    assert rc == 0 and "train: 10 images of 32x32" in out and "test: 2 images" in out and "none is padding" in out
    bad = cifar_pickle_files(n=2)
    bad["cifar-10-batches-py/data_batch_2"] = b"junk"
    rc, _, err = check(capsys, "image", write_files(tmp_path / "d", bad))
    assert rc == 1 and "data_batch_2: not a readable CIFAR python batch" in err
    root = make_pathfinder_tree(tmp_path, per_level=4, levels=["curv_contour_length_14", "curv_baseline"])
    rc, out, _ = check(capsys, "pathfinder", root)
    assert rc == 0 and "level curv_contour_length_14 = hard (the default level)" in out
    assert "all: 4 images" in out and "train 2 / val 1 / test 1" in out
    rc, _, err = check(capsys, "pathfinder", root, "--set", "level=intermediate")
    assert rc == 1 and "no Pathfinder level 'curv_contour_length_9'" in err


def test_check_listops_and_bad_arguments(tmp_path, capsys):
    from mgk.data.listops import generate_listops_dir

    data = generate_listops_dir(tmp_path / "lo", num_train=30, num_val=10, num_test=10, max_length=40)
    rc, out, _ = check(capsys, "listops", data, "--set", "max_len=20")
    assert rc == 0 and "train: 30 rows" in out and "would stop at the first longer row" in out
    (data / "basic_val.tsv").write_text("Source\tTarget\n[MAX 1 2 ]\t12\n")
    rc, _, err = check(capsys, "listops", data)
    assert rc == 1 and "basic_val.tsv: line 2: Target 12 is outside 0-9" in err
    with pytest.raises(SystemExit):  # argparse's type: one line on stderr, exit 2
        main(["data", "check", "--task", "nope", "--data", str(data)])
    assert "unknown task 'nope'; choose from listops" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown config field"):
        main(["data", "check", "--task", "text", "--data", str(data), "--set", "maxlen=3"])


def test_check_lm_reports_each_split_and_needs_train(tmp_path, capsys):
    from mgk.data import wikitext as wt

    data = tmp_path / "wt"
    wt.generate_corpus(data, train_lines=20, valid_lines=5, test_lines=5, seed=1)
    (data / "wiki.test.tokens").unlink()
    rc, out, err = check(capsys, "lm", data)
    assert rc == 0 and "train: " in out and "20 lines" in out and "test: wiki.test.tokens or test.txt absent" in out
    (data / "wiki.train.tokens").unlink()
    rc, out, err = check(capsys, "lm", data)
    assert rc == 1 and "train: wiki.train.tokens or train.txt absent" in err


@pytest.mark.skipif(not (SHARED / "listops" / "basic_val.tsv.gz").is_file(),
                    reason="shared ListOps copy ../shared/data/listops absent")
def test_check_shared_listops_val_counts(tmp_path, capsys):
    (tmp_path / "lo").mkdir()
    (tmp_path / "lo" / "basic_train.tsv.gz").symlink_to((SHARED / "listops" / "basic_val.tsv.gz").resolve())
    rc, out, _ = check(capsys, "listops", tmp_path / "lo", "--preset", "listops-paper")
    assert rc == 0 and "train: 2000 rows" in out and "0 longer than max_len=2000" in out


# ----------------------------------------------------------------- mgk table


def _run(tmp_path, name, task, attention, heads, seed, test=None, val=None, pi="learned"):
    d = tmp_path / name
    d.mkdir(parents=True)
    res = {"task": task, "attention": attention, "num_heads": heads, "seed": seed, "pi": pi,
           "test": None if test is None else {"acc": test, "loss": 1.0, "count": 10},
           "val": None if val is None else {"acc": val, "loss": 1.0, "count": 10}}
    (d / "results.json").write_text(json.dumps(res))
    return d


def test_table_mean_std_order_dash_and_footnotes(tmp_path, capsys):
    runs = [_run(tmp_path, "a", "listops", "mgk", 4, 0, test=0.36), _run(tmp_path, "b", "listops", "mgk", 4, 1,
                                                                            test=0.38),
            _run(tmp_path, "c", "text", "mgk", 4, 0, test=0.65, val=0.99),
            _run(tmp_path, "d", "retrieval", "mgk", 4, 0, val=0.80),
            _run(tmp_path, "e", "listops", "softmax", 8, 0, test=0.37),
            _run(tmp_path, "f", "text", "smgk", 1, 0, test=0.60, pi="hard_e"),
            _run(tmp_path, "g", "lm", "mgk", 4, 0, test=0.5)]
    assert main(["table", *map(str, runs)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == "| Attention | Heads | ListOps | Text | Retrieval | Image | Pathfinder | Avg |"
    rows = [x for x in lines[2:] if x.startswith("| ")]
    assert [r.split(" | ")[0:2] for r in rows] == [["| softmax", "8"], ["| mgk", "4"], ["| smgk+hard_e", "1"]]
    mgk = rows[1]
    assert "| 37.00 ± 1.41 (n=2) | 65.00 | 80.00 † | — | — |" in mgk  # sample std of 36 and 38
    assert mgk.endswith(f"| {(37 + 65 + 80) / 3:.2f} (3/5) |")
    assert "† validation accuracy" in out and "mean over the columns that have values" in out
    assert "mean ± sample std" in out
    # the lm run is the perplexity table's, which says why it is left out; the LRA table does not claim it
    assert "run of lm mgk x 4 seed 0 left out: no validation or test perplexity" in err
    assert "not an LRA task" not in err


def test_table_reads_a_folder_of_runs_and_reports_missing_results(tmp_path, capsys):
    _run(tmp_path / "sweep", "s0", "image", "linear", 8, 0, test=0.4)
    _run(tmp_path / "sweep", "s1", "image", "linear", 8, 1, test=0.5)
    assert main(["table", str(tmp_path / "sweep")]) == 0
    assert "| linear | 8 | — | — | — | 45.00 ± 7.07 (n=2) | — | 45.00 (1/5) |" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="empty/results.json not found"):
        main(["table", str(tmp_path / "empty")])
    table, warnings = lra_table([])
    assert "| — |" in table and warnings == []


def test_table_lists_unfinished_runs_and_goes_on(tmp_path, capsys):
    """A run directory without results.json (failed, stopped or still training) is listed below the table."""
    import os

    import yaml

    done = _run(tmp_path / "runs", "done", "listops", "mgk", 4, 0, test=0.4)
    failed, running = tmp_path / "runs" / "failed", tmp_path / "runs" / "running"
    for d, step in ((failed, 7), (running, 3)):
        d.mkdir()
        (d / "config.yaml").write_text(yaml.safe_dump({"task": "text", "attention": "softmax", "num_heads": 8,
                                                       "steps": 100}))
        (d / "metrics.jsonl").write_text(json.dumps({"step": step, "train/loss": 1.0}) + "\n")
    (running / ".mgk-lock").write_text(f"{os.getpid()}\n")  # the pid a live training writes into its lock file
    for argv in ([str(failed), str(done), str(running)], [str(tmp_path / "runs")]):
        assert main(["table", *argv]) == 0
        out = capsys.readouterr().out
        assert "| mgk | 4 | 40.00 | — | — | — | — | 40.00 (1/5) |" in out
        assert "unfinished (no results.json): 2 run(s)" in out
        assert f"- {failed}: text softmax x 8, step 7 of 100, failed or stopped" in out
        assert f"- {running}: text softmax x 8, step 3 of 100, running (pid {os.getpid()})" in out


def _configured(tmp_path, name, task, seed, acc, init_from=None, **values):
    """A finished run folder with the config.yaml `mgk train` writes (``values``: flat config fields)."""
    import yaml

    from mgk import config

    d = _run(tmp_path, name, task, "mgk", 4, seed, test=acc)
    cfg = config.run_config(task=task, attention="mgk", num_heads=4, seed=seed, **values)
    (d / "config.yaml").write_text(yaml.safe_dump(config.to_dict(cfg), sort_keys=False))
    if init_from is not None:
        res = json.loads((d / "results.json").read_text())
        (d / "results.json").write_text(json.dumps({**res, "init_from": {"source": init_from, "step": 1500}}))
    return d


def _rows(out: str) -> dict[str, str]:
    return {line.split(" | ")[0][2:]: line for line in out.splitlines() if line.startswith("| ") and " | " in line}


def test_table_averages_only_runs_whose_configs_differ_in_the_seed(tmp_path, capsys):
    runs = [_configured(tmp_path, "full0", "listops", 0, 0.393, steps=1500, log_every=5),
            _configured(tmp_path, "full1", "listops", 1, 0.403, steps=1500, progress=False),
            _configured(tmp_path, "smoke", "listops", 0, 0.114, steps=30),
            _configured(tmp_path, "retro", "listops", 0, 0.144, steps=20, init_from="runs/softmax"),
            _configured(tmp_path, "text", "text", 0, 0.6, steps=30)]
    assert main(["table", *map(str, runs)]) == 0
    out, err = capsys.readouterr()
    rows = _rows(out)
    # log_every and progress change no result: seeds 0 and 1 of the full runs share a cell
    assert "| 39.80 ± 0.71 (n=2) | — |" in rows["mgk (steps=1500, init_from=none)"]
    assert "| 11.40 | — |" in rows["mgk (steps=30, init_from=none)"]
    assert "| 14.40 | — |" in rows["mgk (steps=20, init_from=runs/softmax step 1500)"]
    assert "| — | 60.00 |" in rows["mgk"]  # the Text cell has one config: the row keeps its plain name
    assert "21.70" not in out and "n=3" not in out and "differ in more than the seed, a row per config" in out
    assert "runs of listops mgk x 4 differ in more than the seed (steps, init_from)" in err


def test_table_counts_a_duplicate_run_once_and_names_both(tmp_path, capsys):
    runs = [_configured(tmp_path, "a", "listops", 0, 0.30), _configured(tmp_path, "b", "listops", 0, 0.50),
            _configured(tmp_path, "c", "listops", 1, 0.40)]
    assert main(["table", *map(str, runs)]) == 0
    out, err = capsys.readouterr()
    assert "| mgk | 4 | 35.00 ± 7.07 (n=2) |" in out
    assert f"{runs[1]} duplicates {runs[0]} (listops mgk x 4, seed 0, one config): left out" in err


def test_runs_without_config_yaml_are_told_apart_by_results_json():
    from mgk.tasks.lm_table import lm_table
    from mgk.tasks.synthetic_table import synthetic_table

    def res(steps, seed, **more):
        return {"attention": "softmax", "num_heads": 2, "seed": seed, "steps": steps, "max_len": 64, **more}

    lra = [{**res(s, seed), "task": "image", "test": {"acc": a}} for s, seed, a in ((9, 0, 0.2), (9, 1, 0.4),
                                                                                       (5, 0, 0.1))]
    table, warnings = lra_table(lra)
    assert "| softmax (steps=9) | 2 | — | — | — | 30.00 ± 14.14 (n=2) |" in table
    assert "| softmax (steps=5) | 2 | — | — | — | 10.00 |" in table and len(warnings) == 1
    split = {"acc": 0.5, "num_kv_pairs": 8, "seq_len": 64}
    table, warnings = synthetic_table([{**res(9, 0), "task": "mqar", "test": split},
                                       {**res(9, 1, precision="bf16"), "task": "mqar", "test": split}])
    assert "| softmax (precision=32) | 2 |" not in table  # a fact one run lacks is no difference
    assert "n=2" in table and warnings == []
    lm = [({**res(s, 0), "task": "lm", "val": {"ppl": p}}, {}) for s, p in ((9, 50.0), (5, 80.0))]
    table, warnings = lm_table(lm)
    assert "| softmax (steps=9) | 2 | 50.00 |" in table and "| softmax (steps=5) | 2 | 80.00 |" in table


def test_table_skips_folders_a_glob_names_beside_the_runs(tmp_path, capsys):
    run = _configured(tmp_path / "runs", "a", "listops", 0, 0.4)
    compare = tmp_path / "runs" / "listops-compare"  # what `mgk analyze --compare --out` leaves among the runs
    compare.mkdir()
    (compare / "report.md").write_text("# compare\n")
    (tmp_path / "runs" / "notes.txt").write_text("todo\n")
    assert main(["table", str(run), str(compare), str(tmp_path / "runs" / "notes.txt")]) == 0
    out, err = capsys.readouterr()
    assert "| mgk | 4 | 40.00 |" in out and f"warning: skipped {compare}: holds no `mgk train` run" in err
    assert f"skipped {tmp_path / 'runs' / 'notes.txt'}: a file, not a run directory" in err
    with pytest.raises(SystemExit, match="listops-compare/results.json not found"):  # given alone: an error
        main(["table", str(compare)])
    with pytest.raises(SystemExit, match="none of the 2 paths given holds an `mgk train` run"):
        main(["table", str(compare), str(tmp_path / "runs" / "notes.txt")])
    with pytest.raises(SystemExit, match="typo: no such run directory"):  # a glob never names a missing path
        main(["table", str(run), str(tmp_path / "typo")])


def test_an_lm_run_is_in_the_perplexity_table_and_no_warning_says_otherwise(tmp_path, capsys):
    lo = _run(tmp_path, "lo", "listops", "mgk", 4, 0, test=0.4)
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "results.json").write_text(json.dumps({"task": "lm", "attention": "mgk", "num_heads": 4, "seed": 0,
                                                 "val": {"ppl": 42.0}, "test": {"ppl": 44.0}}))
    assert main(["table", str(lo), str(lm)]) == 0
    out, err = capsys.readouterr()
    assert "| mgk | 4 | 42.00 |" in out and "| mgk | 4 | 40.00 |" in out and err == ""


def test_a_run_with_a_damaged_config_yaml_is_still_tabled_by_its_results(tmp_path, capsys):
    runs = [_configured(tmp_path, "a", "listops", 0, 0.30), _configured(tmp_path, "b", "listops", 1, 0.50)]
    (runs[1] / "config.yaml").write_text("task: [listops\n")
    assert main(["table", *map(str, runs)]) == 0
    out, err = capsys.readouterr()
    assert "| mgk | 4 | 40.00 ± 14.14 (n=2) |" in out
    assert f"{runs[1] / 'config.yaml'}: line 2: not valid YAML" in err and "by its results.json alone" in err


def test_a_dataset_read_from_two_machines_folders_is_one_dataset():
    """Seeds of one setting run on the same data under two machines' scratch folders share a cell; another
    dataset (another folder name) does not."""
    from mgk.tasks.run_records import RUN_CONFIG, run_identity

    def record(data):
        return {RUN_CONFIG: {"task": "listops", "data": data, "seed": 0, "steps": 10}}

    assert run_identity(record("/nodeA/scratch/listops")) == run_identity(record("/nodeB/listops"))
    assert run_identity(record("/nodeA/listops")) != run_identity(record("/nodeA/listops-small"))
    assert run_identity(record(None)) != run_identity(record("/nodeA/listops"))
