"""Query chunking (explicit path, checkpointed in training; Soft-E statistics) gives the unchunked numbers."""
import pytest
import torch

from mgk.functional import mgk_attention, mgk_responsibilities


@pytest.mark.parametrize("mixture", ["sum", "max"])
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_explicit_path_values_and_gradients(mixture, causal):
    torch.manual_seed(0)
    q = torch.randn(2, 2, 7, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 3, 7, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 7, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[1, ..., 5:] = False
    outs, grads = [], []
    for chunk in (2, 3, 1000):  # 2 and 3 take the checkpointed path, 1000 the plain one
        out = mgk_attention(q, k, v, mixture=mixture, attn_mask=mask, is_causal=causal, backend="explicit",
                            chunk_size=chunk)
        outs.append(out)
        grads.append(torch.autograd.grad((out * torch.arange(5.0, dtype=out.dtype)).sum(), (q, k, v)))
    for out, grad in zip(outs[:-1], grads[:-1]):
        torch.testing.assert_close(out, outs[-1], atol=1e-12, rtol=1e-10)
        for g, ref in zip(grad, grads[-1]):
            torch.testing.assert_close(g, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("M", [1, 2, 3])
def test_chunked_responsibilities(M):
    torch.manual_seed(1)
    q = torch.randn(2, 2, 9, 4)
    k = torch.randn(2, 2, M, 9, 4)
    qm = torch.ones(2, 9, dtype=torch.bool)
    qm[0, 7:] = False
    full = mgk_responsibilities(q, k, is_causal=True, query_mask=qm, chunk_size=1000)
    for chunk in (1, 4):
        part = mgk_responsibilities(q, k, is_causal=True, query_mask=qm, chunk_size=chunk)
        torch.testing.assert_close(part[0], full[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(part[1], full[1])
    torch.testing.assert_close(full[0].sum(1), full[1])  # responsibilities of a pair sum to 1 over components
