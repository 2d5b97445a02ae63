"""Variances per head and component (sigma2 of shape (H, M), or (M,), or one value), possibly learned: every
backend equals the float64 formula, and the gradient with respect to sigma2 equals the float64 reference's on every
backend that serves it (the fused kernels take k / sigma^2, the per-key bias and the per-row |q|^2 term as
differentiable torch ops); the Triton kernels refuse a learned sigma2 with the reason; the per-row term is kept
exactly when it does not cancel."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from mgk.functional import BackendError, mgk_attention, mgk_responsibilities, select_backend
from mgk.functional._mixture_terms import needs_qnorm

from .reference import make_inputs, mgk_reference, padding_mask, responsibilities_reference, skip_if_refused, tol64

F64 = torch.float64
B, H, L, M, D = 2, 3, 6, 2, 4

SIGMAS = {
    "per_head": torch.tensor([[0.5, 1.5], [2.0, 2.0], [0.8, 3.0]], dtype=F64),   # (H, M)
    "per_head_equal": torch.tensor([[0.5], [2.0], [1.1]], dtype=F64).expand(H, M),  # equal within each head
    "per_component": torch.tensor([0.7, 1.9], dtype=F64),                        # (M,)
    "one": torch.tensor(1.3, dtype=F64),                                          # one value
}


@pytest.mark.parametrize("which", list(SIGMAS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mixture", ["sum", "max"])
def test_each_backend_equals_the_formula_with_per_head_variances(backend, which, causal, mixture, assert_close):
    s2 = SIGMAS[which]
    skip_if_refused(backend, mixture=mixture, sigma2=s2)
    q, k, v = make_inputs(B=B, H=H, L=L, S=L, M=M, D=D, dtype=F64, seed=1)
    mask = padding_mask([L, 4], L, left=causal)
    ref, _ = mgk_reference(q, k, v, sigma2=s2, mixture=mixture, mask=mask, is_causal=causal)
    got = mgk_attention(q, k, v, sigma2=s2, mixture=mixture, attn_mask=mask, is_causal=causal, backend=backend)
    assert_close(f"{backend} {which}", ref, got, **tol64(backend))
    got32 = mgk_attention(q.float(), k.float(), v.float(), sigma2=s2.float(), mixture=mixture, attn_mask=mask,
                          is_causal=causal, backend=backend)
    assert_close(f"{backend} {which} float32", ref, got32, atol=1e-5, rtol=1e-5)


def test_per_head_variances_equal_each_head_run_alone(backend):
    s2 = SIGMAS["per_head"]
    q, k, v = make_inputs(B=B, H=H, L=L, S=L, M=M, D=D, dtype=F64, seed=2)
    out = mgk_attention(q, k, v, sigma2=s2, backend="explicit" if backend == "triton" else backend)
    for h in range(H):
        alone = mgk_attention(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], sigma2=s2[h], backend="explicit")
        torch.testing.assert_close(out[:, h:h + 1], alone, atol=1e-12, rtol=0)


@pytest.mark.parametrize("which", ["per_head", "per_component", "one"])
@pytest.mark.parametrize("causal", [False, True])
def test_sigma2_gradient_matches_the_float64_reference(backend, which, causal):
    if backend == "triton":
        pytest.skip("the Triton kernels refuse a learned sigma2 (test_triton_refuses_a_learned_sigma2)")
    s2 = SIGMAS[which].clone().requires_grad_(True)
    q, k, v = make_inputs(B=B, H=H, L=L, S=L, M=M, D=D, dtype=F64, seed=3)
    mask = padding_mask([L, 4], L)
    lp = torch.log_softmax(torch.randn(1, H, M, 1, dtype=F64), dim=2)
    w = torch.randn(B, H, L, 3, dtype=F64)
    out = mgk_attention(q, k, v, log_pi=lp, sigma2=s2, attn_mask=mask, is_causal=causal, backend=backend)
    g, = torch.autograd.grad((out * w).sum(), s2)
    ref, _ = mgk_reference(q, k, v, log_pi=lp, sigma2=s2, mask=mask, is_causal=causal, grad=True, log_space=True)
    g_ref, = torch.autograd.grad((ref * w).sum(), s2)
    assert g.abs().sum() > 1e-3  # the gradient is really there
    torch.testing.assert_close(g, g_ref, atol=1e-9, rtol=1e-7)
    out32 = mgk_attention(q.float(), k.float(), v.float(), log_pi=lp.float(), sigma2=s2.float(), attn_mask=mask,
                          is_causal=causal, backend=backend)
    g32, = torch.autograd.grad((out32 * w.float()).sum(), s2)
    torch.testing.assert_close(g32, g_ref, atol=1e-4, rtol=1e-4)


def test_gradcheck_through_per_head_variances(backend):
    if backend == "triton":
        pytest.skip("the Triton kernels refuse a learned sigma2")
    g = torch.Generator().manual_seed(4)
    ins = [torch.randn(*s, generator=g, dtype=F64, requires_grad=True)
           for s in [(1, 2, 3, 2), (1, 2, 2, 3, 2), (1, 2, 3, 2)]]
    s2 = torch.tensor([[0.8, 1.7], [1.2, 0.6]], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: mgk_attention(q, k, v, sigma2=s, is_causal=True, backend=backend), [*ins, s2], atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_refuses_a_learned_sigma2(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so that the device is not the reason
    q, k, v = make_inputs(B=1, H=1, L=4, S=4, M=2, D=4, seed=5)
    for s2 in (torch.tensor([1.0, 1.0], requires_grad=True), torch.tensor([1.0, 2.0])):
        with pytest.raises(BackendError, match="backend='triton' cannot serve these inputs: .*variances"):
            mgk_attention(q, k, v, sigma2=s2, backend="triton")


def test_the_per_row_term_is_kept_exactly_when_it_does_not_cancel():
    assert not needs_qnorm(torch.tensor([[1.0, 1.0], [2.0, 2.0]]))  # equal within each head: cancels per row
    assert needs_qnorm(torch.tensor([[1.0, 1.0], [2.0, 3.0]]))
    assert needs_qnorm(torch.tensor([[1.0, 1.0]], requires_grad=True))  # a learned sigma_r moves alone
    assert not needs_qnorm(torch.tensor([[1.0], [2.0]], requires_grad=True))  # one component per head: cancels
    assert select_backend(*make_inputs(B=1, H=2, L=3, S=3, M=2, D=4, seed=6), sigma2=torch.ones(2, 2)) in (
        "kernel", "sdpa")


@pytest.mark.parametrize("name", ["kernel", "explicit"])
def test_soft_e_statistics_with_per_head_variances(name, assert_close):
    s2 = SIGMAS["per_head"]
    q, k, _ = make_inputs(B=B, H=H, L=L, S=L, M=M, D=D, dtype=F64, seed=7)
    mask = padding_mask([L, 4], L)
    resp, count = mgk_responsibilities(q, k, sigma2=s2, attn_mask=mask, is_causal=True, backend=name)
    ref, ref_count = responsibilities_reference(q, k, sigma2=s2, mask=mask, is_causal=True)
    assert torch.equal(count, ref_count)
    assert_close(name, ref, resp, atol=1e-10, rtol=1e-9)


def test_variances_of_the_wrong_shape_name_the_accepted_shapes():
    q, k, v = make_inputs(B=1, H=2, L=3, S=3, M=2, D=4, seed=8)
    for bad in (torch.ones(3, 2), torch.ones(2, 3), torch.ones(2, 2, 1), torch.ones(3)):
        with pytest.raises(ValueError, match=r"sigma2 must be .*\(M,\) = \(2,\) or \(H, M\) = \(2, 2\)"):
            mgk_attention(q, k, v, sigma2=bad)
    assert math.isfinite(float(mgk_attention(q, k, v, sigma2=torch.ones(1, 2)).sum()))
