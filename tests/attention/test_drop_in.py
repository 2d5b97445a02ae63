"""Every attention kind is a drop-in for nn.MultiheadAttention inside torch's Transformer layers: ``batch_first``
both ways (and required, so that a module cannot silently read the other layout), bool and float masks with
nn.MultiheadAttention's semantics, train and eval mode."""
import warnings

import pytest
import torch
from torch import nn

import mgk
from mgk.functional import MaskError

E, H, B, L, S = 16, 2, 3, 7, 5
KINDS = mgk.attention_kinds()


def _attn(build, kind, batch_first):
    return build(kind, batch_first=batch_first)


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
    sa, _ = layer.self_attn(_layout(x, batch_first), key_padding_mask=kpm, need_weights=False, is_causal=True)
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
    x = layer.norm1(t + layer.self_attn(t, t, t, kpm, False, is_causal=True)[0])
    x = layer.norm2(x + layer.multihead_attn(x, m, m, mem_kpm, False)[0])
    want = layer.norm3(x + layer.linear2(layer.activation(layer.linear1(x))))
    real = ~kpm if batch_first else (~kpm).T
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_first_false_reads_length_first(build, kind):
    """(L, B, E) with batch_first=False gives the transposed batch_first output: no attention across the batch."""
    a, b = build(kind), build(kind, batch_first=False)
    assert a.batch_first is True and "batch_first=False" in repr(b)
    x = torch.randn(B, L, E)
    kpm, _ = _masks()
    want, _ = a(x, key_padding_mask=kpm, need_weights=False, is_causal=True)
    got, _ = b(x.transpose(0, 1), key_padding_mask=kpm, need_weights=False, is_causal=True)
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
    ours = mgk.MultiheadAttention(E, H, batch_first=True).eval()
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
        got = ours(x, attn_mask=am, key_padding_mask=km, need_weights=False)[0]
        torch.testing.assert_close(got[~kpm], want[~kpm], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pi", ["learned", "hard_e"])
def test_float_bias_on_mgk_scales_each_keys_mixture_weight(build, pi):
    """For MGK a float mask b_ij multiplies key j's weight by exp(b_ij): a per-key bias (B, S) equals the same
    bias added to log pi of every component, and -inf equals the bool mask."""
    m = build("mgk", pi)
    x = torch.randn(B, L, E)
    kpm, causal = _masks()
    minus_inf = torch.zeros(L, L).masked_fill(causal, float("-inf"))
    torch.testing.assert_close(m(x, attn_mask=minus_inf, need_weights=False)[0],
                               m(x, attn_mask=causal, need_weights=False)[0], rtol=1e-5, atol=1e-6)
    out, w = m(x, key_padding_mask=torch.zeros(B, L).masked_fill(kpm, float("-inf")), attn_mask=causal,
               need_weights=True, average_attn_weights=False)
    plain, w0 = m(x, key_padding_mask=kpm, attn_mask=causal, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
    bias = torch.randn(L, L)
    _, wb = m(x, attn_mask=bias, need_weights=True, average_attn_weights=False)
    _, wn = m(x, need_weights=True, average_attn_weights=False)
    expect = wn * bias.exp()
    torch.testing.assert_close(wb, expect / expect.sum(-1, keepdim=True), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["linear", "mlk", "smlk"])
def test_linear_kinds_take_float_masks_only_as_zero_or_minus_inf(build, kind):
    m = build(kind)
    x = torch.randn(B, L, E)
    kpm, causal = _masks()
    as_float = torch.zeros(B, L).masked_fill(kpm, float("-inf"))
    torch.testing.assert_close(m(x, key_padding_mask=as_float, need_weights=False)[0],
                               m(x, key_padding_mask=kpm, need_weights=False)[0], rtol=0, atol=0)
    causal_float = torch.zeros(L, L).masked_fill(causal, float("-inf"))
    torch.testing.assert_close(m(x, attn_mask=causal_float, need_weights=False)[0],
                               m(x, is_causal=True, need_weights=False)[0], rtol=0, atol=0)
    with pytest.raises(MaskError, match="0 \\(allowed\\) or -inf"):
        m(x, key_padding_mask=kpm.float(), need_weights=False)
    with pytest.raises(MaskError, match="NaN"):
        m(x, key_padding_mask=torch.full((B, L), float("nan")), need_weights=False)


@pytest.mark.parametrize("kind", KINDS)
def test_a_module_built_without_batch_first_is_refused_naming_both_layouts(kind):
    """Torch's layers default to (T, B, E), mgk's models to (B, T, E): with no default, putting a module into a
    layer of the other layout cannot happen silently (it attended across the batch)."""
    cls = type(mgk.build_attention(kind, E, H))
    layer = nn.TransformerEncoderLayer(E, H)  # torch's default batch_first=False
    with pytest.raises(TypeError) as err:
        layer.self_attn = cls(E, H)
    message = str(err.value)
    assert cls.__name__ in message and "\n" not in message
    assert "batch_first=True for (B, T, E)" in message and "batch_first=False for (T, B, E)" in message
    with pytest.raises(TypeError, match="batch_first"):
        layer.self_attn = mgk.MGKAttention(E, H)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_batch_element_0_does_not_see_element_1_inside_torch_layers(build, kind, batch_first):
    """Inside nn.TransformerEncoderLayer / DecoderLayer of either layout, changing only batch element 1 (its tokens
    and its memory) leaves element 0's output bitwise unchanged, and changes element 1's."""
    torch.manual_seed(3)
    enc = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=batch_first).eval()
    enc.self_attn = build(kind, batch_first=batch_first)
    dec = nn.TransformerDecoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=batch_first).eval()
    dec.self_attn = build(kind, batch_first=batch_first, seed=1)
    dec.multihead_attn = build(kind, batch_first=batch_first, seed=2)
    x, mem = torch.randn(B, L, E), torch.randn(B, S, E)
    y, mem2 = x.clone(), mem.clone()
    y[1], mem2[1] = torch.randn(L, E), torch.randn(S, E)

    def element(out, i):
        return out[i] if batch_first else out[:, i]

    pairs = [(enc(_layout(x, batch_first)), enc(_layout(y, batch_first))),
             (dec(_layout(x, batch_first), _layout(mem, batch_first)),
              dec(_layout(y, batch_first), _layout(mem2, batch_first)))]
    for a, b in pairs:
        assert torch.equal(element(a, 0), element(b, 0))
        assert not torch.allclose(element(a, 1), element(b, 1))
