"""Properties every attention kind must have, over every registered kind and option variant (the ``variant``
fixture): padding invariance, causality on every path, batch invariance, dtypes, L = 1, fully masked rows, normalised
returned weights."""
import copy

import pytest
import torch

from mgk.attention import get_kind

E, H = 16, 2  # as the `build` fixture in conftest.py


@pytest.mark.parametrize("causal", [False, True])
def test_padded_content_is_inert(build, variant, causal):
    """Appending padded tokens whose content is 1e30 or NaN leaves the real outputs unchanged."""
    m = build(*variant)
    torch.manual_seed(1)
    x = torch.randn(2, 6, E)
    ref, _ = m(x, is_causal=causal, need_weights=False)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[:, 6:] = True
    for fill in (1e30, float("nan")):
        padded = torch.cat([x, torch.full((2, 3, E), fill)], dim=1)
        out, _ = m(padded, key_padding_mask=kpm, is_causal=causal, need_weights=False)
        torch.testing.assert_close(out[:, :6], ref, rtol=1e-5, atol=1e-6)


def test_padding_changes_are_inert_and_real_changes_matter(build, variant):
    """Polarity probe: changing a padded token moves no real output; changing a real token does."""
    m = build(*variant)
    torch.manual_seed(2)
    x = torch.randn(1, 6, E)
    kpm = torch.tensor([[False] * 4 + [True] * 2])
    base, _ = m(x, key_padding_mask=kpm, need_weights=False)
    x_pad, x_real = x.clone(), x.clone()
    x_pad[0, 5] = 1e30
    x_real[0, 1] += 1.0
    assert torch.equal(m(x_pad, key_padding_mask=kpm, need_weights=False)[0][:, :4], base[:, :4])
    moved = m(x_real, key_padding_mask=kpm, need_weights=False)[0]
    assert (moved[:, [0, 2, 3]] - base[:, [0, 2, 3]]).abs().max() > 1e-4
    no_padding = torch.zeros(1, 6, dtype=torch.bool)
    assert torch.equal(m(x, key_padding_mask=no_padding, need_weights=False)[0], m(x, need_weights=False)[0])


def _run(m, state, x, path):
    m.load_state_dict(state)  # Soft-E writes pi in training: every run starts from the same weights
    if path == "train":
        m.train()
        torch.manual_seed(123)  # the same dropout masks for both runs
        return m(x, is_causal=True, need_weights=False)[0]
    m.eval()
    if path == "weights":
        return m(x, is_causal=True, need_weights=True)[0]
    if path == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x, is_causal=True, need_weights=False)[0]
    return m(x, is_causal=True, need_weights=False)[0]


@pytest.mark.parametrize("path", ["eval", "train", "weights", "bf16", "batch1"])
def test_causality_on_every_path(build, variant, path):
    """Changing tokens after position 5 leaves outputs 0..5 bitwise unchanged and changes later ones."""
    m = build(*variant, dropout=0.1)
    state = copy.deepcopy(m.state_dict())
    torch.manual_seed(3)
    x = torch.randn(1 if path == "batch1" else 2, 8, E)
    y = x.clone()
    y[:, 6:] = torch.randn_like(y[:, 6:])
    a, b = _run(m, state, x, path), _run(m, state, y, path)
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.equal(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("causal", [False, True])
def test_batch_invariance(build, variant, causal):
    """A sequence's outputs do not depend on its batch mates (batch 1 vs inside batch 3, with padding)."""
    m = build(*variant)
    torch.manual_seed(4)
    seq = torch.randn(1, 7, E)
    alone, _ = m(seq, is_causal=causal, need_weights=False)
    batch = torch.randn(3, 10, E)
    batch[1, :7] = seq[0]
    kpm = torch.zeros(3, 10, dtype=torch.bool)
    kpm[1, 7:] = True
    out, _ = m(batch, key_padding_mask=kpm, is_causal=causal, need_weights=False)
    torch.testing.assert_close(out[1:2, :7], alone, rtol=1e-5, atol=1e-6)


def test_dtypes(build, variant):
    """float64 modules compute in float64 (and agree with float32); bf16 autocast stays finite and within 2e-2
    (relative norm) of float32 for inputs of norm ~30."""
    m = build(*variant)
    # Softmax and MGK logits grow with |q| |k| (inputs of norm 30): bf16 rounding of the projections moves them
    # more than linear attention's bounded features.
    tol = 2e-2 if get_kind(variant[0]).family == "linear" else 4e-2
    torch.manual_seed(6)
    x = torch.randn(2, 64, E)
    x = 30 * x / x.norm(dim=-1, keepdim=True)
    for causal in (False, True):
        ref, _ = m(x, is_causal=causal, need_weights=False)
        out64, _ = copy.deepcopy(m).double()(x.double(), is_causal=causal, need_weights=False)
        assert out64.dtype == torch.float64
        torch.testing.assert_close(out64.float(), ref, rtol=1e-4, atol=1e-4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = m(x, is_causal=causal, need_weights=False)
        assert torch.isfinite(out).all()
        # Relative to the output's norm: the bf16 projections shift individual near-zero outputs by a few 1e-2.
        assert ((out.float() - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize("causal", [False, True])
def test_length_one_attends_to_its_own_value(build, variant, causal):
    """With one key, every kind's weight is 1: the output is out_proj(v_proj(x)), each value head read by the query
    heads it serves (all of them for grouped-query attention's one head)."""
    m = build(*variant)
    x = torch.randn(3, 1, E)
    out, _ = m(x, is_causal=causal, need_weights=False)
    v = m.v_proj(x).view(3, 1, m.kv_heads, -1).repeat_interleave(m.num_heads // m.kv_heads, dim=2).flatten(2)
    torch.testing.assert_close(out, m.out_proj(v), rtol=1e-5, atol=1e-6)


def test_fully_masked_rows_are_zero_with_finite_grads(build, variant):
    """A sequence whose keys are all padding: the attention output is exactly zero (out_proj's bias after the
    projection) and every gradient stays finite."""
    m = build(*variant).train()
    x = torch.randn(2, 4, E, requires_grad=True)
    kpm = torch.tensor([[False] * 4, [True] * 4])
    for causal in (False, True):
        out, _ = m(x, key_padding_mask=kpm, is_causal=causal, need_weights=False)
        assert torch.equal(out[1], m.out_proj.bias.expand(4, E).detach())
        m.zero_grad()
        x.grad = None
        out.square().sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
        assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("causal", [False, True])
def test_need_weights_returns_normalised_weights(build, variant, causal):
    m = build(*variant)
    torch.manual_seed(5)
    x = torch.randn(2, 6, E)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[0, 4:] = True
    out, w = m(x, key_padding_mask=kpm, is_causal=causal, need_weights=True, average_attn_weights=False)
    plain, none = m(x, key_padding_mask=kpm, is_causal=causal, need_weights=False)
    assert none is None
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
    assert w.shape == (2, H, 6, 6) and (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, H, 6), rtol=0, atol=1e-5)
    assert torch.equal(w[0, :, :, 4:], torch.zeros_like(w[0, :, :, 4:]))
    if causal:
        assert torch.equal(w.triu(1), torch.zeros_like(w))
