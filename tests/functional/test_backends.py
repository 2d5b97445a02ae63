"""mgk_attention(backend=...) reaches every implementation; each equals the float64 explicit reference; a backend
that cannot serve the inputs is refused by name; the seams' faults: translation invariance of MGK in float32, exact
normalisation of linear attention, mixed dtypes refused."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mgk.functional import (
    BackendError,
    linear_attention,
    linear_attention_step,
    mgk_attention,
    mgk_responsibilities,
    mlk_attention,
    select_backend,
    softmax_attention,
    softmax_attention_reference,
)

from .reference import make_inputs, mgk_reference, padding_mask

F64 = torch.float64


@pytest.mark.parametrize("causal", [False, True])
def test_each_backend_equals_the_float64_reference(backend, causal, assert_close):
    q, k, v = make_inputs(B=2, H=2, L=9, S=9, M=2, D=4, Dv=3, dtype=F64, seed=1)
    mask = padding_mask([9, 6], 9, left=causal)
    ref, _ = mgk_reference(q, k, v, mask=mask, is_causal=causal)
    got = mgk_attention(q, k, v, attn_mask=mask, is_causal=causal, backend=backend)
    assert_close(backend, ref, got, atol=1e-10, rtol=1e-9)
    q32, k32, v32 = q.float(), k.float(), v.float()
    got32 = mgk_attention(q32, k32, v32, attn_mask=mask, is_causal=causal, backend=backend)
    assert_close(f"{backend} float32", ref, got32, atol=1e-5, rtol=1e-5)


def test_hard_e_on_each_backend_that_takes_it(backend, assert_close):
    q, k, v = make_inputs(B=1, H=2, L=7, S=7, M=3, D=4, Dv=3, dtype=F64, seed=2)
    ref, _ = mgk_reference(q, k, v, mixture="max")
    if backend in ("sdpa", "triton"):
        with pytest.raises(BackendError, match="mixture='max'"):
            mgk_attention(q, k, v, mixture="max", backend=backend)
        return
    assert_close(backend, ref, mgk_attention(q, k, v, mixture="max", backend=backend), atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("backend,kw,why", [
    ("kernel", dict(dropout_p=1.0), "dropout"), ("kernel", dict(return_weights=True), "return_weights"),
    ("sdpa", dict(return_weights=True), "return_weights"), ("triton", dict(dropout_p=1.0), "dropout"),
    ("kernel", dict(attn_mask=torch.ones(5, 5, dtype=torch.bool).tril()), "depends on the query")])
def test_a_backend_that_cannot_serve_the_inputs_is_refused_with_the_reason(backend, kw, why):
    q, k, v = make_inputs(B=1, H=1, L=5, S=5, M=2, D=4, Dv=3, seed=0)
    with pytest.raises(BackendError, match=f"backend='{backend}' cannot serve these inputs: .*{why}"):
        mgk_attention(q, k, v, backend=backend, **kw)
    with pytest.raises(ValueError, match="backend must be"):
        mgk_attention(q, k, v, backend="flash")


def test_triton_off_cuda_names_the_device():
    q, k, v = make_inputs(B=1, H=1, L=5, S=5, M=2, D=4, Dv=3, seed=0)
    with pytest.raises(BackendError, match="triton"):
        mgk_attention(q, k, v, backend="triton")


def test_select_backend_is_what_runs():
    q, k, v = make_inputs(B=1, H=1, L=5, S=5, M=2, D=4, Dv=3, seed=0)
    assert select_backend(q, k, v, return_weights=True) == "explicit"
    assert select_backend(q, k, v, dropout_p=0.2) in ("kernel", "sdpa")  # the kernel has dropout inside
    assert select_backend(q, k, v, dropout_p=1.0) == "sdpa"
    assert select_backend(q, k, v, mixture="max") in ("kernel", "explicit")
    assert select_backend(q, k, v) in ("kernel", "sdpa")
    assert select_backend(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.bool)) == "sdpa"


def test_mgk_cpu_kernel_0_makes_the_kernel_unavailable_to_the_selector(tmp_path):
    import subprocess
    import sys

    code = ("import torch; from mgk.functional import select_backend, mgk_attention; "
            "q = torch.randn(1, 1, 4, 4); k = torch.randn(1, 1, 2, 4, 4); print(select_backend(q, k, q)); "
            "mgk_attention(q, k, q, backend='kernel')")
    import os
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, MGK_CPU_KERNEL="0"))
    assert p.stdout.strip() == "sdpa"
    assert "MGK_CPU_KERNEL=0" in p.stderr and "backend='kernel' cannot serve" in p.stderr


# ---- translation invariance in float32 -------------------------------------------------------------------------

def _offset_inputs():
    torch.manual_seed(0)
    return torch.randn(1, 1, 64, 16), torch.randn(1, 1, 2, 64, 16), torch.randn(1, 1, 64, 16)


@pytest.mark.parametrize("offset", [25.0, 250.0])
def test_a_shared_offset_keeps_float32_mgk_within_1e5(backend, offset, assert_close):
    q, k, v = _offset_inputs()
    c = torch.full((16,), offset)
    ref = mgk_attention(q.double(), k.double(), v.double(), backend="explicit")
    got = mgk_attention(q + c, k + c, v, backend=backend)
    assert_close(f"{backend} offset {offset}", ref, got, atol=1e-5, rtol=0)


@pytest.mark.parametrize("offset", [25.0, 250.0])
def test_a_shared_offset_keeps_responsibilities_within_1e5_per_count(offset, assert_close):
    q, k, _ = _offset_inputs()
    c = torch.full((16,), offset)
    for path in ("kernel", "explicit"):
        ref, count = mgk_responsibilities(q.double(), k.double(), backend="explicit")
        try:
            got, _ = mgk_responsibilities(q + c, k + c, backend=path)
        except BackendError:
            continue
        assert_close(f"responsibilities {path}", ref / count, got / count, atol=1e-5, rtol=0)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.floats(0.0, 100.0))
def test_random_shifts_up_to_100_leave_every_path_within_1e5(seed, scale):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 2, 12, 8, generator=g), \
        torch.randn(2, 2, 12, 3, generator=g)
    c = torch.randn(2, 2, 1, 8, generator=g)
    c = c / c.norm(dim=-1, keepdim=True) * scale  # |c| = scale, one shift per (batch, head)
    mask = padding_mask([12, 7], 12)
    kp = (k + c.unsqueeze(2)).masked_fill(~mask[..., 0, :].unsqueeze(-1).unsqueeze(2), float("nan"))
    ref = mgk_attention(q.double(), k.double(), v.double(), attn_mask=mask, backend="explicit")
    for name in ("kernel", "sdpa", "explicit"):
        for causal in (False, True):
            try:
                got = mgk_attention(q + c, kp, v, attn_mask=mask, backend=name)
                ref_c = mgk_attention(q.double(), k.double(), v.double(), attn_mask=mask, is_causal=causal,
                                      backend="explicit")
                got_c = mgk_attention(q + c, kp, v, attn_mask=mask, is_causal=causal, backend=name)
            except BackendError:
                continue
            torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0)
            torch.testing.assert_close(got_c.double(), ref_c, atol=1e-5, rtol=0)
    ref_r, count = mgk_responsibilities(q.double(), k.double(), attn_mask=mask, backend="explicit")
    for name in ("kernel", "explicit"):
        got_r, _ = mgk_responsibilities(q + c, kp, attn_mask=mask, backend=name)
        torch.testing.assert_close(got_r / count.clamp_min(1), ref_r / count.clamp_min(1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["sdpa", "explicit", "kernel"])
def test_gradients_flow_through_the_centring(name):
    """The centring vector is detached; the scores are shift-invariant, so the gradients are exact (gradcheck)."""
    g = torch.Generator().manual_seed(3)
    ins = [torch.randn(*s, generator=g, dtype=F64, requires_grad=True) for s in [(1, 1, 4, 3), (1, 1, 2, 4, 3),
                                                                                (1, 1, 4, 2)]]
    s2 = torch.tensor([0.8, 1.7], dtype=F64, requires_grad=True)
    try:
        mgk_attention(*ins, backend=name)
    except BackendError:
        pytest.skip(f"{name} is not available here")
    assert torch.autograd.gradcheck(lambda q, k, v, s: mgk_attention(q, k, v, sigma2=s, backend=name),
                                    (*ins, s2))


# ---- exactly normalised linear attention -----------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["chunked", "explicit"])
@pytest.mark.parametrize("mlk", [False, True])
def test_constant_values_give_that_constant(causal, name, mlk):
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 7, 3, dtype=F64), torch.randn(1, 1, 7, 3, dtype=F64)
    v = torch.full((1, 1, 7, 3), 3.5, dtype=F64)
    if mlk:
        out = mlk_attention(q, torch.stack([k, k.flip(-1)], 2), v, is_causal=causal, backend=name)
    else:
        out = linear_attention(q, k, v, is_causal=causal, backend=name)
    torch.testing.assert_close(out, torch.full_like(out, 3.5), atol=1e-14, rtol=0)


def test_constant_values_through_the_recurrent_step():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 7, 3, dtype=F64), torch.randn(1, 1, 7, 3, dtype=F64)
    state = None
    for t in range(7):
        out, state = linear_attention_step(q[:, :, t], k[:, :, t], torch.full((1, 1, 3), 3.5, dtype=F64), state)
        torch.testing.assert_close(out, torch.full_like(out, 3.5), atol=1e-14, rtol=0)


def test_linear_explicit_only_serves_weights():
    q, k, v = (torch.randn(1, 1, 4, 3) for _ in range(3))
    with pytest.raises(BackendError, match="return_weights"):
        linear_attention(q, k, v, return_weights=True, backend="chunked")
    with pytest.raises(ValueError, match="backend must be"):
        linear_attention(q, k, v, backend="recurrent")


# ---- mixed dtypes -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["softmax", "softmax_reference", "mgk", "linear", "mlk", "responsibilities",
                                "step"])
def test_mixed_dtypes_are_refused_naming_both(fn):
    q = torch.randn(1, 1, 4, 3, dtype=F64)
    k4, k5, v = torch.randn(1, 1, 4, 3), torch.randn(1, 1, 2, 4, 3), torch.randn(1, 1, 4, 3)
    call = {"softmax": lambda: softmax_attention(q, k4, v), "softmax_reference": lambda: softmax_attention_reference(
        q, k4, v), "mgk": lambda: mgk_attention(q, k5, v), "linear": lambda: linear_attention(q, k4, v),
        "mlk": lambda: mlk_attention(q, k5, v), "responsibilities": lambda: mgk_responsibilities(q, k5),
        "step": lambda: linear_attention_step(q[:, :, 0], k4[:, :, 0], v[:, :, 0])}[fn]
    with pytest.raises(ValueError, match=r"has dtype torch\.float64 but key(_t)? has dtype torch\.float32"):
        call()


@pytest.mark.parametrize("mixture", ["sum", "max"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_batch_row_of_padding_only_with_nan_content_is_zero_on_each_backend(backend, causal, mixture, assert_close):
    """A left-padded batch may hold a row whose every key is padding (its prompt is empty); NaN in that row's
    queries, keys and values is inert: its outputs are exactly zero and the other rows' outputs and gradients are the
    float64 formula's, causal or not (the kernels' fused causal masking used to open such a row and let its NaN
    queries through)."""
    if backend in ("sdpa", "triton") and mixture == "max":
        pytest.skip(f"{backend} takes no Hard-E")
    q, k, v = make_inputs(B=3, H=2, L=6, S=6, M=2, D=4, Dv=3, dtype=F64, seed=21)
    mask = padding_mask([6, 0, 4], 6, left=True)
    for t in (q, k, v):
        t[1] = float("nan")
    ref, _ = mgk_reference(q[[0, 2]], k[[0, 2]], v[[0, 2]], mask=mask[[0, 2]], is_causal=causal, mixture=mixture)
    q, k, v = (t.float().requires_grad_(True) for t in (q, k, v))
    got = mgk_attention(q, k, v, attn_mask=mask, is_causal=causal, mixture=mixture, backend=backend)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert_close(backend, ref, got[[0, 2]], atol=1e-5, rtol=1e-5)
    got[[0, 2]].sum().backward()
    assert all(torch.isfinite(t.grad[[0, 2]]).all() for t in (q, k, v))
