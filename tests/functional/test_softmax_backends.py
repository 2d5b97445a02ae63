"""softmax_attention's backends ("kernel", "sdpa", "explicit") against the float64 reference written from the
formula (Vaswani et al. 2017, eq. 1), and the selector that serves dropout on CPU from the kernel."""
from __future__ import annotations

import pytest
import torch

from mgk.functional import BackendError, _mixture_flash, softmax_attention
from mgk.functional.softmax import SOFTMAX_BACKENDS, select_softmax_backend

from .reference import padding_mask, random_mask, softmax_reference

F64 = torch.float64
TOL = {F64: dict(atol=1e-10, rtol=1e-9), torch.float32: dict(atol=2e-5, rtol=2e-5)}

needs_kernel = pytest.mark.skipif(not _mixture_flash.available(torch.zeros(1), 0.0),
                                  reason=f"the C++ MGK kernel could not be built: {_mixture_flash.build_error()}")


def inputs(B, H, L, S, D=4, Dv=3, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(B, H, n, d, generator=g, dtype=F64) * 1.5).to(dtype)
                 for n, d in ((L, D), (S, D), (S, Dv)))


def backends():
    """Every backend; "kernel" only where it was built."""
    return [pytest.param(b, marks=needs_kernel) if b == "kernel" else b for b in SOFTMAX_BACKENDS]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "left_padding", "zero_real"])
@pytest.mark.parametrize("causal,LS", [(False, (5, 7)), (True, (5, 5)), (True, (3, 6)), (True, (6, 3))])
def test_every_backend_equals_the_float64_reference(backend, dtype, mask_kind, causal, LS):
    B, H, (L, S) = 2, 2, LS
    q, k, v = inputs(B, H, L, S, dtype=dtype, seed=1)
    mask = {"none": None, "padding": padding_mask([S, 2], S), "left_padding": padding_mask([S, 3], S, left=True),
            "zero_real": padding_mask([S, 0], S)}[mask_kind]
    ref, _ = softmax_reference(q, k, v, mask=mask, is_causal=causal, scale=0.7)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = softmax_attention(qg, kg, vg, attn_mask=mask, is_causal=causal, scale=0.7, backend=backend)
    assert out.dtype == dtype
    torch.testing.assert_close(out.to(F64), ref, **TOL[dtype])
    # gradients equal the explicit twin's (the reference path, differentiated by autograd)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    grads = torch.autograd.grad(out, (qg, kg, vg), g)
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out = softmax_attention(qe, ke, ve, attn_mask=mask, is_causal=causal, scale=0.7, backend="explicit")
    for a, b in zip(grads, torch.autograd.grad(ref_out, (qe, ke, ve), g)):
        torch.testing.assert_close(a, b, **TOL[dtype])


@needs_kernel
def test_nan_padding_never_leaks_through_the_kernel():
    q, k, v = inputs(2, 1, 4, 6)
    mask = padding_mask([6, 3], 6)
    k[1, :, 3:] = float("nan")
    v[1, :, 3:] = float("inf")
    ref, _ = softmax_reference(q, k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0), mask=mask)
    out = softmax_attention(q, k, v, attn_mask=mask, backend="kernel")
    torch.testing.assert_close(out, ref, **TOL[F64])


@needs_kernel
@pytest.mark.parametrize("mask_kind", ["none", "padding"])
def test_selector_serves_cpu_dropout_from_the_kernel_and_the_rest_from_sdpa(mask_kind):
    q, k, v = inputs(2, 2, 5, 5, dtype=torch.float32)
    mask = padding_mask([5, 2], 5) if mask_kind == "padding" else None
    assert select_softmax_backend(q, k, v, attn_mask=mask, dropout_p=0.1) == "kernel"
    assert select_softmax_backend(q, k, v, attn_mask=mask, dropout_p=0.0) == "sdpa"
    # a query-dependent mask is beyond the kernel: SDPA (which builds the weights)
    qdep = random_mask(2, 2, 5, 5, seed=1)
    assert select_softmax_backend(q, k, v, attn_mask=qdep, dropout_p=0.1) == "sdpa"
    # bf16 is computed in float32, so the kernel serves it too
    assert select_softmax_backend(q.bfloat16(), k.bfloat16(), v.bfloat16(), dropout_p=0.1) == "kernel"


@needs_kernel
def test_automatic_choice_with_dropout_equals_the_named_kernel_bitwise():
    q, k, v = inputs(2, 2, 6, 6, dtype=torch.float32)
    mask = padding_mask([6, 4], 6)
    torch.manual_seed(3)
    auto = softmax_attention(q, k, v, attn_mask=mask, dropout_p=0.2, is_causal=True)
    torch.manual_seed(3)
    named = softmax_attention(q, k, v, attn_mask=mask, dropout_p=0.2, is_causal=True, backend="kernel")
    assert torch.equal(auto, named)


@needs_kernel
def test_kernel_refuses_what_it_cannot_serve_with_one_line():
    q, k, v = inputs(1, 1, 4, 4)
    with pytest.raises(BackendError, match="backend='kernel' cannot serve.*depends on the query"):
        softmax_attention(q, k, v, attn_mask=random_mask(1, 1, 4, 4), backend="kernel")
    with pytest.raises(BackendError, match="backend='kernel' cannot serve.*dropout_p"):
        softmax_attention(q, k, v, dropout_p=1.0, backend="kernel")


def test_unknown_backend_is_named():
    q, k, v = inputs(1, 1, 2, 2)
    with pytest.raises(ValueError, match="backend must be None or one of"):
        softmax_attention(q, k, v, backend="flash")
