"""`mgk analyze` on kinds whose keys have fewer heads than their queries (gmgk's G groups of mixture keys, GQA's G
key/value heads): statistics per query head equal those of the same layer with its group keys copied to every head,
a group's component is pruned from every head of the group, and both commands run end to end on a tiny gmgk run."""
from __future__ import annotations

import json

import pytest
import torch

from mgk.analyze import prune
from mgk.analyze.mixture import component_sums, mixture_weights, per_query_head
from mgk.attention.gmgk import GroupedMGKAttention
from mgk.attention.gqa import GroupedQueryAttention
from mgk.cli import main
from mgk.config import run_config
from mgk.tasks import dretrieval
from mgk.train.distributed import Dist
from mgk.train.evaluate import evaluate

SIZES = dict(gen_seq_len=8, gen_features=3, gen_vocab=32, gen_train=48, gen_val=24, gen_test=24, d_model=16,
             head_dim=4, ffn_dim=16, classifier_dim=16, dropout=0.0, attn_dropout=0.0, num_layers=1)


def _repeat(t, groups: int, repeat: int, dim: int) -> torch.Tensor:
    """``t`` whose dimension ``dim`` is ``groups`` blocks, each block repeated ``repeat`` times in place."""
    shape = t.shape
    t = t.unflatten(dim, (groups, -1))
    return t.repeat_interleave(repeat, dim=dim).reshape(*shape[:dim], -1, *shape[dim + 1:])


@torch.no_grad()
def _expanded(grouped: GroupedMGKAttention) -> GroupedMGKAttention:
    """The same layer with one key group per query head (G = H, which is MGK / sMGK): every group's key
    projections, shifts, mixture weights and values copied to each of its query heads."""
    H, G, D, M = grouped.num_heads, grouped.kv_heads, grouped.head_dim, grouped.num_keys
    R = H // G
    mix = grouped.mixture
    full = GroupedMGKAttention(grouped.embed_dim, H, head_dim=D, keys=mix.keys, pi=mix.pi_mode, max_len=mix.max_len,
                               batch_first=True).double()
    state = {}
    for name, t in grouped.state_dict().items():
        if name == "mixture.k_proj.weight" or name == "mixture.k_proj.bias":
            parts = M if mix.keys == "separate" else 1  # (parts * G * D, ...): component-major rows
            state[name] = _repeat(t.unflatten(0, (parts, G * D)), G, R, 1).flatten(0, 1)
        elif name.startswith("v_proj."):
            state[name] = _repeat(t, G, R, 0)
        elif name == "mixture.key_shift":  # (M - 1, G, D)
            state[name] = t.repeat_interleave(R, dim=1)
        elif name in ("mixture.pi_logits", "mixture.pi"):  # (G, M) / (G, M, max_len)
            state[name] = t.repeat_interleave(R, dim=0)
        else:
            state[name] = t
    full.load_state_dict(state)
    return full


CASES = [dict(keys="separate", pi="learned", causal=False), dict(keys="shifted", pi="soft_e", causal=True),
         dict(keys="separate", pi="hard_e", causal=False)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['keys']}-{c['pi']}")
def test_grouped_mixture_statistics_equal_those_of_the_group_keys_copied_to_every_head(case, one_thread):
    torch.manual_seed(0)
    grouped = GroupedMGKAttention(8, 4, head_dim=4, num_kv_heads=2, keys=case["keys"], pi=case["pi"], max_len=6,
                                  batch_first=True).double()
    with torch.no_grad():
        if case["pi"] == "learned":
            grouped.mixture.pi_logits.normal_()
        if case["pi"] == "soft_e":
            grouped.mixture.pi.copy_(torch.softmax(torch.randn(2, 2, 6, dtype=torch.float64), dim=1))
    full = _expanded(grouped)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    _, w = grouped(x, need_weights=True, average_attn_weights=False, is_causal=case["causal"])
    _, w_full = full(x, need_weights=True, average_attn_weights=False, is_causal=case["causal"])
    assert torch.allclose(w, w_full, atol=1e-12)  # the expanded layer is the same function
    pi = mixture_weights(grouped, 5)
    if case["pi"] == "hard_e":
        assert pi is None
    else:  # each query head reports its group's pi
        assert pi.shape[0] == 4 and torch.allclose(pi, mixture_weights(full, 5))
    sums, pairs = component_sums(grouped, x, case["causal"])
    sums_full, pairs_full = component_sums(full, x, case["causal"])
    assert sums.shape == (4, 2) and torch.allclose(sums, sums_full, atol=1e-10) and torch.equal(pairs, pairs_full)


def test_gqa_keys_per_query_head_give_the_modules_own_weights(one_thread):
    torch.manual_seed(1)
    attn = GroupedQueryAttention(8, 4, head_dim=4, num_kv_heads=2, batch_first=True).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    k = attn._keys(x)
    assert k.shape[1] == 2
    k = per_query_head(attn, k)  # query head h reads key head h // 2
    q = attn._split(attn.q_proj(x))
    _, w = attn(x, need_weights=True, average_attn_weights=False)
    assert torch.allclose(torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1), w, atol=1e-12)
    assert per_query_head(attn, k) is k  # already per query head


def _task(tmp_path, **options):
    cfg = run_config(task="dretrieval", attention="gmgk", num_heads=4, num_kv_heads=2, **SIZES, **options)
    task = dretrieval.build(cfg, dretrieval.prepare(cfg, tmp_path / "data"))
    torch.manual_seed(0)
    model = task.build_model(cfg).eval()
    (attn,) = prune.attention_layers(model)
    with torch.no_grad():
        attn.mixture.pi_logits.normal_()
    return task, model, attn


def _nmse(task, model, layers, heads=None, components=None):
    with prune.gated(layers, heads, components):
        return evaluate(task, model, task.splits["test"], batch_size=24, precision="32",
                        dist_info=Dist(0, 1, torch.device("cpu")))["nmse"]


def test_a_groups_component_gate_acts_on_every_head_of_the_group(tmp_path, one_thread):
    task, model, attn = _task(tmp_path)
    layers = [attn]
    (gate,) = prune.unit_gates(layers, "component")
    assert gate.shape == (2, 2)  # (G, M): the components belong to the key groups
    off = torch.tensor([[0.0, 0.0], [1.0, 1.0]])  # every component of group 0 off: its heads 0 and 1 see no key
    assert _nmse(task, model, layers, components=[off]) == pytest.approx(
        _nmse(task, model, layers, heads=[torch.tensor([0.0, 0.0, 1.0, 1.0])]), rel=1e-6)
    ds, index = task.splits["val"], torch.arange(12)
    gates = [torch.tensor([[1.0, 0.0], [1.0, 1.0]])]  # group 0 has one component left
    (comp,) = prune.component_importance(task, model, layers, ds, index, gates, batch_size=12)
    (heads,) = prune.importance(task, model, layers, ds, index, prune.unit_gates(layers, "head"), unit="head",
                                batch_size=12, components=gates)
    assert comp[0, 0] == pytest.approx(float(heads[0] + heads[1])) and comp[0, 0] > 0  # the group's heads summed
    curve = prune.prune_curve(task, model, layers, (ds, index, task.splits["test"], index), unit="component",
                              settings=prune.PruneSettings(batch_size=12, random_orders=0))
    assert curve["units"] == 4 and curve["kept"] == [4, 3, 2, 1]


def test_mgk_analyze_and_prune_run_on_a_grouped_mixture_keys_run(tmp_path, th):
    run = tmp_path / "run"
    main(["train", "--task", "dretrieval", "--attention", "gmgk", "--heads", "4", "--steps", "2", "--out", str(run),
          *th.sets(*[f"{k}={v}" for k, v in SIZES.items()], "num_kv_heads=2", "keys=shifted", "eval_every=2",
                   "checkpoint_every=2", "log_every=1", "warmup_steps=1", "progress=false", "batch_size=8")])
    main(["analyze", str(run), "--samples", "3", "--out", str(tmp_path / "a"), "--examples", "1", "--no-progress"])
    (layer,) = json.loads((tmp_path / "a" / "analysis.json").read_text())["layers"]
    assert layer["num_heads"] == 4 and layer["kv_heads"] == 2 and len(layer["mixture"]["shares"]) == 4
    assert "| 3 (group 1) |" in (tmp_path / "a" / "analysis.md").read_text()
    out = tmp_path / "p"
    main(["analyze", "--prune", str(run), "--out", str(out), "--prune-random", "1", "--prune-examples", "8",
          "--batch-size", "8"])
    res = json.loads((out / "prune.json").read_text())
    assert res["units"]["head"]["curve"]["units"] == 4 and res["units"]["component"]["curve"]["units"] == 4
    assert "| L0 g1 r0 |" in (out / "prune.md").read_text()
