"""`mgk analyze` end to end on tiny runs trained for 2 steps in-process: one run, --compare, every task kind."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mgk.cli import main
from mgk.data.samples import make_aan_dir
from mgk.train import checkpoint

TINY_LM = ["batch_size=4", "segment_len=8", "max_len=8", "d_model=16", "num_layers=2", "ffn_dim=32", "head_dim=4",
           "log_every=1", "eval_every=2", "checkpoint_every=2", "eval_batch_size=8", "warmup_steps=1",
           "progress=false", "adaptive_cutoffs=[20,60]", "gen_train=80", "gen_val=12", "gen_test=12"]


def train(th, out: Path, *args, tiny=None):
    tiny = th.TINY if tiny is None else tiny
    main(["train", *args, "--steps", "2", "--out", str(out), *th.sets(*tiny, "eval_every=2")])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, th):
    root = tmp_path_factory.mktemp("runs")
    torch.set_num_threads(1)
    return {"softmax": train(th, root / "sm", "--attention", "softmax", "--heads", "4"),
            "mgk": train(th, root / "mgk", "--attention", "mgk", "--heads", "2")}


def analyze(*args):
    main(["analyze", *args, "--no-progress"])


def test_one_run_writes_json_markdown_and_figures(runs, tmp_path):
    out = tmp_path / "a"
    analyze(str(runs["mgk"]), "--samples", "5", "--seed", "3", "--out", str(out), "--examples", "2")
    result = json.loads((out / "analysis.json").read_text())
    assert result["attention"] == "mgk" and result["num_heads"] == 2 and result["examples_analysed"] == 5
    assert result["settings"]["split"] == "val" and result["checkpoint"].endswith("best.pt")
    assert len(result["layers"]) == 2
    for layer in result["layers"]:
        assert layer["rank"]["absolute"]["n"] == 5 * 2 == len(layer["lengths"])  # examples x heads
        assert all(1 <= r <= n for r, n in zip(layer["ranks"]["absolute"], layer["lengths"]))
        assert 1.0 <= layer["redundancy"]["effective_heads"]["mean"] <= 2.0
        mix = layer["mixture"]
        assert mix["pi_mode"] == "learned" and len(mix["shares"]) == 2
        assert all(abs(sum(row) - 1) < 1e-9 for row in mix["shares"])
    md = (out / "analysis.md").read_text()
    assert "## Mixture" in md and "effective heads" in md
    for name in result["figures"].values():
        assert (out / name).read_bytes()[:4] == b"\x89PNG" and f"]({name})" in md
    assert {"maps_layer0.png", "maps_layer1.png", "rank.png", "js.png", "mixture_shares.png"} <= set(
        result["figures"].values())
    # same seed, same draw: identical statistics
    analyze(str(runs["mgk"]), "--samples", "5", "--seed", "3", "--out", str(tmp_path / "b"), "--examples", "0")
    again = json.loads((tmp_path / "b" / "analysis.json").read_text())
    assert again["layers"][0]["ranks"] == result["layers"][0]["ranks"]


def test_fixed_pi_is_reported_exactly(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["mgk"], run)
    ckpt = checkpoint.load(run / "checkpoints" / "best.pt")
    known = torch.tensor([[0.9, 0.1], [0.35, 0.65]])
    for name in [k for k in ckpt["model"] if k.endswith("pi_logits")]:
        ckpt["model"][name] = known.log()
    checkpoint.save(ckpt, run / "checkpoints" / "best.pt", kind="best")
    analyze(str(run), "--samples", "3", "--out", str(tmp_path / "a"), "--examples", "0")
    for layer in json.loads((tmp_path / "a" / "analysis.json").read_text())["layers"]:
        got = [c["mean"] for head in layer["mixture"]["pi"] for c in head]
        assert got == pytest.approx(known.flatten().tolist(), abs=1e-6)
        assert all(c["n"] == 1 for head in layer["mixture"]["pi"] for c in head)  # one pi per head


def test_compare_overlays_runs(runs, tmp_path):
    out = tmp_path / "cmp"
    analyze("--compare", str(runs["softmax"]), str(runs["mgk"]), "--samples", "4", "--out", str(out))
    result = json.loads((out / "analysis.json").read_text())
    assert list(result["runs"]) == ["softmax-4", "mgk-2"]
    assert result["runs"]["softmax-4"]["layers"][0]["rank"]["absolute"]["n"] == 16
    assert "mixture" not in result["runs"]["softmax-4"]["layers"][0]
    assert {"rank.png", "effective_heads.png", "maps_softmax-4_layer0.png", "maps_mgk-2_layer1.png"} <= set(
        result["figures"].values())
    md = (out / "analysis.md").read_text()
    assert "| softmax-4 | 0 |" in md and "| mgk-2 | 1 |" in md
    with pytest.raises(SystemExit, match="--compare"):
        analyze(str(runs["softmax"]), str(runs["mgk"]))


def test_bad_input_is_one_clear_line(runs, tmp_path):
    with pytest.raises(SystemExit, match="not a run directory"):
        analyze(str(tmp_path), "--out", str(tmp_path / "x"))
    with pytest.raises(SystemExit, match="samples must be >= 1"):
        analyze(str(runs["mgk"]), "--samples", "0", "--out", str(tmp_path / "x"))
    run = tmp_path / "run"
    shutil.copytree(runs["softmax"], run)
    (run / "data" / "basic_test.tsv").unlink()
    with pytest.raises(SystemExit, match="no 'test' split"):
        analyze(str(run), "--split", "test", "--out", str(tmp_path / "x"))
    for args, message in ((["--device", "foo"], "--device 'foo' is not a torch device"),
                          (["--rank-tol", "inf"], "rank tolerance must be finite"),
                          (["--data", str(tmp_path / "nowhere")], "--data .*nowhere: no such folder"),
                          (["--out", str(run / "config.yaml")], "--out .* is a file"),
                          (["--compare"], "--compare needs at least two")):
        with pytest.raises(SystemExit, match=message):
            analyze(str(run), *args)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: CUDA is not available"):
            analyze(str(run), "--device", "cuda", "--out", str(tmp_path / "x"))


def test_language_model_run_causal_soft_e(tmp_path, th):
    run = train(th, tmp_path / "lm", "--task", "lm", "--attention", "mgk", "--heads", "2", "--pi", "soft_e",
                tiny=TINY_LM)
    analyze(str(run), "--samples", "3", "--out", str(tmp_path / "a"))
    result = json.loads((tmp_path / "a" / "analysis.json").read_text())
    layer = result["layers"][0]
    assert layer["mixture"]["pi_mode"] == "soft_e" and layer["mixture"]["positions"] <= 8
    assert len(layer["lengths"]) == 3 * 2 and max(layer["lengths"]) <= 8
    # a causal map is lower triangular with a positive diagonal: full rank, and the report says rank cannot tell
    assert layer["ranks"]["relative"] == layer["lengths"]
    assert all(layer["causal"] for layer in result["layers"])
    md = (tmp_path / "a" / "analysis.md").read_text()
    assert md.count("Causal layers: rank does not discriminate") == 1 and "mgk analyze --prune" in md


def test_retrieval_run_counts_both_documents(tmp_path, th):
    data = make_aan_dir(tmp_path, n=24)
    run = train(th, tmp_path / "rv", "--task", "retrieval", "--data", str(data), "--attention", "mlk", "--heads", "2",
                tiny=[*th.TINY, "val_fraction=0.25"])
    analyze(str(run), "--samples", "3", "--out", str(tmp_path / "a"))
    layer = json.loads((tmp_path / "a" / "analysis.json").read_text())["layers"][0]
    assert len(layer["lengths"]) == 3 * 2 * 2  # examples x documents x heads
    assert layer["causal"] is False and "Causal layers" not in (tmp_path / "a" / "analysis.md").read_text()
    assert layer["mixture"]["share_kind"] == "share of the linear kernel"


def test_a_run_with_one_regression_target_per_sequence_is_analysed(tmp_path, th):
    # D-retrieval's batch has a float target per sequence and no padding mask: not a language model's token targets
    run = tmp_path / "dr"
    main(["train", "--task", "dretrieval", "--attention", "mgk", "--heads", "2", "--steps", "2", "--out", str(run),
          *th.sets("gen_seq_len=8", "gen_vocab=32", "gen_train=64", "gen_val=16", "gen_test=16", "d_model=16",
                   "head_dim=4", "ffn_dim=16", "classifier_dim=16", "num_layers=1", "batch_size=8", "eval_every=2",
                   "checkpoint_every=2", "warmup_steps=1", "progress=false")])
    analyze(str(run), "--samples", "4", "--out", str(tmp_path / "a"), "--examples", "1")
    layer = json.loads((tmp_path / "a" / "analysis.json").read_text())["layers"][0]
    assert layer["lengths"] == [9] * 4 * 2  # T = 8 tokens and the class token, every example x head
