"""LinearAttention / MLKAttention modules and their registry names ("linear", "mlk", "smlk"): padding, causality
and batch invariance (TEST_CASES.md invariants 7-9, R09), returned weights, options."""
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
@pytest.mark.parametrize("causal", [False, True])
def test_padding_invariance_with_nan_content(kind, options, causal):
    """Invariant 7 / R03: appending padded tokens whose content is NaN leaves the real outputs unchanged."""
    m = build(kind, options)
    torch.manual_seed(1)
    x = torch.randn(2, 6, E)
    ref, _ = m(x, is_causal=causal)
    padded = torch.cat([x, torch.full((2, 3, E), float("nan"))], dim=1)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[:, 6:] = True
    out, _ = m(padded, key_padding_mask=kpm, is_causal=causal)
    torch.testing.assert_close(out[:, :6], ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind,options", KINDS, ids=IDS)
def test_padding_changes_are_inert_and_real_changes_matter(kind, options):
    """R04 polarity probe: changing a padded token moves no real output; changing a real token does."""
    m = build(kind, options)
    torch.manual_seed(2)
    x = torch.randn(1, 6, E)
    kpm = torch.tensor([[False] * 4 + [True] * 2])
    base, _ = m(x, key_padding_mask=kpm)
    x_pad = x.clone()
    x_pad[0, 5] = 1e30
    x_real = x.clone()
    x_real[0, 1] += 1.0
    assert torch.equal(m(x_pad, key_padding_mask=kpm)[0][:, :4], base[:, :4])
    assert (m(x_real, key_padding_mask=kpm)[0][:, [0, 2, 3]] - base[:, [0, 2, 3]]).abs().max() > 1e-4
    all_real = torch.zeros(1, 6, dtype=torch.bool)
    assert torch.equal(m(x, key_padding_mask=all_real)[0], m(x)[0])


def _run_path(m, x, path):
    if path == "train":
        m.train()
        torch.manual_seed(123)
        return m(x, is_causal=True)[0]
    m.eval()
    if path == "weights":
        return m(x, is_causal=True, need_weights=True)[0]
    if path == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x, is_causal=True)[0]
    return m(x, is_causal=True)[0]


@pytest.mark.parametrize("kind,options", KINDS, ids=IDS)
@pytest.mark.parametrize("path", ["eval", "train", "weights", "bf16", "batch1"])
def test_causality_on_every_path(kind, options, path):
    """R09: replacing token 5 leaves outputs 0-4 bitwise unchanged and changes some of 5-7."""
    m = build(kind, options, dropout=0.1)
    torch.manual_seed(3)
    x = torch.randn(1 if path == "batch1" else 2, 8, E)
    y = x.clone()
    y[:, 5] = torch.randn_like(y[:, 5])
    a, b = _run_path(m, x, path), _run_path(m, y, path)
    assert torch.equal(a[:, :5], b[:, :5])
    assert not torch.equal(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("kind,options", KINDS, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_batch_invariance(kind, options, causal):
    """Invariant 8: a sequence's outputs do not depend on its batch mates (batch 1 vs 3, with padding)."""
    m = build(kind, options)
    torch.manual_seed(4)
    seq = torch.randn(1, 7, E)
    alone, _ = m(seq, is_causal=causal)
    others = torch.randn(3, 10, E)
    batch = others.clone()
    batch[1, :7] = seq[0]
    kpm = torch.zeros(3, 10, dtype=torch.bool)
    kpm[1, 7:] = True
    out, _ = m(batch, key_padding_mask=kpm, is_causal=causal)
    torch.testing.assert_close(out[1:2, :7], alone, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind,options", KINDS, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_need_weights_returns_normalised_weights(kind, options, causal):
    m = build(kind, options)
    torch.manual_seed(5)
    x = torch.randn(2, 6, E)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[0, 4:] = True
    out, w = m(x, key_padding_mask=kpm, is_causal=causal, need_weights=True)
    plain, none = m(x, key_padding_mask=kpm, is_causal=causal)
    assert none is None
    torch.testing.assert_close(out, plain, rtol=0, atol=1e-5)
    assert w.shape == (2, H, 6, 6) and (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, H, 6), rtol=0, atol=1e-5)
    assert torch.equal(w[0, :, :, 4:], torch.zeros_like(w[0, :, :, 4:]))
    if causal:
        assert torch.equal(w.triu(1), torch.zeros_like(w))


@pytest.mark.parametrize("kind,options", KINDS, ids=IDS)
def test_attn_mask_with_query_dimension_is_rejected(kind, options):
    m = build(kind, options)
    x = torch.randn(2, 5, E)
    with pytest.raises(MaskError, match="key-padding"):
        m(x, attn_mask=torch.zeros(5, 5, dtype=torch.bool))


@pytest.mark.parametrize("kind,options", KINDS, ids=IDS)
def test_dropout_is_accepted_but_unused(kind, options):
    m = build(kind, options, dropout=0.3)
    x = torch.randn(2, 5, E)
    m.train()
    a, _ = m(x)
    b, _ = m(x)
    m.eval()
    c, _ = m(x)
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("kind,options", KINDS, ids=IDS)
def test_bf16_autocast_module_large_inputs(kind, options):
    """Invariant 11 at module level: finite and within 2e-2 (relative norm) of float32 for inputs of norm ~30."""
    m = build(kind, options)
    torch.manual_seed(6)
    x = torch.randn(2, 64, E)
    x = 30 * x / x.norm(dim=-1, keepdim=True)
    for causal in (False, True):
        ref, _ = m(x, is_causal=causal)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = m(x, is_causal=causal)
        assert torch.isfinite(out).all()
        # Relative to the output's norm: the bf16 projections (not the attention core, whose element-wise
        # agreement is tested in tests/functional) shift individual near-zero outputs by a few 1e-2.
        assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2


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
        MLKAttention(E, H, pi=pi)


def test_mlk_option_errors():
    with pytest.raises(ValueError, match="max_len"):
        MLKAttention(E, H, pi_shape="position")
    with pytest.raises(ValueError, match="keys"):
        MLKAttention(E, H, keys="tied")
    with pytest.raises(ValueError, match="pi_shape"):
        MLKAttention(E, H, pi_shape="batch")
    with pytest.raises(ValueError, match="num_keys"):
        MLKAttention(E, H, num_keys=0)
    m = MLKAttention(E, H, pi_shape="position", max_len=8)
    with pytest.raises(ValueError, match=r"9.*max_len=8"):
        m(torch.randn(1, 9, E))


def test_mlk_gradients_reach_mixture_weights_and_shifts():
    m = build("smlk", {"pi_shape": "position", "max_len": 12}).train()
    x = torch.randn(2, 7, E)
    out, _ = m(x, is_causal=True)
    out.square().mean().backward()
    g = m.pi_logits.grad
    assert torch.isfinite(g).all() and g[..., :7].abs().sum() > 0
    assert torch.equal(g[..., 7:], torch.zeros_like(g[..., 7:]))  # only the first S positions are read
    assert m.key_shift.grad is not None and m.key_shift.grad.abs().sum() > 0


def test_mlk_with_one_head_prior_on_first_key_equals_linear_attention():
    """Module-level twin of MLK(pi = (1, 0)) == linear attention on key 1, with shared projections."""
    lin = LinearAttention(E, H)
    mlk = MLKAttention(E, H, num_keys=2)
    with torch.no_grad():
        for name in ("q_proj", "v_proj", "out_proj"):
            getattr(mlk, name).load_state_dict(getattr(lin, name).state_dict())
        mlk.k_proj.weight.view(2, H, E // H, E)[0] = lin.k_proj.weight.view(H, E // H, E)  # outputs (M, H, D)
        mlk.k_proj.bias.view(2, H, E // H)[0] = lin.k_proj.bias.view(H, E // H)
        mlk.pi_logits.copy_(torch.tensor([[0.0, -1e4]] * H))
    x = torch.randn(2, 6, E)
    for causal in (False, True):
        torch.testing.assert_close(mlk(x, is_causal=causal)[0], lin(x, is_causal=causal)[0], rtol=0, atol=1e-6)
