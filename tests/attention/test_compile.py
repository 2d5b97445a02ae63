"""Issue 7: torch.compile works on every attention module and gives the same outputs and gradients on CPU."""
import pytest
import torch

import mgk
from mgk.attention.registry import attention_options

# Inductor compiles take 10-40 s each on 2 cores: one case runs in CI, the rest with `pytest -m slow`.
CASES = [("mgk", "learned")] + [pytest.param(k, p, marks=pytest.mark.slow) for k, p in (
    ("softmax", "learned"), ("mgk", "soft_e"), ("mgk", "hard_e"), ("smgk", "learned"), ("linear", "learned"),
    ("mlk", "learned"), ("smlk", "learned"))]


@pytest.mark.parametrize("kind,pi", CASES)
def test_compiled_module_matches_eager(kind, pi):
    torch._dynamo.reset()
    torch.manual_seed(0)
    options = {k: v for k, v in dict(pi=pi, max_len=16).items() if k in attention_options(kind)}
    m = mgk.build_attention(kind, 32, 2, head_dim=16, **options).eval()
    x = torch.randn(2, 9, 32, requires_grad=True)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 6:] = True
    compiled = torch.compile(m, backend="inductor")
    for causal in (False, True):
        eager, _ = m(x, key_padding_mask=kpm, is_causal=causal, need_weights=False)
        fast, _ = compiled(x, key_padding_mask=kpm, is_causal=causal, need_weights=False)
        torch.testing.assert_close(fast, eager, atol=1e-5, rtol=1e-5)
        g_eager = torch.autograd.grad(eager[~kpm].square().sum(), x)[0]
        g_fast = torch.autograd.grad(fast[~kpm].square().sum(), x)[0]
        torch.testing.assert_close(g_fast, g_eager, atol=1e-5, rtol=1e-4)


def test_compiled_mgk_keeps_the_cpu_kernel_in_its_graph():
    """The C++ kernel is a torch custom op: a compiled MGK module calls it (no graph break, no SDPA fallback)."""
    from mgk.functional import _mixture_flash

    torch.manual_seed(0)
    m = mgk.build_attention("mgk", 32, 2, head_dim=16)  # builds or loads the kernel (CPU-only machine)
    x = torch.randn(2, 9, 32)
    if not _mixture_flash.available(x, 0.0):
        pytest.skip(f"the C++ MGK kernel could not be built: {_mixture_flash.build_error()}")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    out, _ = torch.compile(m, backend=backend, fullgraph=True)(x, need_weights=False)  # before any eager call
    assert any("mixture_flash_forward" in code for code in graphs)
    torch.testing.assert_close(out, m(x, need_weights=False)[0])


def test_dynamic_lengths_do_not_recompile_per_length():
    """Soft-E's E-step loops over query chunks; with a symbolic length it must not pin the length (fullgraph
    would hit the recompile limit after 8 lengths)."""
    torch._dynamo.reset()
    m = mgk.build_attention("mgk", 16, 2, head_dim=8, pi="soft_e", max_len=32).train()
    compiled = torch.compile(m, backend="eager", dynamic=True, fullgraph=True)
    for L in range(5, 16):
        out, _ = compiled(torch.randn(2, L, 16, requires_grad=True), need_weights=False)
        out.sum().backward()
