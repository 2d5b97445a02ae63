"""Module float masks (nn.MultiheadAttention semantics: finite values are added to the logits, -inf = not allowed)
go through the functional core's ``bias=`` and its backends, centred like every other call: with a shared q/k
offset of 1000 (through the projection biases) and an ALiBi-like float mask, MGKAttention in float32 matches its
float64 copy to 1e-5 for every pi mode (a separate uncentred formula gave 3e-3), the Soft-E update included; the
softmax MultiheadAttention's float masks match float64 and torch's semantics."""
from __future__ import annotations

import copy

import pytest
import torch

import mgk

E, H, D, L = 16, 2, 8, 9


def _alibi(L, slope=0.5):
    i = torch.arange(L)
    return -slope * (i[:, None] - i[None, :]).abs().float() - 0.25  # finite, non-zero everywhere


def _masks():
    """(attn_mask, key_padding_mask) pairs: float (L, S), float per head (B * H, L, S), float padding (B, S)."""
    g = torch.Generator().manual_seed(0)
    pad = torch.zeros(2, L)
    pad[1, 6:] = float("-inf")
    pad[0, :3] = torch.randn(3, generator=g)  # a finite per-key bias too
    per_head = torch.randn(2 * H, L, L, generator=g)
    return [(_alibi(L), None), (_alibi(L), pad), (per_head, None), (None, pad)]


def _offset(m, offset):
    """Add one vector of norm ``offset`` to every query and key through the projection biases."""
    c = torch.randn(D, generator=torch.Generator().manual_seed(1))
    c = c / c.norm() * offset
    with torch.no_grad():
        m.q_proj.bias += c.repeat(H)
        keys = m.mixture.k_proj if hasattr(m, "mixture") else m.k_proj
        keys.bias += c.repeat(keys.bias.numel() // D)
    return m


def _run(m, x, am, kpm):
    return m(x, attn_mask=am, key_padding_mask=kpm, need_weights=False)[0]


def _as64(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("pi", ["learned", "soft_e", "hard_e"])
@pytest.mark.parametrize("kind", ["mgk", "smgk"])
def test_mgk_float_masks_with_an_offset_of_1000_match_float64(pi, kind, build):
    m = _offset(build(kind, pi), 1000.0)
    m64 = copy.deepcopy(m).double()
    x = torch.randn(2, L, E, generator=torch.Generator().manual_seed(2))
    real = torch.ones(2, L, dtype=torch.bool)
    real[1, 6:] = False
    for am, kpm in _masks():
        got, ref = _run(m, x, am, kpm), _run(m64, x.double(), _as64(am), _as64(kpm))
        assert torch.isfinite(got[real]).all()
        torch.testing.assert_close(got[real].double(), ref[real], atol=1e-5, rtol=0)


def test_soft_e_update_with_a_float_mask_and_an_offset_matches_float64(build):
    """Training mode: the output and the updated pi (the E-step under the float mask's -inf entries) match."""
    m = _offset(build("mgk", "soft_e"), 1000.0).train()
    m64 = copy.deepcopy(m).double()
    x = torch.randn(2, L, E, generator=torch.Generator().manual_seed(3))
    am, kpm = _alibi(L), _masks()[1][1]
    got, ref = _run(m, x, am, kpm), _run(m64, x.double(), am.double(), kpm.double())
    torch.testing.assert_close(got[0].double(), ref[0], atol=1e-5, rtol=0)
    for module, out in ((m, got), (m64, ref)):  # the E-step is applied after backward
        out.sum().backward()
        assert mgk.soft_e_step(module) == 1
    torch.testing.assert_close(m.pi.double(), m64.pi, atol=1e-5, rtol=0)
    assert not torch.equal(m.pi, build("mgk", "soft_e").pi)  # the E-step ran


def test_softmax_float_masks_match_float64(build):
    m = build("softmax", "learned")
    m64 = copy.deepcopy(m).double()
    x = torch.randn(2, L, E, generator=torch.Generator().manual_seed(4))
    for am, kpm in _masks():
        got, ref = _run(m, x, am, kpm), _run(m64, x.double(), _as64(am), _as64(kpm))
        torch.testing.assert_close(got[0].double(), ref[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["softmax", "mgk"])
def test_a_float_mask_of_zeros_and_minus_inf_equals_the_bool_mask(kind, build):
    m = build(kind, "learned")
    x = torch.randn(2, L, E)
    pad = torch.zeros(2, L, dtype=torch.bool)
    pad[1, 5:] = True
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    as_float = torch.zeros(L, L).masked_fill(causal, float("-inf"))
    kpm_float = torch.zeros(2, L).masked_fill(pad, float("-inf"))
    torch.testing.assert_close(m(x, attn_mask=as_float, key_padding_mask=kpm_float)[0],
                               m(x, attn_mask=causal, key_padding_mask=pad)[0], atol=1e-6, rtol=0)
