"""Eager calls run the C++ kernel through a plain autograd.Function instead of the torch.library custom op (whose
dispatch costs tens of microseconds per call); both must give bitwise the same outputs and gradients."""
import pytest
import torch

from mgk.functional import _mixture_flash


def _run(q, k, bias, v, rowbias, p):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, bias, v, rowbias)]
    out = _mixture_flash.mixture_flash(*leaves[:4], leaves[4], False, dropout_p=p, seed=(11, 5))
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eager_path_equals_the_custom_op_bitwise(monkeypatch, p, dtype):
    if not _mixture_flash.available(torch.empty(0, dtype=dtype), p):
        pytest.skip(f"the C++ kernel is unavailable: {_mixture_flash.build_error()}")
    g = torch.Generator().manual_seed(0)
    B, H, M, L, S, D = 2, 3, 2, 37, 41, 8
    q, v = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for n in (L, S))
    k = torch.randn(B, H, M, S, D, generator=g, dtype=dtype)
    bias, rowbias = torch.randn(B, H, M, S, generator=g, dtype=dtype), torch.randn(B, H, M, L, generator=g, dtype=dtype)
    assert _mixture_flash._eager_ok()
    eager = _run(q, k, bias, v, rowbias, p)
    monkeypatch.setattr(_mixture_flash, "_eager_ok", lambda: False)
    op = _run(q, k, bias, v, rowbias, p)
    for a, b in zip(eager, op):
        assert torch.equal(a, b)


def test_dispatch_modes_still_see_the_custom_op():
    """FlopCounterMode (used by ``mgk bench``) and other dispatch modes must see mgk::mixture_flash_forward."""
    if not _mixture_flash.available(torch.empty(0), 0.0):
        pytest.skip(f"the C++ kernel is unavailable: {_mixture_flash.build_error()}")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = torch.randn(1, 1, 4, 3), torch.randn(1, 1, 2, 5, 3), torch.randn(1, 1, 5, 3)
    with Seen() as mode:
        assert not _mixture_flash._eager_ok()
        _mixture_flash.mixture_flash(q, k, torch.zeros(1, 1, 2, 5), v, None, False)
    assert any("mixture_flash_forward" in op for op in mode.ops)
