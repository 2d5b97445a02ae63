"""Light checks of the authors'-form references in ``reference_authors.py`` (shapes, causality, padding, reductions).

The references are test oracles; these tests make sure each one computes the form its docstring states, so that
a later comparison against our implementation compares against the right thing.
"""
import math

import pytest
import torch

from reference_authors import lm_linear_type34, lm_mgk, lm_mlk_type400, lra_linear, lra_mgk, lra_mlk

B, H, L, D = 2, 3, 7, 4


def _qkv(seed=0, n=3, L=L):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(n)]


def _pad(L=L, real=(7, 4)):
    return torch.arange(L)[None, :] >= torch.tensor(real)[:, None]  # True = padding


def test_shapes_and_dtype():
    q, k, k2, v = _qkv(n=4)
    pi_pair = torch.tensor([0.3, 0.9], dtype=torch.float64)
    pi_pos = torch.rand(H, 256, dtype=torch.float64)
    outs = [lra_linear(q, k, v, _pad()), lra_mlk(q, k, k2, pi_pair, v, _pad()), lra_mgk(q, k, k2, pi_pair, v, _pad()),
            lm_linear_type34(q, k, v), lm_mlk_type400(q, k, k2, v, pi_pos, pi_pos),
            lm_mgk(q, k, k2, v, torch.stack([pi_pos, pi_pos]))]
    for out in outs:
        assert out.shape == (B, H, L, D) and out.dtype == torch.float64 and torch.isfinite(out).all()


def test_lra_linear_is_the_unnormalised_length_scaled_form():
    q, k, v = _qkv()
    # the explicit double sum, written independently of the matrix products in the reference
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    want = torch.einsum("bhid,bhjd,bhje->bhie", fq, fk, v) / math.sqrt(L)
    torch.testing.assert_close(lra_linear(q, k, v), want, rtol=1e-12, atol=1e-12)
    # no denominator: a constant value does not give a constant output
    out = lra_linear(q, k, torch.ones_like(v))
    assert not torch.allclose(out, torch.ones_like(out))


def test_lra_linear_ignores_padded_content_but_keeps_padded_length():
    q, k, v = _qkv()
    pad = _pad()
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 4:] = 1e3
    v2[1, :, 4:] = -7.0
    torch.testing.assert_close(lra_linear(q, k, v, pad), lra_linear(q, k2, v2, pad), rtol=0, atol=1e-12)
    # the scale uses the padded tensor length: dropping the padding changes the real rows by (L/4)^(1/2)
    short = lra_linear(q[1:, :, :4], k[1:, :, :4], v[1:, :, :4])
    torch.testing.assert_close(lra_linear(q, k, v, pad)[1:, :, :4], short * math.sqrt(4 / L), rtol=1e-12, atol=0)


def test_lra_mlk_mixes_raw_keys():
    q, k1, k2, v = _qkv(n=4)
    one_zero = torch.tensor([1.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(lra_mlk(q, k1, k2, one_zero, v), lra_linear(q, k1, v))
    # clamped: a weight above one acts as one, below zero as zero
    torch.testing.assert_close(lra_mlk(q, k1, k2, torch.tensor([3.0, -2.0], dtype=torch.float64), v),
                               lra_linear(q, k1, v))
    half = torch.tensor([0.5, 0.5], dtype=torch.float64)
    torch.testing.assert_close(lra_mlk(q, k1, k2, half, v), lra_linear(q, 0.5 * (k1 + k2), v))


def test_lra_mgk_single_component_is_gaussian_softmax():
    q, k1, k2, v = _qkv(n=4)
    pad = _pad()
    out = lra_mgk(q, k1, k2, torch.tensor([1.0, 0.0], dtype=torch.float64), v, pad)
    logits = -((q[..., :, None, :] - k1[..., None, :, :]) ** 2).sum(-1) / (2 * math.sqrt(D))
    logits = logits.masked_fill(pad[:, None, None, :], -math.inf)
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("form", ["type34", "type400", "mgk"])
def test_lm_forms_are_causal(form):
    q, k1, k2, v = _qkv(n=4)
    pi = torch.rand(2, H, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def run(q, k1, k2, v):
        if form == "type34":
            return lm_linear_type34(q, k1, v)
        if form == "type400":
            return lm_mlk_type400(q, k1, k2, v, pi[0], pi[1])
        return lm_mgk(q, k1, k2, v, pi)

    base = run(q, k1, k2, v)
    t = 3
    changed = [x.clone() for x in (q, k1, k2, v)]
    for x in changed:
        x[:, :, t + 1:] = torch.randn_like(x[:, :, t + 1:]) * 5
    torch.testing.assert_close(run(*changed)[:, :, :t + 1], base[:, :, :t + 1], rtol=0, atol=1e-13)
    assert not torch.allclose(run(*changed)[:, :, t + 1:], base[:, :, t + 1:])


def test_lm_type34_first_position_and_scale():
    q, k, v = _qkv()
    out = lm_linear_type34(q, k, v, eps=0.0)
    # position 0 sees only itself: the normalised weight is 1, times the 1/sqrt(D) output scale
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0] / math.sqrt(D), rtol=1e-12, atol=0)
    # with eps = 0 and the denominator, a constant value gives the constant times 1/sqrt(D)
    torch.testing.assert_close(lm_linear_type34(q, k, torch.ones_like(v), eps=0.0),
                               torch.full_like(v, 1 / math.sqrt(D)), rtol=1e-12, atol=0)


def test_lm_type400_reduces_to_type34():
    q, k1, k2, v = _qkv(n=4)
    ones, zeros = torch.ones(H, 256, dtype=torch.float64), torch.zeros(H, 256, dtype=torch.float64)
    torch.testing.assert_close(lm_mlk_type400(q, k1, k2, v, ones, zeros), lm_linear_type34(q, k1, v))
    # the weights are per key position: weighting one key position changes the outputs that can see it
    w = ones.clone()
    w[:, 2] = 0.2
    diff = (lm_mlk_type400(q, k1, k2, v, w, zeros) - lm_linear_type34(q, k1, v)).abs().amax((0, 1, 3))
    assert torch.all(diff[:2] == 0) and torch.all(diff[2:] > 0)


def test_lm_mgk_variances_and_unnormalised_weights():
    q, k1, k2, v = _qkv(n=4)
    d2 = lambda k: ((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1)  # noqa: E731
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    pi = torch.rand(2, H, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    # component 2 has variance sqrt(D)/3 by default: written as log-kernels, the second is 3x steeper
    logits = torch.logaddexp(torch.log(pi[0, :, :L])[None, :, None, :] - d2(k1) / (2 * math.sqrt(D)),
                             torch.log(pi[1, :, :L])[None, :, None, :] - 3 * d2(k2) / (2 * math.sqrt(D)))
    want = torch.softmax(logits.masked_fill(~causal, -math.inf), -1) @ v
    torch.testing.assert_close(lm_mgk(q, k1, k2, v, pi, eps=0.0), want, rtol=1e-10, atol=1e-12)
    # scaling both weights of one position's components by the same factor is not a no-op (no normalisation
    # over components): the position's prior weight changes
    pi2 = pi.clone()
    pi2[:, :, 1] *= 0.1
    assert not torch.allclose(lm_mgk(q, k1, k2, v, pi2), lm_mgk(q, k1, k2, v, pi))
    # the clamp: weights outside [0, 1] act as the boundary value
    big = pi.clone()
    big[0] = 5.0
    ones = pi.clone()
    ones[0] = 1.0
    torch.testing.assert_close(lm_mgk(q, k1, k2, v, big), lm_mgk(q, k1, k2, v, ones))
    torch.testing.assert_close(lm_mgk(q, k1, k2, v, big, clamp=False, eps=0.0),
                               lm_mgk(q, k1, k2, v, ones * torch.tensor([5.0, 1.0], dtype=torch.float64)[:, None, None],
                                      clamp=False, eps=0.0))


def test_bad_mask_is_a_clear_error():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="key_padding_mask"):
        lra_linear(q, k, v, _pad().float())
