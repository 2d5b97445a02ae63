"""An additive score bias (``bias=``: ALiBi, relative positions, a module's float mask) is one argument of the
functional core, served by the selector's backends with the same centring as every other call: each backend equals
the float64 formula with the bias (MGK: key j's mixture weight times exp(b_ij); softmax: logits plus b), also with
a shared q/k offset of 1000; -inf entries act as the bool mask; the bias is differentiable; bad biases are refused
by name; a float ``attn_mask`` is still never read as a bias."""
from __future__ import annotations

import math

import pytest
import torch

from mgk.functional import (
    BackendError,
    MaskError,
    mgk_attention,
    select_backend,
    softmax_attention,
    softmax_attention_reference,
)
from mgk.functional.softmax import SOFTMAX_BACKENDS, select_softmax_backend

from .reference import (
    make_inputs,
    mgk_reference,
    padding_mask,
    refusal,
    skip_if_refused,
    softmax_reference,
    tol64,
)

F64 = torch.float64
B, H, L, M, D = 2, 2, 7, 2, 4


def _alibi(L, S, slope=0.5):
    """ALiBi-like (L, S): -slope * (distance to the key), finite and non-zero."""
    i, j = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
    return -slope * (i + (S - L) - j).abs().to(F64) - 0.25


def _biases(seed=0):
    g = torch.Generator().manual_seed(seed)
    slopes = torch.tensor([1.0, 0.5], dtype=F64).view(1, H, 1, 1)  # one ALiBi slope per head
    return {
        "key": torch.randn(B, 1, 1, L, generator=g, dtype=F64),  # per key (and batch): the kernels take it
        "alibi": _alibi(L, L).view(1, 1, L, L) * slopes,
        "full": torch.randn(B, H, L, L, generator=g, dtype=F64),
    }


@pytest.mark.parametrize("kind", ["key", "alibi", "full"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mixture", ["sum", "max"])
def test_each_backend_adds_the_bias_to_each_keys_logit(backend, kind, causal, mixture, assert_close):
    bias = _biases()[kind]
    skip_if_refused(backend, bias=bias, mixture=mixture)
    q, k, v = make_inputs(B=B, H=H, L=L, S=L, M=M, D=D, dtype=F64, seed=1)
    mask = padding_mask([L, 5], L, left=causal)
    lp = None if mixture == "max" else torch.log_softmax(torch.randn(1, H, M, L, dtype=F64), dim=2)
    ref, _ = mgk_reference(q, k, v, log_pi=lp, mixture=mixture, mask=mask, is_causal=causal, bias=bias)
    got = mgk_attention(q, k, v, log_pi=lp, mixture=mixture, attn_mask=mask, bias=bias, is_causal=causal,
                        backend=backend)
    assert_close(f"{backend} {kind}", ref, got, **tol64(backend))
    got32 = mgk_attention(q.float(), k.float(), v.float(), log_pi=None if lp is None else lp.float(),
                          mixture=mixture, attn_mask=mask, bias=bias.float(), is_causal=causal, backend=backend)
    assert_close(f"{backend} {kind} float32", ref, got32, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["key", "alibi", "full"])
def test_a_shared_offset_of_1000_keeps_the_bias_path_within_1e5(backend, kind, assert_close):
    """The bias path is centred like every other call (a separate uncentred formula gave 3e-3 here)."""
    bias = _biases(3)[kind].float()
    skip_if_refused(backend, bias=bias)
    q, k, v = make_inputs(B=B, H=H, L=L, S=L, M=M, D=8, dtype=torch.float32, seed=2)
    c = torch.randn(8)
    c = c / c.norm() * 1000
    q, k = q + c, k + c
    for causal in (False, True):
        ref, _ = mgk_reference(q.double(), k.double(), v.double(), bias=bias, is_causal=causal, log_space=True)
        got = mgk_attention(q, k, v, bias=bias, is_causal=causal, backend=backend)
        assert_close(f"{backend} {kind} causal={causal}", ref, got, atol=1e-5, rtol=0)


def test_minus_inf_in_the_bias_is_the_bool_mask(backend, assert_close):
    q, k, v = make_inputs(B=B, H=H, L=L, S=L, M=M, D=D, dtype=F64, seed=4)
    keep = padding_mask([L, 4], L)
    bias = torch.zeros(B, 1, 1, L, dtype=F64).masked_fill(~keep, float("-inf"))
    assert_close(backend, mgk_attention(q, k, v, attn_mask=keep, backend=backend),
                 mgk_attention(q, k, v, bias=bias, backend=backend), atol=1e-12, rtol=0)
    everything = torch.full((B, 1, 1, L), float("-inf"), dtype=F64)
    assert (mgk_attention(q, k, v, bias=everything, backend=backend) == 0).all()  # rows with no key are zero


@pytest.mark.parametrize("kind", ["key", "full"])
def test_the_bias_is_differentiable(backend, kind):
    bias = _biases(5)[kind][:1, :1, :3, :3].clone()
    if kind == "key":
        bias = bias[..., :1, :]
    skip_if_refused(backend, bias=bias)
    q, k, v = make_inputs(B=1, H=1, L=3, S=3, M=2, D=2, dtype=F64, seed=5)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    if backend != "triton":  # float32 inside: no float64 finite differences
        assert torch.autograd.gradcheck(
            lambda q, k, v, b: mgk_attention(q, k, v, bias=b, is_causal=True, backend=backend), ins, atol=1e-6)
    grads = torch.autograd.grad(mgk_attention(*ins[:3], bias=ins[3], backend=backend).square().sum(), ins)
    ref_ins = [t.detach().clone().requires_grad_(True) for t in ins]
    ref, _ = mgk_reference(*ref_ins[:3], bias=ref_ins[3], grad=True, log_space=True)
    tol = dict(atol=1e-4, rtol=1e-4) if backend == "triton" else dict(atol=1e-9, rtol=1e-7)
    for a, b in zip(grads, torch.autograd.grad(ref.square().sum(), ref_ins)):
        torch.testing.assert_close(a, b, **tol)


def test_the_selector_serves_key_biases_in_the_kernels_and_query_biases_through_sdpa():
    q, k, v = make_inputs(B=B, H=H, L=L, S=L, M=M, D=D, seed=6)
    key, full = _biases()["key"].float(), _biases()["full"].float()
    assert select_backend(q, k, v, bias=key) == select_backend(q, k, v)
    assert select_backend(q, k, v, bias=full) == "sdpa"
    assert select_backend(q, k, v, bias=full, mixture="max") == "explicit"
    for name in ("kernel", "triton"):
        assert "depends on the query" in refusal(name, bias=full)
    with pytest.raises(BackendError, match="bias depends on the query"):
        mgk_attention(q, k, v, bias=full, backend="kernel")


def test_bad_biases_are_refused_by_name():
    q, k, v = make_inputs(B=B, H=H, L=L, S=L, M=M, D=D, seed=7)
    for bad in (torch.zeros(B, H, L, L + 1), torch.zeros(3, 1, 1, L), torch.zeros(L, L, dtype=torch.int64),
                torch.full((L, L), float("nan")), torch.full((L, L), float("inf")), "alibi"):
        for f in (lambda b: mgk_attention(q, k, v, bias=b), lambda b: select_backend(q, k, v, bias=b),
                  lambda b: softmax_attention(q, k[:, :, 0], v, bias=b),
                  lambda b: softmax_attention_reference(q, k[:, :, 0], v, bias=b)):
            with pytest.raises(ValueError, match="bias"):
                f(bad)
    with pytest.raises(MaskError, match="bool"):  # a float mask is never read as a bias
        mgk_attention(q, k, v, attn_mask=torch.ones(L, L))


@pytest.mark.parametrize("name", SOFTMAX_BACKENDS)
@pytest.mark.parametrize("kind", ["key", "alibi", "full"])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_attention_adds_the_bias_to_the_logits(name, kind, causal, assert_close):
    bias = _biases(8)[kind]
    q, k, v = make_inputs(B=B, H=H, L=L, S=L, M=1, D=D, dtype=F64, seed=8)
    k = k[:, :, 0]
    mask = padding_mask([L, 5], L, left=causal)
    ref, _ = softmax_reference(q, k, v, mask=mask, is_causal=causal, bias=bias)
    try:
        got = softmax_attention(q, k, v, attn_mask=mask, bias=bias, is_causal=causal, backend=name)
    except BackendError as e:
        assert name == "kernel" and kind != "key", e
        return
    assert_close(f"softmax {name} {kind}", ref, got, atol=1e-10, rtol=1e-9)


def test_softmax_selector_takes_the_kernel_with_dropout_and_a_key_bias_only():
    q, k, v = make_inputs(B=B, H=H, L=L, S=L, M=1, D=D, seed=9)
    k = k[:, :, 0]
    key, full = _biases()["key"].float(), _biases()["full"].float()
    assert select_softmax_backend(q, k, v, bias=key, dropout_p=0.1) == "kernel"
    assert select_softmax_backend(q, k, v, bias=full, dropout_p=0.1) == "sdpa"
    torch.manual_seed(0)
    out = softmax_attention(q, k, v, bias=key, dropout_p=0.5)
    assert torch.isfinite(out).all()


def test_softmax_bias_gradient_matches_the_reference():
    q, k, v = make_inputs(B=1, H=2, L=4, S=4, M=1, D=3, dtype=F64, seed=10)
    bias = torch.randn(1, 2, 4, 4, dtype=F64, requires_grad=True)
    for name in SOFTMAX_BACKENDS:
        if name == "kernel":
            continue  # a query-dependent bias: refused by the kernel
        g, = torch.autograd.grad(softmax_attention(q, k[:, :, 0], v, bias=bias, backend=name).sum(), bias)
        scores = q @ k[:, :, 0].transpose(-1, -2) / math.sqrt(3) + bias
        g_ref, = torch.autograd.grad((torch.softmax(scores, -1) @ v).sum(), bias)
        torch.testing.assert_close(g, g_ref, atol=1e-10, rtol=1e-9)
