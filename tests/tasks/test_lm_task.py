"""LM task: the standard LM iterator through the sampler/batch protocol, loss sums, perplexity invariance."""
import math
from types import SimpleNamespace

import pytest
import torch

from mgk import config as config_mod
from mgk.models import IGNORE_INDEX, AttentionConfig, LMConfig, TransformerLM
from mgk.tasks import all_presets, get_task
from mgk.tasks.lm import LMSegments, LMTask, StreamSampler, make_batch, summarise
from mgk.train.evaluate import evaluate

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_each_training_segment_once_per_epoch_targets_shifted_by_one():
    tokens = torch.arange(1000, 1000 + 4 * 23 + 3, dtype=torch.int32)  # token value = 1000 + position
    ds = LMSegments(tokens, 4, 5, drop_last=True)
    assert ds.stream_len == 23 and ds.segments_per_stream == 4 and len(ds) == 16  # (23 - 1) // 5
    sampler = StreamSampler(len(ds), 4, seed=0)
    seen = []
    for step in range(ds.segments_per_stream):
        idx = sampler.indices(step)
        seen += idx.tolist()
        b = make_batch(ds, idx, "cpu")
        assert b["input"].shape == (4, 5) and b["input"].dtype == torch.int64
        for row in range(4):  # stream `row`, segment `step`: contiguous text, in order
            start = row * 23 + step * 5
            assert b["input"][row].tolist() == list(range(1000 + start, 1000 + start + 5))
        assert torch.equal(b["target"], b["input"] + 1)
    assert sorted(seen) == list(range(len(ds)))
    assert torch.equal(sampler.indices(ds.segments_per_stream), sampler.indices(0))  # next epoch starts over


@pytest.mark.parametrize("world,accum", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_ranks_and_micro_batches_get_disjoint_slices(world, accum):
    sampler = StreamSampler(8 * 6, 8, seed=0)
    local = 8 // world
    for step in (0, 5, 13):
        idx = sampler.indices(step)
        parts = []
        for r in range(world):  # what the training loop hands to rank r, then to each micro-batch
            mine = idx[r * local:(r + 1) * local]
            micro = local // accum
            parts += [mine[a * micro:(a + 1) * micro].tolist() for a in range(accum)]
        flat = [i for p in parts for i in p]
        assert sorted(flat) == sorted(idx.tolist()) and len(set(flat)) == 8


def test_sampler_refuses_a_layout_for_another_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        StreamSampler(30, 8, seed=0)


def test_evaluation_segments_predict_every_token_after_the_first_once():
    tokens = torch.arange(50, dtype=torch.int32)
    ds = LMSegments(tokens, 1, 8, drop_last=False)
    assert len(ds) == 7 and ds.num_predicted == 49  # 6 full segments and one of 1 token
    for bs in (1, 3, 7):
        targets = []
        for i in range(0, len(ds), bs):
            b = make_batch(ds, torch.arange(i, min(len(ds), i + bs)), "cpu")
            t = b["target"]
            targets += t[t != IGNORE_INDEX].tolist()
            assert torch.equal(b["input"][t != IGNORE_INDEX] + 1, t[t != IGNORE_INDEX])
        assert sorted(targets) == list(range(1, 50))


def test_too_short_train_split_is_a_clear_error():
    with pytest.raises(ValueError, match="too few"):
        LMSegments(torch.arange(20), 4, 5, drop_last=True)


class ConstNLL(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x, y):
        return torch.where(y != IGNORE_INDEX, self.w.expand(y.shape), torch.zeros(()))


def test_loss_returns_summed_nll_and_token_count():
    ds = LMSegments(torch.arange(30, dtype=torch.int32), 1, 8, drop_last=False)
    batch = make_batch(ds, torch.arange(len(ds)), "cpu")  # 3 full segments + one of 5 tokens
    back, sums = LMTask.loss(ConstNLL(), batch)
    assert int(sums["count"]) == 29 and float(sums["loss"]) == pytest.approx(58.0)
    assert float(back.detach()) == pytest.approx(58.0 / 8)
    # / segment width: the loop's / batch then gives a token mean
    m = summarise(sums)
    assert m["count"] == 29 and m["loss"] == pytest.approx(2.0) and m["ppl"] == pytest.approx(math.exp(2.0))


def context_free_lm(vocab=40, cutoffs=(10, 25)):
    """A unigram model: the last LayerNorm outputs a constant vector, so every position predicts the same law."""
    torch.manual_seed(0)
    lm = TransformerLM(LMConfig(vocab, d_model=8, num_layers=2, ffn_dim=16, cutoffs=tuple(cutoffs),
                                attention=AttentionConfig(num_heads=2, head_dim=4))).eval()
    with torch.no_grad():
        lm.blocks[-1].norm2.weight.zero_()
        lm.blocks[-1].norm2.bias.normal_()
    return lm


@pytest.mark.parametrize("segment_len", [3, 8, 64])
def test_unigram_perplexity_invariant_to_batch_size_segment_length_and_world_size(segment_len):
    torch.manual_seed(1)
    tokens = torch.randint(0, 40, (161,), dtype=torch.int32)
    lm = context_free_lm()
    with torch.no_grad():
        ref = -lm.adaptive.log_prob(lm.hidden(tokens[None, :2].long())[0, :1]).squeeze(0)[tokens[1:].long()].sum()
    ds = LMSegments(tokens, 1, segment_len, drop_last=False)
    task = LMTask("lm", {}, vocab=None)
    for bs in (2, 64):
        for world in (1, 3):  # rank r of `world` takes examples r, r+W, ...; sums add up over ranks
            total, count = 0.0, 0
            for r in range(world):
                info = SimpleNamespace(rank=r, world_size=world, device=torch.device("cpu"))
                m = evaluate(task, lm, ds, batch_size=bs, precision="32", dist_info=info)
                if m["count"]:  # a rank without examples reports count 0 (and loss nan)
                    total += m["loss"] * m["count"]
                    count += m["count"]
            assert count == 160
            assert total == pytest.approx(float(ref), rel=1e-5)


def test_presets_and_task_registry():
    presets = all_presets()
    paper = config_mod.flat(presets["wt103-small"])
    assert tuple(paper[k] for k in ("num_layers", "d_model", "head_dim", "ffn_dim", "segment_len", "batch_size")) == \
        (16, 128, 16, 2048, 256, 96)
    assert tuple(paper[k] for k in ("lr", "warmup_steps", "schedule", "grad_clip", "dropout", "weight_decay")) == \
        (2.5e-4, 2000, "cosine", 0.25, 0.1, 0.0)
    assert paper["adaptive_cutoffs"] is None  # the default [20000, 40000, 200000]
    assert presets["lm-small"].task == "lm" and presets["lm-small"].data.path is None
    assert get_task("lm").PRESETS is not None
    cfg = config_mod.run_config(task="lm", sigma2=[4.0, 4.0 / 3], d_model=8, head_dim=4, num_heads=2, num_layers=1,
                                ffn_dim=8)
    task = LMTask("lm", {}, vocab=[None] * 30)
    model = task.build_model(cfg)
    sig = [m.sigma2.tolist() for m in model.modules() if hasattr(m, "sigma2") and torch.is_tensor(m.sigma2)]
    assert sig and all(s == pytest.approx([4.0, 4.0 / 3]) for s in sig)
