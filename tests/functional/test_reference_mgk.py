"""mgk_attention on every backend (and its weights, backend="explicit" with return_weights=True) against the
literal float64 reference of the paper's eq. 9-10."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mgk.functional import BackendError, mgk_attention

from .reference import (
    make_inputs,
    mgk_reference,
    normalised_log_pi,
    padding_mask,
    random_mask,
    refusal,
    skip_if_refused,
)

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-9), torch.float32: dict(atol=1e-5, rtol=1e-5)}


def check(backend, q, k, v, dtype, ref_kw=None, **kw):
    """``backend``'s output, and on "explicit" also the returned weights, equal the reference to TOL[dtype]."""
    ref_kw = dict(kw) if ref_kw is None else ref_kw
    skip_if_refused(backend, mixture=kw.get("mixture", "sum"), mask=kw.get("attn_mask"))
    ref_out, ref_w = mgk_reference(q, k, v, **ref_kw)
    out = mgk_attention(q, k, v, backend=backend, **kw)
    assert out.dtype == q.dtype
    assert out.shape == ref_out.shape
    torch.testing.assert_close(out.to(torch.float64), ref_out, **TOL[dtype])
    if backend == "explicit":
        out, w = mgk_attention(q, k, v, backend=backend, return_weights=True, **kw)
        torch.testing.assert_close(out.to(torch.float64), ref_out, **TOL[dtype])
        assert w.shape == ref_w.shape
        torch.testing.assert_close(w.to(torch.float64), ref_w, **TOL[dtype])


def sigma2_for(kind, M, D, dtype):
    if kind == "default":
        return None
    if kind == "float":
        return 0.7
    if kind == "scalar_tensor":
        return torch.tensor([1.9], dtype=dtype)
    if kind == "unequal":
        return torch.tensor([0.6, 2.5, 1.3][:M], dtype=dtype)
    raise AssertionError(kind)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("sig", ["default", "float", "scalar_tensor", "unequal"])
def test_unmasked_random_inputs(dtype, M, backend, sig):
    q, k, v = make_inputs(B=2, H=2, L=5, S=6, M=M, D=4, Dv=3, dtype=dtype, seed=M)
    s2 = sigma2_for(sig, M, 4, dtype)
    check(backend, q, k, v, dtype, sigma2=s2)


@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("pi_kind", ["per_head", "per_position", "full", "flat_heads", "unnormalised"])
def test_custom_log_pi(M, backend, pi_kind):
    B, H, S = 2, 2, 6
    dtype = torch.float64
    q, k, v = make_inputs(B=B, H=H, L=4, S=S, M=M, D=3, dtype=dtype, seed=10 + M)
    shape = {"per_head": (H, M, 1), "per_position": (H, M, S), "full": (B, H, M, S), "flat_heads": (M, S),
             "unnormalised": (H, M, S)}[pi_kind]
    log_pi = normalised_log_pi(shape, dim=-2, seed=M).to(dtype)
    if pi_kind == "unnormalised":  # docs: an un-normalised prior only rescales a key's mass; formula still literal
        log_pi = log_pi + torch.linspace(-1.0, 2.0, S, dtype=dtype)
    s2 = torch.tensor([0.8, 1.7, 3.0][:M], dtype=dtype)
    check(backend, q, k, v, dtype, log_pi=log_pi, sigma2=s2)


def test_log_pi_changes_output(backend):
    """The prior really enters: a non-uniform pi differs from the default uniform one (guards against ignoring it)."""
    q, k, v = make_inputs(B=1, H=1, L=4, S=5, M=2, D=3, dtype=torch.float64, seed=3)
    lp = torch.log(torch.tensor([0.95, 0.05], dtype=torch.float64)).view(1, 2, 1)
    a = mgk_attention(q, k, v, backend=backend)
    b = mgk_attention(q, k, v, log_pi=lp, backend=backend)
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("mask_kind", ["random", "random_heads", "padding", "left_padding", "zero_real", "LS"])
def test_bool_masks(dtype, M, backend, mask_kind):
    B, H, L, S = 2, 2, 5, 6
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=M, D=4, dtype=dtype, seed=20 + M)
    if mask_kind == "random":
        mask = random_mask(B, H, L, S, seed=M, empty_rows=[(0, 1, 2), (1, 0, 0), (1, 1, 4)])
    elif mask_kind == "random_heads":  # (B, 1, L, S)
        mask = random_mask(B, 1, L, S, seed=M, empty_rows=[(1, 0, 3)])
    elif mask_kind == "padding":
        mask = padding_mask([6, 3], S)
    elif mask_kind == "left_padding":
        mask = padding_mask([6, 2], S, left=True)
    elif mask_kind == "zero_real":
        mask = padding_mask([4, 0], S)
    else:  # 2-dim (L, S) mask
        mask = random_mask(1, 1, L, S, seed=M, empty_rows=[(0, 0, 1)])[0, 0]
    sig = torch.tensor([0.9, 2.2, 1.4][:M], dtype=dtype)
    check(backend, q, k, v, dtype, sigma2=sig, attn_mask=mask, ref_kw=dict(sigma2=sig, mask=mask))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("LS,M", [((5, 5), 2), ((3, 6), 1), ((3, 6), 3), ((6, 3), 2), ((6, 3), 1), ((1, 4), 2),
                                  ((4, 1), 2)])
@pytest.mark.parametrize("with_padding", [False, True])
def test_causal_bottom_right(dtype, backend, LS, M, with_padding):
    L, S = LS
    B, H = 2, 1
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=M, D=3, dtype=dtype, seed=30 + L * 7 + S)
    mask = padding_mask([S, max(1, S - 2)], S, left=True) if with_padding else None
    check(backend, q, k, v, dtype, attn_mask=mask, is_causal=True, ref_kw=dict(mask=mask, is_causal=True))


def test_causal_last_query_equals_last_row_of_full(backend):
    """Causal attention aligned bottom-right: a single query against 6 keys equals row 5 of the full causal run
    (never attends only to key 0)."""
    q, k, v = make_inputs(B=1, H=2, L=6, S=6, M=2, D=4, dtype=torch.float64, seed=5)
    full = mgk_attention(q, k, v, is_causal=True, backend=backend)
    last = mgk_attention(q[:, :, 5:], k, v, is_causal=True, backend=backend)
    torch.testing.assert_close(last, full[:, :, 5:], atol=1e-12, rtol=1e-10)
    first_only = mgk_attention(q[:, :, 5:], k[:, :, :, :1], v[:, :, :1], backend=backend)
    assert (last - first_only).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_hard_e_max(dtype, M, backend, masked):
    """mixture='max': kernel max_r exp(-|q-k_r|^2/(2 s_r)); pi unused."""
    B, H, L, S = 2, 2, 4, 5
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=M, D=3, dtype=dtype, seed=40 + M)
    sig = torch.tensor([0.7, 1.9, 1.1][:M], dtype=dtype)
    mask = random_mask(B, H, L, S, seed=M, empty_rows=[(0, 0, 1)]) if masked else None
    check(backend, q, k, v, dtype, sigma2=sig, mixture="max", attn_mask=mask,
          ref_kw=dict(sigma2=sig, mixture="max", mask=mask))


def test_hard_e_differs_from_sum():
    q, k, v = make_inputs(B=1, H=1, L=4, S=5, M=2, D=3, dtype=torch.float64, seed=4)
    a = mgk_attention(q, k, v, mixture="max")
    b = mgk_attention(q, k, v)
    assert (a - b).abs().max() > 1e-4


def test_chunking_does_not_change_explicit_path():
    q, k, v = make_inputs(B=2, H=1, L=7, S=5, M=2, D=3, dtype=torch.float64, seed=8)
    mask = random_mask(2, 1, 7, 5, seed=1, empty_rows=[(0, 0, 6)])
    ref, _ = mgk_reference(q, k, v, mask=mask, is_causal=True)
    for cs in (1, 2, 3, 100):
        out = mgk_attention(q, k, v, attn_mask=mask, is_causal=True, backend="explicit", chunk_size=cs)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
        out, w = mgk_attention(q, k, v, attn_mask=mask, is_causal=True, return_weights=True, chunk_size=cs,
                               mixture="max")
        torch.testing.assert_close(out, mgk_reference(q, k, v, mask=mask, is_causal=True, mixture="max")[0],
                                   atol=1e-12, rtol=1e-10)


# The backend fixture is a plain parameter (nothing to reset between examples), so hypothesis may share it.
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    B=st.integers(1, 3), H=st.integers(1, 2), L=st.sampled_from([1, 2, 5, 9]), S=st.sampled_from([1, 2, 5, 9]),
    D=st.sampled_from([1, 2, 4, 8]), M=st.integers(1, 3), causal=st.booleans(), use_mask=st.booleans(),
    unequal=st.booleans(), use_pi=st.booleans(), mixture=st.sampled_from(["sum", "max"]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_each_backend_matches_reference(backend, B, H, L, S, D, M, causal, use_mask, unequal, use_pi,
                                                   mixture, seed):
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=M, D=D, Dv=2, dtype=torch.float64, seed=seed)
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, 1, L, S, generator=g) < 0.7) if use_mask else None
    sig = (torch.rand(M, generator=g, dtype=torch.float64) * 3 + 0.3) if unequal else None
    log_pi = normalised_log_pi((H, M, S), dim=-2, seed=seed) if (use_pi and mixture == "sum") else None
    kw = dict(sigma2=sig, mixture=mixture, attn_mask=mask, is_causal=causal, log_pi=log_pi)
    ref_out, ref_w = mgk_reference(q, k, v, sigma2=sig, mixture=mixture, mask=mask, is_causal=causal,
                                   log_pi=log_pi, log_space=True)
    why = refusal(backend, mixture=mixture, mask=mask)
    if why is not None:
        with pytest.raises(BackendError, match=f"backend='{backend}' cannot serve"):
            mgk_attention(q, k, v, backend=backend, **kw)
        return
    out = mgk_attention(q, k, v, backend=backend, **kw)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, atol=1e-9, rtol=1e-9)
    if backend == "explicit":
        out, w = mgk_attention(q, k, v, backend=backend, return_weights=True, **kw)
        torch.testing.assert_close(out, ref_out, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(w, ref_w, atol=1e-9, rtol=1e-9)
        visible = ref_w.sum(-1) > 0.5
        torch.testing.assert_close(w.sum(-1)[visible], torch.ones_like(w.sum(-1)[visible]))
        assert (w >= 0).all()


def test_reference_literal_and_log_space_agree():
    """Sanity of the test oracle itself: the literal and log-space forms coincide on well-scaled inputs."""
    q, k, v = make_inputs(B=2, H=2, L=4, S=5, M=3, D=3, dtype=torch.float64, seed=2)
    lp = normalised_log_pi((2, 3, 5), dim=-2, seed=2)
    mask = random_mask(2, 2, 4, 5, seed=2, empty_rows=[(1, 1, 1)])
    a = mgk_reference(q, k, v, log_pi=lp, mask=mask, sigma2=torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64))
    b = mgk_reference(q, k, v, log_pi=lp, mask=mask, sigma2=torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64),
                      log_space=True)
    torch.testing.assert_close(a[0], b[0], atol=1e-12, rtol=1e-12)
    assert math.isclose(float(a[1][1, 1, 1].sum()), 0.0)
