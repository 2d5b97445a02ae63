"""LinearAttention / MLKAttention modules and their registry names ("linear", "mlk", "smlk"): masks, options,
the mixture keys. Padding, causality, batch invariance, dtypes and returned weights of every kind are in
test_properties.py."""
import pytest
import torch

import mgk
from mgk.attention import LinearAttention, MLKAttention, build_attention
from mgk.functional import MaskError

E, H = 16, 2
KINDS = [
    ("linear", {}),
    ("mlk", {}),
    ("smlk", {}),
    ("mlk", {"num_keys": 3, "pi_shape": "position", "max_len": 64}),
]
IDS = ["linear", "mlk", "smlk", "mlk3-position"]


def build(kind, options, **common):
    torch.manual_seed(0)
    module = build_attention(kind, E, H, **common, **options)
    if isinstance(module, MLKAttention):  # non-uniform priors, so that pi actually matters
        with torch.no_grad():
            module.pi_logits.normal_()
    return module.eval()


@pytest.mark.parametrize("kind,options", KINDS, ids=IDS)
def test_attn_mask_with_query_dimension_is_rejected(kind, options):
    m = build(kind, options)
    x = torch.randn(2, 5, E)
    with pytest.raises(MaskError, match="key-padding"):
        m(x, attn_mask=torch.zeros(5, 5, dtype=torch.bool), need_weights=False)


@pytest.mark.parametrize("kind,options", KINDS, ids=IDS)
def test_dropout_is_accepted_but_unused(kind, options):
    m = build(kind, options, dropout=0.3)
    x = torch.randn(2, 5, E)
    m.train()
    a, _ = m(x, need_weights=False)
    b, _ = m(x, need_weights=False)
    m.eval()
    c, _ = m(x, need_weights=False)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_registry_builds_the_right_classes():
    assert {"linear", "mlk", "smlk"} <= set(mgk.attention_kinds())
    lin = build_attention("linear", E, H)
    assert type(lin) is LinearAttention and not hasattr(lin, "pi_logits")
    for option in ({"num_keys": 3}, {"pi": "soft_e"}, {"sigma2": 2.0}):  # never silently dropped
        with pytest.raises(ValueError, match=f"{next(iter(option))}.*linear"):
            build_attention("linear", E, H, **option)
    with pytest.raises(ValueError, match="sigma2.*mlk"):
        build_attention("mlk", E, H, sigma2=2.0)
    mlk = build_attention("mlk", E, H, num_keys=3, dropout=0.1, head_dim=4)
    assert type(mlk) is MLKAttention and mlk.keys == "separate" and mlk.num_keys == 3 and mlk.head_dim == 4
    assert mlk.k_proj.out_features == 3 * H * 4 and mlk.dropout == 0.1
    smlk = build_attention("smlk", E, H)
    assert type(smlk) is MLKAttention and smlk.keys == "shifted" and smlk.key_shift.shape == (1, H, E // H)
    assert mgk.LinearAttention is LinearAttention and mgk.MLKAttention is MLKAttention


def test_shifted_keys_are_one_projection_minus_offsets():
    m = build_attention("smlk", E, H, num_keys=3)
    x = torch.randn(2, 5, E)
    k = m._keys(x)  # (B, H, M, S, D)
    assert k.shape == (2, H, 3, 5, E // H)
    torch.testing.assert_close(k[:, :, 0] - k[:, :, 2], m.key_shift[1][None, :, None, :].expand(2, H, 5, -1))


@pytest.mark.parametrize("pi", ["soft_e", "hard_e", "bogus"])
def test_mlk_rejects_pi_other_than_learned(pi):
    for kind in ("mlk", "smlk"):
        with pytest.raises(ValueError, match="pi='learned'"):
            build_attention(kind, E, H, pi=pi)
    with pytest.raises(ValueError, match="learned"):
        MLKAttention(E, H, pi=pi, batch_first=True)


def test_mlk_option_errors():
    with pytest.raises(ValueError, match="max_len"):
        MLKAttention(E, H, pi_shape="position", batch_first=True)
    with pytest.raises(ValueError, match="keys"):
        MLKAttention(E, H, keys="tied", batch_first=True)
    with pytest.raises(ValueError, match="pi_shape"):
        MLKAttention(E, H, pi_shape="batch", batch_first=True)
    with pytest.raises(ValueError, match="num_keys"):
        MLKAttention(E, H, num_keys=0, batch_first=True)
    m = MLKAttention(E, H, pi_shape="position", max_len=8, batch_first=True)
    with pytest.raises(ValueError, match=r"9.*max_len=8"):
        m(torch.randn(1, 9, E), need_weights=False)


def test_mlk_gradients_reach_mixture_weights_and_shifts():
    m = build("smlk", {"pi_shape": "position", "max_len": 12}).train()
    x = torch.randn(2, 7, E)
    out, _ = m(x, is_causal=True, need_weights=False)
    out.square().mean().backward()
    g = m.pi_logits.grad
    assert torch.isfinite(g).all() and g[..., :7].abs().sum() > 0
    assert torch.equal(g[..., 7:], torch.zeros_like(g[..., 7:]))  # only the first S positions are read
    assert m.key_shift.grad is not None and m.key_shift.grad.abs().sum() > 0


def test_mlk_with_one_head_prior_on_first_key_equals_linear_attention():
    """Module-level twin of MLK(pi = (1, 0)) == linear attention on key 1, with shared projections."""
    lin = LinearAttention(E, H, batch_first=True)
    mlk = MLKAttention(E, H, num_keys=2, batch_first=True)
    with torch.no_grad():
        for name in ("q_proj", "v_proj", "out_proj"):
            getattr(mlk, name).load_state_dict(getattr(lin, name).state_dict())
        mlk.k_proj.weight.view(2, H, E // H, E)[0] = lin.k_proj.weight.view(H, E // H, E)  # outputs (M, H, D)
        mlk.k_proj.bias.view(2, H, E // H)[0] = lin.k_proj.bias.view(H, E // H)
        mlk.pi_logits.copy_(torch.tensor([[0.0, -1e4]] * H))
    x = torch.randn(2, 6, E)
    for causal in (False, True):
        torch.testing.assert_close(mlk(x, is_causal=causal, need_weights=False)[0],
                                   lin(x, is_causal=causal, need_weights=False)[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind,pi", [("mgk", "learned"), ("smgk", "soft_e"), ("mlk", "learned"), ("smlk", "learned")])
def test_state_dicts_from_before_the_mixture_submodule_still_load(kind, pi):
    """Issue 11: the keys moved into `mixture`; a state dict with the old flat names (k_proj.*, key_shift,
    pi_logits, pi) loads strictly into the new module and gives the same outputs."""
    torch.manual_seed(0)
    options = {"pi": pi, "max_len": 8} if kind.endswith("mgk") else {}
    m = build_attention(kind, E, H, **options).eval()
    old = {k.replace("mixture.", ""): v.clone() for k, v in m.state_dict().items()}
    assert "k_proj.weight" in old and not any(k.startswith("mixture.") for k in old)
    fresh = build_attention(kind, E, H, **options).eval()
    fresh.load_state_dict(old)
    x = torch.randn(2, 5, E)
    assert torch.equal(fresh(x, need_weights=False)[0], m(x, need_weights=False)[0])
    assert m.k_proj is m.mixture.k_proj and isinstance(m.mixture, mgk.MixtureKeys if hasattr(mgk, "MixtureKeys")
                                                      else mgk.attention.MixtureKeys)
