"""Every attention kind is a drop-in for nn.MultiheadAttention inside torch's Transformer layers:
``batch_first`` both ways, bool and float masks with nn.MultiheadAttention's semantics, train and eval mode."""
import warnings

import pytest
import torch
from torch import nn

import mgk
from mgk.functional import MaskError

E, H, B, L, S = 16, 2, 3, 7, 5
KINDS = mgk.attention_kinds()


def _attn(build, kind, batch_first):
    m = build(kind)
    m.batch_first = batch_first
    return m


def _layout(x, batch_first):
    return x if batch_first else x.transpose(0, 1)


def _masks():
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 5:] = True
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)  # True = not allowed
    return kpm, causal


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_encoder_layer_equals_the_module_called_directly(build, kind, batch_first, train):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    layer.self_attn = _attn(build, kind, batch_first)
    layer.train(train)
    x = torch.randn(B, L, E)
    kpm, causal = _masks()
    got = layer(_layout(x, batch_first), src_mask=causal, src_key_padding_mask=kpm, is_causal=True)
    sa, _ = layer.self_attn(_layout(x, batch_first), key_padding_mask=kpm, is_causal=True)
    h = layer.norm1(_layout(x, batch_first) + sa)
    want = layer.norm2(h + layer.linear2(layer.activation(layer.linear1(h))))
    real = ~kpm if batch_first else (~kpm).T
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "enable_nested_tensor is True, but ... False because ..."
        stack = nn.TransformerEncoder(layer, 2)
    out = stack(_layout(x, batch_first), mask=causal, src_key_padding_mask=kpm, is_causal=True)
    assert out.shape == _layout(x, batch_first).shape and torch.isfinite(out[real]).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_decoder_layer_self_and_cross_attention(build, kind, batch_first, train):
    torch.manual_seed(1)
    layer = nn.TransformerDecoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    layer.self_attn = _attn(build, kind, batch_first)
    layer.multihead_attn = _attn(build, kind, batch_first)
    layer.train(train)
    tgt, mem = torch.randn(B, L, E), torch.randn(B, S, E)
    kpm, causal = _masks()
    mem_kpm = torch.zeros(B, S, dtype=torch.bool)
    mem_kpm[2, 3:] = True
    t, m = _layout(tgt, batch_first), _layout(mem, batch_first)
    got = layer(t, m, tgt_mask=causal, tgt_key_padding_mask=kpm, memory_key_padding_mask=mem_kpm)
    x = layer.norm1(t + layer.self_attn(t, t, t, key_padding_mask=kpm, is_causal=True)[0])
    x = layer.norm2(x + layer.multihead_attn(x, m, m, key_padding_mask=mem_kpm)[0])
    want = layer.norm3(x + layer.linear2(layer.activation(layer.linear1(x))))
    real = ~kpm if batch_first else (~kpm).T
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_first_false_reads_length_first(build, kind):
    """(L, B, E) with batch_first=False gives the transposed batch_first output: no attention across the batch."""
    a, b = build(kind), build(kind)
    b.batch_first = False
    assert a.batch_first is True and "batch_first=False" in repr(b)
    x = torch.randn(B, L, E)
    kpm, _ = _masks()
    want, _ = a(x, key_padding_mask=kpm, is_causal=True)
    got, _ = b(x.transpose(0, 1), key_padding_mask=kpm, is_causal=True)
    torch.testing.assert_close(got.transpose(0, 1), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="batch_first"):
        b(torch.randn(L, B, E), torch.randn(S, B + 1, E))


@pytest.mark.parametrize("kind", KINDS)
def test_constructor_takes_batch_first(kind):
    cls = type(mgk.build_attention(kind, E, H))
    kw = {"keys": "shifted"} if kind.startswith("s") and kind != "softmax" else {}
    m = cls(E, H, batch_first=False, **kw)
    assert m.batch_first is False and m.in_proj_weight is None and m._qkv_same_embed_dim is False


def test_float_masks_match_nn_multihead_attention():
    """Our softmax MultiheadAttention with nn.MultiheadAttention's weights: float masks (any finite bias and -inf)
    and bool masks give torch's result."""
    torch.manual_seed(2)
    ref = nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = mgk.MultiheadAttention(E, H).eval()
    with torch.no_grad():
        wq, wk, wv = ref.in_proj_weight.chunk(3)
        bq, bk, bv = ref.in_proj_bias.chunk(3)
        for proj, w, b in ((ours.q_proj, wq, bq), (ours.k_proj, wk, bk), (ours.v_proj, wv, bv)):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        ours.out_proj.load_state_dict(ref.out_proj.state_dict())
    x = torch.randn(B, L, E)
    kpm, causal = _masks()
    bias = torch.randn(L, L).masked_fill(causal, float("-inf"))
    kpm_bias = torch.randn(B, L).masked_fill(kpm, float("-inf"))
    for am, km in ((bias, kpm_bias), (causal, kpm), (bias, kpm), (torch.randn(B * H, L, L), None)):
        want = ref(x, x, x, attn_mask=am, key_padding_mask=km, need_weights=False)[0]
        got = ours(x, attn_mask=am, key_padding_mask=km)[0]
        torch.testing.assert_close(got[~kpm], want[~kpm], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pi", ["learned", "hard_e"])
def test_float_bias_on_mgk_scales_each_keys_mixture_weight(build, pi):
    """For MGK a float mask b_ij multiplies key j's weight by exp(b_ij): a per-key bias (B, S) equals the same
    bias added to log pi of every component, and -inf equals the bool mask."""
    m = build("mgk", {"pi": pi})
    x = torch.randn(B, L, E)
    kpm, causal = _masks()
    minus_inf = torch.zeros(L, L).masked_fill(causal, float("-inf"))
    torch.testing.assert_close(m(x, attn_mask=minus_inf)[0], m(x, attn_mask=causal)[0], rtol=1e-5, atol=1e-6)
    out, w = m(x, key_padding_mask=torch.zeros(B, L).masked_fill(kpm, float("-inf")), attn_mask=causal,
               need_weights=True)
    plain, w0 = m(x, key_padding_mask=kpm, attn_mask=causal, need_weights=True)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
    bias = torch.randn(L, L)
    _, wb = m(x, attn_mask=bias, need_weights=True)
    _, wn = m(x, need_weights=True)
    expect = wn * bias.exp()
    torch.testing.assert_close(wb, expect / expect.sum(-1, keepdim=True), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["linear", "mlk", "smlk"])
def test_linear_kinds_take_float_masks_only_as_zero_or_minus_inf(build, kind):
    m = build(kind)
    x = torch.randn(B, L, E)
    kpm, causal = _masks()
    as_float = torch.zeros(B, L).masked_fill(kpm, float("-inf"))
    torch.testing.assert_close(m(x, key_padding_mask=as_float)[0], m(x, key_padding_mask=kpm)[0], rtol=0, atol=0)
    causal_float = torch.zeros(L, L).masked_fill(causal, float("-inf"))
    torch.testing.assert_close(m(x, attn_mask=causal_float)[0], m(x, is_causal=True)[0], rtol=0, atol=0)
    with pytest.raises(MaskError, match="0 \\(allowed\\) or -inf"):
        m(x, key_padding_mask=kpm.float())
    with pytest.raises(MaskError, match="NaN"):
        m(x, key_padding_mask=torch.full((B, L), float("nan")))
