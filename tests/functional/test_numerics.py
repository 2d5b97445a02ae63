"""Numerical cases on every backend: a query far from every key (every Gaussian term underflows in float32, so the
literal formula gives 0/0), bf16 autocast with query/key norms about 30 under a left-padded causal mask, and q is k
(zero distances, where the expanded |q|^2 - 2 q.k + |k|^2 rounds below zero; cf. pytorch/pytorch#42479)."""
from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from mgk.functional import gaussian_log_kernel, mgk_attention, mgk_responsibilities, softmax_attention

from .reference import mgk_reference, padding_mask, skip_if_refused, squared_distances

F64 = torch.float64
MIXTURES = pytest.mark.parametrize("mixture", ["sum", "max"])


# ---- a query far from every key: every Gaussian term underflows ----------------------------------------------

def far_query_inputs(M):
    torch.manual_seed(0)
    keys = torch.randn(1, 6, 4)                              # (H, S, D) as in the case description
    k = keys.view(1, 1, 1, 6, 4)
    if M == 2:
        k = torch.cat([k, torch.randn(1, 1, 1, 6, 4)], dim=2)
    q = 100 * torch.ones(1, 1, 1, 4)
    v = torch.randn(1, 1, 6, 3)
    return q, k, v


def far_query_log_pi(M):
    if M == 1:
        return None
    return torch.log(torch.tensor([0.3, 0.7])).view(1, 2, 1)


def test_far_query_literal_formula_really_underflows():
    """Guard on the case itself: in float32 every exp(-|q-k|^2 / (2 sigma^2)) is 0, so raw exp gives 0/0."""
    q, k, v = far_query_inputs(1)
    d2 = squared_distances(q, k).float()
    assert (torch.exp(-d2 / 0.02) == 0).all()
    out, _ = mgk_reference(q, k, v, sigma2=0.01)  # literal (not log-space) form
    assert torch.isnan(out).all()


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("unequal", [False, True])
def test_far_query_is_finite_and_matches_log_space(M, backend, autocast, unequal):
    q, k, v = far_query_inputs(M)
    lp = far_query_log_pi(M)
    sig = torch.tensor([0.01, 0.02][:M]) if unequal else 0.01
    ref, ref_w = mgk_reference(q, k, v, sigma2=sig, log_pi=lp, log_space=True)
    nearest = ref_w.argmax(-1)
    assert ref_w.max() > 0.999  # the weight sits (almost) entirely on the nearest key
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = mgk_attention(q, k, v, sigma2=sig, log_pi=lp, backend=backend)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.to(F64), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.to(F64)[0, 0, 0], v[0, 0, int(nearest)].to(F64), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("M", [1, 2])
@MIXTURES
def test_far_query_gradients_finite(M, backend, mixture):
    skip_if_refused(backend, mixture=mixture)
    q, k, v = far_query_inputs(M)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    lp = far_query_log_pi(M) if mixture == "sum" else None
    if lp is not None:
        lp = lp.clone().requires_grad_(True)
    out = mgk_attention(q, k, v, sigma2=0.01, log_pi=lp, mixture=mixture, backend=backend)
    (out * torch.arange(1.0, 4.0)).sum().backward()
    for t in (q, k, v) + ((lp,) if lp is not None else ()):
        assert torch.isfinite(t.grad).all()
    assert v.grad.abs().sum() > 0.5  # the value of the nearest key receives the gradient


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("autocast", [False, True])
def test_far_query_hard_e_gives_weight_one_to_nearest_key(M, autocast):
    q, k, v = far_query_inputs(M)
    d2 = squared_distances(q, k)[0, 0, 0]  # (M, S)
    nearest = int(d2.min(dim=0).values.argmin())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, w = mgk_attention(q, k, v, sigma2=0.01, mixture="max", return_weights=True)
    expected = torch.zeros(6)
    expected[nearest] = 1.0
    assert torch.equal(w[0, 0, 0].float(), expected)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, nearest])


def test_far_query_responsibilities_finite_and_normalised():
    q, k, _ = far_query_inputs(2)
    resp, count = mgk_responsibilities(q, k, sigma2=0.01, log_pi=far_query_log_pi(2))
    assert torch.isfinite(resp).all()
    torch.testing.assert_close(resp.sum(1), count)  # gamma sums to 1 over the components for each (i, j)


# ---- bf16 autocast with query/key norms about 30, left padding, causal -------------------------------------------

def autocast_inputs(M, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, L, D = 2, 2, 8, 8
    q = torch.randn(B, H, L, D, generator=g)
    k = torch.randn(B, H, M, L, D, generator=g)
    q = 30 * q / q.norm(dim=-1, keepdim=True)
    k = 30 * k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, H, L, 4, generator=g)
    mask = padding_mask([8, 5], 8, left=True)  # batch 1: positions 0-2 are padding
    return q, k, v, mask


def _autocast_call(attend, q, k, v, mask):
    """``attend`` (softmax or an MGK backend and mixture) on the causal, left-padded case; unequal variances for
    Soft-E."""
    if attend is softmax_attention:
        return softmax_attention(q, k[:, :, 0], v, attn_mask=mask, is_causal=True)
    if attend.keywords["mixture"] == "max":
        return attend(q, k, v, attn_mask=mask, is_causal=True)
    return attend(q, k, v, attn_mask=mask, is_causal=True, sigma2=torch.tensor([2.0, 4.0][:k.shape[2]]))


def _real_rows(out):
    real = torch.ones(out.shape[0], out.shape[2], dtype=torch.bool)
    real[1, :3] = False
    return out.permute(0, 2, 1, 3)[real]


def _check_autocast_float32_inputs(attend, M):
    """float32 inputs under bf16 autocast: finite, within rel 2e-2 of float32; padded-only rows exactly 0."""
    q, k, v, mask = autocast_inputs(M)
    ref = _autocast_call(attend, q, k, v, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _autocast_call(attend, q, k, v, mask)
    assert torch.isfinite(out).all()
    assert (out[1, :, :3] == 0).all()
    a, b = _real_rows(out).float(), _real_rows(ref)
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.detach().abs().max()))


def _check_bf16_projections_under_autocast(attend, M):
    """q, k, v produced in bf16 by an autocast linear layer: the attention computes in float32 on those values,
    so the result is within rel 2e-2 of float32 attention on the same (upcast) values, and finite."""
    q0, k0, v0, mask = autocast_inputs(M, seed=1)
    eye = torch.nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        eye.weight.copy_(torch.eye(8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k = eye(q0), eye(k0)
        assert q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16
        v = v0.to(torch.bfloat16)
        out = _autocast_call(attend, q, k, v, mask)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    ref = _autocast_call(attend, q.float(), k.float(), v.float(), mask)
    a, b = _real_rows(out).float(), _real_rows(ref)
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.detach().abs().max()))


@pytest.mark.parametrize("M", [1, 2])
def test_autocast_float32_inputs_softmax(M):
    _check_autocast_float32_inputs(softmax_attention, M)


@MIXTURES
@pytest.mark.parametrize("M", [1, 2])
def test_autocast_float32_inputs(backend, mixture, M):
    skip_if_refused(backend, mixture=mixture)
    _check_autocast_float32_inputs(partial(mgk_attention, backend=backend, mixture=mixture), M)


@pytest.mark.parametrize("M", [1, 2])
def test_bf16_projections_under_autocast_softmax(M):
    _check_bf16_projections_under_autocast(softmax_attention, M)


@MIXTURES
@pytest.mark.parametrize("M", [1, 2])
def test_bf16_projections_under_autocast(backend, mixture, M):
    skip_if_refused(backend, mixture=mixture)
    _check_bf16_projections_under_autocast(partial(mgk_attention, backend=backend, mixture=mixture), M)


@MIXTURES
def test_backward_under_autocast_is_finite(backend, mixture):
    skip_if_refused(backend, mixture=mixture)
    q, k, v, mask = autocast_inputs(2)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _autocast_call(partial(mgk_attention, backend=backend, mixture=mixture), q, k, v, mask)
    _real_rows(out).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


# ---- q is k: zero distances ---------------------------------------------------------------------------------------

def q_is_k_inputs(M, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 4, 8, generator=g) * scale
    k = q.unsqueeze(2).expand(1, 1, M, 4, 8)  # q is k bitwise (a view of the same storage)
    v = torch.randn(1, 1, 4, 8, generator=g)
    v = 1e3 * v / v.norm(dim=-1, keepdim=True)
    return q, k, v


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("scale", [1.0, 30.0, 300.0])
@MIXTURES
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_q_is_k_forward_backward_finite(M, scale, backend, mixture, dtype):
    skip_if_refused(backend, mixture=mixture)
    q, k, v = q_is_k_inputs(M, scale)
    q, v = q.to(dtype).requires_grad_(True), v.to(dtype).requires_grad_(True)
    k = q.unsqueeze(2).expand(1, 1, M, 4, 8)
    out = mgk_attention(q, k, v, mixture=mixture, is_causal=True, backend=backend)
    assert torch.isfinite(out).all()
    (out * out).sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(v.grad).all()
    ref, _ = mgk_reference(q, k, v, is_causal=True, log_space=True, mixture=mixture)
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-8, rtol=1e-9)
    if scale == 1.0 or dtype == F64:
        torch.testing.assert_close(out.to(F64), ref, **tol)


@pytest.mark.parametrize("scale", [1.0, 100.0, 1e3])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("seed", [0, 1])
def test_q_is_k_gaussian_log_kernel_nonpositive_and_correct(scale, dtype, seed):
    """q is k bitwise for component 0 (16 queries, so rounding of an expanded |q|^2 + |k|^2 - 2 q.k does go
    negative somewhere): every log-kernel value is <= 0, finite, and equals -|q - k|^2 / (2 s2)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, 1, 16, 8, generator=g, dtype=F64) * scale).to(dtype)
    k = torch.cat([q.unsqueeze(2), (q + 0.5).unsqueeze(2)], dim=2)
    s2 = torch.tensor([0.5, 2.0], dtype=dtype)
    out = gaussian_log_kernel(q, k, s2)
    assert out.shape == (1, 1, 16, 2, 16)
    assert torch.isfinite(out).all()
    assert (out <= 0).all(), "kernel value exp(g) must be <= 1: squared distance went negative"
    ref = -squared_distances(q, k) / (2 * s2.to(F64).view(2, 1))
    diag = torch.arange(16)
    assert (ref[0, 0, diag, 0, diag] == 0).all()
    if scale == 1.0:
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(out.to(F64), ref, **tol)
    else:  # expanded form loses absolute precision at large norms; still close relative to |q|^2 / s2
        qn = float((q.to(F64) ** 2).sum(-1).max())
        eps = 1e-6 if dtype == torch.float32 else 1e-14
        assert ((out.to(F64) - ref).abs() <= 8 * eps * qn / 0.5 + 1e-9).all()


def test_q_is_k_hard_e_identical_components_deterministic(backend):
    skip_if_refused(backend, mixture="max")
    q, k, v = q_is_k_inputs(2)
    q = q.clone().requires_grad_(True)
    results = []
    for _ in range(3):
        q.grad = None
        kk = q.unsqueeze(2).expand(1, 1, 2, 4, 8)
        out = mgk_attention(q, kk, v, mixture="max", backend=backend)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
        results.append((out.detach().clone(), q.grad.clone()))
    for o, g in results[1:]:
        assert torch.equal(o, results[0][0]) and torch.equal(g, results[0][1])
    # and equals Hard-E on the single component
    torch.testing.assert_close(results[0][0], mgk_attention(q.detach(), q.detach().unsqueeze(2), v, mixture="max"))


def test_float32_backends_agree_at_moderate_scale(backend):
    """float32 on well-scaled inputs matches the float64 reference to 1e-5 (the fused backends' bias folding
    included)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 16, 8, generator=g) * 2
    k = torch.randn(2, 2, 2, 16, 8, generator=g) * 2
    v = torch.randn(2, 2, 16, 8, generator=g)
    sig = torch.tensor([math.sqrt(8), 1.0])
    ref, _ = mgk_reference(q, k, v, sigma2=sig, is_causal=True)
    out = mgk_attention(q, k, v, sigma2=sig, is_causal=True, backend=backend)
    torch.testing.assert_close(out.to(F64), ref, atol=1e-5, rtol=1e-5)
