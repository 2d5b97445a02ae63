"""torch.func on whole attention modules, every kind and pi variant, in eval and training mode: torch's
model-ensembling recipe (``stack_module_state`` + ``vmap(functional_call)``), ``torch.func.grad`` and
``torch.func.jvp`` give the plain module's results. Module-held tensors (the sigma2 and pi buffers, stacked by the
ensemble) meet functorch wrappers there, so a path that serves them must be chosen; a Soft-E module gathers no
E-step statistics under a transform (its functions cannot change module state), so pi stays as it is."""
import copy

import pytest
import torch
from torch.func import functional_call, grad, jvp, stack_module_state, vmap

import mgk

MODES = ["eval", "train"]


def _module(build, variant, mode, seed=0, dtype=torch.float32):
    return build(*variant, seed=seed).to(dtype).train(mode == "train")


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 16, generator=gen, dtype=dtype)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    return x, kpm


def _assert_soft_e_untouched(modules, before):
    for m, pi in zip(modules, before):
        if pi is not None:
            mgk.soft_e_step(m)
            assert torch.equal(m.pi, pi), "a transform gathered E-step statistics"


def _pis(modules):
    return [m.pi.clone() if getattr(m, "pi_mode", None) == "soft_e" else None for m in modules]


@pytest.mark.parametrize("mode", MODES)
def test_ensemble_by_vmap_equals_each_member(build, variant, mode):
    members = [_module(build, variant, mode, seed=s) for s in range(3)]
    before = _pis(members)
    params, buffers = stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    x, kpm = _inputs()

    def run(p, b, x):
        return functional_call(base, (p, b), (x,), {"key_padding_mask": kpm, "is_causal": True})[0]

    out = vmap(run, in_dims=(0, 0, None))(params, buffers, x)
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(x, key_padding_mask=kpm, is_causal=True)[0], atol=1e-5, rtol=1e-5)
    _assert_soft_e_untouched(members, before)


@pytest.mark.parametrize("mode", MODES)
def test_func_grad_equals_autograd(build, variant, mode):
    m, plain = _module(build, variant, mode), _module(build, variant, mode)
    before = _pis([m])
    x, kpm = _inputs()
    params = {n: p.detach() for n, p in m.named_parameters()}

    def loss(p):
        return functional_call(m, p, (x,), {"key_padding_mask": kpm})[0][~kpm].square().sum()

    grads = grad(loss)(params)
    plain(x, key_padding_mask=kpm)[0][~kpm].square().sum().backward()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    _assert_soft_e_untouched([m], before)


@pytest.mark.parametrize("mode", MODES)
def test_func_jvp_equals_the_derivative(build, variant, mode):
    """Forward-mode derivative along a random direction equals the central difference of the plain float64 module
    (outputs of order 1: difference error ~ eps^2), and the primal equals the plain output."""
    m = _module(build, variant, mode, dtype=torch.float64)
    before = _pis([m])
    x, kpm = _inputs(torch.float64)
    direction = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)

    def f(inp):
        return m(inp, key_padding_mask=kpm, is_causal=True)[0]

    out, tangent = jvp(f, (x,), (direction,))
    with torch.no_grad():
        torch.testing.assert_close(out, f(x), atol=1e-10, rtol=1e-10)
        eps = 1e-5
        expected = (f(x + eps * direction) - f(x - eps * direction)) / (2 * eps)
    torch.testing.assert_close(tangent, expected, atol=1e-7, rtol=1e-6)
    _assert_soft_e_untouched([m], before)
