"""Attention dropout inside the Triton MGK kernels: the keep mask is the C++ kernel's counter-based hash (checked
against an independent re-implementation and against the C++ kernel's own mask), and forward and gradients equal
the float64 formula with that mask applied to the mixed weights.

The kernels run on CPU through Triton's interpreter, which must be switched on before Triton is imported: run
directly with ``TRITON_INTERPRET=1`` (or on a CUDA machine, where they are compiled), these tests run in this
process; otherwise :func:`test_this_file_under_the_interpreter` runs this file once in a subprocess with
``TRITON_INTERPRET=1``. Skipped when Triton is not installed. Sizes are tiny: the interpreter is slow."""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mgk.functional import _mixture_flash, mgk_attention

from .reference import assert_checkpoint_regenerates_dropout, causal_allowed, make_inputs, padding_mask

F64 = torch.float64
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
RUNS_HERE = HAS_TRITON and (INTERPRETED or torch.cuda.is_available())
here = pytest.mark.skipif(not RUNS_HERE, reason="needs Triton and TRITON_INTERPRET=1 or a CUDA GPU (see "
                                                "test_this_file_under_the_interpreter)")
needs_cpu_kernel = pytest.mark.skipif(not _mixture_flash.available(torch.zeros(1), 0.0),
                                      reason=f"the C++ MGK kernel could not be built: {_mixture_flash.build_error()}")


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="Triton is not installed, or the tests run here already")
def test_this_file_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
                       capture_output=True, text=True, env=env, cwd=root, timeout=1200)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and " failed" not in p.stdout, p.stdout[-2000:]


# ---- an independent re-implementation of the hash (numpy wraps uint64 and uint32 arithmetic) ------------------------

def _u64(x):
    return np.uint64(x & (2 ** 64 - 1))


def _splitmix64(z):
    z = (z ^ (z >> _u64(30))) * _u64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _u64(27))) * _u64(0x94D049BB133111EB)
    return z ^ (z >> _u64(31))


def _fmix32(h):
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def hash_mask(seed, offset, B, H, L, S, p):
    """keep (B, H, L, S): row key splitmix64(seed ^ splitmix64(offset + (bh L + i) * golden64)), keep j iff
    fmix32(fmix32(j * golden32 ^ lo) ^ hi) >= round(p 2^32), written from the description of the C++ kernel."""
    with np.errstate(over="ignore"):
        rows = np.arange(B * H * L, dtype=np.uint64)
        key = _splitmix64(_u64(seed) ^ _splitmix64(_u64(offset) + rows * _u64(0x9E3779B97F4A7C15)))
        lo = (key & _u64(0xFFFFFFFF)).astype(np.uint32)[:, None]
        hi = (key >> _u64(32)).astype(np.uint32)[:, None]
        cols = np.arange(S, dtype=np.uint32)[None, :]
        h = _fmix32(_fmix32((cols * np.uint32(0x9E3779B9)) ^ lo) ^ hi)
    keep = h.astype(np.int64) >= math.floor(p * 2 ** 32 + 0.5)
    return torch.from_numpy(keep).view(B, H, L, S)


def triton_mask(seed, offset, B, H, L, S, p):
    from mgk.functional import _triton_dropout

    return _triton_dropout.dropout_mask(seed, offset, B, H, L, S, p, device=DEVICE).cpu()


# ---- the random stream -------------------------------------------------------------------------------------------

@here
@pytest.mark.parametrize("seed,offset", [(0, 0), (-5, 77), (2 ** 63 - 2, -(2 ** 63)), (123456789, -987654321)])
def test_mask_is_the_documented_hash(seed, offset):
    for p in (0.1, 0.5, 2.0 ** -32):
        assert torch.equal(triton_mask(seed, offset, 2, 3, 9, 70, p), hash_mask(seed, offset, 2, 3, 9, 70, p))
    assert triton_mask(seed, offset, 1, 2, 5, 7, 0.0).all()


@here
@needs_cpu_kernel
def test_mask_equals_the_cpu_kernel_mask():
    for seed, offset, p in [(-5, 77, 0.3), (2 ** 62 + 3, 11, 0.9), (1, 2 ** 40, 0.05)]:
        assert torch.equal(triton_mask(seed, offset, 2, 2, 33, 65, p),
                           _mixture_flash.dropout_mask(seed, offset, 2, 2, 33, 65, p))


@here
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_and_neighbour_independence_within_4_sigma(p):
    keep = triton_mask(12345, 678, 2, 1, 64, 256, p)  # 32768 draws
    rate = keep.double().mean().item()
    assert abs(rate - (1 - p)) < 4 * math.sqrt(p * (1 - p) / keep.numel()), rate
    for pair in (keep[..., 1:] & keep[..., :-1], keep[:, :, 1:] & keep[:, :, :-1], keep[1] & keep[0]):
        q = (1 - p) ** 2
        assert abs(pair.double().mean().item() - q) < 4 * math.sqrt(q * (1 - q) / pair.numel())


@here
def test_mask_depends_on_seed_offset_and_position_only():
    a = triton_mask(1, 2, 2, 3, 20, 40, 0.3)
    assert torch.equal(a, triton_mask(1, 2, 2, 3, 20, 40, 0.3))
    assert not torch.equal(a, triton_mask(1, 3, 2, 3, 20, 40, 0.3))
    assert not torch.equal(a, triton_mask(2, 2, 2, 3, 20, 40, 0.3))
    assert torch.equal(a, triton_mask(1, 2, 2, 3, 20, 70, 0.3)[..., :40])  # columns are keyed by j alone


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_seed_draw_is_the_cpu_kernel_draw_and_follows_the_generator():
    from mgk.functional import _triton_dropout

    torch.manual_seed(0)
    a = _mixture_flash.draw_dropout_seed_tensor("cpu").tolist()
    torch.manual_seed(0)
    assert tuple(a) == _mixture_flash.draw_dropout_seed()
    assert _mixture_flash.draw_dropout_seed_tensor("cpu").tolist() != a  # each call advances the generator
    assert [_triton_dropout.threshold(p) for p in (0.0, 0.5, 2.0 ** -33, 1.0)] == [0, 2 ** 31, 1, 2 ** 32]


# ---- the kernels against the formula with their own mask ------------------------------------------------------------

def formula(q, k, bias, v, allowed, keep, p):
    """float64 ``(A * keep / (1 - p)) @ v``, A_ij = sum_r softmax over (j, r) of q_i.k_jr + bias_jr."""
    s = torch.einsum("bhld,bhmsd->bhlms", q, k) + bias.unsqueeze(2)
    B, H, L, M, S = s.shape
    s = s.masked_fill(~allowed.unsqueeze(3), float("-inf"))
    w = torch.softmax(s.reshape(B, H, L, M * S), -1).reshape(B, H, L, M, S).sum(3)
    w = torch.where(allowed.any(-1, keepdim=True), w, torch.zeros((), dtype=w.dtype))
    return (w * keep / (1 - p)) @ v


# (B, H, L, S, M, causal): the block size is 64, so 70 and 90 span two blocks; L > S leaves early rows empty
CASES = [(1, 2, 70, 90, 2, False), (1, 1, 70, 71, 2, True), (2, 1, 30, 12, 3, True), (1, 1, 9, 40, 1, False)]


@here
@pytest.mark.parametrize("B,H,L,S,M,causal", CASES)
def test_forward_and_gradients_equal_formula_with_the_mask(B, H, L, S, M, causal):
    from mgk.functional._mixture_triton import MixtureTriton

    D, Dv, p = 8, 5, 0.3
    g = torch.Generator().manual_seed(L + S)
    ins = [torch.randn(*s, generator=g, dtype=F64) for s in [(B, H, L, D), (B, H, M, S, D), (B, H, M, S),
                                                                (B, H, S, Dv)]]
    ins[1] = ins[1] * 0.5
    seed, offset = 31, -7
    x32 = [t.float().to(DEVICE).requires_grad_() for t in ins]
    x64 = [t.requires_grad_() for t in ins]
    out = MixtureTriton.apply(*x32, causal, p, torch.tensor([seed, offset], device=DEVICE))
    allowed = causal_allowed(L, S).expand(B, H, L, S) if causal else torch.ones(B, H, L, S, dtype=torch.bool)
    ref = formula(*x64, allowed, hash_mask(seed, offset, B, H, L, S, p), p)
    go = torch.randn(ref.shape, generator=g, dtype=F64)
    grads = torch.autograd.grad(out, x32, go.float().to(DEVICE))
    for name, a, b in zip(("out", "q", "k", "bias", "v"), (out, *grads),
                          (ref, *torch.autograd.grad(ref, x64, go))):
        torch.testing.assert_close(a.cpu().double(), b, atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


@here
@pytest.mark.parametrize("causal", [False, True])
def test_mgk_attention_with_padding_and_dropout_equals_formula(causal):
    B, H, L, S, M, D, Dv, p = 2, 2, 20, 20, 2, 8, 5, 0.3
    q, k, v = (t.to(DEVICE).requires_grad_() for t in make_inputs(B=B, H=H, L=L, S=S, M=M, D=D, Dv=Dv, seed=3))
    mask = padding_mask([S, S // 3], S, left=causal).to(DEVICE)
    torch.manual_seed(11)
    out = mgk_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=p, backend="triton")
    torch.manual_seed(11)

    seed, offset = _mixture_flash.draw_dropout_seed_tensor(DEVICE).tolist()
    allowed = mask.cpu().expand(B, H, L, S) & (causal_allowed(L, S) if causal else True)
    qr, kr, vr = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    s2 = math.sqrt(D)
    bias = -(kr * kr).sum(-1) / (2 * s2) - math.log(M)  # |q|^2 / (2 sigma^2) cancels in the softmax
    ref = formula(qr, kr / s2, bias, vr, allowed, hash_mask(seed, offset, B, H, L, S, p), p)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=2e-5)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), g.float().to(DEVICE)),
                          torch.autograd.grad(ref, (qr, kr, vr), g)):
        torch.testing.assert_close(a.cpu().double(), b, atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.skipif(not (HAS_TRITON and INTERPRETED), reason="needs TRITON_INTERPRET=1 (on CUDA the seed is drawn "
                    "from the CUDA generator, not the CPU one the C++ kernel uses)")
@needs_cpu_kernel
def test_same_generator_state_gives_the_cpu_kernel_output():
    """One torch.manual_seed, two backends: the same (seed, offset), the same mask, the same numbers (float32)."""
    q, k, v = make_inputs(B=1, H=2, L=24, S=40, M=2, D=8, Dv=4, seed=5)
    mask = padding_mask([29], 40)
    outs = []
    for backend in ("triton", "kernel"):
        x = [t.to(DEVICE if backend == "triton" else "cpu").requires_grad_() for t in (q, k, v)]
        torch.manual_seed(4)
        out = mgk_attention(*x, attn_mask=mask.to(x[0].device), is_causal=True, dropout_p=0.25, backend=backend)
        outs.append([t.cpu() for t in (out, *torch.autograd.grad(out.square().sum(), x))])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@here
def test_same_seed_bitwise_same_output_and_gradients_new_state_differs():
    q, k, v = (t.to(DEVICE).requires_grad_() for t in make_inputs(B=1, H=2, L=20, S=20, M=2, D=8, Dv=8, seed=2))

    def run(seed):
        torch.manual_seed(seed)
        out = mgk_attention(q, k, v, is_causal=True, dropout_p=0.1, backend="triton")
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    a, b, c = run(3), run(3), run(4)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])


@here
def test_mean_over_draws_approaches_the_output_without_dropout():
    """n batch copies draw independent masks (rows are keyed by b * H + h); the mean is within 5 standard errors of
    the no-dropout output."""
    q, k, v = make_inputs(B=1, H=1, L=4, S=16, M=2, D=4, Dv=3, dtype=F64, seed=6)
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    base = mgk_attention(q, k, v, backend="triton")
    n = 256
    torch.manual_seed(0)
    rep = mgk_attention(q.expand(n, -1, -1, -1), k.expand(n, -1, -1, -1, -1), v.expand(n, -1, -1, -1),
                        dropout_p=0.3, backend="triton")
    err = (rep.mean(0) - base[0]).abs()
    se = rep.std(0) / math.sqrt(n)
    assert (err < 5 * se + 1e-6).all(), (err / se).max()
    assert (rep.std(0) > 0).all()


@here
def test_activation_checkpointing_regenerates_the_same_mask():
    q, k, v = (t.to(DEVICE).requires_grad_() for t in make_inputs(B=1, H=2, L=16, S=16, M=2, D=8, Dv=8, seed=12))
    assert_checkpoint_regenerates_dropout(
        lambda q, k, v: mgk_attention(q, k, v, is_causal=True, dropout_p=0.25, backend="triton"), q, k, v)


@here
def test_bad_dropout_arguments_are_refused():
    from mgk.functional import BackendError
    from mgk.functional._mixture_triton import MixtureTriton

    q, k, v = (t.to(DEVICE) for t in make_inputs(B=1, H=1, L=4, S=4, M=2, D=4, seed=0))
    bias = torch.zeros(1, 1, 2, 4, device=DEVICE)
    with pytest.raises(BackendError, match="backend='triton' cannot serve these inputs: dropout_p=1.0"):
        mgk_attention(q, k, v, dropout_p=1.0, backend="triton")
    with pytest.raises(ValueError, match="dropout_p must be in"):
        MixtureTriton.apply(q, k, bias, v, False, -0.1)
    with pytest.raises(ValueError, match="seed must be a"):
        MixtureTriton.apply(q, k, bias, v, False, 0.1, torch.tensor([1, 2, 3], device=DEVICE))


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs Triton and a CUDA GPU")
def test_selector_takes_triton_with_dropout_on_cuda_when_opted_in(monkeypatch):
    from mgk.functional import _mixture_triton, select_backend

    monkeypatch.setenv("MGK_TRITON", "1")
    q, k, v = (t.cuda() for t in make_inputs(B=1, H=1, L=8, S=8, M=2, D=4, seed=0))
    assert _mixture_triton.available(q, 0.1)
    assert select_backend(q, k, v, dropout_p=0.1) == "triton"
    assert select_backend(q, k, v, dropout_p=1.0) != "triton"
