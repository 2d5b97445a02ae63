"""The authors' attention forms through the modules, the registry and the run config.

Each module is run in float64 and compared, to 1e-10, with the reference of ``tests/reference_authors.py`` applied
to the module's own projections of the same input (q = x W_q + b, the mixture keys, v), followed by its output
projection: the module round trip of the functional comparisons in tests/functional/test_authors_forms.py.
"""
import math

import pytest
import torch

from mgk.attention import LinearAttention, MGKAttention, MLKAttention, build_attention
from mgk.attention.registry import attention_options, check_options
from mgk.config import RunConfig, apply_overrides, attention_config, validate
from reference_authors import lm_linear_type34, lm_mgk, lm_mlk_type400, lra_linear, lra_mlk

E, H, D, B, L = 12, 3, 4, 2, 9
TOL = dict(rtol=1e-10, atol=1e-10)
LM34 = dict(feature_map="elu_sum", output_scale=D ** -0.5, eps=1e-5, eps_mode="add")


def _x(seed=0):
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _module(cls, **kw):
    torch.manual_seed(0)
    return cls(E, H, head_dim=D, **kw, batch_first=True).double()


def _through(module, x, core):
    """out_proj(core(q, keys, v)) with the module's own projections; keys (B, H, S, D) or (B, H, M, S, D)."""
    q = module._split(module.q_proj(x))
    k = module._keys(x)
    v = module._split(module.v_proj(x))
    out = core(q, k, v)
    return module.out_proj(out.transpose(1, 2).reshape(B, L, H * D))


def _padding():
    return torch.arange(L)[None, :] >= torch.tensor([L, 5])[:, None]  # True = padded


def test_lra_linear_module():
    m = _module(LinearAttention, normalize="length")
    x, pad = _x(), _padding()
    got, _ = m(x, key_padding_mask=pad, need_weights=False)
    want = _through(m, x, lambda q, k, v: lra_linear(q, k, v, pad))
    torch.testing.assert_close(got, want, **TOL)


def test_lra_mlk_module():
    m = _module(MLKAttention, mix="keys", pi_shape="layer", pi_norm="none", normalize="length")
    assert m.pi_logits.shape == (1, 2)
    torch.testing.assert_close(m.pi_logits.exp(), torch.full((1, 2), 0.5, dtype=torch.float64))  # authors' init
    pi = torch.tensor([0.9, 0.25], dtype=torch.float64)
    with torch.no_grad():
        m.pi_logits.copy_(pi.log()[None])
    x, pad = _x(1), _padding()
    got, _ = m(x, key_padding_mask=pad, need_weights=False)
    want = _through(m, x, lambda q, k, v: lra_mlk(q, k[:, :, 0], k[:, :, 1], pi, v, pad))
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("normalize", [True, False])
def test_lm_type34_module(normalize):
    m = _module(LinearAttention, normalize="row" if normalize else "none", **LM34)
    x = _x(2)
    got, _ = m(x, is_causal=True, need_weights=False)
    want = _through(m, x, lambda q, k, v: lm_linear_type34(q, k, v, normalize=normalize))
    torch.testing.assert_close(got, want, **TOL)


def test_lm_type400_module():
    P = 16
    m = _module(MLKAttention, pi_shape="position", pi_norm="none", max_len=P, mix="features", **LM34)
    assert m.pi_logits.shape == (H, 2, P)
    pi0, pi1 = torch.rand(H, P, dtype=torch.float64) * 0.9 + 0.05, torch.rand(H, P, dtype=torch.float64) * 0.9 + 0.05
    with torch.no_grad():
        m.pi_logits.copy_(torch.stack([pi0, pi1], dim=1).log())
    x = _x(3)
    got, _ = m(x, is_causal=True, need_weights=False)
    want = _through(m, x, lambda q, k, v: lm_mlk_type400(q, k[:, :, 0], k[:, :, 1], v, pi0, pi1))
    torch.testing.assert_close(got, want, **TOL)


def test_lm_mgk_module():
    P = 16
    m = _module(MGKAttention, pi_shape="position", pi_norm="none", max_len=P, sigma2=(math.sqrt(D), math.sqrt(D) / 3))
    m.eval()
    pi = torch.rand(2, H, P, dtype=torch.float64) * 0.9 + 0.05
    with torch.no_grad():
        m.pi_logits.copy_(pi.transpose(0, 1).log())
    x = _x(4)
    got, _ = m(x, is_causal=True, need_weights=False)
    want = _through(m, x, lambda q, k, v: lm_mgk(q, k[:, :, 0], k[:, :, 1], v, pi, eps=0.0))
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("cls", [MGKAttention, MLKAttention])
def test_pi_norm_none_starts_at_one_over_m_and_keeps_a_gradient_where_the_clamp_had_none(cls):
    soft = _module(cls, pi_shape="position", max_len=L)
    free = _module(cls, pi_shape="position", pi_norm="none", max_len=L)
    torch.testing.assert_close(free.mixture_log_weights(L).exp(), torch.full((1, H, 2, L), 0.5, dtype=torch.float64))
    free.load_state_dict(soft.state_dict() | {"mixture.pi_logits": free.pi_logits.detach()})
    x = _x(5)
    # the same first forward as the softmax form
    torch.testing.assert_close(free(x, need_weights=False)[0], soft(x, need_weights=False)[0], **TOL)
    with torch.no_grad():  # a weight above 1 (the authors' clamp would freeze it there) and one below 0 in log
        free.pi_logits[0, 0, :] = math.log(1.5)
    free(x, need_weights=False)[0].pow(2).sum().backward()
    grad = free.pi_logits.grad
    assert torch.isfinite(grad).all() and (grad[0, 0] != 0).all()
    assert not torch.allclose(free.mixture_log_weights(L).exp().sum(2), torch.ones(1, H, L, dtype=torch.float64))


def test_pi_shape_layer_is_one_set_shared_by_heads():
    layer = _module(MGKAttention, pi_shape="layer")
    head = _module(MGKAttention, pi_shape="head")
    with torch.no_grad():
        layer.pi_logits.copy_(torch.tensor([[0.3, -0.4]]))
        head.pi_logits.copy_(torch.tensor([[0.3, -0.4]]).expand(H, 2))
    head.load_state_dict(layer.state_dict() | {"mixture.pi_logits": head.pi_logits.detach()})
    assert layer.mixture_log_weights(L).shape == (1, 1, 2, 1)
    x = _x(6)
    torch.testing.assert_close(layer(x, need_weights=False)[0], head(x, need_weights=False)[0], **TOL)


def test_per_component_sigma2_accepts_list_and_tuple():
    a = _module(MGKAttention, sigma2=(2.0, 2.0 / 3))
    b = _module(MGKAttention, sigma2=[2.0, 2.0 / 3])
    assert a.sigma2.tolist() == b.sigma2.tolist() == pytest.approx([2.0, 2.0 / 3])
    with pytest.raises(ValueError, match="sigma2"):
        _module(MGKAttention, sigma2=(2.0, 1.0, 0.5))


def test_defaults_are_unchanged():
    for cls in (LinearAttention, MLKAttention):
        m = _module(cls)
        assert (m.normalize, m.feature_map, m.output_scale, m.eps, m.eps_mode) == ("row", "elu", 1.0, 1e-6, "guard")
    assert _module(MLKAttention).mix == "features"
    for cls in (MGKAttention, MLKAttention):
        m = _module(cls)
        assert m.pi_norm == "softmax" and m.pi_shape == "head" and torch.equal(m.pi_logits, torch.zeros(H, 2,
                                                                                                       dtype=torch.float64))


@pytest.mark.parametrize("kw, name", [(dict(normalize="rows"), "normalize"), (dict(feature_map="relu"), "feature_map"),
                                      (dict(output_scale=-1.0), "output_scale"), (dict(eps_mode="x"), "eps_mode")])
def test_bad_module_options_name_the_option(kw, name):
    for cls in (LinearAttention, MLKAttention):
        with pytest.raises(ValueError, match=name):
            _module(cls, **kw)


def test_bad_mixture_options_name_the_option():
    with pytest.raises(ValueError, match="mix"):
        _module(MLKAttention, mix="raw")
    with pytest.raises(ValueError, match="pi_norm"):
        _module(MGKAttention, pi_norm="clamp")
    with pytest.raises(ValueError, match="pi_norm"):
        _module(MGKAttention, pi="soft_e", pi_norm="none", max_len=L)
    with pytest.raises(ValueError, match="pi_shape"):
        _module(MGKAttention, pi_shape="batch")


# --- registry and run config -------------------------------------------------------------------------------------

def test_registry_declares_the_options_with_types():
    linear = attention_options("linear")
    assert {"normalize", "feature_map", "output_scale", "attn_eps", "eps_mode"} <= set(linear)
    assert {"mix", "pi_norm", "normalize", "attn_eps"} <= set(attention_options("mlk")) - {"sigma2"}
    assert "pi_norm" in attention_options("mgk") and "normalize" not in attention_options("mgk")
    with pytest.raises(ValueError, match="normalize"):
        check_options("mgk", {"normalize": "length"})
    with pytest.raises(ValueError, match="output_scale"):
        check_options("linear", {"output_scale": "0.25"})


@pytest.mark.parametrize("kind, sets, attrs", [
    ("linear", ["normalize=length"], dict(normalize="length")),
    ("linear", ["feature_map=elu_sum", "output_scale=0.25", "attn_eps=1e-5", "eps_mode=add"],
     dict(feature_map="elu_sum", output_scale=0.25, eps=1e-5, eps_mode="add")),
    ("mlk", ["mix=keys", "pi_shape=layer", "pi_norm=none", "normalize=length"],
     dict(mix="keys", pi_shape="layer", pi_norm="none", normalize="length")),
    ("smlk", ["pi_norm=none", "feature_map=elu_sum"], dict(pi_norm="none", feature_map="elu_sum")),
    ("mgk", ["pi_norm=none", "pi_shape=position", "sigma2=[4.0,1.3333333333333333]"],
     dict(pi_norm="none", pi_shape="position")),
])
def test_set_reaches_the_module_through_the_config(kind, sets, attrs):
    cfg = validate(apply_overrides(RunConfig(attention=kind, d_model=E, num_heads=H, head_dim=D), sets))
    ac = attention_config(cfg)
    m = build_attention(ac.kind, E, ac.num_heads, head_dim=ac.head_dim, **ac.options)
    for name, value in attrs.items():
        assert getattr(m, name) == value, name


def test_config_defaults_build_todays_modules():
    for kind in ("linear", "mlk", "mgk"):
        ac = attention_config(RunConfig(attention=kind, d_model=E, num_heads=H, head_dim=D))
        torch.manual_seed(0)
        built = build_attention(kind, E, H, head_dim=D, **ac.options).double()
        torch.manual_seed(0)
        plain = build_attention(kind, E, H, head_dim=D, max_len=ac.options.get("max_len")).double() \
            if "max_len" in attention_options(kind) else build_attention(kind, E, H, head_dim=D).double()
        x = _x(7)
        torch.testing.assert_close(built(x, need_weights=False)[0], plain(x, need_weights=False)[0], rtol=0, atol=0)


@pytest.mark.parametrize("field, value", [("normalize", "rows"), ("feature_map", "relu"), ("eps_mode", "plus"),
                                          ("mix", "raw"), ("pi_norm", "clamp"), ("pi_shape", "batch")])
def test_config_refuses_unknown_values(field, value):
    with pytest.raises(ValueError, match=field):
        validate(apply_overrides(RunConfig(attention="mlk"), [f"{field}={value}"]))
