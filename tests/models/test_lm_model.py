"""Decoder LM: tied adaptive input/softmax (normalised, really tied), causality for every attention kind."""
import math

import pytest
import torch

from mgk.attention.registry import get_kind, kind_variants, variant_name
from mgk.models import IGNORE_INDEX, AttentionConfig, LMConfig, TiedAdaptiveSoftmax, TransformerLM, sinusoidal_positions

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("cutoffs,div", [([10, 30], 1.0), ([10, 30], 2.0), ([5], 4.0), ([100], 1.0)])
def test_log_probs_normalise_and_match_nll(cutoffs, div):
    torch.manual_seed(0)
    m = TiedAdaptiveSoftmax(50, 8, cutoffs, div_value=div)
    h = torch.randn(13, 8) * 3
    logp = m.log_prob(h)
    assert logp.shape == (13, 50)
    torch.testing.assert_close(torch.logsumexp(logp.double(), dim=1), torch.zeros(13, dtype=torch.float64),
                               atol=1e-5, rtol=0)
    t = torch.tensor([0, 9, 10, 29, 30, 49, 1, 2, 3, 11, 31, 48, 5])
    torch.testing.assert_close(m.nll(h, t), -logp.gather(1, t[:, None]).squeeze(1), atol=1e-5, rtol=1e-5)
    if cutoffs == [100]:
        assert m.softmax is None and "dropped" in m.notes[0]


def test_adaptive_input_is_tied_to_the_softmax_weights():
    torch.manual_seed(0)
    m = TiedAdaptiveSoftmax(40, 8, [10, 25], div_value=2.0)
    sm = m.softmax
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in sm.parameters())
    ids = torch.tensor([[3, 12, 30]])
    e = m.embed(ids)
    s = math.sqrt(8)
    torch.testing.assert_close(e[0, 0], sm.head.weight[3] * s)
    torch.testing.assert_close(e[0, 1], (sm.tail[0][1].weight[12 - 10] @ sm.tail[0][0].weight) * s)
    torch.testing.assert_close(e[0, 2], (sm.tail[1][1].weight[30 - 25] @ sm.tail[1][0].weight) * s)
    with pytest.raises(IndexError, match="token ids"):
        m.embed(torch.tensor([40]))
    e.sum().backward()  # input-side gradients reach the output weights
    assert sm.head.weight.grad[3].abs().sum() > 0 and sm.head.weight.grad[4].abs().sum() == 0
    assert sm.tail[1][1].weight.grad[5].abs().sum() > 0 and sm.tail[1][0].weight.grad.abs().sum() > 0
    lm = TransformerLM(LMConfig(40, d_model=8, num_layers=1, ffn_dim=16, cutoffs=(10, 25),
                                attention=AttentionConfig(num_heads=2, head_dim=4)))
    keys = list(lm.state_dict())
    assert len(keys) == len(set(keys)) and not any("embed" in k for k in keys)


def test_default_cutoffs_at_or_above_the_vocabulary_are_dropped():
    lm = TransformerLM(LMConfig(30000, d_model=8, num_layers=1, ffn_dim=8, attention=AttentionConfig(num_heads=1,
                                                                                                  head_dim=8)))
    assert lm.adaptive.cutoffs == [20000]
    assert "[40000, 200000] >= vocabulary size 30000 dropped" in lm.notes[0]
    assert lm.num_parameters(non_embedding=True) < lm.num_parameters()


def test_sinusoidal_positions():
    p = sinusoidal_positions(5, 6)
    assert p.shape == (5, 6)
    torch.testing.assert_close(p[0], torch.tensor([0.0, 0, 0, 1, 1, 1]))
    torch.testing.assert_close(p[3, 0], torch.tensor(math.sin(3.0)))
    assert sinusoidal_positions(4, 7).shape == (4, 7)


def test_ignored_targets_score_zero_and_the_rest_match_log_probs():
    torch.manual_seed(0)
    lm = TransformerLM(LMConfig(60, d_model=16, num_layers=2, ffn_dim=32, cutoffs=(20, 40),
                                attention=AttentionConfig(num_heads=2, head_dim=8))).eval()
    x = torch.randint(0, 60, (2, 7))
    y = torch.randint(0, 60, (2, 7))
    y[0, :3] = IGNORE_INDEX
    nll = lm(x, y)
    assert torch.all(nll[0, :3] == 0)
    ref = -lm.log_probs(x).gather(2, y.clamp(min=0).unsqueeze(2)).squeeze(2)
    torch.testing.assert_close(nll[y != IGNORE_INDEX], ref[y != IGNORE_INDEX], atol=1e-5, rtol=1e-5)


VARIANTS = kind_variants()


@pytest.mark.parametrize("kind,options", VARIANTS, ids=[variant_name(k, v) for k, v in VARIANTS])
@pytest.mark.parametrize("train", [False, True])
def test_future_tokens_never_change_earlier_log_probs(kind, options, train):
    torch.manual_seed(0)
    spec = get_kind(kind)
    attention = AttentionConfig(kind=kind, num_heads=2, head_dim=8, dropout=0.0 if spec.family == "linear" else 0.1,
                                options={**options, **({"max_len": 8} if "max_len" in spec.options.names() else {})})
    lm = TransformerLM(LMConfig(50, d_model=16, num_layers=2, ffn_dim=32, dropout=0.1, cutoffs=(10, 30),
                                attention=attention))
    lm.train(train)
    x = torch.randint(0, 50, (2, 8))
    y = x.clone()
    y[:, 5] = (x[:, 5] + 17) % 50
    state = {k: v.clone() for k, v in lm.state_dict().items()}  # Soft-E updates pi in training forwards
    torch.manual_seed(1)
    a = lm.log_probs(x)
    lm.load_state_dict(state)
    torch.manual_seed(1)
    b = lm.log_probs(y)
    torch.testing.assert_close(a[:, :5], b[:, :5], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])
