"""torch.compile works on every attention kind and variant and gives the same outputs and gradients on CPU."""
import pytest
import torch

import mgk
from mgk.attention.registry import get_kind, kind_variants, variant_name

# Inductor compiles take 10-40 s each: MGK with its defaults runs by default, every other variant with `-m slow`.
CASES = [pytest.param(k, v, id=variant_name(k, v), marks=() if (k, v) == ("mgk", {}) else pytest.mark.slow)
         for k, v in kind_variants()]


@pytest.mark.parametrize("kind,options", CASES)
def test_compiled_module_matches_eager(kind, options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    options = {**options, **({"max_len": 16} if "max_len" in get_kind(kind).options.names() else {})}
    m = mgk.build_attention(kind, 32, 2, head_dim=16, **options).eval()
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
    out, _ = torch.compile(m, backend=backend, fullgraph=True)(x)  # compiled before any eager call
    assert any("mixture_flash_forward" in code for code in graphs)
    torch.testing.assert_close(out, m(x)[0])


def test_dynamic_lengths_do_not_recompile_per_length():
    """Soft-E's E-step loops over query chunks; with a symbolic length it must not pin the length (fullgraph
    would hit the recompile limit after 8 lengths)."""
    torch._dynamo.reset()
    m = mgk.build_attention("mgk", 16, 2, head_dim=8, pi="soft_e", max_len=32).train()
    compiled = torch.compile(m, backend="eager", dynamic=True, fullgraph=True)
    for L in range(5, 16):
        out, _ = compiled(torch.randn(2, L, 16, requires_grad=True))
        out.sum().backward()
