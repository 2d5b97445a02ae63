"""Attention dropout inside the CPU kernel: forward and gradients equal the explicit float64 formula with the
kernel's own keep mask; the mask is a counter-based stream (seed, offset from torch's generator) that is
reproducible, thread-count independent and statistically sound; mgk_attention and softmax_attention use it."""
from __future__ import annotations

import math

import pytest
import torch

from mgk.functional import _mixture_flash, mgk_attention, softmax_attention

from .reference import assert_checkpoint_regenerates_dropout, causal_allowed, make_inputs, padding_mask

F64 = torch.float64

pytestmark = pytest.mark.skipif(not _mixture_flash.available(torch.zeros(1), 0.0),
                                reason=f"the C++ MGK kernel could not be built: {_mixture_flash.build_error()}")


def weights_formula(q, k, allowed, mixture="sum", log_pi=None, sigma2=None, scale=None):
    """Differentiable float64 attention weights (B, H, L, S) written from the formula (paper eq. 9-10, Hard-E with
    a max over components; softmax attention for ``scale`` with k (B, H, S, D)). Empty rows are 0."""
    if scale is not None:
        s = (q @ k.transpose(-1, -2)) * scale
    else:
        M, D = k.shape[2], q.shape[-1]
        s2 = torch.full((M,), math.sqrt(D), dtype=q.dtype) if sigma2 is None else sigma2
        d2 = ((q[:, :, :, None, None, :] - k[:, :, None]) ** 2).sum(-1)  # (B, H, L, M, S)
        g = -d2 / (2 * s2.view(M, 1))
        if mixture == "max":
            s = g.amax(3)
        else:
            lp = torch.full((M, 1), -math.log(M), dtype=q.dtype) if log_pi is None else log_pi[:, :, None]
            s = torch.logsumexp(g + lp, dim=3)
    s = s.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(s, dim=-1)
    return torch.where(allowed.any(-1, keepdim=True), w, torch.zeros((), dtype=w.dtype))


def drawn_mask(seed_state, B, H, L, S, p):
    """The keep mask a call made right after ``torch.manual_seed(seed_state)`` uses."""
    torch.manual_seed(seed_state)
    seed, offset = _mixture_flash.draw_dropout_seed()
    return _mixture_flash.dropout_mask(seed, offset, B, H, L, S, p)


# ---- the random stream -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_neighbour_independence_within_4_sigma(p):
    keep = _mixture_flash.dropout_mask(12345, 678, 2, 1, 100, 500, p)  # 1e5 draws
    n = keep.numel()
    rate = keep.double().mean().item()
    assert abs(rate - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n), rate
    # neighbouring keys and neighbouring queries are independent: P(both kept) = (1 - p)^2
    for pair in (keep[..., 1:] & keep[..., :-1], keep[:, :, 1:] & keep[:, :, :-1], keep[1] & keep[0]):
        q = (1 - p) ** 2
        assert abs(pair.double().mean().item() - q) < 4 * math.sqrt(q * (1 - q) / pair.numel())


def test_mask_depends_on_seed_offset_and_position_only():
    a = _mixture_flash.dropout_mask(1, 2, 2, 3, 40, 70, 0.3)
    assert torch.equal(a, _mixture_flash.dropout_mask(1, 2, 2, 3, 40, 70, 0.3))
    assert not torch.equal(a, _mixture_flash.dropout_mask(1, 3, 2, 3, 40, 70, 0.3))
    assert not torch.equal(a, _mixture_flash.dropout_mask(2, 2, 2, 3, 40, 70, 0.3))
    # rows are keyed by (b * H + h, i) and columns by j: a longer key axis extends each row
    assert torch.equal(a, _mixture_flash.dropout_mask(1, 2, 2, 3, 40, 90, 0.3)[..., :70])
    assert _mixture_flash.dropout_mask(1, 2, 1, 1, 4, 5, 0.0).all()


def test_generator_state_controls_the_draw_and_advances():
    torch.manual_seed(0)
    a, b = _mixture_flash.draw_dropout_seed(), _mixture_flash.draw_dropout_seed()
    assert a != b
    torch.manual_seed(0)
    assert _mixture_flash.draw_dropout_seed() == a
    state = torch.get_rng_state()
    c = _mixture_flash.draw_dropout_seed()
    torch.set_rng_state(state)  # what an exact resume restores
    assert _mixture_flash.draw_dropout_seed() == c


# ---- the kernel against the formula with its own mask -------------------------------------------------------------

KERNEL_CASES = [
    dict(M=1, causal=False, mixture="sum", L=130, S=600),
    dict(M=2, causal=False, mixture="sum", L=70, S=530),
    dict(M=2, causal=True, mixture="sum", L=140, S=140),
    dict(M=2, causal=True, mixture="sum", L=50, S=20),
    dict(M=3, causal=True, mixture="max", L=100, S=520),
    dict(M=2, causal=False, mixture="max", L=33, S=47),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("padding", [False, True])
def test_mgk_attention_with_dropout_equals_formula_with_kernel_mask(case, padding):
    B, H, L, S, M, D, Dv, p = 2, 2, case["L"], case["S"], case["M"], 8, 5, 0.3
    q, k, v = (t.to(F64).requires_grad_() for t in make_inputs(B=B, H=H, L=L, S=S, M=M, D=D, Dv=Dv, seed=3))
    mask = padding_mask([S, S // 3], S) if padding else None
    torch.manual_seed(11)
    out = mgk_attention(q, k, v, attn_mask=mask, is_causal=case["causal"], mixture=case["mixture"], dropout_p=p)
    keep = drawn_mask(11, B, H, L, S, p)
    allowed = torch.ones(B, H, L, S, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if case["causal"]:
        allowed = allowed & causal_allowed(L, S)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    w = weights_formula(qr, kr, allowed, case["mixture"])
    ref = (w * keep / (1 - p)) @ vr
    torch.testing.assert_close(out, ref, atol=1e-11, rtol=1e-10)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (qr, kr, vr), g)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=lambda m, n=name: f"grad of {n}: {m}")


def test_kernel_with_row_bias_and_dropout_gradcheck():
    """Unequal variances add a per-(query, component) bias; gradcheck with a fixed (seed, offset)."""
    g = torch.Generator().manual_seed(4)
    q, k, bias, v, rb = (torch.randn(*s, generator=g, dtype=F64).requires_grad_() for s in
                         [(1, 2, 6, 3), (1, 2, 2, 7, 3), (1, 2, 2, 7), (1, 2, 7, 2), (1, 2, 2, 6)])
    for causal in (False, True):
        for hard in (False, True):
            def fn(*t, causal=causal, hard=hard):
                return _mixture_flash.mixture_flash(*t, causal, hard, 0.4, seed=(5, 6))

            assert torch.autograd.gradcheck(fn, (q, k, bias, v, rb))


@pytest.mark.parametrize("causal,padding,L,S", [(False, False, 90, 600), (True, True, 130, 130),
                                                (True, False, 40, 25), (False, True, 9, 11)])
def test_softmax_attention_with_dropout_equals_formula_with_kernel_mask(causal, padding, L, S):
    B, H, D, Dv, p = 2, 3, 8, 4, 0.2
    q, k, v = (t.to(F64).requires_grad_() for t in make_inputs(B=B, H=H, L=L, S=S, M=1, D=D, Dv=Dv, seed=8))
    k1 = k[:, :, 0]
    mask = padding_mask([S, 0 if L < 20 else S // 2], S) if padding else None  # 0: a batch with no key at all
    torch.manual_seed(5)
    out = softmax_attention(q, k1, v, attn_mask=mask, is_causal=causal, dropout_p=p)
    keep = drawn_mask(5, B, H, L, S, p)
    allowed = torch.ones(B, H, L, S, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        allowed = allowed & causal_allowed(L, S)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k1, v))
    ref = (weights_formula(qr, kr, allowed, scale=1 / math.sqrt(D)) * keep / (1 - p)) @ vr
    torch.testing.assert_close(out, ref, atol=1e-11, rtol=1e-10)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (qr, kr, vr), g)):
        torch.testing.assert_close(a[:, :, 0] if a.dim() == 5 else a, b, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("kind", ["mgk", "mgk-max", "softmax"])
def test_dropout_runs_in_the_kernel_without_an_l_by_s_matrix(kind, monkeypatch):
    calls = []
    real = _mixture_flash.mixture_flash
    monkeypatch.setattr(_mixture_flash, "mixture_flash", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = make_inputs(B=1, H=2, L=64, S=64, M=2, D=8, seed=1)
    mask = padding_mask([50], 64)
    for causal in (False, True):
        if kind == "softmax":
            softmax_attention(q, k[:, :, 0], v, attn_mask=mask, is_causal=causal, dropout_p=0.1)
        else:
            mgk_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=0.1,
                          mixture="max" if kind == "mgk-max" else "sum")
    assert len(calls) == 2


# ---- statistics and reproducibility through the public functions ----------------------------------------------------

@pytest.mark.parametrize("kind", ["mgk", "softmax"])
def test_mean_over_draws_approaches_the_output_without_dropout(kind):
    """Each of n batch copies draws its own mask; the mean is within 5 standard errors of the no-dropout output."""
    q, k, v = make_inputs(B=1, H=2, L=6, S=40, M=2, D=4, Dv=3, dtype=F64, seed=6)
    call = ((lambda *t, **kw: softmax_attention(t[0], t[1][:, :, 0], t[2], **kw)) if kind == "softmax"
            else mgk_attention)
    base = call(q, k, v)
    n = 4000
    torch.manual_seed(0)
    rep = call(q.expand(n, -1, -1, -1), k.expand(n, -1, -1, -1, -1), v.expand(n, -1, -1, -1), dropout_p=0.3)
    err = (rep.mean(0) - base[0]).abs()
    se = rep.std(0) / math.sqrt(n)
    assert (err < 5 * se + 1e-12).all(), (err / se).max()
    assert (rep.std(0) > 0).all()


@pytest.mark.parametrize("kind", ["mgk", "mgk-max", "softmax"])
def test_same_seed_bitwise_same_output_and_gradients_new_state_differs(kind):
    q, k, v = (t.requires_grad_() for t in make_inputs(B=2, H=2, L=150, S=150, M=2, D=8, Dv=8, seed=2))

    def run(seed):
        torch.manual_seed(seed)
        if kind == "softmax":
            out = softmax_attention(q, k[:, :, 0], v, is_causal=True, dropout_p=0.1)
        else:
            out = mgk_attention(q, k, v, is_causal=True, dropout_p=0.1, mixture="max" if kind == "mgk-max" else "sum")
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    a, b, c = run(3), run(3), run(4)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("B,H,L,S,bitwise", [(2, 2, 256, 512, True), (1, 1, 90, 1500, False)])
def test_one_thread_and_two_threads(B, H, L, S, bitwise):
    """The mask never depends on the thread count. Where both counts use the same blocks (4 slices, 2 query blocks,
    one key block) results are bitwise equal; where the kernel splits work differently only rounding differs."""
    q, k, v = (t.requires_grad_() for t in make_inputs(B=B, H=H, L=L, S=S, M=2, D=8, Dv=8, seed=7,
                                                         dtype=torch.float32 if bitwise else F64))
    n = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.manual_seed(9)
            out = mgk_attention(q, k, v, is_causal=True, dropout_p=0.2)
            results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    finally:
        torch.set_num_threads(n)
    for x, y in zip(*results):
        if bitwise:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-11)


def test_activation_checkpointing_regenerates_the_same_mask():
    """torch.utils.checkpoint restores the generator state before recomputing, so the recomputed forward draws the
    same (seed, offset) and the gradients equal those without checkpointing."""
    q, k, v = (t.requires_grad_() for t in make_inputs(B=1, H=2, L=80, S=80, M=2, D=8, Dv=8, seed=12, dtype=F64))
    assert_checkpoint_regenerates_dropout(
        lambda q, k, v: mgk_attention(q, k, v, is_causal=True, dropout_p=0.25), q, k, v)


def test_invalid_or_full_dropout_leaves_the_kernel():
    q, k, v = make_inputs(B=1, H=1, L=4, S=4, M=2, D=4, seed=0)
    assert not _mixture_flash.usable(q, v, 1.0)
    torch.testing.assert_close(mgk_attention(q, k, v, dropout_p=1.0), torch.zeros(1, 1, 4, 3))
