"""softmax_attention and softmax_attention_reference against the literal float64 reference, plus rows that see no key,
inert padded content, causality, bottom-right causal alignment and length one."""
from __future__ import annotations

import math

import pytest
import torch

from mgk.functional import softmax_attention, softmax_attention_reference

from .reference import padding_mask, random_mask, softmax_reference

F64 = torch.float64
TOL = {F64: dict(atol=1e-10, rtol=1e-9), torch.float32: dict(atol=1e-5, rtol=1e-5)}


def inputs(B=2, H=2, L=5, S=5, D=4, Dv=3, dtype=F64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=F64) * scale
    k = torch.randn(B, H, S, D, generator=g, dtype=F64) * scale
    v = torch.randn(B, H, S, Dv, generator=g, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def both(q, k, v, **kw):
    """(fast SDPA output, reference-twin output, reference-twin weights)."""
    fast = softmax_attention(q, k, v, **kw)
    twin, w = softmax_attention_reference(q, k, v, return_weights=True, **kw)
    return fast, twin, w


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("mask_kind", ["none", "random", "padding", "left_padding", "zero_real", "LS"])
def test_matches_reference(dtype, scale, mask_kind):
    B, H, L, S = 2, 2, 5, 6
    q, k, v = inputs(B, H, L, S, dtype=dtype, seed=1, scale=1.5)
    mask = {"none": None,
            "random": random_mask(B, H, L, S, seed=2, empty_rows=[(0, 1, 3), (1, 0, 0)]),
            "padding": padding_mask([6, 2], S),
            "left_padding": padding_mask([6, 3], S, left=True),
            "zero_real": padding_mask([6, 0], S),
            "LS": random_mask(1, 1, L, S, seed=3, empty_rows=[(0, 0, 2)])[0, 0]}[mask_kind]
    ref, ref_w = softmax_reference(q, k, v, mask=mask, scale=scale)
    fast, twin, w = both(q, k, v, attn_mask=mask, scale=scale)
    for out in (fast, twin):
        assert out.dtype == dtype
        torch.testing.assert_close(out.to(F64), ref, **TOL[dtype])
    torch.testing.assert_close(w.to(F64), ref_w, **TOL[dtype])


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("LS", [(5, 5), (3, 6), (6, 3), (1, 4), (4, 1), (1, 1)])
@pytest.mark.parametrize("with_padding", [False, True])
def test_causal_bottom_right(dtype, LS, with_padding):
    L, S = LS
    q, k, v = inputs(2, 2, L, S, dtype=dtype, seed=4)
    mask = padding_mask([S, max(1, S - 2)], S, left=True) if with_padding else None
    ref, ref_w = softmax_reference(q, k, v, mask=mask, is_causal=True)
    fast, twin, w = both(q, k, v, attn_mask=mask, is_causal=True)
    for out in (fast, twin):
        torch.testing.assert_close(out.to(F64), ref, **TOL[dtype])
    torch.testing.assert_close(w.to(F64), ref_w, **TOL[dtype])


def test_the_last_query_alone_equals_the_last_row():
    q, k, v = inputs(1, 2, 6, 6, seed=5)
    full = softmax_attention(q, k, v, is_causal=True)
    last = softmax_attention(q[:, :, 5:], k, v, is_causal=True)
    torch.testing.assert_close(last, full[:, :, 5:], atol=1e-12, rtol=1e-10)
    assert (last - v[:, :, :1]).abs().max() > 1e-3  # not "attends only to key 0"
    torch.testing.assert_close(full[:, :, 0], v[:, :, 0])  # length-1 prefix: v_0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L", [1, 3])
def test_single_key(causal, L):
    q, k, v = inputs(2, 1, L, 1, dtype=torch.float32, seed=6, scale=4.0)
    out = softmax_attention(q, k, v, is_causal=causal)
    if causal:
        torch.testing.assert_close(out[:, :, -1:], v)
        assert (out[:, :, :-1] == 0).all()
    else:
        torch.testing.assert_close(out, v.expand_as(out))


@pytest.mark.parametrize("content", [1e30, math.nan, math.inf])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_content_is_inert(content, causal):
    """Padded keys/values with 1e30/NaN/inf do not change real outputs; equal to the unpadded length-4 run."""
    q, k, v = inputs(1, 2, 4, 4, dtype=torch.float32, seed=7)
    kp = torch.full((1, 2, 2, 4), content)
    vp = torch.full((1, 2, 2, 3), content)
    if causal:  # bottom-right alignment: put the padding in front
        k2, v2, mask = torch.cat([kp, k], 2), torch.cat([vp, v], 2), padding_mask([4], 6, left=True)
    else:
        k2, v2, mask = torch.cat([k, kp], 2), torch.cat([v, vp], 2), padding_mask([4], 6)
    base = softmax_attention(q, k, v, is_causal=causal)
    for fn in (softmax_attention, softmax_attention_reference):
        out = fn(q, k2, v2, attn_mask=mask, is_causal=causal)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, base, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fn", [softmax_attention, softmax_attention_reference])
@pytest.mark.parametrize("scenario", ["no_real_keys", "causal_left_padding", "causal_L_gt_S"])
def test_fully_masked_rows_zero_and_finite_grads(fn, scenario):
    B, H = 2, 2
    L, S = (7, 5) if scenario == "causal_L_gt_S" else (5, 5)
    q, k, v = inputs(B, H, L, S, dtype=torch.float32, seed=8)
    empty = torch.zeros(B, L, dtype=torch.bool)
    if scenario == "no_real_keys":
        mask, causal = padding_mask([5, 0], S), False
        empty[1] = True
    elif scenario == "causal_left_padding":
        mask, causal = padding_mask([5, 3], S, left=True), True
        empty[1, :2] = True
    else:
        mask, causal = None, True
        empty[:, :2] = True
    if mask is not None:
        v = v.clone()
        v[(~mask.view(B, S)).view(B, 1, S, 1).expand_as(v)] = 1e3  # the row must not become their mean
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, attn_mask=mask, is_causal=causal)
    e = empty.view(B, 1, L, 1).expand_as(out)
    assert torch.isfinite(out).all()
    assert (out[e] == 0).all()
    ref, _ = softmax_reference(q, k, v, mask=mask, is_causal=causal)
    torch.testing.assert_close(out.detach().to(F64), ref, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("content", [1e30, math.nan])
def test_fully_masked_query_rows_with_garbage_content(content):
    """Padded query rows (fully masked) holding NaN/1e30 must not poison the gradients of real keys."""
    L, n = 5, 3
    q, k, v = inputs(1, 1, L, L, D=3, dtype=torch.float32, seed=9)
    q, k, v = q.clone(), k.clone(), v.clone()
    for t in (q, k, v):
        t[:, :, n:] = content
    real = torch.arange(L) < n
    mask = (real[:, None] & real[None, :]).view(1, 1, L, L)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = softmax_attention(q, k, v, attn_mask=mask)
    assert (out[:, :, n:] == 0).all()
    torch.testing.assert_close(out[:, :, :n], softmax_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n]))
    out[:, :, :n].sum().backward()
    assert torch.isfinite(q.grad[:, :, :n]).all()
    assert torch.isfinite(v.grad[:, :, :n]).all()
    assert torch.isfinite(k.grad[:, :, :n]).all(), "NaN gradient reaches real keys from a fully masked query row"


def test_batch_invariance_and_permutation():
    q, k, v = inputs(3, 2, 5, 5, dtype=torch.float32, seed=10)
    mask = padding_mask([5, 2, 4], 5)
    out = softmax_attention(q, k, v, attn_mask=mask)
    for b in range(3):
        torch.testing.assert_close(out[b:b + 1], softmax_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                                                    attn_mask=mask[b:b + 1]), atol=1e-6, rtol=1e-6)
    perm = torch.tensor([4, 2, 0, 1, 3])
    o = softmax_attention(q, k, v)
    torch.testing.assert_close(softmax_attention(q[:, :, perm], k[:, :, perm], v[:, :, perm]), o[:, :, perm])


def test_rows_stochastic_and_constant_values():
    q, k, _ = inputs(2, 2, 5, 6, seed=11, scale=3.0)
    v = torch.full((2, 2, 6, 3), 2.5, dtype=F64)
    mask = random_mask(2, 2, 5, 6, seed=4, empty_rows=[(0, 0, 0)])
    out, w = softmax_attention_reference(q, k, v, attn_mask=mask, return_weights=True)
    has = mask.any(-1)
    torch.testing.assert_close(w.sum(-1)[has], torch.ones_like(w.sum(-1)[has]))
    assert (w >= 0).all() and (w[~mask] == 0).all()
    fast = softmax_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(fast[has], torch.full_like(fast[has], 2.5))
    assert (fast[~has] == 0).all()


@pytest.mark.parametrize("fn", [softmax_attention, softmax_attention_reference])
def test_causal_future_does_not_leak(fn):
    q, k, v = inputs(1, 2, 8, 8, D=8, dtype=torch.float32, seed=12)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, :, 5] += 3
    k2[:, :, 5] -= 2
    v2[:, :, 5] += 5
    a, b = fn(q, k, v, is_causal=True), fn(q2, k2, v2, is_causal=True)
    assert torch.equal(a[:, :, :5], b[:, :, :5])
    assert (a[:, :, 5:] - b[:, :, 5:]).abs().max() > 1e-3


def test_half_inputs_computed_in_float32():
    """16-bit inputs: output in the input dtype, equal to the float32 computation on the same values."""
    q, k, v = inputs(1, 2, 6, 6, dtype=torch.bfloat16, seed=13, scale=5.0)
    out = softmax_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    ref = softmax_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
