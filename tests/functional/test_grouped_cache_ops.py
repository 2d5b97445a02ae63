"""MGK's cached ops over grouped keys (gMGK: G key groups shared by H query heads, the group's heads folded into its
query rows): mgk_attention_cached and mgk_cache_step with G < H equal the float64 formula of the keys repeated for
every query head, on the C++ kernel and the explicit GEMMs, for one new token and for several (the causal alignment
repeating for each folded head), separate and shifted keys, a padded cache, per-group variances; and the step writes
the group's entries once, as the explicit composition does."""
from __future__ import annotations

import pytest
import torch

from mgk.functional import _mixture_flash, mgk_attention_cached, mgk_cache_entries, mgk_cache_step

from .reference import mgk_reference, normalised_log_pi

F64 = torch.float64


@pytest.fixture
def kernel():
    if _mixture_flash._load() is None:
        pytest.skip(f"the CPU kernel could not be built here: {_mixture_flash.build_error()}")


def _grouped(*, B=2, H=6, G=2, M=2, D=8, Dv=5, old=9, L=1, T=16, shifted=False, seed=0):
    """float64 keys of ``old`` cached and L new tokens for G groups, H queries, the buffers holding the old entries,
    the step's arguments and the formula's output over every key repeated for the H / G heads of its group."""
    g = torch.Generator().manual_seed(seed)
    S, R = old + L, H // G
    raw = (torch.randn(B, G, S, D, generator=g, dtype=F64) if shifted
           else torch.randn(B, G, M, S, D, generator=g, dtype=F64)) + 2.0
    v = torch.randn(B, G, S, Dv, generator=g, dtype=F64)
    q = torch.randn(B, H, L, D, generator=g, dtype=F64) + 2.0
    shifts = None
    if shifted:
        shifts = torch.cat([torch.zeros(1, G, D, dtype=F64), 0.5 * torch.randn(M - 1, G, D, generator=g, dtype=F64)])
    sigma2 = torch.linspace(0.7, 2.0, G * M, dtype=F64).reshape(G, M)  # per group, unequal
    log_pi = normalised_log_pi((1, G, M, 1), dim=2, seed=seed)
    centre = raw.mean(dim=-2) if shifted else raw.mean(dim=(2, 3))
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[-1, :2] = False
    keys, key_bias = mgk_cache_entries(raw[..., :old, :], centre=centre, log_pi=log_pi, sigma2=sigma2, shifts=shifts)
    buffers = {"keys": torch.zeros(*keys.shape[:-2], T, D, dtype=F64), "key_bias": torch.zeros(B, G, M, T, dtype=F64),
               "values": torch.zeros(B, G, T, Dv, dtype=F64)}
    buffers["keys"][..., :old, :] = keys
    buffers["key_bias"][..., :old] = key_bias
    buffers["values"][:, :, :old] = v[:, :, :old]
    k = raw if not shifted else raw.unsqueeze(2) - shifts.transpose(0, 1).unsqueeze(0).unsqueeze(3)
    heads = {"k": k.repeat_interleave(R, 1), "v": v.repeat_interleave(R, 1), "log_pi": log_pi.repeat_interleave(R, 1),
             "sigma2": sigma2.repeat_interleave(R, 0)}
    want, _ = mgk_reference(q, heads["k"], heads["v"], log_pi=heads["log_pi"], sigma2=heads["sigma2"],
                            mask=valid[:, None, None, :], is_causal=True, log_space=True)
    step = dict(slot=old, centre=centre, key_valid=valid, log_pi=log_pi, sigma2=sigma2, shifts=shifts)
    return q, raw[..., old:, :], v[:, :, old:], buffers, step, want


@pytest.mark.parametrize("backend", ["kernel", "explicit"])
@pytest.mark.parametrize("shifted", [False, True], ids=["separate", "shifted"])
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("old", [9, 2100], ids=["dot-loop", "gemm"])
def test_a_grouped_step_is_the_formula_of_the_repeated_keys(old, L, shifted, backend, kernel):
    """Each group's query heads folded into its rows (causal period L), with few cached tokens and with enough for
    the kernel's batched GEMM of the dot products."""
    q, key, value, buffers, step, want = _grouped(L=L, old=old, T=old + L + 6, shifted=shifted)
    bufs = {n: b.clone() for n, b in buffers.items()}
    got = mgk_cache_step(q, key, value, **bufs, **step, backend=backend)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    ref = {n: b.clone() for n, b in buffers.items()}
    mgk_cache_step(q, key, value, **ref, **step, backend="explicit")
    for name in bufs:  # the group's entries, written once whoever writes them
        torch.testing.assert_close(bufs[name], ref[name], atol=1e-12, rtol=1e-12, msg=name)
    S = step["slot"] + L
    cached = mgk_attention_cached(q, bufs["keys"][..., :S, :], bufs["key_bias"][..., :S], bufs["values"][:, :, :S],
                                  centre=step["centre"], sigma2=step["sigma2"], shifts=step["shifts"],
                                  attn_mask=step["key_valid"][:, None, None, :], backend=backend)
    torch.testing.assert_close(cached, want, atol=1e-10, rtol=1e-10)


def test_a_grouped_cache_needs_groups_that_divide_the_query_heads():
    _, key, value, buffers, step, _ = _grouped(H=4, G=2)
    q = torch.randn(2, 5, 1, 8, dtype=F64)
    with pytest.raises(ValueError, match="dividing query's 5 heads") as info:
        mgk_cache_step(q, key, value, **buffers, **step)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="dividing query's 5 heads"):
        mgk_attention_cached(q, buffers["keys"], buffers["key_bias"], buffers["values"], centre=step["centre"])
