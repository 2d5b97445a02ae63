"""Grouped-query and multi-query attention (kind "gqa"; Ainslie et al. 2023, Shazeer 2019) against a float64
reference written from the formula (query head h attends with key/value head h // (H / G)), at every ratio H / G
that ports have broken at (TEST_CASES R26), with masks, causality, L != S and gradients; its cache, its conversion and
its labels."""
import math

import pytest
import torch

from mgk import swap_attention
from mgk.attention import AttentionConfig, build_attention, get_kind
from mgk.attention.registry import display_label, make_options, run_label
from mgk.models import LMConfig, TransformerLM

E, D = 48, 4


def _reference(m, query, key, value, key_padding_mask=None, attn_mask=None, is_causal=False):
    """The module's function in float64 from its weights: projections, per-head scores q_h . k_g / sqrt(D) with
    g = h // (H / G), masks (bool True = not allowed; causal bottom-right), softmax, values, output projection."""
    H, G = m.num_heads, m.num_kv_heads
    w = {n: p.double() for n, p in m.named_parameters()}
    B, L, S = query.shape[0], query.shape[1], key.shape[1]
    q = (query.double() @ w["q_proj.weight"].T + w["q_proj.bias"]).view(B, L, H, D).transpose(1, 2)
    k = (key.double() @ w["k_proj.weight"].T + w["k_proj.bias"]).view(B, S, G, D).transpose(1, 2)
    v = (value.double() @ w["v_proj.weight"].T + w["v_proj.bias"]).view(B, S, G, D).transpose(1, 2)
    allowed = torch.ones(B, L, S, dtype=torch.bool)
    if key_padding_mask is not None:
        allowed &= ~key_padding_mask[:, None, :]
    if attn_mask is not None:
        allowed &= ~attn_mask[None]
    if is_causal:
        allowed &= torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
    heads = []
    for h in range(H):
        g = h // (H // G)
        scores = (q[:, h] @ k[:, g].transpose(-1, -2)) / math.sqrt(D)
        weights = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1).nan_to_num(0.0)
        heads.append(weights @ v[:, g])
    out = torch.stack(heads, dim=1).transpose(1, 2).reshape(B, L, H * D)
    return out @ w["out_proj.weight"].T + w["out_proj.bias"]


RATIOS = [(1, 1), (2, 1), (3, 1), (4, 2), (6, 3), (6, 1), (8, 2), (8, 1), (8, 8), (12, 2)]


@pytest.mark.parametrize("H,G", RATIOS, ids=[f"{h}q-{g}kv" for h, g in RATIOS])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bfloat16"])
def test_outputs_equal_the_float64_formula_at_every_ratio(H, G, dtype, tol):
    torch.manual_seed(H * 10 + G)
    m = build_attention("gqa", E, H, head_dim=D, num_kv_heads=G)
    B, L, S = 2, 5, 7  # odd lengths, L != S
    x, y = torch.randn(B, L, E), torch.randn(B, S, E)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, 4:] = True
    blocked = torch.rand(L, S) < 0.3
    for kwargs in ({}, {"key_padding_mask": pad}, {"attn_mask": blocked}, {"is_causal": True},
                   {"key_padding_mask": pad, "is_causal": True}):
        want = _reference(m, x, y, y, **kwargs)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            got = m(x, y, y, need_weights=False, **kwargs)[0]
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, msg=lambda s, kw=kwargs: f"{kw}: {s}")
    if dtype == torch.float32:  # the weights path (need_weights=True) computes the same function
        got, weights = m(x, y, y, key_padding_mask=pad)
        torch.testing.assert_close(got.double(), _reference(m, x, y, y, key_padding_mask=pad), atol=tol, rtol=tol)
        assert weights.shape == (B, L, S)


@pytest.mark.parametrize("H,G", [(8, 2), (6, 3), (4, 1)])
def test_gradients_equal_the_float64_formula(H, G):
    torch.manual_seed(0)
    m = build_attention("gqa", E, H, head_dim=D, num_kv_heads=G)
    x = torch.randn(2, 6, E, requires_grad=True)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, :2] = True
    out = m(x, key_padding_mask=pad, is_causal=True, need_weights=False)[0]
    grads = torch.autograd.grad(out[~pad].pow(2).sum(), [x, *m.parameters()])
    ref = build_attention("gqa", E, H, head_dim=D, num_kv_heads=G).double()
    ref.load_state_dict(m.state_dict())
    x64 = x.detach().double().requires_grad_()
    # the reference's own parameters in float64, through the formula
    want = _reference(ref, x64, x64, x64, key_padding_mask=pad, is_causal=True)
    want_grads = torch.autograd.grad(want[~pad].pow(2).sum(), [x64, *ref.parameters()])
    for (name, _), got, expected in zip([("x", None), *m.named_parameters()], grads, want_grads):
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5, msg=lambda s, n=name: f"{n}: {s}")


def test_gradcheck_in_float64():
    torch.manual_seed(1)
    m = build_attention("gqa", 8, 4, head_dim=2, num_kv_heads=2).double()
    x = torch.randn(1, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: m(t, is_causal=True, need_weights=False)[0], (x,))


def test_as_many_kv_heads_as_query_heads_is_softmax_attention_with_the_same_weights():
    torch.manual_seed(2)
    softmax = build_attention("softmax", E, 8, head_dim=D)
    gqa = build_attention("gqa", E, 8, head_dim=D, num_kv_heads=8)
    gqa.load_state_dict(softmax.state_dict())  # the same parameter names and shapes
    x = torch.randn(2, 9, E)
    for kwargs in ({}, {"is_causal": True}):
        torch.testing.assert_close(gqa(x, need_weights=False, **kwargs)[0], softmax(x, need_weights=False, **kwargs)[0],
                                   atol=0, rtol=0)


def test_one_kv_head_is_multi_query_attention():
    m = build_attention("gqa", E, 8, head_dim=D, num_kv_heads=1)
    assert m.k_proj.weight.shape == m.v_proj.weight.shape == (D, E)  # one key and one value head
    assert m.q_proj.weight.shape == (8 * D, E)


@pytest.mark.parametrize("bad", [3, 0, 16])
def test_kv_heads_that_do_not_divide_the_query_heads_are_one_line_naming_the_option(bad):
    with pytest.raises(ValueError, match="num_kv_heads") as err:
        build_attention("gqa", E, 8, head_dim=D, num_kv_heads=bad)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("G", [8, 4, 2, 1])
def test_cached_decoding_equals_the_uncached_forward_and_stores_g_heads(G):
    torch.manual_seed(G)
    m = build_attention("gqa", E, 8, head_dim=D, num_kv_heads=G).eval()
    x = torch.randn(2, 11, E)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, :3] = True  # row 1 left-padded
    cache, outs = m.new_cache(), []
    with torch.no_grad():
        outs.append(m(x[:, :6], past_key_values=cache, is_causal=True, need_weights=False,
                      key_padding_mask=pad[:, :6])[0])
        for t in range(6, 11):
            outs.append(m(x[:, t:t + 1], past_key_values=cache, is_causal=True, need_weights=False)[0])
        got = torch.cat(outs, dim=1)
        for b, start in ((0, 0), (1, 3)):  # each row as decoded alone over its own real tokens
            want = m(x[b:b + 1, start:], is_causal=True, need_weights=False)[0]
            torch.testing.assert_close(got[b:b + 1, start:], want, atol=1e-5, rtol=1e-5)
    entries = cache.entries()
    assert entries["keys"].shape == entries["values"].shape == (2, G, 11, D)  # G heads, never the expanded 8
    spec, options = get_kind("gqa"), make_options("gqa", num_kv_heads=G)
    assert cache.nbytes() == 2 * spec.cache.cache_bytes(options, num_heads=8, head_dim=D, length=11)


def test_cache_bytes_per_token_against_softmax_8_measured_from_the_buffers():
    """At d = 256, D = 32 (SPEC section 1): GQA-8 (kv 4) 0.5x softmax-8's bytes, GQA-8 (kv 2) 0.25x, MQA-8
    0.125x, read from what the caches hold after the same tokens."""
    x = torch.randn(1, 16, 256)

    def measured(kind, **options):
        m = build_attention(kind, 256, 8, head_dim=32, **options).eval()
        cache = m.new_cache()
        with torch.no_grad():
            m(x, past_key_values=cache, is_causal=True, need_weights=False)
        return cache.nbytes()

    softmax = measured("softmax")
    assert softmax == 16 * 2 * 8 * 32 * 4
    assert [measured("gqa", num_kv_heads=g) / softmax for g in (4, 2, 1)] == [0.5, 0.25, 0.125]


def _nll(lm, tokens):
    """Mean negative log-likelihood of each next token."""
    return lm(tokens[:, :-1], tokens[:, 1:]).mean()


def _trained_softmax_lm(seed=0):
    torch.manual_seed(seed)
    cfg = LMConfig(vocab_size=50, d_model=E, num_layers=2, ffn_dim=64, dropout=0.0,
                   attention=AttentionConfig(kind="softmax", num_heads=8, head_dim=6))
    lm = TransformerLM(cfg)
    opt = torch.optim.SGD(lm.parameters(), lr=0.1)
    tokens = torch.randint(0, 50, (4, 17))
    for _ in range(5):  # a few steps, so the weights are no longer their initialisation
        loss = _nll(lm, tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return lm.eval(), tokens


def test_swap_to_as_many_kv_heads_keeps_a_trained_lms_log_likelihood():
    lm, tokens = _trained_softmax_lm()
    with torch.no_grad():
        before = _nll(lm, tokens).item()
        swap_attention(lm, "gqa", num_kv_heads=8)
        after = _nll(lm, tokens).item()
    assert abs(after - before) < 1e-5


def test_swap_to_fewer_kv_heads_takes_the_mean_of_each_groups_projections():
    lm, _ = _trained_softmax_lm(1)
    old = [{n: p.detach().clone() for n, p in block.attn.named_parameters()} for block in lm.blocks]
    swap_attention(lm, "gqa", num_kv_heads=2)
    for block, before in zip(lm.blocks, old):
        new = dict(block.attn.named_parameters())
        for proj in ("k_proj", "v_proj"):
            w, b = before[f"{proj}.weight"], before[f"{proj}.bias"]
            torch.testing.assert_close(new[f"{proj}.weight"], w.view(2, 4, 6, E).mean(1).reshape(12, E))
            torch.testing.assert_close(new[f"{proj}.bias"], b.view(2, 4, 6).mean(1).reshape(12))
        for name in ("q_proj.weight", "q_proj.bias", "out_proj.weight", "out_proj.bias"):
            assert torch.equal(new[name], before[name])
    # and back: a GQA layer read as multi-head repeats each group's projection for its query heads, exactly
    x = torch.randn(2, 7, E)
    gqa = lm.blocks[0].attn
    softmax = swap_attention(gqa, "softmax")
    torch.testing.assert_close(softmax(x, need_weights=False, is_causal=True)[0],
                               gqa(x, need_weights=False, is_causal=True)[0], atol=1e-6, rtol=1e-6)


def test_labels_flops_and_options_come_from_the_registry():
    assert display_label("gqa", 8, make_options("gqa", num_kv_heads=2)) == "GQA x 8 (kv 2)"
    assert display_label("gqa", 8, make_options("gqa", num_kv_heads=1)) == "MQA x 8"
    assert run_label("gqa", 8, make_options("gqa", num_kv_heads=2)) == "gqa-8 kv2"
    with pytest.raises(ValueError, match="'num_kv_heads' of kind 'gqa' must be >= 1"):
        make_options("gqa", num_kv_heads=0)
    shape = dict(heads=8, length=64, batch=1, embed_dim=256, head_dim=32, causal=True, backward=False)
    gqa, softmax = get_kind("gqa"), get_kind("softmax")
    assert gqa.flops(make_options("gqa", num_kv_heads=8), **shape) == softmax.flops(make_options("softmax"), **shape)
    saved = softmax.flops(make_options("softmax"), **shape) - gqa.flops(make_options("gqa", num_kv_heads=2), **shape)
    assert saved == 2 * 64 * 256 * (8 - 2) * 32 * 2  # the key and value projections of the 6 heads not kept
