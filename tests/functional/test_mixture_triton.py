"""The Triton MGK kernels, run on CPU through Triton's interpreter (``TRITON_INTERPRET=1``), against the formula.

The interpreter executes the kernels' Python/NumPy semantics block by block, so this checks the algorithm (online
softmax over components, causal block skipping, the three backward kernels) without a GPU. Skipped when Triton is
not installed; on a CUDA machine the compiled kernels are compared too (test_cuda_kernels_match_explicit_path)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

SCRIPT = textwrap.dedent("""
    import torch
    from mgk.functional._mixture_triton import MixtureTriton

    def formula(q, k, bias, v, causal):
        s = torch.einsum("bhld,bhmsd->bhlms", q, k) + bias.unsqueeze(2)
        B, H, L, M, S = s.shape
        if causal:
            allowed = torch.ones(L, S, dtype=torch.bool).tril(S - L)
            s = s.masked_fill(~allowed[:, None, :], float("-inf"))
        w = torch.softmax(s.reshape(B, H, L, M * S), -1).reshape(B, H, L, M, S).sum(3)
        return torch.nan_to_num(w, nan=0.0) @ v

    worst = 0.0
    # the block size is 64: S = L + 1 puts the last visible key of query 63 in the second key block
    for (B, H, L, S, M, D, Dv) in [(1, 2, 70, 90, 2, 8, 5), (2, 1, 33, 33, 3, 16, 16), (1, 1, 100, 20, 1, 4, 3),
                                   (1, 1, 70, 71, 2, 8, 8)]:
        for causal in (False, True):
            g = torch.Generator().manual_seed(L + S)
            ins = [torch.randn(*s, generator=g, dtype=torch.float64)
                   for s in [(B, H, L, D), (B, H, M, S, D), (B, H, M, S), (B, H, S, Dv)]]
            ins[1] = ins[1] * 0.5
            x32 = [t.float().requires_grad_() for t in ins]
            x64 = [t.requires_grad_() for t in ins]
            out = MixtureTriton.apply(*x32, causal)
            ref = formula(*x64, causal)
            go = torch.randn(ref.shape, generator=g, dtype=torch.float64)
            grads = torch.autograd.grad(out, x32, go.float())
            ref_grads = torch.autograd.grad(ref, x64, go)
            for a, b in zip((out, *grads), (ref, *ref_grads)):
                assert a.shape == b.shape, (a.shape, b.shape)
                err = ((a.double() - b).abs() - 2e-5 * b.abs()).max().item()  # float32 against float64
                worst = max(worst, err)
    print("WORST", worst)
""")


def test_interpreted_kernels_match_formula_with_gradients():
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    worst = float(p.stdout.split("WORST")[-1])
    assert worst < 2e-5, p.stdout  # |a - b| <= 2e-5 + 2e-5 |b| everywhere


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernels_match_explicit_path(monkeypatch):
    """On a GPU: the compiled kernels (opted in) against the float64 explicit path, output and gradients."""
    from mgk.functional import _mixture_triton, mgk_attention

    monkeypatch.setenv("MGK_TRITON", "1")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g) for s in [(2, 4, 300, 32), (2, 4, 2, 300, 32), (2, 4, 300, 32)])
    assert _mixture_triton.available(q.cuda(), 0.0)
    for causal in (False, True):
        ins = [t.cuda().requires_grad_() for t in (q, k, v)]
        ref_ins = [t.double().requires_grad_() for t in (q, k, v)]
        out = mgk_attention(*ins, is_causal=causal)
        ref = mgk_attention(*ref_ins, is_causal=causal, backend="explicit")
        torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)
        grads = torch.autograd.grad(out.sum(), ins)
        ref_grads = torch.autograd.grad(ref.sum(), ref_ins)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a.cpu().double(), b, atol=1e-3, rtol=1e-3)
