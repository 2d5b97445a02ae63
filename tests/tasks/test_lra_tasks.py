"""`mgk train --task text|retrieval|image|pathfinder|listops` end to end on tiny fixtures; the length and the
Pathfinder level are recorded."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from mgk import config as config_mod
from mgk.cli import main
from mgk.data.samples import cifar_pickle_files, make_aan_dir, make_imdb_tar, make_pathfinder_tree, write_files
from mgk.tasks import get_task

TINY = ["batch_size=8", "d_model=16", "head_dim=8", "ffn_dim=32", "classifier_dim=16", "log_every=1",
        "eval_every=3", "warmup_steps=1", "progress=false", "eval_batch_size=16", "num_heads=2",
        "attn_dropout=0"]  # attention dropout keeps SDPA on its slow O(L^2) path: 1024-pixel inputs take seconds


def sets(*pairs):
    """--set arguments; a later pair replaces an earlier one of the same key (PIXELS' batch_size over TINY's)."""
    last = {p.split("=", 1)[0]: p for p in pairs}
    return [x for p in last.values() for x in ("--set", p)]


def _train(out, task, *extra, steps=3, data=None):
    argv = ["train", "--task", task, "--steps", str(steps), "--out", str(out), *sets(*TINY, *extra)]
    if data is not None:
        argv += ["--data", str(data)]
    main(argv)
    return json.loads((out / "results.json").read_text()), _flat(yaml.safe_load((out / "config.yaml").read_text())), \
        (out / "train.log").read_text()


def _flat(saved: dict) -> dict:
    """A saved config (config.yaml, a checkpoint's) by --set names."""
    return config_mod.flat(config_mod.from_dict(saved))


def test_text_trains_and_records_the_length_used(tmp_path):
    data = make_imdb_tar(tmp_path, n_per_class=12)
    res, cfg, log = _train(tmp_path / "run", "text", "max_len=24", data=data)
    assert res["task"] == "text" and res["max_len"] == 24 and cfg["max_len"] == 24  # the length is recorded
    assert res["val"]["max_len"] == 24 and res["test"]["count"] == 24 and res["val"]["count"] == 2
    assert "cut to their first 24 bytes" in log and "never from test" in log
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert _flat(ckpt["config"])["max_len"] == 24
    assert any((data.parent / ".mgk-cache").glob("imdb-*.npz"))  # tokenised arrays cached beside the data


def test_text_without_data_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no embedded default data: pass --data"):
        main(["train", "--task", "text", "--steps", "1", "--out", str(tmp_path / "r"), *sets(*TINY)])


def test_retrieval_trains_on_both_documents(tmp_path):
    data = make_aan_dir(tmp_path, n=16)
    res, cfg, log = _train(tmp_path / "run", "retrieval", "max_len=32", data=data)
    assert res["task"] == "retrieval" and res["val"]["count"] == 16 and res["test"]["count"] == 16
    assert 0 <= res["test"]["acc"] <= 1 and "new_aan_pairs.eval.tsv" in log


def test_retrieval_batch_and_loss_shapes(tmp_path):
    data = make_aan_dir(tmp_path, n=8)
    cfg = config_mod.run_config(task="retrieval", data=str(data), max_len=64, d_model=16, head_dim=8, ffn_dim=32,
                                classifier_dim=16, num_heads=2, cache_dir="off")
    task = get_task("retrieval").build(cfg, data)
    batch = task.batch(task.splits["train"], torch.tensor([0, 3]), "cpu")
    assert set(batch) == {"tokens1", "padding_mask1", "tokens2", "padding_mask2", "label"}
    assert batch["tokens1"].dtype == torch.int64
    assert (~batch["padding_mask1"]).sum(1).tolist() == task.splits["train"].lengths1[[0, 3]].tolist()
    loss, sums = task.loss(task.build_model(cfg), batch)
    assert loss.shape == () and sums["count"] == 2


PIXELS = ["max_len=1024", "batch_size=2", "num_layers=1", "eval_batch_size=8"]  # 1024-token inputs: keep it tiny


def test_image_trains_on_pickle_batches(tmp_path):
    data = write_files(tmp_path / "cifar", cifar_pickle_files(n=2))
    res, cfg, log = _train(tmp_path / "run", "image", *PIXELS, steps=2, data=data)
    assert res["test"]["count"] == 2 and res["val"]["count"] == 1 and "no padding" in log
    with pytest.raises(SystemExit, match="set max_len=1024"):
        _train(tmp_path / "run2", "image", "max_len=512", data=data)


def test_pathfinder_default_generates_the_hard_level_and_records_it(tmp_path):
    res, cfg, log = _train(tmp_path / "run", "pathfinder", "gen_train=16", "gen_val=2", "gen_test=2",
                            *PIXELS, steps=2)
    assert cfg["level"] == "curv_contour_length_14"  # the difficulty is in the run's config.yaml
    assert "level curv_contour_length_14 = hard (the default level)" in log
    assert res["test"]["count"] == 2 and res["val"]["count"] == 2  # 10% / 10% of 20
    assert (tmp_path / "run" / "data" / "pathfinder32" / "curv_contour_length_14" / "metadata" / "0.npy").is_file()


def test_pathfinder_reads_the_named_level_of_a_release_tree(tmp_path):
    root = make_pathfinder_tree(tmp_path, per_level=5)
    res, cfg, log = _train(tmp_path / "run", "pathfinder", "level=curv_baseline", *PIXELS, steps=2, data=root)
    assert cfg["level"] == "curv_baseline" and res["val"]["count"] == 1 and res["test"]["count"] == 1
    assert "read only" in log and "curv_baseline" in log and "curv_contour_length_9" not in log


def test_listops_still_trains_with_the_generated_default(tmp_path):
    res, _, _ = _train(tmp_path / "run", "listops", "gen_train=64", "gen_val=16", "gen_test=16", "max_len=64",
                       "gen_max_length=40")
    assert res["task"] == "listops" and res["test"]["count"] > 0
