"""Dropout on attention weights, in softmax attention and on every MGK backend and mixture: finite, reproducible
with a seed, unbiased in expectation (the 1/(1-p) rescale), causal (a changed future token leaves earlier outputs
bitwise equal under the same seed), and rows that see no key stay exactly zero."""
from __future__ import annotations

from functools import partial

import pytest
import torch

from mgk.functional import mgk_attention, softmax_attention

from .reference import make_inputs, padding_mask, skip_if_refused


def _softmax(q, k, v, **kw):
    """Softmax attention on the first key component."""
    return softmax_attention(q, k[:, :, 0], v, **kw)


def seeded_finite_and_active(call):
    q, k, v = make_inputs(B=2, H=2, L=6, S=6, M=2, D=4, seed=0)
    mask = padding_mask([6, 3], 6)
    torch.manual_seed(123)
    a = call(q, k, v, attn_mask=mask, dropout_p=0.3)
    torch.manual_seed(123)
    b = call(q, k, v, attn_mask=mask, dropout_p=0.3)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)
    base = call(q, k, v, attn_mask=mask)
    assert (a - base).abs().max() > 1e-3  # dropout is applied


def expectation(call):
    """Average over 1000 independent dropout draws (one batch of 1000 copies) approaches the no-dropout output."""
    q, k, v = make_inputs(B=1, H=2, L=4, S=4, M=2, D=4, seed=1)
    base = call(q, k, v, is_causal=True)
    n = 1000
    torch.manual_seed(0)
    rep = call(q.expand(n, -1, -1, -1), k.expand(n, -1, -1, -1, -1), v.expand(n, -1, -1, -1),
               is_causal=True, dropout_p=0.2)
    assert torch.isfinite(rep).all()
    assert (rep[0] != rep[1]).any()  # the copies really are independent draws
    mean = rep.mean(0, keepdim=True)
    err = (mean - base).abs().max()
    assert err < 0.08, f"mean of dropout outputs deviates from the no-dropout output by {err}"
    # a biased implementation (no 1/(1-p) rescale) would be off by ~p * |out|: check that is detectable here
    assert (0.8 * base - base).abs().max() > 0.08


def causal_no_leak(call):
    """With a seed reset before each call, outputs before the changed token are bitwise identical."""
    q, k, v = make_inputs(B=1, H=2, L=8, S=8, M=2, D=8, seed=2)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, :, 5] += 1.0
    k2[:, :, :, 5] -= 1.0
    v2[:, :, 5] += 2.0
    torch.manual_seed(7)
    a = call(q, k, v, is_causal=True, dropout_p=0.1)
    torch.manual_seed(7)
    b = call(q2, k2, v2, is_causal=True, dropout_p=0.1)
    assert torch.equal(a[:, :, :5], b[:, :, :5])
    assert (a[:, :, 5:] - b[:, :, 5:]).abs().max() > 1e-4


def fully_masked_rows_stay_zero(call):
    q, k, v = make_inputs(B=2, H=1, L=4, S=4, M=2, D=4, seed=3)
    torch.manual_seed(0)
    out = call(q, k, v, attn_mask=padding_mask([4, 0], 4), dropout_p=0.5)
    assert torch.isfinite(out).all() and (out[1] == 0).all()


CHECKS = pytest.mark.parametrize("check", [seeded_finite_and_active, expectation, causal_no_leak,
                                           fully_masked_rows_stay_zero], ids=lambda f: f.__name__)


@CHECKS
@pytest.mark.parametrize("mixture", ["sum", "max"])
def test_mgk_dropout(check, backend, mixture):
    skip_if_refused(backend, mixture=mixture, dropout_p=0.5)
    check(partial(mgk_attention, backend=backend, mixture=mixture))


@CHECKS
def test_softmax_dropout(check):
    check(_softmax)
