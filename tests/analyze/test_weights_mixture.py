"""Per-layer weights through the modules' need_weights path, and mixture statistics with known answers."""
import math

import pytest
import torch

from mgk.analyze import stats
from mgk.analyze.mixture import component_sums, mixture_weights
from mgk.analyze.weights import WeightRecorder
from mgk.attention import MGKAttention, MLKAttention, MultiheadAttention
from mgk.models import LRAClassifier

KINDS = ["softmax", "mgk", "smgk", "linear", "mlk"]


def tiny_classifier(attention, heads=2, **options):
    torch.manual_seed(0)
    return LRAClassifier(12, 3, 16, d_model=16, num_layers=2, ffn_dim=16, attention=attention, num_heads=heads,
                         head_dim=4, dropout=0.0, attn_dropout=0.0, classifier_dim=8,
                         attention_options=options).double().eval()


@pytest.mark.parametrize("kind", KINDS)
def test_recorder_returns_each_layers_weights_and_leaves_the_output_alone(kind, one_thread):
    model = tiny_classifier(kind)
    tokens = torch.randint(0, 12, (3, 9))
    padding = torch.zeros(3, 9, dtype=torch.bool)
    padding[1, 5:] = True
    plain = model(tokens, padding)
    with torch.no_grad(), WeightRecorder(model) as rec:
        logits = model(tokens, padding)
    assert torch.allclose(logits, plain, atol=1e-10)
    assert [c.layer for c in rec.calls] == [0, 1]
    call = rec.calls[0]
    assert call.weights.shape == (3, 2, 9, 9) and call.real_lengths().tolist() == [9, 5, 9]
    # the same as calling layer 0 directly with need_weights on its recorded input
    attn = model.encoder.blocks[0].attn
    _, direct = attn(call.query, key_padding_mask=padding, need_weights=True, average_attn_weights=False)
    assert torch.equal(call.weights, direct)
    # real rows of the short sequence: its keys only, rows sum to 1, and equal to running it alone
    short = call.weights[1, :, :5, :5]
    assert torch.allclose(short.sum(-1), torch.ones(2, 5, dtype=torch.float64))
    with torch.no_grad(), WeightRecorder(model) as alone:
        model(tokens[1:2, :5])
    assert torch.allclose(alone.calls[0].weights[0], short, atol=1e-10)
    assert not model.encoder.blocks[0].attn._forward_hooks  # hooks removed on exit


def test_rank_one_and_copied_heads_through_a_real_module():
    torch.manual_seed(0)
    attn = MultiheadAttention(8, 3, head_dim=4, batch_first=True).double()
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    with torch.no_grad():
        attn.q_proj.weight.zero_()
        attn.q_proj.bias.zero_()  # every score 0: uniform rows, rank 1, all heads equal
    _, w = attn(x, need_weights=True, average_attn_weights=False)
    assert stats.numerical_rank(w[0]).tolist() == [1, 1, 1]
    assert stats.pairwise_js(w[0]) == 0.0 and stats.effective_heads(w[0]) == pytest.approx(1.0)
    with torch.no_grad():  # three heads with the same query and key projections: exact copies
        attn.q_proj.weight.copy_(torch.randn(4, 8).repeat(3, 1))
        attn.k_proj.weight.copy_(torch.randn(4, 8).repeat(3, 1))
        attn.k_proj.bias.copy_(torch.randn(4).repeat(3))
    _, w = attn(x, need_weights=True, average_attn_weights=False)
    assert stats.pairwise_l2(w[0]) == pytest.approx(0.0, abs=1e-12)
    assert stats.effective_heads(w[0]) == pytest.approx(1.0, abs=1e-9)
    assert stats.numerical_rank(w[0]).tolist() == [6, 6, 6]


def set_pi(module, pi):
    with torch.no_grad():
        module.pi_logits.copy_(torch.log(torch.as_tensor(pi, dtype=module.pi_logits.dtype)))


def test_reported_pi_equals_fixed_values():
    attn = MGKAttention(8, 2, head_dim=4, keys="shifted", batch_first=True).double()
    set_pi(attn, [[0.7, 0.3], [0.2, 0.8]])
    assert torch.allclose(mixture_weights(attn, 5)[..., 0], torch.tensor([[0.7, 0.3], [0.2, 0.8]],
                                                                         dtype=torch.float64))
    pos = MGKAttention(8, 2, head_dim=4, pi_shape="position", max_len=6, batch_first=True).double()
    target = torch.softmax(torch.randn(2, 2, 6, dtype=torch.float64), dim=1)
    set_pi(pos, target)
    assert torch.allclose(mixture_weights(pos, 4), target[..., :4])
    soft = MGKAttention(8, 2, head_dim=4, pi="soft_e", max_len=6, batch_first=True)
    soft.pi.copy_(target.float())
    assert torch.equal(mixture_weights(soft, 6), target.float().double())
    assert mixture_weights(MGKAttention(8, 2, head_dim=4, pi="hard_e", batch_first=True), 4) is None
    mlk = MLKAttention(8, 2, head_dim=4, batch_first=True).double()
    set_pi(mlk, [[0.6, 0.4], [0.5, 0.5]])
    assert torch.allclose(mixture_weights(mlk, 3)[..., 0], torch.tensor([[0.6, 0.4], [0.5, 0.5]],
                                                                        dtype=torch.float64))


@pytest.mark.parametrize("cls", [MGKAttention, MLKAttention])
@pytest.mark.parametrize("causal", [False, True])
def test_identical_components_share_attention_as_pi(cls, causal):
    """With k_1 = k_2 (shifted keys, zero shift) every pair's responsibility is exactly pi."""
    torch.manual_seed(1)
    attn = cls(8, 2, head_dim=4, keys="shifted", batch_first=True).double()
    with torch.no_grad():
        attn.key_shift.zero_()
    set_pi(attn, [[0.7, 0.3], [0.25, 0.75]])
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    sums, pairs = component_sums(attn, x, causal)
    assert pairs.tolist() == [15.0, 15.0] if causal else [25.0, 25.0]
    assert torch.allclose(sums / pairs[:, None], torch.tensor([[0.7, 0.3], [0.25, 0.75]], dtype=torch.float64))


def test_hard_e_counts_the_nearest_component():
    torch.manual_seed(2)
    attn = MGKAttention(8, 2, head_dim=4, keys="shifted", pi="hard_e", batch_first=True).double()
    with torch.no_grad():
        attn.key_shift.fill_(1e3)  # component 2 far from every query: component 1 always wins
    sums, pairs = component_sums(attn, torch.randn(1, 4, 8, dtype=torch.float64), False)
    assert (sums / pairs[:, None]).tolist() == [[1.0, 0.0], [1.0, 0.0]]
    with torch.no_grad():
        attn.key_shift.fill_(-1e3)
    attn.key_shift.data[0, 0] = 0.0  # head 0's second component coincides with its first: tie -> first
    sums, _ = component_sums(attn, torch.randn(1, 4, 8, dtype=torch.float64), True)
    assert sums[:, 1].tolist() == [0.0, 0.0] and math.isclose(float(sums.sum()), 2 * 10)


def test_per_layer_unnormalised_pi_is_reported_for_every_head():
    """pi_shape="layer" holds one set of weights for all heads; pi_norm="none" reports exp(logits) as they are."""
    for cls in (MGKAttention, MLKAttention):
        attn = cls(8, 2, head_dim=4, pi_shape="layer", pi_norm="none", batch_first=True).double()
        with torch.no_grad():
            attn.pi_logits.copy_(torch.log(torch.tensor([[0.9, 0.6]], dtype=torch.float64)))
        pi = mixture_weights(attn, 5)
        assert pi.shape == (2, 2, 1)
        assert torch.allclose(pi[..., 0], torch.tensor([[0.9, 0.6], [0.9, 0.6]], dtype=torch.float64))


@pytest.mark.parametrize("feature_map", ["elu", "elu_sum"])
def test_mlk_shares_use_the_modules_feature_map(feature_map):
    """Shares written from eq. 14 with the module's own phi: pi_r phi(q_i).phi(k_jr) / sum_r' (same), averaged."""
    torch.manual_seed(3)
    attn = MLKAttention(8, 2, head_dim=4, feature_map=feature_map, batch_first=True).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(torch.randn_like(p))  # components far apart, so the feature maps give different shares
    set_pi(attn, [[0.7, 0.3], [0.4, 0.6]])
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    elu1 = torch.nn.functional.elu
    phi = ((lambda t: elu1(t) + 1) if feature_map == "elu" else
           (lambda t: (elu1(t) + 1) / (elu1(t) + 1).sum(-1, keepdim=True)))
    q = attn.q_proj(x).view(5, 2, 4).transpose(0, 1)  # (H, n, D)
    keys = attn._keys(x)[0]  # (H, M, n, D)
    pi = torch.tensor([[0.7, 0.3], [0.4, 0.6]], dtype=torch.float64)
    expected = torch.zeros(2, 2, dtype=torch.float64)
    for h in range(2):
        for i in range(5):
            for j in range(5):
                w = torch.stack([pi[h, r] * phi(q[h, i]) @ phi(keys[h, r, j]) for r in range(2)])
                expected[h] += w / w.sum()
    sums, pairs = component_sums(attn, x, False)
    assert torch.allclose(sums / pairs[:, None], expected / 25, atol=1e-12)
    other = "elu" if feature_map == "elu_sum" else "elu_sum"
    attn.feature_map = other  # the statistic follows the option: the two maps give different shares here
    moved, _ = component_sums(attn, x, False)
    assert not torch.allclose(moved, sums, atol=1e-6)


def test_mlk_that_mixes_keys_has_no_component_shares():
    attn = MLKAttention(8, 2, head_dim=4, mix="keys", batch_first=True).double()
    assert component_sums(attn, torch.randn(1, 4, 8, dtype=torch.float64), False) is None


def test_run_labels_name_the_options_that_change_the_weights():
    from mgk.analyze.run import run_label
    from mgk.config import RunConfig

    assert run_label(RunConfig(attention="softmax", num_heads=8)) == "softmax-8"
    assert run_label(RunConfig(attention="mgk", num_heads=4, pi="soft_e")) == "mgk-4 soft_e"
    assert run_label(RunConfig(attention="mlk", num_heads=4)) == "mlk-4"
    assert run_label(RunConfig(attention="mlk", num_heads=4, mix="keys", feature_map="elu_sum")) == \
        "mlk-4 mix=keys feature_map=elu_sum"
    linear = RunConfig(attention="linear", num_heads=8, feature_map="elu_sum")
    assert run_label(linear) == "linear-8 feature_map=elu_sum"
