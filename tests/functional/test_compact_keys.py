"""mgk_attention of compact keys: G key groups shared by H query heads (gMGK) and sMGK's one unshifted key with its
shifts, which the C++ kernel reads in place (one score product for the M shifted components, no key or value
repeated for the query heads), equal the same call on the keys repeated for every query head and component, forward
and every gradient (the variances' and the shifts' included), on every backend, with padding, causality and Hard-E."""
from __future__ import annotations

import pytest
import torch

from mgk.functional import _mixture_flash, mgk_attention
from mgk.functional._mixture_terms import shifted_keys

from .reference import mgk_reference

F64 = torch.float64


def _inputs(B=2, H=6, G=2, M=2, L=21, S=21, D=8, Dv=5, shifted=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=F64) + 1.5
    k = torch.randn(B, G, *(() if shifted else (M,)), S, D, generator=g, dtype=F64) + 1.5
    v = torch.randn(B, G, S, Dv, generator=g, dtype=F64)
    shifts = torch.cat([torch.zeros(1, G, D, dtype=F64), 0.4 * torch.randn(M - 1, G, D, generator=g, dtype=F64)])
    sigma2 = torch.linspace(0.8, 2.0, G * M, dtype=F64).reshape(G, M)
    log_pi = torch.log_softmax(torch.randn(1, G, M, 1, generator=g, dtype=F64), dim=2)
    return q, k, v, (shifts if shifted else None), sigma2, log_pi


def _expanded(k, v, shifts, sigma2, log_pi, R):
    """The same keys repeated for every query head and component (what the other backends read)."""
    k = k if shifts is None else shifted_keys(k, shifts)
    return (k.repeat_interleave(R, 1), v.repeat_interleave(R, 1), sigma2.repeat_interleave(R, 0),
            log_pi.repeat_interleave(R, 1))


@pytest.mark.parametrize("backend", ["kernel", "explicit", "sdpa"])
@pytest.mark.parametrize("G", [2, 6], ids=["groups", "per_head"])
@pytest.mark.parametrize("shifted", [True, False], ids=["shifted", "separate"])
@pytest.mark.parametrize("mixture", ["sum", "max"])
def test_compact_keys_equal_the_repeated_keys_forward_and_backward(backend, G, shifted, mixture):
    if backend == "kernel" and _mixture_flash._load() is None:
        pytest.skip("the CPU kernel could not be built here")
    if backend == "sdpa" and mixture == "max":
        pytest.skip("Hard-E has no dot-product form")
    if not shifted and G == 6:
        pytest.skip("separate keys with one group per head are the plain call")
    q, k, v, shifts, sigma2, log_pi = _inputs(G=G, shifted=shifted)
    mask = torch.ones(2, 1, 1, 21, dtype=torch.bool)
    mask[1, ..., :4] = False  # left padding in one row
    leaves = [t.requires_grad_() for t in (q, k, v, sigma2, *(() if shifts is None else (shifts,)))]
    lp = None if mixture == "max" else log_pi
    got = mgk_attention(q, k, v, log_pi=lp, sigma2=sigma2, mixture=mixture, attn_mask=mask, is_causal=True,
                        shifts=shifts, backend=backend)
    ke, ve, s2e, lpe = _expanded(k, v, shifts, sigma2, log_pi, 6 // G)
    want = mgk_attention(q, ke, ve, log_pi=None if lp is None else lpe, sigma2=s2e, mixture=mixture, attn_mask=mask,
                         is_causal=True, backend=backend)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    w = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad((got * w).sum(), leaves), torch.autograd.grad((want * w).sum(), leaves)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
    if mixture == "sum":  # and the float64 formula itself
        ref, _ = mgk_reference(q.detach(), ke.detach(), ve.detach(), log_pi=lpe, sigma2=s2e.detach(),
                               mask=mask, is_causal=True, log_space=True)
        torch.testing.assert_close(got.detach(), ref, atol=1e-10, rtol=1e-10)


def test_compact_keys_are_checked_in_one_line_naming_the_argument():
    q, k, v, shifts, sigma2, log_pi = _inputs()
    cases = [(dict(shifts=shifts[:, :1]), "shifts must be a floating tensor"),
             (dict(k=k[:, :, :5]), "key length S"),
             (dict(log_pi=log_pi.repeat(1, 2, 1, 1)), "log_pi of shape"),
             (dict(q=q[:, :5]), "number of heads")]
    for change, match in cases:
        args = dict(q=q, k=k, v=v, shifts=shifts, log_pi=log_pi)
        args.update(change)
        with pytest.raises(ValueError, match=match) as info:
            mgk_attention(args["q"], args["k"], args["v"], log_pi=args["log_pi"], sigma2=sigma2,
                          shifts=args["shifts"])
        assert "\n" not in str(info.value)
