"""torch.compile (fullgraph) of every attention module, aot_eager and inductor, in training mode: the same outputs,
gradients and Soft-E pi (after ``mgk.soft_e_step``) as eager on CPU, causal and not, with key padding."""
import copy

import pytest
import torch
from torch import nn

import mgk

# The linear forms whose feature maps and key mixing take other code paths (all compiled through backward).
FORMS = [("linear", {"feature_map": "elu_sum"}), ("mlk", {"mix": "keys"}), ("smlk", {"pi_shape": "layer"})]


class Calls(nn.Module):
    """Every module in ``modules`` on one input, non-causal and causal: one graph, so one compile serves them all."""

    def __init__(self, modules):
        super().__init__()
        self.kinds = nn.ModuleList(modules)

    def forward(self, x, key_padding_mask):
        return [m(x, key_padding_mask=key_padding_mask, is_causal=causal, need_weights=False)[0] for m in self.kinds
                for causal in (False, True)]


def _check_compiled_equals_eager(modules, backend):
    torch._dynamo.reset()
    eager = Calls(modules).train()
    start = {name: buf.clone() for name, buf in eager.named_buffers() if name.endswith(".pi")}
    compiled_copy = copy.deepcopy(eager)
    compiled = torch.compile(compiled_copy, backend=backend, fullgraph=True)
    x = torch.randn(2, 9, 16)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 6:] = True
    grads = []
    for net, model in ((eager, eager), (compiled, compiled_copy)):
        inp = x.clone().requires_grad_()
        outs = net(inp, kpm)
        sum(o[~kpm].square().sum() for o in outs).backward()
        soft_e = sum(getattr(m, "pi_mode", None) == "soft_e" for m in modules)
        if soft_e:
            assert mgk.soft_e_step(model) == soft_e
        grads.append((outs, inp.grad, {n: p.grad for n, p in model.named_parameters()}))
    (outs, g_x, g_p), (c_outs, c_x, c_p) = grads
    for i, (a, b) in enumerate(zip(c_outs, outs)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"output {i}")
    torch.testing.assert_close(c_x, g_x, atol=1e-5, rtol=1e-4)
    for name, g in g_p.items():
        torch.testing.assert_close(c_p[name], g, atol=1e-5, rtol=1e-4, msg=name)
    for name, pi in start.items():
        buf = dict(eager.named_buffers())[name]
        assert not torch.equal(buf, pi), "the Soft-E step changed pi"
        torch.testing.assert_close(dict(compiled_copy.named_buffers())[name], buf, atol=1e-6, rtol=0)


def test_aot_eager_compiled_module_matches_eager(build, variant):
    """aot_eager runs the traced forward and backward graphs as they are: a view whose traced strides differ from
    the kernel's (the linear kinds' feature map under a head split) fails here, not under inductor."""
    _check_compiled_equals_eager([build(*variant)], "aot_eager")


@pytest.mark.parametrize("kind,options", FORMS, ids=[k + "-" + "-".join(map(str, o.values())) for k, o in FORMS])
def test_aot_eager_compiled_linear_forms_match_eager(kind, options):
    torch.manual_seed(0)
    m = mgk.build_attention(kind, 16, 2, head_dim=8, **options)
    _check_compiled_equals_eager([m], "aot_eager")


# Inductor compiles take tens of seconds each on 2 cores: Soft-E MGK and MLK run in CI, every variant with -m slow.
@pytest.mark.parametrize("kind,pi", [("mgk", "soft_e"), ("mlk", "learned")])
def test_inductor_compiled_module_matches_eager(build, kind, pi):
    _check_compiled_equals_eager([build(kind, pi)], "inductor")


@pytest.mark.slow
def test_inductor_compiled_module_matches_eager_every_variant(build, variant):
    _check_compiled_equals_eager([build(*variant)], "inductor")


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
    assert mgk.soft_e_step(m) == 1
