"""`mgk eval` and the sliding-window harness: exact counts, brute-force equality,
protocol invariance for a context-free model, and `mgk train --task lm` -> `mgk eval` end to end."""
import json
import math
from types import SimpleNamespace

import pytest
import torch
import yaml

from mgk.cli import main
from mgk.data import wikitext as wt
from mgk.models import IGNORE_INDEX, AttentionConfig, LMConfig, TransformerLM
from mgk.tasks.lm import LMSegments, LMTask
from mgk.train.evaluate import evaluate
from mgk.train.lm_eval import evaluate_tokens, window_plan

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("n,context,stride", [(50, 8, 1), (50, 8, 3), (50, 8, 8), (5, 8, 2), (2, 1, 1), (17, 4, 4)])
def test_window_plan_scores_every_token_once_with_bounded_context(n, context, stride):
    starts, lengths, scored = window_plan(n, context, stride)
    assert int(scored.sum()) == n - 1 and bool(torch.all(lengths <= context))
    seen = []
    for k, (s, w, c) in enumerate(zip(starts.tolist(), lengths.tolist(), scored.tolist())):
        preds = list(range(s + 1, s + w + 1))  # tokens predicted by this window
        if k == 0:
            assert s == 0 and c == w  # the first window scores everything it predicts
        else:
            assert s == starts[k - 1] + stride and c <= stride
        seen += preds[w - c:]
    assert seen == list(range(1, n))
    with pytest.raises(ValueError):
        window_plan(n, context, context + 1)
    with pytest.raises(ValueError, match="nothing to predict"):
        window_plan(1, context, 1)


def tiny_lm(seed=0, vocab=30, cutoffs=(8, 20), attention="softmax"):
    torch.manual_seed(seed)
    return TransformerLM(LMConfig(vocab, d_model=16, num_layers=2, ffn_dim=32, cutoffs=tuple(cutoffs),
                                  attention=AttentionConfig(kind=attention, num_heads=2, head_dim=8))).eval()


@pytest.mark.parametrize("attention", ["softmax", "mgk"])
def test_stride_one_equals_brute_force_per_token_windows(attention):
    lm = tiny_lm(attention=attention)
    torch.manual_seed(1)
    tokens = torch.randint(0, 30, (50,))
    W = 8
    with torch.no_grad():
        brute = 0.0
        for t in range(1, 50):  # token t from its own window of min(t, W) previous tokens
            ctx = tokens[max(0, t - W):t]
            brute -= float(lm.log_probs(ctx[None])[0, -1, tokens[t]])
    for bs in (1, 16):
        r = evaluate_tokens(lm, tokens, context=W, stride=1, batch_size=bs)
        assert r["tokens"] == 49 and r["windows"] == 49 - W + 1
        assert r["nll_sum"] == pytest.approx(brute, rel=1e-5)
        assert r["ppl"] == pytest.approx(math.exp(brute / 49), rel=1e-5)


def test_stride_equal_to_context_is_chunked_eval_and_training_validation():
    lm = tiny_lm()
    torch.manual_seed(2)
    tokens = torch.randint(0, 30, (50,))
    W = 8
    with torch.no_grad():
        chunked = 0.0
        for s in range(0, 49, W):  # inputs tokens[s:s+W], targets shifted by one; the last chunk is shorter
            x = tokens[s:min(s + W, 49)]
            y = tokens[s + 1:s + 1 + x.numel()]
            chunked -= float(lm.log_probs(x[None])[0].gather(1, y[:, None]).sum())
    r = evaluate_tokens(lm, tokens, context=W, stride=W, batch_size=3)
    assert r["tokens"] == 49 and r["nll_sum"] == pytest.approx(chunked, rel=1e-5)
    val = evaluate(LMTask("lm", {}, vocab=None), lm, LMSegments(tokens, 1, W, drop_last=False), batch_size=4,
                   precision="32", dist_info=SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu")))
    assert val["count"] == 49 and val["ppl"] == pytest.approx(r["ppl"], rel=1e-5)


class CopyBack(torch.nn.Module):
    """Predicts the token P positions back with probability 0.9 when its window reaches that far, else uniform."""

    def __init__(self, vocab, period):
        super().__init__()
        self.vocab, self.period = vocab, period
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x, y):
        L = x.shape[1]
        nll = torch.full(y.shape, math.log(self.vocab))
        pos = torch.arange(L)
        for i in range(self.period - 1, L):  # predicting x[i+1] = x[i+1-P], which is in the window
            hit = y[:, i] == x[:, i + 1 - self.period]
            nll[:, i] = torch.where(hit, -math.log(0.9 + 0.1 / self.vocab), -math.log(0.1 / self.vocab))
        return torch.where(y != IGNORE_INDEX, nll, torch.zeros(())) + 0 * pos.sum()


def test_context_matters_stride_one_beats_non_overlapping_windows():
    W = 8
    tokens = torch.arange(W).repeat(7)  # period W: each token equals the one W back
    model = CopyBack(vocab=20, period=W)
    slide = evaluate_tokens(model, tokens, context=W, stride=1, batch_size=5)
    chunk = evaluate_tokens(model, tokens, context=W, stride=W, batch_size=5)
    mid = evaluate_tokens(model, tokens, context=W, stride=4, batch_size=5)
    assert slide["tokens"] == chunk["tokens"] == mid["tokens"] == 55
    assert slide["ppl"] < mid["ppl"] < chunk["ppl"]
    # stride 1: only the first W-1 targets lack the token W back
    expect = ((W - 1) * math.log(20) - (55 - W + 1) * math.log(0.9 + 0.1 / 20)) / 55
    assert slide["nll"] == pytest.approx(expect, rel=1e-6)


def uniform_lm(vocab, cutoffs):
    """Every word gets probability 1/V: constant hidden e_0, zero word scores, cluster scores log(cluster size)."""
    lm = tiny_lm(vocab=vocab, cutoffs=cutoffs)
    with torch.no_grad():
        norm = lm.blocks[-1].norm2
        norm.weight.zero_()
        norm.bias.zero_()
        norm.bias[0] = 1.0
        for p in lm.adaptive.parameters():
            p.zero_()
        sm = lm.adaptive.softmax
        if sm is not None:
            for i, (lo, hi) in enumerate(zip(sm.cutoffs[:-1], sm.cutoffs[1:])):
                sm.head.weight[sm.shortlist_size + i, 0] = math.log(hi - lo)
    return lm


@pytest.mark.parametrize("cutoffs", [(8, 20), ()])
def test_uniform_model_has_perplexity_equal_to_vocabulary_size(cutoffs):
    lm = uniform_lm(30, list(cutoffs) or [100])
    torch.manual_seed(3)
    tokens = torch.randint(0, 30, (40,))
    for stride in (1, 5):
        r = evaluate_tokens(lm, tokens, context=5, stride=stride, batch_size=4)
        assert r["tokens"] == 39 and r["ppl"] == pytest.approx(30.0, rel=1e-5)


def test_unigram_model_perplexity_independent_of_stride_batch_and_world_size():
    lm = tiny_lm(seed=4)
    with torch.no_grad():
        lm.blocks[-1].norm2.weight.zero_()
        lm.blocks[-1].norm2.bias.normal_()
    torch.manual_seed(5)
    tokens = torch.randint(0, 30, (41,))
    results = []
    for context, stride, bs in [(4, 1, 3), (4, 4, 1), (7, 3, 16), (40, 40, 1), (64, 64, 2)]:
        results.append(evaluate_tokens(lm, tokens, context=context, stride=stride, batch_size=bs))
    parts = [evaluate_tokens(lm, tokens, context=4, stride=1, batch_size=2,
                             dist_info=SimpleNamespace(rank=r, world_size=3, device=torch.device("cpu")))
             for r in range(3)]  # a process group of 3 sums these (no group here: each part is one rank's share)
    assert sum(p["tokens"] for p in parts) == 40
    results.append({"nll_sum": sum(p["nll_sum"] for p in parts)})
    for r in results[1:]:
        assert r["nll_sum"] == pytest.approx(results[0]["nll_sum"], rel=1e-5)


# -- end to end ----------------------------------------------------------------------------------------------------
TINY_LM = ["batch_size=4", "segment_len=8", "max_len=8", "d_model=16", "num_layers=2", "ffn_dim=32", "head_dim=4",
           "log_every=1", "eval_every=2", "checkpoint_every=2", "eval_batch_size=8", "warmup_steps=1",
           "progress=false", "adaptive_cutoffs=[20,60]"]


def test_train_then_eval_counts_every_predicted_token(tmp_path, th):
    data = tmp_path / "wt"
    wt.generate_corpus(data, train_lines=120, valid_lines=30, test_lines=25, num_words=120, seed=1)
    n_valid = wt.load_corpus(data, cache_dir=False).tokens["valid"].numel()
    n_test = wt.load_corpus(data, cache_dir=False).tokens["test"].numel()
    out = tmp_path / "run"
    main(["train", "--task", "lm", "--data", str(data), "--attention", "mgk", "--heads", "2", "--steps", "4",
          "--out", str(out), *th.sets(*TINY_LM, "sigma2=[2.0,0.6667]")])
    results = json.loads((out / "results.json").read_text())
    assert results["val"]["count"] == n_valid - 1 and results["test"]["count"] == n_test - 1
    assert results["val"]["tokens"] == n_valid and results["val"]["ppl"] > 1
    assert (out / "vocab.txt").is_file() and (out / "checkpoints" / "best.pt").is_file()
    assert yaml.safe_load((out / "config.yaml").read_text())["attention"]["options"]["sigma2"] == [2.0, 0.6667]
    log = (out / "train.log").read_text()
    assert "data: valid" in log and "vocabulary" in log

    main(["eval", str(out), "--split", "valid", "--json", str(tmp_path / "v.json"), "--no-progress"])
    v = json.loads((tmp_path / "v.json").read_text())
    for key in ("ppl", "nll", "tokens", "protocol", "context", "stride"):
        assert key in v
    assert v["tokens"] == n_valid - 1 and v["protocol"] == "segments" and v["context"] == v["stride"] == 8
    assert v["ppl"] == pytest.approx(results["val"]["ppl"], rel=1e-5)  # segment mode = validation in training
    assert v["ppl"] == pytest.approx(math.exp(v["nll"])) and v["nll_sum"] == pytest.approx(v["nll"] * v["tokens"])

    main(["eval", str(out), "--split", "test", "--context", "6", "--stride", "1", "--json", str(tmp_path / "t.json"),
          "--no-progress", "--batch-size", "64"])
    t = json.loads((tmp_path / "t.json").read_text())
    assert t["tokens"] == n_test - 1 and t["protocol"] == "sliding" and (t["context"], t["stride"]) == (6, 1)
    assert t["windows"] == n_test - 1 - 6 + 1

    with pytest.raises(SystemExit, match="stride"):
        main(["eval", str(out), "--context", "4", "--stride", "5", "--no-progress"])
    (data / "wiki.test.tokens").unlink()
    with pytest.raises(SystemExit, match="no test split"):
        main(["eval", str(out), "--split", "test", "--no-progress"])


def test_train_without_data_uses_a_generated_corpus(tmp_path, th):
    out = tmp_path / "run"
    main(["train", "--task", "lm", "--attention", "softmax", "--heads", "2", "--steps", "2", "--out", str(out),
          *th.sets(*TINY_LM, "gen_train=80", "gen_val=12", "gen_test=12")])
    assert (out / "data" / "wiki.train.tokens").is_file()
    results = json.loads((out / "results.json").read_text())
    n_test = wt.load_corpus(out / "data", cache_dir=False).tokens["test"].numel()
    main(["eval", str(out), "--split", "test", "--json", str(tmp_path / "t.json"), "--no-progress"])
    t = json.loads((tmp_path / "t.json").read_text())
    assert t["tokens"] == results["test"]["count"] == n_test - 1
    assert t["ppl"] == pytest.approx(results["test"]["ppl"], rel=1e-5)


def test_eval_refuses_a_classification_run(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"task": "listops"}))
    with pytest.raises(SystemExit, match="'listops' run"):
        main(["eval", str(tmp_path), "--no-progress"])


def test_torchrun_two_ranks_train_like_one_and_three_ranks_evaluate_like_one(tmp_path, th):
    """The LM harness with real process groups (gloo): the stream slices of 2 ranks make the same global
    batch as 1 process (rare adaptive clusters missing from one rank's slice must not break DDP), and `mgk eval`
    on 3 ranks scores the same tokens with the same perplexity as on 1."""

    data = tmp_path / "wt"
    wt.generate_corpus(data, train_lines=120, valid_lines=30, test_lines=25, num_words=120, seed=1)
    V = len(wt.load_corpus(data, cache_dir=False).vocab)  # the last cluster holds the 2 rarest words
    args = ["train", "--task", "lm", "--data", str(data), "--attention", "mgk", "--heads", "2", "--steps", "4",
            *th.sets(*TINY_LM, "dropout=0.0", "attn_dropout=0.0", f"adaptive_cutoffs=[20,{V - 2}]")]
    one, two = tmp_path / "one", tmp_path / "two"
    th.run(th.mgk_cmd(*args, "--out", str(one)))
    th.run_torchrun(2, [*args, "--out", str(two)])
    for (s1, a), (s2, b) in zip(th.series(one, "train/loss"), th.series(two, "train/loss")):
        assert s1 == s2 and a == pytest.approx(b, rel=1e-4)
    r1, r2 = (json.loads((d / "results.json").read_text()) for d in (one, two))
    assert r2["world_size"] == 2 and r1["val"]["count"] == r2["val"]["count"]
    assert r1["val"]["ppl"] == pytest.approx(r2["val"]["ppl"], rel=1e-4)

    ev = ["eval", str(one), "--split", "valid", "--context", "8", "--stride", "3", "--no-progress", "--device", "cpu"]
    th.run(th.mgk_cmd(*ev, "--json", str(tmp_path / "e1.json")))
    th.run_torchrun(3, [*ev, "--json", str(tmp_path / "e3.json")])
    e1, e3 = (json.loads((tmp_path / f).read_text()) for f in ("e1.json", "e3.json"))
    assert e3["world_size"] == 3 and e1["tokens"] == e3["tokens"] == r1["val"]["count"]
    assert e1["ppl"] == pytest.approx(e3["ppl"], rel=1e-6)


def test_resumed_lm_run_equals_an_uninterrupted_one(tmp_path, th):
    data = tmp_path / "wt"
    wt.generate_corpus(data, train_lines=120, valid_lines=30, test_lines=25, num_words=120, seed=1)
    common = ["train", "--task", "lm", "--data", str(data), "--attention", "mgk", "--heads", "2"]
    pairs = [*TINY_LM, "schedule=constant"]  # the lr must not depend on --steps
    main([*common, *th.sets(*pairs), "--steps", "6", "--out", str(tmp_path / "a")])
    main([*common, *th.sets(*pairs, "checkpoint_every=3"), "--steps", "3", "--out", str(tmp_path / "b")])
    main(["train", "--resume", str(tmp_path / "b"), "--steps", "6"])

    assert th.series(tmp_path / "a", "train/loss") == th.series(tmp_path / "b", "train/loss")
    sa, sb = th.last_state(tmp_path / "a")["model"], th.last_state(tmp_path / "b")["model"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
