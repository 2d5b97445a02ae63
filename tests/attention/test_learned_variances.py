"""MGK with learned variances (``sigma2="learned"``: one sigma^2 per head and component, positive by construction):
declared once in the registry's MGK options, trained through every backend that serves it, with gradients equal to
the float64 formula (tests/functional/reference.py), and named, counted and built by every reader of the registry
(labels, bench variants, run configs) without anything else listing it."""
from __future__ import annotations

import math

import pytest
import torch

import mgk
from functional.reference import mgk_reference  # tests/functional (tests/ is on sys.path: its conftest)
from mgk.attention.registry import display_label, make_options, run_label
from mgk.bench.attention import build_kind
from mgk.config import RunConfig, apply_overrides

E, H, D, L = 16, 2, 8, 7
BACKENDS = ("kernel", "sdpa", "explicit")


def _module(kind="mgk", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = mgk.build_attention(kind, E, H, head_dim=D, sigma2="learned").to(dtype)
    with torch.no_grad():  # variances that differ per head and component, so that each matters
        m.log_sigma2.add_(0.4 * torch.randn(H, 2, dtype=dtype))
        m.pi_logits.normal_()
    return m


def _reference(m64, x, causal):
    """The module's output through the float64 formula on its own projections and variances."""
    q, k, v = m64._split(m64.q_proj(x)), m64._keys(x), m64._split(m64.v_proj(x))
    out, _ = mgk_reference(q, k, v, log_pi=m64.mixture_log_weights(L), sigma2=m64.sigma2, is_causal=causal,
                           grad=True)
    return m64.out_proj(out.transpose(1, 2).reshape(x.shape[0], L, H * D))


def test_learned_variances_start_at_sqrt_head_dim_per_head_and_component():
    m = mgk.build_attention("mgk", E, H, head_dim=D, sigma2="learned")
    assert m.learned_variances and m.sigma2.shape == (H, 2) and m.sigma2.requires_grad
    torch.testing.assert_close(m.sigma2, torch.full((H, 2), math.sqrt(D)))
    names = [n for n, _ in m.named_parameters()]
    assert "log_sigma2" in names  # a parameter: the optimiser trains it
    fixed = mgk.build_attention("mgk", E, H, head_dim=D)
    assert not fixed.learned_variances and "sigma2" in dict(fixed.named_buffers())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["mgk", "smgk"])
def test_learned_variance_gradients_match_the_float64_formula(kind, backend, causal):
    m = _module(kind)
    m.backend = backend
    m64 = _module(kind, torch.float64)
    x = torch.randn(2, L, E, generator=torch.Generator().manual_seed(1))
    out, _ = m(x, is_causal=causal, need_weights=False)
    ref = _reference(m64, x.double(), causal)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    out.square().sum().backward()
    ref.square().sum().backward()
    theta, theta64 = m.log_sigma2, m64.log_sigma2
    assert theta.grad.abs().max() > 0
    torch.testing.assert_close(theta.grad.double(), theta64.grad, atol=1e-4, rtol=1e-3)


def test_training_moves_the_variances_and_keeps_them_positive():
    torch.manual_seed(0)
    m = mgk.build_attention("mgk", E, H, head_dim=D, sigma2="learned")
    opt = torch.optim.SGD(m.parameters(), lr=5.0)
    x, target = torch.randn(4, L, E), torch.randn(4, L, E)
    start = m.sigma2.detach().clone()
    for _ in range(20):
        opt.zero_grad()
        out, _ = m(x, need_weights=False)
        (out - target).square().mean().backward()
        opt.step()
    assert not torch.allclose(m.sigma2, start)
    assert bool((m.sigma2 > 0).all()) and bool(torch.isfinite(m.sigma2).all())


def test_learned_variances_round_trip_through_state_dict():
    m = _module()
    fresh = mgk.build_attention("mgk", E, H, head_dim=D, sigma2="learned")
    fresh.load_state_dict(m.state_dict())
    torch.testing.assert_close(fresh.sigma2, m.sigma2)


def test_the_registry_names_the_option_everywhere():
    options = make_options("mgk", sigma2="learned")
    assert run_label("mgk", 4, options) == "mgk-4 sigma2=learned"
    assert display_label("mgk", 4, options) == "MGK x 4 (learned variances)"
    cfg = apply_overrides(RunConfig(), ["sigma2=learned"], attention="mgk")
    assert cfg.attention.options.sigma2 == "learned"
    assert build_kind("mgk+sigma2=learned", 4, 32, 8, 16).learned_variances  # a bench variant, from its name
    with pytest.raises(ValueError, match="sigma2"):
        make_options("mgk", sigma2="trained")
    with pytest.raises(ValueError, match="sigma2"):
        apply_overrides(RunConfig(), ["sigma2=learned"], attention="softmax")
