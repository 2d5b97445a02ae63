"""The paper's protocol: the authors' parameter totals, the *-paper presets traced to their sources, the schedules,
the fixed-size validation, and the protocol recorded with every result."""
import inspect
import math
import re

import pytest
import torch

from mgk import config as config_mod
from mgk.models import LRAClassifier, RetrievalModel, TransformerLM
from mgk.tasks import all_presets, authors
from mgk.train.evaluate import eval_slice
from mgk.train.schedule import build_scheduler, check_resumable, lr_factor

WT103_VOCAB = 267_735  # WikiText-103 with <eos> (the authors' V)


def _lm(cfg, device=None):
    lm_cfg = config_mod.lm_config(cfg, WT103_VOCAB)
    if device == "meta":
        with torch.device("meta"):
            return TransformerLM(lm_cfg)
    return TransformerLM(lm_cfg)


def test_wt103_paper_has_the_authors_parameter_totals():
    """softmax x 8 heads: 44,018,394 (44.02M); MGK x 4 heads (rbf2keys: k, k', per-position pi): 43,657,946."""
    paper = all_presets()["wt103-paper"]
    soft = _lm(paper, device="meta")
    assert soft.num_parameters() == 44_018_394
    assert soft.num_attention_parameters() == 16 * 4 * 128 * 128
    mgk = _lm(config_mod.replace(paper, attention="mgk", num_heads=4))
    assert abs(mgk.num_parameters() - 43_657_946) <= 0.0005 * 43_657_946
    assert mgk.num_parameters() == 43_657_946
    assert mgk.num_attention_parameters() == 16 * 43_008
    # the other output layer, kept and named: nn.AdaptiveLogSoftmaxWithLoss with tail projections, no biases
    ours = _lm(config_mod.replace(paper, adaptive_softmax="torch", attn_bias=True), device="meta")
    assert ours.num_parameters() == 43_808_000


# Non-embedding counts of the authors' LRA structure (docs/authors-protocol.md, section 3), per task and model.
LRA_NON_EMBEDDING = {
    "listops": {("softmax", 8): 176_138, ("mgk", 4): 126_478, ("softmax", 4): 109_834, ("softmax", 1): 60_106,
                ("mgk", 1): 64_270},
    "text": {("softmax", 8): 175_106, ("mgk", 4): 125_446, ("softmax", 4): 108_802, ("softmax", 1): 59_074,
             ("mgk", 1): 63_238},
    "retrieval": {("softmax", 8): 199_682, ("mgk", 4): 150_022, ("softmax", 4): 133_378, ("softmax", 1): 83_650,
                  ("mgk", 1): 87_814},
}


@pytest.mark.parametrize("task", sorted(LRA_NON_EMBEDDING))
def test_lra_paper_presets_have_the_authors_counts(task):
    """Total = the authors' non-embedding count + 64 (V + P) for our vocabulary V and position table P = max_len
    (the presets set the authors' one (2,) mixture weight per layer, ``pi_shape="layer"``)."""
    from mgk.tasks import get_task

    classes = {"listops": 10, "text": 2, "retrieval": 2}[task]
    vocab = {"listops": 16, "text": 257, "retrieval": 257}[task]
    for (kind, heads), authors_count in LRA_NON_EMBEDDING[task].items():
        cfg = config_mod.replace(all_presets()[f"{task}-paper"], attention=kind, num_heads=heads, vocab_size=vocab,
                                 num_classes=classes)
        model_cls = RetrievalModel if task == "retrieval" else LRAClassifier
        model = model_cls(config_mod.encoder_config(cfg))
        expected = authors_count + cfg.model.d_model * (vocab + cfg.data.max_len)
        assert sum(p.numel() for p in model.parameters()) == expected, (task, kind, heads)
    assert get_task(task) is not None


def test_paper_presets_keep_the_authors_values():
    presets = all_presets()
    for task, per_task in authors.LRA_TASKS.items():
        cfg = presets[f"{task}-paper"]
        values = config_mod.flat(cfg)
        for name, value in {**authors.AUTHORS_LRA, **per_task}.items():
            assert values[name] == value, (task, name)
        assert cfg.task == task
        assert cfg.attention_forms.keys() == authors.AUTHORS_LRA_FORMS.keys()
    lm = presets["wt103-paper"]
    values = config_mod.flat(lm)
    for name, value in authors.AUTHORS_LM.items():
        assert values[name] == value, name
    assert (lm.attention.kind, lm.attention.num_heads) == ("softmax", 8)
    for name, forms in (("listops-paper", authors.AUTHORS_LRA_FORMS), ("wt103-paper", authors.AUTHORS_LM_FORMS)):
        for kind, form in forms.items():  # each kind's form, exactly as the authors' code has it
            held = presets[name].attention_forms[kind]
            assert {k: getattr(held, k) for k in form} == {k: tuple(v) if isinstance(v, list) else v
                                                            for k, v in form.items()}, (name, kind)
    assert lm.attention_forms["mgk"].sigma2 == (4.0, 4.0 / 3) and lm.attention_forms["mgk"].pi_shape == "position"


def test_each_authors_value_cites_its_source():
    """Every key of the shared authors' dicts sits on a line (or the continuation line of its entry) whose comment
    names a file, README or config."""
    lines = inspect.getsource(authors).splitlines()
    cites = [bool(re.search(r"#.*(\.py|README|cfg)", ln)) for ln in lines]
    for table in (authors.AUTHORS_LRA, authors.AUTHORS_LM, *authors.LRA_TASKS.values()):
        for key in table:
            hits = [i for i, ln in enumerate(lines) if re.search(rf"\b{key}=", ln)]
            assert hits, key
            for i in hits:
                cont = i + 1 < len(lines) and re.search(r"\b\w+=", lines[i + 1].split("#")[0]) is not None \
                    and lines[i].rstrip().endswith(",") and lines[i + 1].startswith(" " * 16)
                assert cites[i] or (cont and cites[i + 1]), (key, lines[i])


def test_preset_attention_forms_reach_only_the_kind_they_belong_to():
    paper = all_presets()["wt103-paper"]
    config_mod.validate(paper)  # softmax: the other kinds' sigma2 / pi_shape are simply not its options
    assert config_mod.attention_config(paper).options.as_kwargs() == {}
    mgk = config_mod.replace(paper, attention="mgk", num_heads=4)
    assert config_mod.attention_config(mgk, max_len=256).options.sigma2 == (4.0, 4.0 / 3)
    mlk = config_mod.apply_overrides(paper, ["attention=mlk"])  # the authors' LM MLK (type 400)
    assert (mlk.attention.options.feature_map, mlk.attention.options.eps, mlk.attention.options.pi_shape) == \
        ("elu_sum", 1e-5, "position")
    with pytest.raises(ValueError, match="'sigma2'.*'softmax'"):  # set on purpose for a kind that does not take it
        config_mod.apply_overrides(paper, ["sigma2=1,2"])


def test_new_fields_validate_and_parse():
    cfg = config_mod.apply_overrides(config_mod.RunConfig(), [
        "init=paper", "classifier_activation=relu", "attn_bias=false", "schedule=onecycle", "eval_batches=3",
        "adaptive_softmax=authors"])
    config_mod.validate(cfg)
    assert (cfg.model.init, cfg.attention.bias, cfg.eval.batches) == ("paper", False, 3)
    for bad, match in (("init=xavier", "init"), ("classifier_activation=tanh", "classifier_activation"),
                       ("schedule=step", "schedule"), ("eval_batches=-1", "eval_batches"),
                       ("adaptive_softmax=fairseq", "adaptive_softmax")):
        with pytest.raises(ValueError, match=match):
            config_mod.validate(config_mod.apply_overrides(config_mod.RunConfig(), [bad]))
    with pytest.raises(ValueError, match="onecycle"):
        config_mod.validate(config_mod.apply_overrides(config_mod.RunConfig(), ["schedule=onecycle",
                                                                               "warmup_steps=1"]))


def _lrs_and_betas(schedule, steps=100, warmup=20, lr=1e-3):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=lr)
    sched = build_scheduler(opt, schedule=schedule, lr=lr, warmup_steps=warmup, total_steps=steps)
    lrs, betas = [], []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        betas.append(opt.param_groups[0]["betas"][0])
        opt.step()
        sched.step()
    return lrs, betas, sched


def test_onecycle_is_torchs_onecycle_with_the_authors_settings():
    lrs, betas, _ = _lrs_and_betas("onecycle")
    lr = 1e-3
    assert lrs[0] == pytest.approx(lr / 25) and betas[0] == pytest.approx(0.95)
    peak = max(range(100), key=lambda i: lrs[i])
    assert peak == 19 and lrs[peak] == pytest.approx(lr) and betas[peak] == pytest.approx(0.85)
    assert lrs[-1] == pytest.approx(lr / 25 / 1e4, rel=1e-3) and betas[-1] == pytest.approx(0.95, abs=1e-3)
    # linear in both phases
    assert lrs[10] == pytest.approx(lr / 25 + (lr - lr / 25) * 10 / 19)
    assert lrs[60] == pytest.approx(lr + (lr / 2.5e5 - lr) * (60 - 19) / (99 - 19))


def test_cosine_global_follows_the_global_step():
    lrs, _, _ = _lrs_and_betas("cosine_global")
    assert lrs[0] == pytest.approx(1e-3 / 20) and lrs[19] == pytest.approx(1e-3)
    for s in (20, 50, 99):
        assert lrs[s] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * s / 100)))
    assert lr_factor(20, warmup_steps=20, total_steps=100, schedule="cosine") == 1.0  # the other one restarts


def test_onecycle_refuses_to_resume_with_another_length():
    _, _, sched = _lrs_and_betas("onecycle", steps=50, warmup=5)
    check_resumable(sched, sched.state_dict(), 50)
    with pytest.raises(ValueError, match="planned for 50 steps"):
        check_resumable(sched, sched.state_dict(), 80)


def test_eval_slice_walks_an_endless_reshuffled_stream():
    rounds = [eval_slice(10, batches=2, batch_size=3, round_index=k, seed=1) for k in range(5)]  # 30 = 3 epochs
    stream = torch.cat(rounds)
    for e in range(3):
        assert sorted(stream[10 * e:10 * (e + 1)].tolist()) == list(range(10))  # every example once per pass
    assert not torch.equal(stream[:10], stream[10:20])  # reshuffled on wrap
    assert torch.equal(eval_slice(10, batches=2, batch_size=3, round_index=3, seed=1), rounds[3])  # pure
    assert not torch.equal(eval_slice(10, batches=2, batch_size=3, round_index=3, seed=2), rounds[3])
    assert not torch.equal(rounds[0], rounds[1])


@pytest.mark.parametrize("pi", ["soft_e", "hard_e"])
def test_lra_paper_presets_run_the_pi_ablations(pi):
    """The presets' learned-weight shape (one (2,) per layer, not normalised) does not apply to Soft-E's buffer or
    Hard-E: ``--preset listops-paper --attention mgk --pi soft_e`` builds; setting the shape on purpose is refused."""
    paper = all_presets()["listops-paper"]
    assert paper.attention.options.pi_shape == "layer"
    cfg = config_mod.replace(paper, attention="mgk", num_heads=1, pi=pi, vocab_size=16, num_classes=10)
    config_mod.validate(cfg)
    options = config_mod.encoder_config(cfg).attention.options
    assert options.pi == pi and options.pi_shape == "head" and options.pi_norm == "softmax"
    LRAClassifier(config_mod.encoder_config(cfg))
    with pytest.raises(ValueError, match="pi_shape.*learned"):
        config_mod.validate(config_mod.replace(paper, attention="mgk", pi=pi, pi_shape="layer"))
