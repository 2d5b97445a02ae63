"""A mixture component switched off with log_pi = -inf contributes exactly nothing, in value and gradient, on every
backend, however far the live components are (a floor of -1e4 added to a log-kernel let the dead component win
once every live one was more than 1e4 nats away); a key whose components are all off is a masked key; the Soft-E
statistics and MLK treat them the same way."""
from __future__ import annotations

import math

import pytest
import torch

from mgk.functional import mgk_attention, mgk_responsibilities, mlk_attention

from .reference import make_inputs, mgk_reference, padding_mask, responsibilities_reference, tol64

F64 = torch.float64
INF = float("inf")


def _constructed(dtype=torch.float32):
    """q = 0, D = 2, M = 2, S = 2; key 0: live component at (5, 5), dead one at 0; key 1: live at (sqrt(30), 0),
    dead at (100, 100); values (1, 2); sigma2 = 1e-3. By the definition key 1 (closer live component) takes the
    weight: the output is 2."""
    q = torch.zeros(1, 1, 1, 2, dtype=dtype)
    k = torch.zeros(1, 1, 2, 2, 2, dtype=dtype)
    k[0, 0, 0, 0] = torch.tensor([5.0, 5.0])
    k[0, 0, 0, 1] = torch.tensor([math.sqrt(30.0), 0.0])
    k[0, 0, 1, 1] = torch.tensor([100.0, 100.0])
    log_pi = torch.tensor([0.0, -INF], dtype=dtype).view(1, 1, 2, 1).expand(1, 1, 2, 2).contiguous()
    v = torch.tensor([1.0, 2.0], dtype=dtype).view(1, 1, 2, 1)
    return q, k, v, log_pi


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_dead_component_at_the_query_does_not_take_the_weight(backend, dtype):
    q, k, v, log_pi = _constructed(dtype)
    q, k, v, log_pi = (t.clone().requires_grad_(True) for t in (q, k, v, log_pi))
    out = mgk_attention(q, k, v, log_pi=log_pi, sigma2=1e-3, backend=backend)
    assert out.item() == pytest.approx(2.0, abs=1e-6)
    out.sum().backward()
    for t in (q, k, v, log_pi):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(k.grad[0, 0, 1], torch.zeros_like(k.grad[0, 0, 1]))  # the dead components: no gradient
    assert torch.equal(log_pi.grad[0, 0, 1], torch.zeros_like(log_pi.grad[0, 0, 1]))
    torch.testing.assert_close(v.grad.view(2), torch.tensor([0.0, 1.0], dtype=dtype))


def _random_dead(seed, B=2, H=2, M=3, S=7):
    """log pi (B, H, M, S) with about a third of the components switched off, key 2 entirely off."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(B, H, M, S, generator=g, dtype=F64), dim=2)
    lp = lp.masked_fill(torch.rand(B, H, M, S, generator=g) < 0.35, -INF)
    lp[:, :, :, 2] = -INF
    lp[:, :, 0, 4] = 0.0  # keep at least one live component on key 4
    return lp


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sigma2", [None, 1e-2])
def test_dead_components_contribute_nothing_and_dead_keys_are_masked(backend, causal, sigma2, assert_close):
    q, k, v = make_inputs(B=2, H=2, L=7, S=7, M=3, D=4, dtype=F64, seed=3, scale=3.0)
    lp = _random_dead(3)
    live = torch.isfinite(lp).any(dim=2).unsqueeze(2)  # (B, H, 1, S): keys with a live component
    ref, _ = mgk_reference(q, k, v, log_pi=lp, sigma2=sigma2, mask=live, is_causal=causal, log_space=True)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, lp)]
    got = mgk_attention(*ins[:3], log_pi=ins[3], sigma2=sigma2, is_causal=causal, backend=backend)
    assert_close(backend, ref, got, **tol64(backend))
    got.square().sum().backward()
    for t in ins:
        assert torch.isfinite(t.grad).all()
    dead = ~torch.isfinite(lp)
    assert (ins[1].grad[dead] == 0).all() and (ins[3].grad[dead] == 0).all()
    assert (ins[2].grad[:, :, 2] == 0).all()  # a key with every component off: its value gets no gradient
    got32 = mgk_attention(q.float(), k.float(), v.float(), log_pi=lp.float(), sigma2=sigma2, is_causal=causal,
                          backend=backend)
    assert_close(f"{backend} float32", ref, got32, atol=1e-5, rtol=1e-5)


def test_a_row_whose_every_key_is_switched_off_is_zero(backend):
    q, k, v = make_inputs(B=1, H=1, L=3, S=4, M=2, D=4, dtype=F64, seed=4)
    lp = torch.full((1, 1, 2, 4), -INF, dtype=F64, requires_grad=True)
    q.requires_grad_(True)
    out = mgk_attention(q, k, v, log_pi=lp, backend=backend)
    assert (out == 0).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(lp.grad).all()


def test_a_head_whose_every_component_is_off_gives_zero_rows(backend, assert_close):
    """One prior for every key position (the paper's per-head pi): switching a head off zeroes its rows only."""
    q, k, v = make_inputs(B=2, H=2, L=5, S=5, M=2, D=4, dtype=F64, seed=7)
    lp = torch.log(torch.tensor([[0.3, 0.7], [0.6, 0.4]], dtype=F64)).view(1, 2, 2, 1)
    lp[0, 0] = -INF
    lp.requires_grad_(True)
    qg = q.clone().requires_grad_(True)
    for causal in (False, True):
        out = mgk_attention(qg, k, v, log_pi=lp, is_causal=causal, backend=backend)
        assert (out[:, 0] == 0).all()
        ref, _ = mgk_reference(q, k, v, log_pi=lp.detach(), is_causal=causal)
        assert_close(backend, ref[:, 1], out[:, 1], **tol64(backend))
        out.sum().backward()
        assert torch.isfinite(lp.grad).all() and torch.isfinite(qg.grad).all() and (qg.grad[:, 0] == 0).all()


@pytest.mark.parametrize("name", ["kernel", "explicit"])
def test_soft_e_statistics_give_dead_components_no_responsibility_and_dead_keys_no_count(name, assert_close):
    q, k, _ = make_inputs(B=2, H=2, L=7, S=7, M=3, D=4, dtype=F64, seed=5)
    lp = _random_dead(5)
    mask = padding_mask([7, 5], 7)
    live = torch.isfinite(lp).any(dim=2).unsqueeze(2)
    resp, count = mgk_responsibilities(q, k, log_pi=lp, attn_mask=mask, is_causal=True, backend=name)
    ref, ref_count = responsibilities_reference(q, k, log_pi=lp, mask=mask & live, is_causal=True)
    assert torch.isfinite(resp).all()
    assert torch.equal(count, ref_count) and (count[:, 2] == 0).all()
    dead_everywhere = (~torch.isfinite(lp)).all(dim=0)  # (H, M, S): off in every batch element
    assert (resp[dead_everywhere] == 0).all()
    assert_close(name, ref, resp, atol=1e-10, rtol=1e-9)


def test_mlk_with_a_component_switched_off_is_linear_attention_on_the_other(assert_close):
    q, k, v = make_inputs(B=1, H=2, L=6, S=6, M=2, D=4, dtype=F64, seed=6)
    lp = torch.tensor([0.0, -INF], dtype=F64).view(1, 1, 2, 1)
    for causal in (False, True):
        assert_close("mlk", mlk_attention(q, k[:, :, :1], v, is_causal=causal),
                     mlk_attention(q, k, v, log_pi=lp, is_causal=causal), atol=1e-12, rtol=0)
