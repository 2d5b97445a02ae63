"""A language model converted with ``model.double()`` scores, trains and generates in float64 (its adaptive softmax
cast the hidden states to float32 against float64 weights: a dtype RuntimeError); ``model.to(torch.bfloat16)`` is a
ValueError that says to use autocast, since the log-softmax runs in at least float32."""
from __future__ import annotations

import pytest
import torch

from mgk.models import AttentionConfig, LMConfig, TransformerLM
from mgk.models.lm import ADAPTIVE_SOFTMAX

V = 30


def _lm(adaptive, cutoffs, kind="mgk"):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=V, d_model=16, num_layers=2, ffn_dim=32, dropout=0.0, cutoffs=cutoffs,
                   adaptive_softmax=adaptive, attention=AttentionConfig(kind=kind, num_heads=2, head_dim=8))
    return TransformerLM(cfg).eval()


SOFTMAXES = [(a, c) for a in ADAPTIVE_SOFTMAX for c in ((10,), (V + 5,))]


@pytest.mark.parametrize("adaptive,cutoffs", SOFTMAXES)
def test_a_float64_model_scores_and_generates_in_float64(adaptive, cutoffs):
    model = _lm(adaptive, cutoffs)
    idx = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    want = model.log_probs(idx).double()
    model.double()
    got = model.log_probs(idx)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    nll = model(idx, idx)
    assert nll.dtype == torch.float64 and bool(torch.isfinite(nll).all())
    nll.sum().backward()
    out = model.generate(idx, 5, temperature=0)
    steps = idx
    with torch.no_grad():
        for _ in range(5):
            steps = torch.cat([steps, model.log_probs(steps)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, steps)


@pytest.mark.parametrize("adaptive,cutoffs", SOFTMAXES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_is_told_to_use_autocast(adaptive, cutoffs, dtype):
    model = _lm(adaptive, cutoffs).to(dtype)
    with pytest.raises(ValueError, match="adaptive softmax's weights are torch.*autocast"):
        model.generate(torch.zeros(1, 3, dtype=torch.int64), 2)
