"""mgk_responsibilities (Soft-E E-step statistics) against an explicit-loop float64 computation; padded queries
contribute no responsibility."""
from __future__ import annotations

import math

import pytest
import torch

from mgk.functional import mgk_responsibilities

from .reference import make_inputs, normalised_log_pi, padding_mask, random_mask, responsibilities_reference

F64 = torch.float64


def _setup(M=2, seed=0, dtype=F64):
    B, H, L, S, D = 2, 2, 4, 4, 3
    q, k, _ = make_inputs(B=B, H=H, L=L, S=S, M=M, D=D, dtype=dtype, seed=seed)
    return q, k


def _compare(q, k, tol, **kw):
    resp, count = mgk_responsibilities(q, k, **kw)
    ref_kw = dict(kw)
    ref_kw["mask"] = ref_kw.pop("attn_mask", None)
    ref_resp, ref_count = responsibilities_reference(q, k, **ref_kw)
    H, M, S = k.shape[1], k.shape[2], k.shape[3]
    assert resp.shape == (H, M, S) and count.shape == (H, S)
    assert resp.requires_grad is False
    torch.testing.assert_close(count.to(F64), ref_count, atol=0, rtol=0)
    torch.testing.assert_close(resp.to(F64), ref_resp, atol=tol, rtol=tol)
    return resp, count


@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("use_qmask", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "random"])
def test_matches_hand_computation(M, causal, use_qmask, mask_kind):
    q, k = _setup(M=M, seed=M)
    mask = {"none": None, "padding": padding_mask([4, 2], 4),
            "random": random_mask(2, 2, 4, 4, seed=M, empty_rows=[(0, 1, 2)])}[mask_kind]
    qmask = torch.tensor([[True, True, True, True], [True, True, False, False]]) if use_qmask else None
    log_pi = normalised_log_pi((2, M, 4), dim=1, seed=M)
    s2 = torch.tensor([0.5, 1.5, 1.0][:M], dtype=F64)
    _compare(q, k, 1e-10, log_pi=log_pi, sigma2=s2, attn_mask=mask, is_causal=causal, query_mask=qmask)


@pytest.mark.parametrize("chunk", [1, 3, 256])
def test_chunking_and_float32(chunk):
    q, k = _setup(M=2, seed=5, dtype=torch.float32)
    resp, count = mgk_responsibilities(q, k, attn_mask=padding_mask([4, 3], 4), is_causal=True, chunk_size=chunk)
    assert resp.dtype == torch.float32
    ref_resp, ref_count = responsibilities_reference(q, k, mask=padding_mask([4, 3], 4), is_causal=True)
    torch.testing.assert_close(resp.to(F64), ref_resp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(count.to(F64), ref_count)


def test_sums_over_components_equal_counts_and_update_is_a_distribution():
    q, k = _setup(M=3, seed=6)
    mask = padding_mask([4, 1], 4)
    resp, count = mgk_responsibilities(q, k, attn_mask=mask, is_causal=True, log_pi=normalised_log_pi((2, 3, 1), 1))
    torch.testing.assert_close(resp.sum(1), count)
    live = count > 0
    pi = resp / count.clamp_min(1).unsqueeze(1)
    torch.testing.assert_close(pi.sum(1)[live], torch.ones_like(pi.sum(1)[live]))
    assert (pi >= 0).all()


def test_padded_queries_contribute_nothing():
    """Changing a padded query (even to NaN) changes nothing; dropping it from query_mask removes its share."""
    q, k = _setup(M=2, seed=7)
    qmask = torch.tensor([[True, True, True, False], [True, False, True, True]])
    resp, count = mgk_responsibilities(q, k, query_mask=qmask, is_causal=True)
    q2 = q.clone()
    q2[0, :, 3] = math.nan
    q2[1, :, 1] = 1e30
    resp2, count2 = mgk_responsibilities(q2, k, query_mask=qmask, is_causal=True)
    assert torch.equal(count, count2)
    torch.testing.assert_close(resp2, resp, atol=0, rtol=0)
    # the padded queries really are the only difference with the unmasked statistics
    resp_all, count_all = mgk_responsibilities(q, k, is_causal=True)
    assert count_all.sum() - count.sum() == 2 * (4 + 2)  # H=2 heads x (query 3 sees 4 keys + query 1 sees 2)
    assert (resp_all - resp).abs().max() > 1e-3


@pytest.mark.parametrize("content", [math.nan, math.inf, 1e30])
def test_dead_key_content_does_not_poison_sums(content):
    q, k = _setup(M=2, seed=8)
    mask = padding_mask([4, 2], 4)
    resp, count = mgk_responsibilities(q, k, attn_mask=mask)
    k2 = k.clone()
    k2[1, :, :, 2:] = content
    resp2, count2 = mgk_responsibilities(q, k2, attn_mask=mask)
    assert torch.isfinite(resp2).all()
    torch.testing.assert_close(resp2, resp, atol=1e-12, rtol=1e-12)
    assert torch.equal(count, count2)
    # the dead keys of batch 1 still receive the responsibilities from batch 0, which sees them
    assert (count[:, 2:] == 4).all()


def test_dead_key_content_with_causal_left_padding():
    q, k = _setup(M=2, seed=9)
    mask = padding_mask([4, 3], 4, left=True)
    k2 = k.clone()
    k2[1, :, :, 0] = math.nan
    resp, count = mgk_responsibilities(q, k2, attn_mask=mask, is_causal=True)
    assert torch.isfinite(resp).all()
    ref_resp, ref_count = responsibilities_reference(q, k, mask=mask, is_causal=True)
    torch.testing.assert_close(resp, ref_resp, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(count, ref_count)


def test_no_gradient_tracked():
    q, k = _setup(M=2, seed=10)
    q.requires_grad_(True)
    k.requires_grad_(True)
    resp, count = mgk_responsibilities(q, k)
    assert not resp.requires_grad and not count.requires_grad


def test_all_queries_padded_gives_zero():
    q, k = _setup(M=2, seed=11)
    resp, count = mgk_responsibilities(q, k, query_mask=torch.zeros(2, 4, dtype=torch.bool))
    assert (resp == 0).all() and (count == 0).all()


@pytest.mark.parametrize("backend", ["kernel", "explicit"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [(0,), (1,), (0, 1), (2, 3)], ids=lambda p: "rows" + "".join(map(str, p)))
def test_padded_queries_never_set_the_centre(padded, causal, backend):
    """Whichever rows the query mask pads (the first ones included, which a causal centre would otherwise read), their
    content (1e30, NaN) changes no statistic: the centre is chosen among real queries only. float32, so that a
    centre on a 1e30 query could not go unnoticed."""
    q, k = _setup(M=2, seed=9, dtype=torch.float32)
    qmask = torch.ones(2, 4, dtype=torch.bool)
    qmask[1, list(padded)] = False
    resp, count = mgk_responsibilities(q, k, query_mask=qmask, is_causal=causal, backend=backend)
    for content in (1e30, math.nan, 1e3):
        q2 = q.clone()
        q2[1, :, list(padded)] = content
        resp2, count2 = mgk_responsibilities(q2, k, query_mask=qmask, is_causal=causal, backend=backend)
        assert torch.equal(count, count2)
        torch.testing.assert_close(resp2, resp, atol=0, rtol=0, msg=lambda s, c=content: f"content {c}: {s}")
