"""torch's Transformer layers pass every padding mask to their attention as a float mask (0 / -inf): with our
attention inside, ``torch.compile(fullgraph=True)`` captures them without a graph break (the float-mask check reads
no value on the host inside a trace) and gives eager's outputs; so do our own blocks. Inside a trace a NaN mask, or
a finite bias given to linear attention, still raises (on the device)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mgk
from mgk.models.blocks import TransformerBlock

E, H, L = 32, 2, 7
KINDS = ["mgk", "smgk", "softmax", "linear", "mlk"]


def _padding():
    pad = torch.zeros(2, L, dtype=torch.bool)
    pad[1, 5:] = True
    return pad


def _compiled(module):
    torch._dynamo.reset()
    return torch.compile(module, fullgraph=True, backend="eager")  # fullgraph: a graph break raises


@pytest.mark.parametrize("kind", KINDS)
def test_transformer_encoder_layer_with_a_padding_mask_compiles_in_one_graph(kind):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True)
    layer.self_attn = mgk.build_attention(kind, E, H)
    layer.eval()
    x, pad = torch.randn(2, L, E), _padding()
    got = _compiled(layer)(x, src_key_padding_mask=pad)
    want = layer(x, src_key_padding_mask=pad)
    torch.testing.assert_close(got[~pad], want[~pad], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["mgk", "softmax"])
def test_transformer_decoder_layer_with_float_causal_and_padding_masks_compiles_in_one_graph(kind):
    torch.manual_seed(1)
    layer = nn.TransformerDecoderLayer(E, H, 64, dropout=0.0, batch_first=True)
    layer.self_attn = mgk.build_attention(kind, E, H)
    layer.multihead_attn = mgk.build_attention(kind, E, H)
    layer.eval()
    x, memory, pad = torch.randn(2, L, E), torch.randn(2, L, E), _padding()
    causal = nn.Transformer.generate_square_subsequent_mask(L)  # float: 0 and -inf
    kw = dict(tgt_mask=causal, tgt_key_padding_mask=pad, memory_key_padding_mask=pad)
    got = _compiled(layer)(x, memory, **kw)
    torch.testing.assert_close(got[~pad], layer(x, memory, **kw)[~pad], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["mgk", "softmax", "linear"])
def test_our_block_with_a_padding_mask_compiles_in_one_graph(kind):
    torch.manual_seed(2)
    block = TransformerBlock(E, mgk.build_attention(kind, E, H), 64, 0.0).eval()
    x, pad = torch.randn(2, L, E), _padding()
    for causal in (False, True):
        got = _compiled(block)(x, key_padding_mask=pad, is_causal=causal)
        torch.testing.assert_close(got[~pad], block(x, key_padding_mask=pad, is_causal=causal)[~pad], atol=1e-5,
                                   rtol=1e-5)


def test_a_nan_float_mask_still_raises_inside_a_trace():
    m = mgk.build_attention("mgk", E, H).eval()
    bad = torch.zeros(2, L)
    bad[0, 1] = float("nan")
    with pytest.raises(Exception, match="finite values or -inf"):
        _compiled(m)(torch.randn(2, L, E), key_padding_mask=bad)


def test_a_finite_bias_given_to_linear_attention_still_raises_inside_a_trace():
    m = mgk.build_attention("linear", E, H).eval()
    with pytest.raises(Exception, match="0 \\(allowed\\) or -inf"):
        _compiled(m)(torch.randn(2, L, E), key_padding_mask=torch.full((2, L), 0.5))
