"""`mgk train --init-from`: a trained softmax-8 run converted to another kind or number of heads
(results/cpu/kv-budget.md, "Retro-fitting"). The conversion to GQA with G = H is exact (its first validation is the
source's); a conversion to MGK-4 carries what was learned (after the same steps it is far better than a fresh
MGK-4 of the same seed); everything outside attention is copied; bad inputs end in one line."""
from __future__ import annotations

import json

import pytest
import torch

from mgk import load_run
from mgk.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["gen_features=8", "gen_train=512", "gen_val=64", "gen_test=64", "progress=false", "warmup_steps=5",
         "eval_every=40", "log_every=10", "eval_batch_size=64"]


@pytest.fixture(scope="module")
def source(tmp_path_factory, th):
    """A 120-step softmax-8 run on D-retrieval D = 8 (T = 16), head_dim 8."""
    out = tmp_path_factory.mktemp("retrofit") / "softmax8"
    main(["train", "--task", "dretrieval", "--preset", "dretrieval-small", "--attention", "softmax", "--heads", "8",
          "--steps", "120", "--out", str(out), *th.sets(*SMALL)])
    return out


def _convert(source, out, *flags, steps=10, th=None):
    main(["train", "--init-from", str(source), *flags, "--steps", str(steps), "--out", str(out),
          "--set", "warmup_steps=1", "--set", f"eval_every={steps}"])
    return out


def _val_at(run, step, key="val/loss"):
    return [r[key] for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())
            if r["step"] == step and key in r]


def _best_val(run):
    return json.loads((run / "results.json").read_text())["val"]["loss"]


def test_gqa_with_as_many_kv_heads_starts_exactly_where_the_source_ended(source, tmp_path):
    run = _convert(source, tmp_path / "gqa8", "--attention", "gqa", "--heads", "8", "--set", "num_kv_heads=8")
    assert _val_at(run, 0) == [pytest.approx(_best_val(source), rel=1e-5)]
    init = json.loads((run / "init.json").read_text())
    assert [layer["rule"] for layer in init["layers"]] == ["same"] and init["step"] == 120
    assert "initialised from" in (run / "train.log").read_text()


def test_everything_outside_attention_is_the_source_s(source, tmp_path):
    run = _convert(source, tmp_path / "kv2", "--attention", "gqa", "--heads", "8", "--set", "num_kv_heads=2",
                   steps=1)
    src = load_run(source).model.state_dict()
    # the step-1 run moved its weights; its step-0 state is what was converted, so check the conversion directly
    from mgk.retrofit import InitFrom, initialise
    new = load_run(run).model
    torch.manual_seed(0)
    for p in new.parameters():
        p.data.normal_()
    task = load_run(source).with_splits().task
    record = initialise(InitFrom(source), new, task, seed=0)
    state = new.state_dict()
    outside = [k for k in src if ".attn." not in k]
    assert outside and all(torch.equal(state[k], src[k]) for k in outside)
    assert record["copied_entries"] == len(outside)
    # GQA's rule: query heads copied, key/value heads the mean of their group of 4 (Ainslie et al. 2023)
    k_src = src["encoder.blocks.0.attn.k_proj.weight"].reshape(2, 4, 8, -1).mean(1).reshape(16, -1)
    torch.testing.assert_close(state["encoder.blocks.0.attn.k_proj.weight"], k_src)
    assert torch.equal(state["encoder.blocks.0.attn.q_proj.weight"], src["encoder.blocks.0.attn.q_proj.weight"])


@pytest.mark.parametrize("pairs", ["similar", "adjacent"])
def test_mgk4_from_softmax8_carries_what_was_learned(source, tmp_path, pairs):
    steps = 20
    run = _convert(source, tmp_path / f"mgk4-{pairs}", "--attention", "mgk", "--heads", "4", "--init-pairs", pairs,
                   steps=steps)
    fresh = tmp_path / "fresh"
    if not fresh.exists():
        main(["train", "--task", "dretrieval", "--preset", "dretrieval-small", "--attention", "mgk", "--heads", "4",
              "--steps", str(steps), "--out", str(fresh), "--set", "warmup_steps=1", "--set", f"eval_every={steps}",
              *[a for s in SMALL if not s.startswith(("warmup", "eval_every")) for a in ("--set", s)]])
    converted, scratch = _val_at(run, steps)[0], _val_at(fresh, steps)[0]
    assert converted < 0.7 * scratch, (converted, scratch)
    layer = json.loads((run / "init.json").read_text())["layers"][0]
    assert layer["rule"] == "merge" and sorted(h for g in layer["groups"] for h in g) == list(range(8))
    if pairs == "adjacent":
        assert layer["groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_softmax4_keeps_the_most_important_heads(source, tmp_path):
    run = _convert(source, tmp_path / "sm4", "--attention", "softmax", "--heads", "4", steps=1)
    layer = json.loads((run / "init.json").read_text())["layers"][0]
    imp = layer["importance"]
    assert layer["rule"] == "prune" and len(layer["keep"]) == 4
    assert min(imp[h] for h in layer["keep"]) >= max(imp[h] for h in range(8) if h not in layer["keep"])


@pytest.mark.parametrize("flags, match", [
    (["--attention", "mgk", "--heads", "3"], "no conversion from MultiheadAttention x 8 .* to MGKAttention x 3"),
    (["--attention", "softmax", "--heads", "16", "--set", "head_dim=4"], "no conversion"),
    (["--attention", "gqa", "--heads", "8", "--set", "num_kv_heads=3"], "num_kv_heads"),
    (["--task", "listops"], "--init-from takes the task, data and sizes from .*; drop --task"),
    (["--preset", "listops-small"], "drop --preset"),
    (["--init-pairs", "similar", "--resume", "x"], "--resume takes its config from x/config.yaml; drop --out, "
                                                    "--init-from, --init-pairs"),
])
def test_bad_conversions_end_in_one_line(source, tmp_path, flags, match):
    with pytest.raises(SystemExit) as e:
        main(["train", "--init-from", str(source), *flags, "--steps", "1", "--set", "warmup_steps=1", "--out",
              str(tmp_path / "bad")])
    msg = str(e.value.code)
    assert "\n" not in msg and msg.startswith("mgk train: ")
    assert __import__("re").search(match, msg), msg
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


def test_not_a_run_and_pairs_without_init_from(tmp_path):
    with pytest.raises(SystemExit, match="--init-from .*: not a run directory"):
        main(["train", "--init-from", str(tmp_path), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--init-pairs applies to --init-from RUN_DIR only"):
        main(["train", "--init-pairs", "adjacent", "--out", str(tmp_path / "x")])


def test_a_source_of_another_task_is_refused(tmp_path, th):
    from mgk.retrofit import InitFrom

    lo = tmp_path / "lo"
    main(["train", "--steps", "2", "--out", str(lo), *th.sets(*th.TINY, "eval_every=2", "gen_train=64",
                                                            "gen_val=16", "gen_test=16")])
    with pytest.raises(ValueError, match="a listops run; this run trains dretrieval"):
        InitFrom(lo).check("dretrieval")


def test_the_source_cannot_be_the_new_run_s_folder(source, tmp_path):
    """A new-user pass found `--out SRC --overwrite` deleting the source run before anything was converted."""
    before = sorted(p.name for p in source.iterdir())
    for out in (source, source.parent):
        with pytest.raises(SystemExit) as e:
            main(["train", "--init-from", str(source), "--attention", "softmax", "--heads", "4", "--steps", "5",
                  "--set", "warmup_steps=1", "--out", str(out), "--overwrite"])
        assert "is the --init-from run" in str(e.value.code) and "\n" not in str(e.value.code)
    assert sorted(p.name for p in source.iterdir()) == before and (source / "checkpoints" / "best.pt").is_file()


def test_pairs_that_merge_nothing_and_a_warmup_longer_than_the_run_are_refused(source, tmp_path):
    with pytest.raises(SystemExit, match="--init-pairs adjacent: this conversion merges no heads .*by prune"):
        main(["train", "--init-from", str(source), "--attention", "softmax", "--heads", "4", "--init-pairs",
              "adjacent", "--steps", "5", "--set", "warmup_steps=1", "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="keeps the source's warmup_steps=5, more than --steps 3: give --set"):
        main(["train", "--init-from", str(source), "--attention", "softmax", "--heads", "4", "--steps", "3",
              "--out", str(tmp_path / "b")])


def test_mgk_to_the_same_mgk_is_exact_and_results_name_the_source(tmp_path, th):
    """Same heads keep the source's own parameters (every key component, the learned weights), as swap_attention
    does; results.json says where the weights came from."""
    src = tmp_path / "mgk4"
    main(["train", "--task", "dretrieval", "--preset", "dretrieval-small", "--attention", "mgk", "--heads", "4",
          "--steps", "40", "--out", str(src), *th.sets(*SMALL)])
    run = _convert(src, tmp_path / "again", "--attention", "mgk", "--heads", "4", steps=2)
    assert _val_at(run, 0) == [pytest.approx(_best_val(src), rel=1e-5)]
    results = json.loads((run / "results.json").read_text())
    assert results["init_from"]["source"] == str(src) and results["init_from"]["rules"] == ["same"]


def test_a_language_model_on_another_vocabulary_is_refused():
    """Embeddings are rows by word id: the same number of words in another order would silently swap them."""
    from types import SimpleNamespace

    from mgk.data.wikitext import Vocabulary
    from mgk.retrofit import _check_vocabulary

    def holder(words):
        return SimpleNamespace(task=SimpleNamespace(vocab=Vocabulary(words)), vocab=Vocabulary(words))

    _check_vocabulary(holder(["a", "b", "<eos>"]), holder(["a", "b", "<eos>"]), "src")
    with pytest.raises(ValueError, match="word 0: 'a' there, 'b' here"):
        _check_vocabulary(holder(["a", "b", "<eos>"]), holder(["b", "a", "<eos>"]), "src")
