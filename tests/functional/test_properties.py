"""Invariants of MGK attention, checked on every backend and both mixtures (Soft-E sum, Hard-E max): reduction to
softmax, collapse of identical components, shift/rotation/scale invariances, row-stochastic weights, permutation
equivariance, padding invariance (padded keys of any content, even NaN, are inert), rows that see no key, length one,
batch invariance and causality."""
from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mgk.functional import mgk_attention, softmax_attention

from .reference import make_inputs, mgk_reference, padding_mask, random_mask, skip_if_refused

F64 = torch.float64
MIXTURES = pytest.mark.parametrize("mixture", ["sum", "max"])


def close(a, b, tol=1e-9):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ---- 1. MGK reduces to softmax -----------------------------------------------------------------------------------

@MIXTURES
@pytest.mark.parametrize("sigma2", [None, 0.5, 3.0])
@pytest.mark.parametrize("causal", [False, True])
def test_m1_is_softmax_with_key_norm_bias(backend, mixture, sigma2, causal):
    """M=1: A = softmax_j((q.k - |k|^2/2)/s2). Realised via softmax_attention on augmented q'=[q,1], k'=[k,-|k|^2/2]."""
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    B, H, L, S, D = 2, 2, 5, 5, 4
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=1, D=D, dtype=F64, seed=1)
    s2 = math.sqrt(D) if sigma2 is None else sigma2
    k1 = k[:, :, 0]
    qa = torch.cat([q, torch.ones(B, H, L, 1, dtype=F64)], -1)
    ka = torch.cat([k1, -0.5 * (k1 * k1).sum(-1, keepdim=True)], -1)
    expected = softmax_attention(qa, ka, v, scale=1.0 / s2, is_causal=causal)
    # same thing directly, without the library
    scores = (q @ k1.transpose(-1, -2) - 0.5 * (k1 * k1).sum(-1)[:, :, None, :]) / s2
    if causal:
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -math.inf)
    direct = torch.softmax(scores, -1) @ v
    close(expected, direct)
    close(attend(q, k, v, sigma2=sigma2, is_causal=causal), expected)


@MIXTURES
@pytest.mark.parametrize("sigma2", [None, 0.8])
def test_m1_equal_key_norms_is_plain_softmax_with_temperature(backend, mixture, sigma2):
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    B, H, L, S, D = 1, 2, 4, 6, 4
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=1, D=D, dtype=F64, seed=2)
    k = 1.7 * k / k.norm(dim=-1, keepdim=True)  # every |k_j| = 1.7
    s2 = math.sqrt(D) if sigma2 is None else sigma2
    expected = softmax_attention(q, k[:, :, 0], v, scale=1.0 / s2)
    close(attend(q, k, v, sigma2=sigma2), expected)
    if sigma2 is None:  # default sigma2 = sqrt(D): exactly the library's softmax default scale
        close(attend(q, k, v), softmax_attention(q, k[:, :, 0], v))


def test_m1_unequal_key_norms_is_not_plain_softmax(backend):
    """Discriminating counterpart: with unequal key norms the |k|^2 bias matters."""
    attend = partial(mgk_attention, backend=backend)
    q, k, v = make_inputs(B=1, H=1, L=4, S=6, M=1, D=4, dtype=F64, seed=3)
    k = k * torch.linspace(0.3, 3.0, 6, dtype=F64).view(1, 1, 1, 6, 1)
    assert (attend(q, k, v) - softmax_attention(q, k[:, :, 0], v)).abs().max() > 1e-3


# ---- 2. identical components collapse ----------------------------------------------------------------------------

@MIXTURES
@pytest.mark.parametrize("M", [2, 3])
@pytest.mark.parametrize("pi_seed", [0, 1])
def test_identical_components_collapse_to_m1(backend, mixture, M, pi_seed):
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    q, k, v = make_inputs(B=2, H=2, L=5, S=5, M=1, D=3, dtype=F64, seed=4)
    kM = k.expand(2, 2, M, 5, 3).clone()
    g = torch.Generator().manual_seed(pi_seed)
    log_pi = torch.log_softmax(torch.randn(2, M, 5, generator=g, dtype=F64) * 2, dim=-2)  # per head & position
    mask = random_mask(2, 2, 5, 5, seed=pi_seed, empty_rows=[(0, 0, 0)])
    skip_if_refused(backend, mask=mask)
    close(attend(q, kM, v, log_pi=log_pi if mixture == "sum" else None, sigma2=1.3, attn_mask=mask),
          attend(q, k, v, sigma2=1.3, attn_mask=mask))


def test_hard_e_far_second_component_is_m1(backend):
    skip_if_refused(backend, mixture="max")
    attend = partial(mgk_attention, backend=backend, mixture="max")
    q, k, v = make_inputs(B=1, H=2, L=4, S=5, M=1, D=3, dtype=F64, seed=5)
    far = k + 1e3
    k2 = torch.cat([k, far], dim=2)
    close(attend(q, k2, v), attend(q, k, v))
    # sanity: with the far key as the *only* component the result is different (ties broken by the near one)
    assert (attend(q, k2, v) - attend(q, far, v)).abs().max() > 1e-3


def test_zero_prior_component_is_ignored(backend):
    """pi = (1, 0) with log pi_2 = -inf exactly: equals M=1 on component 1, finite output and gradients."""
    attend = partial(mgk_attention, backend=backend)
    q, k, v = make_inputs(B=1, H=2, L=4, S=5, M=2, D=3, dtype=F64, seed=21)
    lp = torch.log(torch.tensor([1.0, 0.0], dtype=F64)).view(1, 2, 1).expand(2, 2, 5).clone().requires_grad_(True)
    qq = q.clone().requires_grad_(True)
    out = attend(qq, k, v, log_pi=lp)
    close(out, attend(q, k[:, :, :1], v))
    out.sum().backward()
    assert torch.isfinite(qq.grad).all() and torch.isfinite(lp.grad).all()


# ---- 3. shift and rotation invariance ----------------------------------------------------------------------------

@MIXTURES
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("unequal", [False, True])
def test_translation_invariance_mgk_not_softmax(backend, mixture, M, unequal):
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    q, k, v = make_inputs(B=2, H=2, L=5, S=5, M=M, D=4, dtype=F64, seed=6)
    c = torch.tensor([3.0, -2.0, 0.5, 4.0], dtype=F64)
    sig = torch.tensor([0.7, 2.0][:M], dtype=F64) if unequal else None
    close(attend(q + c, k + c, v, sigma2=sig, is_causal=True), attend(q, k, v, sigma2=sig, is_causal=True))
    # dot-product softmax is not translation invariant: the same shift must move its output
    moved = softmax_attention(q + c, k[:, :, 0] + c, v) - softmax_attention(q, k[:, :, 0], v)
    assert moved.abs().max() > 1e-2


@MIXTURES
@pytest.mark.parametrize("M", [1, 3])
def test_orthogonal_rotation_invariance(backend, mixture, M):
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    D = 4
    q, k, v = make_inputs(B=2, H=1, L=5, S=6, M=M, D=D, dtype=F64, seed=7)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(0), dtype=F64))
    sig = torch.tensor([0.7, 2.0, 1.2][:M], dtype=F64)
    close(attend(q @ Q, k @ Q, v, sigma2=sig), attend(q, k, v, sigma2=sig))


# ---- 4. scale <-> sigma --------------------------------------------------------------------------------------------

@MIXTURES
@pytest.mark.parametrize("a", [0.3, 2.5])
def test_scale_sigma_duality(backend, mixture, a):
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    q, k, v = make_inputs(B=1, H=2, L=4, S=5, M=2, D=3, dtype=F64, seed=8)
    s2 = torch.tensor([0.9, 1.6], dtype=F64)
    close(attend(a * q, a * k, v, sigma2=s2), attend(q, k, v, sigma2=s2 / a ** 2))
    assert (attend(a * q, a * k, v, sigma2=s2) - attend(q, k, v, sigma2=s2)).abs().max() > 1e-3


# ---- 5. row-stochastic ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mixture", ["sum", "max"])
@pytest.mark.parametrize("causal", [False, True])
def test_weights_are_row_stochastic(mixture, causal):
    q, k, v = make_inputs(B=2, H=2, L=5, S=6, M=2, D=4, dtype=F64, seed=9, scale=2.0)
    mask = random_mask(2, 2, 5, 6, seed=3, empty_rows=[(1, 0, 4)])
    out, w = mgk_attention(q, k, v, mixture=mixture, attn_mask=mask, is_causal=causal, return_weights=True)
    assert (w >= 0).all()
    allowed = mask & torch.ones(5, 6, dtype=torch.bool).tril(1) if causal else mask
    assert (w[~allowed] == 0).all()
    has = allowed.any(-1)
    close(w.sum(-1)[has], torch.ones_like(w.sum(-1)[has]))
    assert (w.sum(-1)[~has] == 0).all()


@MIXTURES
@pytest.mark.parametrize("causal", [False, True])
def test_constant_values_give_constant_output(backend, mixture, causal):
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    q, k, _ = make_inputs(B=2, H=2, L=5, S=5, M=2, D=4, dtype=F64, seed=10, scale=3.0)
    v = torch.tensor([1.5, -2.0, 7.0], dtype=F64).expand(2, 2, 5, 3)
    out = attend(q, k, v, is_causal=causal, sigma2=torch.tensor([0.4, 2.0], dtype=F64))
    close(out, v[:, :, :1].expand_as(out))


# ---- 6. permutation equivariance ---------------------------------------------------------------------------------

@MIXTURES
def test_permutation_equivariance(backend, mixture):
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    q, k, v = make_inputs(B=2, H=2, L=6, S=6, M=2, D=3, dtype=F64, seed=11)
    log_pi = torch.log_softmax(torch.randn(2, 2, 1, dtype=F64), dim=1)  # per head, constant across positions
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    kw = dict(sigma2=torch.tensor([0.8, 1.5], dtype=F64))
    if mixture == "sum":
        kw["log_pi"] = log_pi
    out = attend(q, k, v, **kw)
    outp = attend(q[:, :, perm], k[:, :, :, perm], v[:, :, perm], **kw)
    close(outp, out[:, :, perm])
    # permuting only the keys (not the values) must change the output: equivariance is not trivial
    assert (attend(q, k[:, :, :, perm], v, **kw) - out).abs().max() > 1e-3


def test_per_position_pi_breaks_permutation_equivariance():
    q, k, v = make_inputs(B=1, H=1, L=6, S=6, M=2, D=3, dtype=F64, seed=12)
    lp = torch.log_softmax(torch.randn(1, 2, 6, generator=torch.Generator().manual_seed(1), dtype=F64) * 3, dim=1)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    out = mgk_attention(q, k, v, log_pi=lp)
    outp = mgk_attention(q[:, :, perm], k[:, :, :, perm], v[:, :, perm], log_pi=lp)
    assert (outp - out[:, :, perm]).abs().max() > 1e-4
    # ...but permuting pi along with the keys restores equivariance
    close(mgk_attention(q[:, :, perm], k[:, :, :, perm], v[:, :, perm], log_pi=lp[..., perm]), out[:, :, perm])


# ---- 7. padding invariance: masked content is inert, rows that see no key are zero ------------------------------

@MIXTURES
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("content", ["random", "1e30", "nan", "inf"])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_invariance(backend, mixture, dtype, content, causal):
    """Appending 3 padded keys (any content, even NaN or inf) with a padding mask leaves all outputs unchanged."""
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    B, H, L, S, P, M = 2, 2, 4, 4, 3, 2
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=M, D=4, dtype=dtype, seed=13)
    fill = {"random": None, "1e30": 1e30, "nan": math.nan, "inf": math.inf}[content]
    kp, vp = make_inputs(B=B, H=H, L=1, S=P, M=M, D=4, dtype=dtype, seed=99)[1:]
    if fill is not None:
        kp, vp = torch.full_like(kp, fill), torch.full_like(vp, fill)
    k2, v2 = torch.cat([k, kp], dim=3), torch.cat([v, vp], dim=2)
    mask = padding_mask([S, S], S + P)
    # with is_causal and L < S + P the alignment is bottom-right, so the padded keys sit at the front instead
    if causal:
        k2, v2 = torch.cat([kp, k], dim=3), torch.cat([vp, v], dim=2)
        mask = padding_mask([S, S], S + P, left=True)
    base = attend(q, k, v, is_causal=causal)
    out = attend(q, k2, v2, attn_mask=mask, is_causal=causal)
    assert torch.isfinite(out).all()
    tol = 1e-12 if dtype == F64 else 1e-6
    torch.testing.assert_close(out, base, atol=tol, rtol=tol)


@MIXTURES
def test_padding_invariance_batched_against_unpadded(backend, mixture):
    """Batch 1 has only positions 0-2 real (1e30 beyond): its real rows equal the length-3 run (atol 1e-6)."""
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    q, k, v = make_inputs(B=2, H=2, L=5, S=5, M=2, D=4, dtype=torch.float32, seed=0)
    k = k.clone()
    v = v.clone()
    k[1, :, :, 3:] = 1e30
    v[1, :, 3:] = 1e30
    mask = padding_mask([5, 3], 5)
    out = attend(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all()
    alone = attend(q[1:], k[1:, :, :, :3], v[1:, :, :3])
    torch.testing.assert_close(out[1:], alone, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[:1], attend(q[:1], k[:1], v[:1]), atol=1e-6, rtol=1e-6)


@MIXTURES
@pytest.mark.parametrize("scenario", ["no_real_keys", "causal_left_padding", "causal_L_gt_S"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_fully_masked_rows_are_exactly_zero_with_finite_grads(backend, mixture, scenario, dtype):
    """A row that sees no key returns exactly 0 (not the mean of the padded values = 1e3) with finite grads."""
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    B, H, M, D = 2, 2, 2, 4
    L, S = (7, 5) if scenario == "causal_L_gt_S" else (5, 5)
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=M, D=D, dtype=dtype, seed=14)
    causal = scenario != "no_real_keys"
    if scenario == "no_real_keys":
        mask = padding_mask([5, 0], S)
        empty = torch.zeros(B, L, dtype=torch.bool)
        empty[1] = True
    elif scenario == "causal_left_padding":
        mask = padding_mask([5, 3], S, left=True)  # batch 1: keys 0,1 padding -> rows 0,1 see nothing
        empty = torch.zeros(B, L, dtype=torch.bool)
        empty[1, :2] = True
    else:
        mask = padding_mask([5, 5], S)
        empty = torch.zeros(B, L, dtype=torch.bool)
        empty[:, :2] = True  # L - S = 2 first rows see no key (bottom-right)
    padded = ~mask.view(B, S)
    v = v.clone()
    v[padded.view(B, 1, S, 1).expand_as(v)] = 1e3
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = attend(q, k, v, attn_mask=mask, is_causal=causal)
    assert torch.isfinite(out).all()
    e = empty.view(B, 1, L, 1).expand_as(out)
    assert (out[e] == 0).all(), "fully masked row must be exactly zero"
    real = ~e
    (out[real].sum() + out.sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    # real rows are unaffected by the 1e3 padded values and match their own reference
    ref, _ = mgk_reference(q, k, v, mask=mask, is_causal=causal, mixture=mixture)
    tol = 1e-10 if dtype == F64 else 1e-5
    torch.testing.assert_close(out.detach().to(F64), ref, atol=tol, rtol=tol)


@MIXTURES
@pytest.mark.parametrize("content", [1e30, math.nan])
def test_fully_masked_query_rows_with_garbage_content(backend, mixture, content):
    """Self-attention with a (B,1,L,S) mask that masks padded queries and keys; padded q/k/v hold 1e30 or NaN.
    Real rows equal the unpadded run, padded rows are exactly 0, and gradients stay finite on real tokens."""
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    B, H, L, M, D, n = 1, 1, 5, 2, 3, 3
    q, k, v = make_inputs(B=B, H=H, L=L, S=L, M=M, D=D, dtype=torch.float32, seed=15)
    real = torch.arange(L) < n
    q, k, v = q.clone(), k.clone(), v.clone()
    q[:, :, n:] = content
    k[:, :, :, n:] = content
    v[:, :, n:] = content
    mask = (real[:, None] & real[None, :]).view(1, 1, L, L)
    skip_if_refused(backend, mask=mask)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = attend(q, k, v, attn_mask=mask)
    assert (out[:, :, n:] == 0).all()
    base = attend(q[:, :, :n].detach(), k[:, :, :, :n].detach(), v[:, :, :n].detach())
    torch.testing.assert_close(out[:, :, :n], base, atol=1e-6, rtol=1e-6)
    out[:, :, :n].sum().backward()
    assert torch.isfinite(q.grad[:, :, :n]).all(), "NaN gradient reaches real queries"
    assert torch.isfinite(v.grad[:, :, :n]).all(), "NaN gradient reaches real values"
    assert torch.isfinite(k.grad[:, :, :, :n]).all(), "NaN gradient reaches real keys from a fully masked query row"


# ---- length one, batch invariance (no squeeze without a dim) -----------------------------------------------------

@MIXTURES
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L", [1, 4])
def test_single_key_gives_v0(backend, mixture, causal, L):
    """S=1 (and L=1): the single key gets weight 1, so every query row returns v_0 exactly (up to rounding)."""
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    q, k, v = make_inputs(B=2, H=2, L=L, S=1, M=2, D=4, dtype=torch.float32, seed=16, scale=5.0)
    out = attend(q, k, v, is_causal=causal)
    if causal:  # bottom-right alignment: only the last query sees the single key, the L-1 rows above see none
        torch.testing.assert_close(out[:, :, -1:], v, atol=1e-6, rtol=1e-6)
        assert (out[:, :, :-1] == 0).all()
    else:
        torch.testing.assert_close(out, v.expand_as(out), atol=1e-6, rtol=1e-6)


@MIXTURES
def test_causal_length1_prefix_is_v0(backend, mixture):
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    q, k, v = make_inputs(B=1, H=2, L=6, S=6, M=2, D=4, dtype=F64, seed=17)
    out = attend(q, k, v, is_causal=True)
    close(out[:, :, 0], v[:, :, 0])


@MIXTURES
@pytest.mark.parametrize("masked", [False, True])
def test_batch_invariance(backend, mixture, masked):
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    q, k, v = make_inputs(B=3, H=2, L=5, S=5, M=2, D=4, dtype=torch.float32, seed=18)
    mask = padding_mask([5, 2, 4], 5) if masked else None
    out = attend(q, k, v, attn_mask=mask, is_causal=masked)
    for b in range(3):
        mb = mask[b:b + 1] if masked else None
        alone = attend(q[b:b + 1], k[b:b + 1], v[b:b + 1], attn_mask=mb, is_causal=masked)
        assert alone.shape == (1, 2, 5, 3)
        torch.testing.assert_close(out[b:b + 1], alone, atol=1e-6, rtol=1e-6)


@MIXTURES
def test_single_everything_keeps_shape(backend, mixture):
    """B=H=L=S=M=D=1 keeps all dims (no squeeze without dim)."""
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    q, k, v = make_inputs(B=1, H=1, L=1, S=1, M=1, D=1, Dv=1, dtype=torch.float32, seed=19)
    out = attend(q, k, v)
    assert out.shape == (1, 1, 1, 1)
    torch.testing.assert_close(out, v)


# ---- causality: a changed future token leaves earlier outputs bitwise equal --------------------------------------

@MIXTURES
@pytest.mark.parametrize("autocast", [False, True])
def test_causal_future_tokens_do_not_leak(backend, mixture, autocast):
    skip_if_refused(backend, mixture=mixture)
    attend = partial(mgk_attention, backend=backend, mixture=mixture)
    q, k, v = make_inputs(B=1, H=2, L=8, S=8, M=2, D=8, dtype=torch.float32, seed=20)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    g = torch.Generator().manual_seed(7)
    q2[:, :, 5] = torch.randn(1, 2, 8, generator=g)
    k2[:, :, :, 5] = torch.randn(1, 2, 2, 8, generator=g)
    v2[:, :, 5] = torch.randn(1, 2, 3, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        a = attend(q, k, v, is_causal=True)
        b = attend(q2, k2, v2, is_causal=True)
    assert torch.equal(a[:, :, :5], b[:, :, :5])
    assert (a[:, :, 5:] - b[:, :, 5:]).abs().max() > 1e-4


@settings(max_examples=30, deadline=None, derandomize=True)
@given(B=st.integers(1, 3), H=st.integers(1, 2), L=st.sampled_from([1, 2, 5, 9]), D=st.sampled_from([1, 2, 4, 8]),
       M=st.integers(1, 2), seed=st.integers(0, 10_000), shift=st.floats(-20, 20), a=st.floats(0.2, 4.0))
def test_hypothesis_shift_scale_invariances(B, H, L, D, M, seed, shift, a):
    q, k, v = make_inputs(B=B, H=H, L=L, S=L, M=M, D=D, dtype=F64, seed=seed)
    s2 = torch.linspace(0.5, 2.0, M, dtype=F64)
    base = mgk_attention(q, k, v, sigma2=s2, is_causal=True)
    c = torch.full((D,), shift, dtype=F64)
    close(mgk_attention(q + c, k + c, v, sigma2=s2, is_causal=True), base, tol=1e-7)
    close(mgk_attention(a * q, a * k, v, sigma2=s2 * a * a, is_causal=True), base, tol=1e-7)
    close(mgk_attention(q, k, v, sigma2=s2, is_causal=True, backend="explicit"), base, tol=1e-9)


@MIXTURES
@pytest.mark.parametrize("LS", [(0, 3), (3, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_length_sequences(backend, mixture, LS, causal):
    """An empty query block gives an empty output, and an empty key set gives all-zero rows (every row sees no key),
    identically on every backend (and in softmax attention, below)."""
    skip_if_refused(backend, mixture=mixture)
    L, S = LS
    q, k, v = make_inputs(B=2, H=1, L=L, S=S, M=2, D=3, Dv=2, dtype=F64, seed=22)
    out = mgk_attention(q, k, v, is_causal=causal, backend=backend, mixture=mixture)
    assert out.shape == (2, 1, L, 2)
    assert (out == 0).all()


@pytest.mark.parametrize("LS", [(0, 3), (3, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_length_sequences_softmax(LS, causal):
    L, S = LS
    q, k, v = make_inputs(B=2, H=1, L=L, S=S, M=2, D=3, Dv=2, dtype=F64, seed=22)
    out = softmax_attention(q, k[:, :, 0], v, is_causal=causal)
    assert out.shape == (2, 1, L, 2)
    assert (out == 0).all()
