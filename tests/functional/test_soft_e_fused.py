"""The Soft-E statistics fused into the kernel's forward pass equal mgk_responsibilities (explicit backend) and the
float64 loop reference, and its output equals mgk_attention's."""
from __future__ import annotations

import pytest
import torch

from mgk.functional import _mixture_flash, mgk_attention, mgk_responsibilities
from mgk.functional._soft_e import mgk_attention_soft_e

from .reference import make_inputs, normalised_log_pi, padding_mask, random_mask, responsibilities_reference

F64 = torch.float64

pytestmark = pytest.mark.skipif(not _mixture_flash.available(torch.zeros(1), 0.0),
                                reason=f"the C++ MGK kernel could not be built: {_mixture_flash.build_error()}")


def case(B, H, L, S, M, D=4, seed=0, dtype=F64):
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=M, D=D, dtype=dtype, seed=seed)
    return q, k, v


@pytest.mark.parametrize("LS", [(5, 5), (3, 7), (7, 3), (130, 600)])  # the last spans several blocks
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("unequal", [False, True])
@pytest.mark.parametrize("use_qmask", [False, True])
def test_fused_statistics_equal_the_explicit_e_step(LS, causal, padding, unequal, use_qmask):
    L, S = LS
    B, H, M = 2, 2, 3 if unequal else 2
    q, k, v = case(B, H, L, S, M, seed=L + S)
    log_pi = normalised_log_pi((H, M, S), dim=1, seed=3)
    s2 = torch.tensor([0.7, 2.0, 1.3], dtype=F64) if unequal else None
    mask = padding_mask([S, max(1, S // 2)], S) if padding else None
    qmask = None
    if use_qmask:
        qmask = torch.ones(B, L, dtype=torch.bool)
        qmask[1, L // 2:] = False
    if padding:  # padded keys may hold anything: the statistics must not see it
        k[1, :, :, max(1, S // 2):] = float("nan")
    kw = dict(log_pi=log_pi, sigma2=s2, attn_mask=mask, is_causal=causal)
    out, resp, count = mgk_attention_soft_e(q, k, v, query_mask=qmask, **kw)
    ref_resp, ref_count = mgk_responsibilities(q, k, query_mask=qmask, backend="explicit", **kw)
    torch.testing.assert_close(resp, ref_resp, atol=1e-6, rtol=1e-6)
    assert torch.equal(count, ref_count)
    if L * S < 100:  # the loop reference is slow
        loop_resp, loop_count = responsibilities_reference(q, k, log_pi=log_pi, sigma2=s2, mask=mask,
                                                           is_causal=causal, query_mask=qmask)
        torch.testing.assert_close(resp, loop_resp, atol=1e-6, rtol=1e-6)
        assert torch.equal(count.to(F64), loop_count)
    assert not resp.requires_grad
    torch.testing.assert_close(out, mgk_attention(q, k, v, backend="explicit", **kw), atol=1e-10, rtol=1e-9)


def test_float32_statistics_and_gradients_equal_the_kernel_path():
    q, k, v = case(2, 2, 40, 40, 2, D=8, seed=1, dtype=torch.float32)
    mask = padding_mask([40, 25], 40)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, resp, count = mgk_attention_soft_e(*leaves, attn_mask=mask, is_causal=True)
    ref_resp, ref_count = mgk_responsibilities(q, k, attn_mask=mask, is_causal=True, backend="explicit")
    torch.testing.assert_close(resp, ref_resp, atol=1e-4, rtol=1e-5)
    assert torch.equal(count, ref_count)
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = mgk_attention(*plain, attn_mask=mask, is_causal=True, backend="kernel")
    assert torch.equal(out, ref)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    for a, b in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, plain, g)):
        assert torch.equal(a, b)


def test_dropout_changes_the_output_not_the_statistics():
    q, k, v = case(1, 2, 30, 30, 2, seed=2)
    torch.manual_seed(7)
    out, resp, _ = mgk_attention_soft_e(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    ref = mgk_attention(q, k, v, dropout_p=0.3, backend="kernel")
    assert torch.equal(out, ref)
    torch.testing.assert_close(resp, mgk_responsibilities(q, k, backend="explicit")[0], atol=1e-10, rtol=1e-10)


def test_calls_the_kernel_cannot_serve_return_none():
    q, k, v = case(1, 1, 4, 4, 2)
    assert mgk_attention_soft_e(q, k, v, attn_mask=random_mask(1, 1, 4, 4, seed=1)) is None
    assert mgk_attention_soft_e(q, k, v, backend="sdpa") is None
    assert mgk_attention_soft_e(q, k[:, :, :1], v) is None  # one component: nothing to estimate
