"""torch.autograd.gradcheck in float64 at tiny shapes (B=1, H=1, L=3, S=3, D=2) on every MGK backend and mixture
and for softmax attention, including a query equal to a key (zero distance) and rows that see no key."""
from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from mgk.functional import mgk_attention, softmax_attention, softmax_attention_reference

from .reference import skip_if_refused

F64 = torch.float64


def tiny(M=2, seed=0, coincide=False, L=3, S=3, D=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, L, D, generator=g, dtype=F64)
    k = torch.randn(1, 1, M, S, D, generator=g, dtype=F64)
    v = torch.randn(1, 1, S, 2, generator=g, dtype=F64)
    if coincide:  # one query equals one key (zero distance)
        k[0, 0, 0, 1] = q[0, 0, 2]
    return q, k, v


MASKS = {
    "none": (None, False),
    "causal": (None, True),
    "empty_row": (torch.tensor([[False, False, False], [True, False, True], [True, True, True]]).view(1, 1, 3, 3),
                  False),
    "causal_left_pad": (torch.tensor([False, True, True]).view(1, 1, 1, 3), True),  # row 0 sees only padding
}


def _mgk_fn(mask, causal, with_pi, sig, **options):
    """``(q, k, v, [log_pi], [sigma2]) -> mgk_attention(...)`` with ``options`` (backend, mixture, return_weights)."""
    def fn(q, k, v, *rest):
        kw = dict(attn_mask=mask, is_causal=causal, **options)
        if sig is not None:
            kw["sigma2"] = rest[-1] if isinstance(sig, str) else sig
        if with_pi:
            kw["log_pi"] = rest[0]
        return mgk_attention(q, k, v, **kw)
    return fn


_SIGS = ["default", "unequal", "unequal_grad", "equal_grad"]
# every (mask, variance kind) pair on every backend, with the coincidence of a query and a key rotated over them
CASES = [(m, (j + s) % 2 == 0, sig) for j, m in enumerate(MASKS) for s, sig in enumerate(_SIGS)]
# a few cases in gradcheck's full (slow, element-wise) mode; the rest in fast_mode (random projections)
FULL = [("empty_row", True, "unequal_grad"), ("causal_left_pad", True, "unequal_grad"), ("empty_row", True, "unequal")]


def _mgk_case(mask_kind, coincide, sig_kind, mixture="sum", **options):
    M = 2
    q, k, v = tiny(M=M, seed=1, coincide=coincide)
    mask, causal = MASKS[mask_kind]
    with_pi = mixture == "sum"
    sig = {"default": None, "unequal": torch.tensor([0.7, 1.9], dtype=F64), "unequal_grad": "grad",
           "equal_grad": "grad"}[sig_kind]
    args = [q, k, v]
    if with_pi:
        args.append(torch.log_softmax(torch.randn(1, M, 3, dtype=F64, generator=torch.Generator().manual_seed(2)),
                                      dim=1))
    if sig_kind == "unequal_grad":
        args.append(torch.tensor([0.7, 1.9], dtype=F64))
    if sig_kind == "equal_grad":  # equal variances take the two-column fast path; the gradient must still be right
        args.append(torch.tensor([1.3, 1.3], dtype=F64))
    args = tuple(a.clone().requires_grad_(True) for a in args)
    return _mgk_fn(mask, causal, with_pi, sig, mixture=mixture, **options), args


@pytest.mark.parametrize("mask_kind,coincide,sig_kind", CASES + [c for c in FULL if c not in CASES])
@pytest.mark.parametrize("mixture", ["sum", "max"])
def test_gradcheck_mgk(backend, mixture, mask_kind, coincide, sig_kind):
    skip_if_refused(backend, mixture=mixture, mask=MASKS[mask_kind][0])
    fn, args = _mgk_case(mask_kind, coincide, sig_kind, mixture=mixture, backend=backend)
    full = (mask_kind, coincide, sig_kind) in FULL
    assert gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=not full)


@pytest.mark.parametrize("mask_kind", list(MASKS))
def test_gradcheck_mgk_weights(mask_kind):
    """Output and the (B, H, L, S) weights together (return_weights=True, served by backend="explicit")."""
    fn, args = _mgk_case(mask_kind, mask_kind != "causal", "unequal_grad", return_weights=True)
    assert gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=mask_kind != "causal")


@pytest.mark.parametrize("M", [1, 3])
def test_gradcheck_mgk_component_counts(M, backend):
    q, k, v = tiny(M=M, seed=3, coincide=True)
    lp = torch.log_softmax(torch.randn(1, M, 1, dtype=F64), dim=1)  # per head
    args = tuple(a.clone().requires_grad_(True) for a in (q, k, v, lp))
    fn = _mgk_fn(None, True, True, None, backend=backend)
    assert gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


def test_gradcheck_q_is_k_exactly():
    """Every query coincides with its own key (q is k): gradients stay correct through the zero distances."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 1, 3, 2, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(1, 1, 3, 2, generator=g, dtype=F64, requires_grad=True)

    def fn(x, v):
        return mgk_attention(x, x.unsqueeze(2), v, sigma2=0.5), mgk_attention(x, x.unsqueeze(2), v, backend="explicit",
                                                                               sigma2=0.5)
    assert gradcheck(fn, (x, v), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fn", [softmax_attention, softmax_attention_reference])
@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("LS", [(3, 3), (2, 3), (3, 2)])
def test_gradcheck_softmax(fn, mask_kind, LS):
    full = LS == (3, 3) and mask_kind in ("empty_row", "causal_left_pad")
    L, S = LS
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, L, 2, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(1, 1, S, 2, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(1, 1, S, 2, generator=g, dtype=F64, requires_grad=True)
    mask, causal = MASKS[mask_kind]
    if mask is not None and (L, S) != (3, 3):
        mask = mask[..., :L, :S] if mask.shape[-2] > 1 else mask[..., :S]
    assert gradcheck(lambda q, k, v: fn(q, k, v, attn_mask=mask, is_causal=causal), (q, k, v),
                     eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=not full)


@pytest.mark.parametrize("mixture", ["sum", "max"])
def test_fully_masked_row_gradient_is_zero_not_nan(backend, mixture):
    """The gradient through a fully masked row is exactly zero for every input (the row is a constant 0)."""
    q, k, v = tiny(M=2, seed=6)
    mask = MASKS["empty_row"][0]
    skip_if_refused(backend, mixture=mixture, mask=mask)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = _mgk_fn(mask, False, False, None, backend=backend, mixture=mixture)(qq, kk, vv)
    out[:, :, 0].sum().backward()
    for t in (qq, kk, vv):
        assert torch.isfinite(t.grad).all() and (t.grad == 0).all()


def test_log_pi_gradient_flows_from_boundary(backend):
    """A prior at the boundary, pi = (1, 0) (log pi_2 = -inf or very negative), must still be a usable input (a
    clamp there would freeze the parameter): with a normalised softmax parameterisation the logits receive a
    non-zero finite gradient."""
    q, k, v = tiny(M=2, seed=7)
    k[0, 0, 1] = q[0, 0].mean(0) + 0.01 * k[0, 0, 1]  # component 2 aligned with the queries
    logits = torch.tensor([[[8.0], [-8.0]]], dtype=F64, requires_grad=True)  # pi ~ (1, 0)
    out = _mgk_fn(None, False, True, None, backend=backend)(q, k, v, torch.log_softmax(logits, dim=1))
    (out * torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(0))).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().max() > 0


@pytest.mark.parametrize("M", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_sigma2_gradient_with_equal_variances(backend, M, causal):
    """Learnable per-component variances that happen to be equal (e.g. both initialised at sqrt(D)): every backend
    must give the d out / d sigma2_r of central differences. The |q|^2 / (2 sigma_r^2) term is row-constant in value
    when the sigma_r agree, but its derivative w.r.t. one sigma_r is not."""
    q, k, v = tiny(M=M, seed=8)
    w = torch.randn(1, 1, 3, 2, dtype=F64, generator=torch.Generator().manual_seed(9))
    s2 = torch.full((M,), 1.3, dtype=F64, requires_grad=True)
    (mgk_attention(q, k, v, sigma2=s2, is_causal=causal, backend=backend) * w).sum().backward()
    num = torch.zeros(M, dtype=F64)
    for r in range(M):
        d = torch.zeros(M, dtype=F64)
        d[r] = 1e-6
        f = [(mgk_attention(q, k, v, sigma2=torch.full((M,), 1.3, dtype=F64) + sgn * d, is_causal=causal,
                            backend="explicit") * w).sum() for sgn in (1, -1)]
        num[r] = (f[0] - f[1]) / 2e-6
    torch.testing.assert_close(s2.grad, num, atol=1e-6, rtol=1e-5)
