"""torch's Transformer layers hand their attention the causal mask itself, as a float (L, L) mask of 0 / -inf, with
``is_causal=True`` (``nn.TransformerEncoderLayer`` detects it; a decoder layer passes ``tgt_is_causal``) or without
it. Every kind takes that exact mask as ``is_causal=True`` with no explicit mask, so MGK and softmax keep their
causal kernels (they had left them for the explicit mask, 1.8-3.1x slower at L = 1024), and the
outputs are those of the explicit mask. Any other mask still reaches the core as a mask."""
import pytest
import torch
from torch import nn

from mgk.attention.registry import get_kind

B, L, E = 2, 9, 16


def _spy(monkeypatch, attn):
    """Record (mask, is_causal) of every call of ``attn._core``."""
    calls, core = [], attn._core

    def spy(q, k, v, mask, is_causal, *args, **kwargs):
        calls.append((mask, is_causal))
        return core(q, k, v, mask, is_causal, *args, **kwargs)

    monkeypatch.setattr(attn, "_core", spy)
    return calls


def _explicit(attn, kind, x, padding):
    """The output the causal mask gives as an explicit mask: as (B*H, L, L), which is never taken for causal; the
    linear kinds take no query-dependent mask, and their causal path is is_causal itself."""
    if get_kind(kind).family == "linear":
        return attn(x, key_padding_mask=padding, is_causal=True, need_weights=False)[0]
    blocked = ~torch.ones(L, L, dtype=torch.bool).tril()
    return attn(x, key_padding_mask=padding, attn_mask=blocked.expand(B * attn.num_heads, L, L),
                need_weights=False)[0]


@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "padding"])
@pytest.mark.parametrize("hint", [True, False], ids=["is_causal", "no_hint"])
def test_the_causal_float_mask_reaches_the_core_as_is_causal_with_the_same_outputs(variant, build, monkeypatch,
                                                                                   hint, padded):
    kind, options = variant
    attn = build(kind, options)
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(0))
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[1, L - 3:] = True
    padding = padding if padded else None
    want = _explicit(attn, kind, x, padding)
    calls = _spy(monkeypatch, attn)
    causal = nn.Transformer.generate_square_subsequent_mask(L)  # float: 0, and -inf above the diagonal
    got = attn(x, key_padding_mask=padding, attn_mask=causal, is_causal=hint, need_weights=False)[0]
    [(mask, is_causal)] = calls
    assert is_causal is True
    if padded:
        assert mask is not None and mask.shape[-2] == 1  # the key padding only, no query dimension
    else:
        assert mask is None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_torch_encoder_layer_with_a_causal_mask_calls_the_causal_core(variant, build, monkeypatch):
    """The path of every swapped torch decoder: ``nn.TransformerEncoderLayer(src_mask=causal, is_causal=True)``."""
    kind, options = variant
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(E, 2, 32, dropout=0.0, batch_first=True).eval()
    layer.self_attn = build(kind, options)
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(2))
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    calls = _spy(monkeypatch, layer.self_attn)
    layer(x, src_mask=causal, is_causal=True)
    assert [(mask, is_causal) for mask, is_causal in calls] == [(None, True)]


@pytest.mark.parametrize("kind", ["softmax", "mgk"])
def test_other_masks_still_reach_the_core_as_masks(build, monkeypatch, kind):
    """A mask one entry away from causal, or causal over a different (L, S), is applied as given."""
    attn = build(kind)
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(3))
    calls = _spy(monkeypatch, attn)
    near = ~torch.ones(L, L, dtype=torch.bool).tril()
    near[L - 1, 0] = True  # the last row may not see key 0
    attn(x, attn_mask=near, need_weights=False)
    memory = torch.randn(B, L + 2, E)
    top_left = ~torch.ones(L, L + 2, dtype=torch.bool).tril()  # causal aligned top-left, not bottom-right
    attn(x, memory, memory, attn_mask=top_left, need_weights=False)
    assert [(m is not None, c) for m, c in calls] == [(True, False), (True, False)]
