"""MGKAttention with pi="soft_e" takes its E-step statistics from the kernel's forward pass: the same output,
gradients and pi after ``soft_e_step`` as the separate E-step (mgk_responsibilities after mgk_attention)."""
from __future__ import annotations

import pytest
import torch

import mgk
import mgk.attention.mgk as mgk_module
from mgk.attention import MGKAttention
from mgk.functional import _mixture_flash

pytestmark = pytest.mark.skipif(not _mixture_flash.available(torch.zeros(1), 0.0),
                                reason=f"the C++ MGK kernel could not be built: {_mixture_flash.build_error()}")


def step(monkeypatch, fused: bool, causal: bool):
    torch.manual_seed(0)
    m = MGKAttention(16, 2, head_dim=8, pi="soft_e", max_len=12, sigma2=[1.5, 3.0], dropout=0.0,
                     batch_first=True).double().train()
    calls = []
    real = mgk_module.mgk_attention_soft_e

    def spy(*a, **kw):
        out = real(*a, **kw) if fused else None
        calls.append(out is not None)
        return out
    monkeypatch.setattr(mgk_module, "mgk_attention_soft_e", spy)
    x = torch.randn(2, 12, 16, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, 7:] = True
    outs, grads = [], []
    for _ in range(2):  # the second step reads the pi the first one wrote
        out, _ = m(x, key_padding_mask=pad, is_causal=causal, need_weights=False)
        outs.append(out)
        grads.append(torch.autograd.grad(out.sum(), x)[0])  # the backward through the output commits
        assert mgk.soft_e_step(m) == 1
    return outs, grads, m.mixture.pi.clone(), calls


@pytest.mark.parametrize("causal", [False, True])
def test_fused_e_step_equals_the_separate_one(monkeypatch, causal):
    outs, grad, pi, calls = step(monkeypatch, True, causal)
    ref_outs, ref_grad, ref_pi, ref_calls = step(monkeypatch, False, causal)
    assert calls == [True, True] and ref_calls == [False, False]
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    for a, b in zip(grad, ref_grad):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(pi, ref_pi, atol=1e-10, rtol=1e-9)
    assert not torch.equal(pi, torch.full_like(pi, 0.5))  # the E-step did run
