"""Issue 7: torch.compile works on every attention module and gives the same outputs and gradients on CPU."""
import pytest
import torch

import mgk

# Inductor compiles take 10-40 s each on 2 cores: one case runs in CI, the rest with `pytest -m slow`.
CASES = [("mgk", "learned")] + [pytest.param(k, p, marks=pytest.mark.slow) for k, p in (
    ("softmax", "learned"), ("mgk", "soft_e"), ("mgk", "hard_e"), ("smgk", "learned"), ("linear", "learned"),
    ("mlk", "learned"), ("smlk", "learned"))]


@pytest.mark.parametrize("kind,pi", CASES)
def test_compiled_module_matches_eager(kind, pi):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = mgk.build_attention(kind, 32, 2, head_dim=16, pi=pi, max_len=16).eval()
    x = torch.randn(2, 9, 32, requires_grad=True)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 6:] = True
    compiled = torch.compile(m, backend="inductor")
    for causal in (False, True):
        eager, _ = m(x, key_padding_mask=kpm, is_causal=causal)
        fast, _ = compiled(x, key_padding_mask=kpm, is_causal=causal)
        torch.testing.assert_close(fast, eager, atol=1e-5, rtol=1e-5)
        g_eager = torch.autograd.grad(eager[~kpm].square().sum(), x)[0]
        g_fast = torch.autograd.grad(fast[~kpm].square().sum(), x)[0]
        torch.testing.assert_close(g_fast, g_eager, atol=1e-5, rtol=1e-4)
