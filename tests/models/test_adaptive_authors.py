"""The authors' adaptive input/softmax (adaptive_softmax="authors"): a distribution over V, equal to the formula of
the paper code's ProjectedAdaptiveLogSoftmax at div_val 1 written out in float64, tied with the input side."""
import math

import pytest
import torch

from mgk.models import AttentionConfig, LMConfig, TransformerLM
from mgk.models.adaptive_authors import AuthorsAdaptiveSoftmax


def _reference_logprob(m, hidden):
    """float64 (N, V) from the description: head = [shortlist words ; cluster rows], cluster i (1-based) is the
    head's column head_size - i; a tail word adds the log-softmax over its cluster's slice (with biases)."""
    W, b = m.weight.double(), m.bias.double()
    cw, cb = m.cluster_weight.double(), m.cluster_bias.double()
    h = hidden.double()
    bounds = [0, *m.cutoffs, m.vocab_size]
    head_logits = torch.cat([h @ W[:bounds[1]].T + b[:bounds[1]], h @ cw.T + cb], dim=1)
    head = head_logits - torch.logsumexp(head_logits, dim=1, keepdim=True)
    out = torch.empty(h.shape[0], m.vocab_size, dtype=torch.float64)
    out[:, :bounds[1]] = head[:, :bounds[1]]
    size = head.shape[1]
    for i in range(1, len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        logits = h @ W[lo:hi].T + b[lo:hi]
        out[:, lo:hi] = head[:, size - i:size - i + 1] + logits - torch.logsumexp(logits, dim=1, keepdim=True)
    return out


@pytest.mark.parametrize("cutoffs", [[10, 30, 60], [50], [200]])  # 3 clusters, 1 cluster, none kept (plain)
def test_distribution_sums_to_one_and_matches_the_formula(cutoffs):
    torch.manual_seed(0)
    m = AuthorsAdaptiveSoftmax(100, 8, cutoffs)
    with torch.no_grad():  # non-zero biases, so that a dropped bias would show
        m.bias.normal_()
        m.cluster_bias.normal_()
    h = torch.randn(7, 8) * 3
    lp = m.log_prob(h)
    assert lp.shape == (7, 100) and lp.dtype == torch.float32
    torch.testing.assert_close(lp.double().exp().sum(1), torch.ones(7, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(lp.double(), _reference_logprob(m, h), atol=2e-5, rtol=0)
    t = torch.arange(100)[torch.randperm(100)[:7]]
    torch.testing.assert_close(m.nll(h, t), -lp.gather(1, t[:, None]).squeeze(1), atol=1e-5, rtol=0)
    if cutoffs == [200]:
        assert m.cutoffs == [] and m.notes and "dropped" in m.notes[0]


def test_structure_and_parameter_count():
    m = AuthorsAdaptiveSoftmax(1000, 16, [100, 300, 600])
    names = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert names == {"weight": (1000, 16), "bias": (1000,), "cluster_weight": (3, 16), "cluster_bias": (3,)}
    assert sum(p.numel() for p in m.parameters()) == 1000 * 16 + 1000 + 3 * 16 + 3
    with pytest.raises(ValueError, match="div_val"):
        AuthorsAdaptiveSoftmax(1000, 16, [100], div_value=4)


def test_input_and_output_share_the_table():
    m = AuthorsAdaptiveSoftmax(50, 4, [10, 20])
    ids = torch.tensor([[0, 15, 49]])
    torch.testing.assert_close(m.embed(ids), m.weight[ids] * math.sqrt(4))
    m.embed(torch.tensor([49])).sum().backward()
    assert m.weight.grad[49].abs().sum() > 0 and m.weight.grad[:49].abs().sum() == 0
    with pytest.raises(IndexError, match="token ids"):
        m.embed(torch.tensor([50]))
    with pytest.raises(ValueError, match="target ids"):
        m.nll(torch.zeros(1, 4), torch.tensor([50]))


def test_lm_perplexity_is_computed_the_same_way():
    """forward(tokens, targets) gives -log p of the next token under log_probs, for either output layer."""
    torch.manual_seed(0)
    for kind in ("authors", "torch"):
        lm = TransformerLM(LMConfig(60, d_model=16, num_layers=1, ffn_dim=32, cutoffs=(20, 40), adaptive_softmax=kind,
                                    attention=AttentionConfig(num_heads=2, head_dim=8))).eval()
        tokens = torch.randint(0, 60, (2, 9))
        targets = torch.randint(0, 60, (2, 9))
        with torch.no_grad():
            nll = lm(tokens, targets)
            lp = lm.log_probs(tokens)
        torch.testing.assert_close(nll, -lp.gather(2, targets.unsqueeze(2)).squeeze(2), atol=1e-5, rtol=0)
        torch.testing.assert_close(lp.exp().sum(-1), torch.ones(2, 9), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="adaptive_softmax"):
        TransformerLM(LMConfig(60, d_model=16, num_layers=1, adaptive_softmax="fairseq"))


def test_training_step_reaches_every_parameter():
    lm = TransformerLM(LMConfig(60, d_model=16, num_layers=1, ffn_dim=32, cutoffs=(20, 40), adaptive_softmax="authors",
                                attention=AttentionConfig(num_heads=2, head_dim=8)))
    tokens = torch.randint(0, 20, (2, 5))  # only shortlist words: the tail clusters still get a (zero) gradient
    lm(tokens, tokens).sum().backward()
    assert all(p.grad is not None for p in lm.parameters())
    assert lm.adaptive.bias.grad[:20].abs().sum() > 0
