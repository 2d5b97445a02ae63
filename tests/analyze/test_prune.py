"""Head importance and pruning (Michel et al. 2019) on small D-retrieval models: a copied head has its twin's
importance, a head with zero output has none, the gates are the modules' own (pruning all but one head is the
model of that head alone; a pruned component is the model without it), importance is a mean over examples of
per-example derivatives, and `mgk analyze --prune` end to end."""
from __future__ import annotations

import json

import pytest
import torch

from mgk.analyze import prune
from mgk.attention import MGKAttention
from mgk.cli import main
from mgk.config import run_config
from mgk.tasks import dretrieval
from mgk.train.distributed import Dist
from mgk.train.evaluate import evaluate

SIZES = dict(gen_seq_len=8, gen_features=3, gen_vocab=32, gen_train=64, gen_val=40, gen_test=40, d_model=16,
             head_dim=4, ffn_dim=16, classifier_dim=16, dropout=0.0, attn_dropout=0.0, num_layers=1)
SETTINGS = prune.PruneSettings(batch_size=16, random_orders=2).check()


def _task(tmp_path, kind, heads, **extra):
    cfg = run_config(task="dretrieval", attention=kind, num_heads=heads, **SIZES, **extra)
    task = dretrieval.build(cfg, dretrieval.prepare(cfg, tmp_path / "data"))
    return task, cfg


def _model(task, cfg, seed=0):
    torch.manual_seed(seed)
    return task.build_model(cfg).eval()


def _metric(task, model, split="test"):
    ds = task.splits[split]
    return evaluate(task, model, ds, batch_size=16, precision="32", dist_info=Dist(0, 1, torch.device("cpu")))["nmse"]


def _data(task):
    return task.splits["val"], torch.arange(len(task.splits["val"])), task.splits["test"], \
        torch.arange(len(task.splits["test"]))


def _head_rows(attn, h):
    """Row blocks of head h in each per-head projection (weight rows and bias entries)."""
    D, H = attn.head_dim, attn.num_heads
    blocks = [(attn.q_proj, h * D), (attn.v_proj, h * D)]
    if isinstance(attn, MGKAttention):
        blocks += [(attn.mixture.k_proj, m * H * D + h * D) for m in range(attn.num_keys)]
    else:
        blocks.append((attn.k_proj, h * D))
    return blocks


@torch.no_grad()
def _copy_head(attn, src, dst):
    D = attn.head_dim
    for (lin, a), (_, b) in zip(_head_rows(attn, src), _head_rows(attn, dst)):
        lin.weight[b:b + D] = lin.weight[a:a + D]
        lin.bias[b:b + D] = lin.bias[a:a + D]
    attn.out_proj.weight[:, dst * D:(dst + 1) * D] = attn.out_proj.weight[:, src * D:(src + 1) * D]
    if isinstance(attn, MGKAttention):
        attn.mixture.pi_logits[dst] = attn.mixture.pi_logits[src]


@pytest.mark.parametrize("kind", ["softmax", "mgk"])
def test_a_copied_head_has_its_twins_importance_and_a_zero_output_head_has_none(tmp_path, kind):
    task, cfg = _task(tmp_path, kind, 4)
    model = _model(task, cfg)
    (attn,) = prune.attention_layers(model)
    if kind == "mgk":
        with torch.no_grad():  # distinct mixture weights per head, so the copy has something to copy
            attn.mixture.pi_logits.copy_(torch.randn_like(attn.mixture.pi_logits))
    _copy_head(attn, 0, 1)
    with torch.no_grad():
        attn.out_proj.weight[:, 3 * 4:4 * 4] = 0.0
    imp_ds, imp_index, _, _ = _data(task)
    (heads,) = prune.importance(task, model, [attn], imp_ds, imp_index, prune.unit_gates([attn], "head"),
                                unit="head", batch_size=16)
    assert heads[1] == pytest.approx(float(heads[0]), rel=1e-5) and heads[0] > 0
    assert heads[3] == 0.0 and heads[2] > 0
    if kind == "mgk":
        (comps,) = prune.importance(task, model, [attn], imp_ds, imp_index, prune.unit_gates([attn], "component"),
                                    unit="component", batch_size=16)
        assert torch.allclose(comps[1], comps[0], rtol=1e-5) and bool((comps[0] > 0).all())
        assert bool((comps[3] == 0).all())


def test_importance_is_the_mean_of_per_example_absolute_derivatives(tmp_path):
    task, cfg = _task(tmp_path, "softmax", 4)
    model = _model(task, cfg, seed=1)
    layers = prune.attention_layers(model)
    ds, index = task.splits["val"], torch.arange(12)
    (batched,) = prune.importance(task, model, layers, ds, index, prune.unit_gates(layers, "head"), unit="head",
                                  batch_size=5)
    total = torch.zeros(4, dtype=torch.float64)
    for i in index:  # one example at a time, with one shared (H,) gate: the definition itself
        gate = torch.ones(4, requires_grad=True)
        with prune.gated(layers, [gate]):
            loss, _ = task.loss(model, task.batch(ds, i.reshape(1), "cpu"))
        (g,) = torch.autograd.grad(loss, [gate])
        total += g.abs().double()
    assert torch.allclose(batched, total / len(index), rtol=1e-5)
    # the absolute value of a batch's gradient would be smaller wherever examples disagree in sign
    gate = torch.ones(4, requires_grad=True)
    with prune.gated(layers, [gate]):
        loss, _ = task.loss(model, task.batch(ds, index, "cpu"))
    (g,) = torch.autograd.grad(loss, [gate])
    assert bool((g.abs().double() / len(index) <= batched + 1e-7).all())
    assert all(p.grad is None for p in model.parameters())


def _alone_state(full: dict, alone: dict, prefix: str, h: int, D: int, H: int, M: int) -> dict:
    """The state dict of a 1-head model from a H-head one: head h's rows of the per-head projections, its columns
    of out_proj, its mixture weights; everything else as it is."""
    out = {}
    for k, v in alone.items():
        w = full[k]
        if w.shape == v.shape:
            out[k] = w
        elif k.startswith(prefix + "mixture.k_proj."):
            out[k] = torch.cat([w[m * H * D + h * D:m * H * D + (h + 1) * D] for m in range(M)])
        elif k.startswith(prefix + "out_proj.weight"):
            out[k] = w[:, h * D:(h + 1) * D]
        else:  # q/k/v projections and pi_logits (H, M): the head's own slice
            out[k] = w[h * (v.shape[0]):(h + 1) * v.shape[0]]
    return out


@pytest.mark.parametrize("kind", ["softmax", "mgk"])
def test_pruning_all_but_one_head_gives_the_model_of_that_head_alone(tmp_path, kind):
    task, cfg = _task(tmp_path, kind, 4)
    model = _model(task, cfg, seed=2)
    if kind == "mgk":
        with torch.no_grad():
            prune.attention_layers(model)[0].mixture.pi_logits.normal_()
    layers = prune.attention_layers(model)
    curve = prune.prune_curve(task, model, layers, _data(task), unit="head", settings=SETTINGS)
    assert curve["kept"] == [4, 3, 2, 1] and len(curve["pruned"]) == 3
    (survivor,) = set(range(4)) - {idx[0] for _, idx in curve["pruned"]}
    one = run_config(task="dretrieval", attention=kind, num_heads=1, **SIZES)
    alone = _model(task, one)
    prefix = next(n for n, m in model.named_modules() if m is layers[0]) + "."
    alone.load_state_dict(_alone_state(model.state_dict(), alone.state_dict(), prefix, survivor, 4, 4,
                                       getattr(layers[0], "num_keys", 1)))
    assert curve["metric"][-1] == pytest.approx(_metric(task, alone), rel=1e-5)
    assert curve["metric"][0] == pytest.approx(_metric(task, model), rel=1e-6)
    assert layers[0].head_gate is None  # the gates are removed after use


def test_a_pruned_component_is_the_model_without_it(tmp_path):
    task, cfg = _task(tmp_path, "mgk", 2)
    model = _model(task, cfg, seed=3)
    (attn,) = prune.attention_layers(model)
    with torch.no_grad():
        attn.mixture.pi_logits.normal_()
    gate = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # component 1 of both heads off: pi_0 renormalised to 1
    with prune.gated([attn], None, [gate]):
        gated = _metric(task, model)
    one = _model(task, run_config(task="dretrieval", attention="mgk", num_heads=2, num_keys=1, **SIZES))
    state = {k: (v[:2 * 4] if ".mixture.k_proj." in k else v[:, :1] if k.endswith("pi_logits")
                 else v[:1] if k.endswith("sigma2") else v)  # component 0's keys, weight and variance
             for k, v in model.state_dict().items()}
    one.load_state_dict(state)
    assert gated == pytest.approx(_metric(task, one), rel=1e-5)
    with prune.gated([attn], None, [torch.zeros(2, 2)]):  # every component off: no head left, as gating heads off
        none = _metric(task, model)
    with prune.gated([attn], [torch.zeros(2)]):
        assert none == pytest.approx(_metric(task, model), rel=1e-6)


def test_gates_of_the_wrong_shape_and_component_gates_without_weights_are_refused():
    attn = MGKAttention(16, 4, head_dim=4, batch_first=True)
    x = torch.randn(2, 5, 16)
    attn.head_gate = torch.ones(3)
    with pytest.raises(ValueError, match=r"head_gate must have shape \(num_heads,\) = \(4,\)"):
        attn(x, need_weights=False)
    attn.head_gate, attn.mixture.component_gate = None, torch.ones(4, 3)
    with pytest.raises(ValueError, match=r"component_gate must have shape \(num_heads, num_keys\) = \(4, 2\)"):
        attn(x, need_weights=False)
    hard = MGKAttention(16, 4, head_dim=4, pi="hard_e", batch_first=True)
    hard.mixture.component_gate = torch.ones(4, 2)
    with pytest.raises(ValueError, match="component_gate needs mixture weights"):
        hard(x, need_weights=False)
    assert prune.unit_gates([hard], "head")[0].shape == (4,)
    with pytest.raises(ValueError, match="no mixture components to prune"):
        prune.unit_gates([hard], "component")


def test_random_order_and_ablation_cover_every_unit(tmp_path):
    task, cfg = _task(tmp_path, "mgk", 2)
    model = _model(task, cfg, seed=4)
    layers = prune.attention_layers(model)
    rand = prune.random_curves(task, model, layers, _data(task), unit="component", settings=SETTINGS)
    assert rand["orders"] == 2 and len(rand["mean"]) == 4 == len(rand["std"])  # 4 components, one at a time
    assert rand["std"][0] == 0.0  # every order starts from the full model
    abl = prune.ablation(task, model, layers, _data(task), unit="head", settings=SETTINGS)
    assert [u["index"] for u in abl["units"]] == [[0], [1]]
    assert abl["full"] == pytest.approx(_metric(task, model), rel=1e-6)
    with prune.gated(layers, [torch.tensor([0.0, 1.0])]):
        assert abl["units"][0]["metric"] == pytest.approx(_metric(task, model), rel=1e-6)


def test_mgk_analyze_prune_writes_curves_ablation_and_figures(tmp_path, th):
    run = tmp_path / "run"
    extra = [f"{k}={v}" for k, v in SIZES.items()]
    main(["train", "--task", "dretrieval", "--attention", "mgk", "--heads", "2", "--steps", "2", "--out", str(run),
          *th.sets(*extra, "eval_every=2", "checkpoint_every=2", "log_every=1", "warmup_steps=1", "progress=false",
                   "batch_size=8")])
    out = tmp_path / "p"
    main(["analyze", "--prune", str(run), "--out", str(out), "--prune-random", "2", "--batch-size", "16"])
    res = json.loads((out / "prune.json").read_text())
    assert res["metric"] == "nmse" and res["eval_split"] == "test" and res["importance_split"] == "val"
    assert set(res["units"]) == {"head", "component"}
    assert res["units"]["head"]["curve"]["kept"] == [2, 1]
    assert res["units"]["component"]["curve"]["kept"] == [4, 3, 2, 1]
    assert len(res["units"]["component"]["ablation"]["units"]) == 4
    for name in res["figures"].values():
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    md = (out / "prune.md").read_text()
    assert "One-head ablation" in md and "One-component ablation" in md
    with pytest.raises(SystemExit, match="mgk analyze: "):
        main(["analyze", "--prune", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="mgk analyze: --prune-random must be >= 0, got -1"):
        main(["analyze", "--prune", str(run), "--out", str(out), "--prune-random", "-1"])


def test_the_last_component_of_a_head_takes_its_heads_importance(tmp_path):
    task, cfg = _task(tmp_path, "mgk", 2)
    model = _model(task, cfg, seed=5)
    layers = prune.attention_layers(model)
    with torch.no_grad():
        layers[0].mixture.pi_logits.normal_()
    ds, index = task.splits["val"], torch.arange(20)
    gates = [torch.tensor([[1.0, 0.0], [1.0, 1.0]])]  # head 0 has one component left
    (plain,) = prune.importance(task, model, layers, ds, index, gates, unit="component", batch_size=8)
    assert plain[0, 0] == pytest.approx(0.0, abs=1e-7)  # its weight is 1 whatever its gate
    assert plain[1, 0] == pytest.approx(float(plain[1, 1]), rel=1e-4) and plain[1, 0] > 0  # M = 2: opposite
    (comp,) = prune.component_importance(task, model, layers, ds, index, gates, batch_size=8)
    (heads,) = prune.importance(task, model, layers, ds, index, prune.unit_gates(layers, "head"), unit="head",
                                batch_size=8, components=gates)
    assert comp[0, 0] == pytest.approx(float(heads[0])) and comp[0, 0] > 0
    assert torch.equal(comp[1], plain[1])
