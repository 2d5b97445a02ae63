"""mgk's attention modules take nn.MultiheadAttention's forward arguments, in its order and with its defaults, and
give its results: every argument is checked against nn.MultiheadAttention itself, with its weights loaded into
mgk.MultiheadAttention (the state-dict upgrade splits the packed ``in_proj_weight``)."""
import inspect

import pytest
import torch
from torch import nn

import mgk
from mgk.attention import AttentionBase
from mgk.functional import MaskError
from mgk.models.blocks import TransformerBlock

E, H, B, L, S, KDIM, VDIM = 8, 2, 3, 4, 5, 6, 7
KINDS = mgk.attention_kinds()
TOL = dict(rtol=1e-10, atol=1e-12)


def _pair(batch_first, kdim=KDIM, vdim=VDIM, seed=0):
    """(nn.MultiheadAttention, mgk.MultiheadAttention with its state dict), float64, eval mode."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, batch_first=batch_first).double().eval()
    ours = mgk.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, batch_first=batch_first).double().eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _inputs(batch_first, batched, Lq=L, Sk=S, kdim=KDIM, vdim=VDIM):
    def make(T, width):
        x = torch.randn(B, T, width, dtype=torch.float64)
        if not batched:
            return x[0]
        return x if batch_first else x.transpose(0, 1)
    return make(Lq, E), make(Sk, kdim), make(Sk, vdim)


def _masks(kind, batched, Lq=L, Sk=S):
    """(key_padding_mask, attn_mask) of ``kind`` (unbatched: element 1's padding, (H, L, S) per-head masks); every
    query row keeps at least one key (key 0), since torch gives NaN for a row without keys and mgk zeros."""
    pad = torch.zeros(B, Sk, dtype=torch.bool)
    pad[1, -2:] = True
    block = torch.zeros(Lq, Sk, dtype=torch.bool)
    block[0, 1] = block[2, 3:] = True
    as_float = lambda m: torch.randn(m.shape, dtype=torch.float64).masked_fill(m, float("-inf"))  # noqa: E731
    n = B * H if batched else H
    per_head = torch.randn(n, Lq, Sk, dtype=torch.float64).masked_fill(torch.rand(n, Lq, Sk) < 0.3, float("-inf"))
    per_head[:, :, 0] = 0.0  # every row keeps key 0
    table = {"none": (None, None), "bool": (pad, block), "float": (as_float(pad), as_float(block)),
             "padding_only": (pad, None), "attn_only": (None, block), "per_head": (None, per_head),
             "float_padding_per_head": (as_float(pad), per_head)}
    kpm, am = table[kind]
    return (kpm[1] if kpm is not None and not batched else kpm), am


def test_forward_signature_and_defaults_are_torchs():
    """Names, order and defaults of nn.MultiheadAttention.forward, for every kind's class; the one addition is the
    keyword-only decoding cache ``past_key_values`` (None), after them, so every positional call is torch's."""
    want = list(inspect.signature(nn.MultiheadAttention.forward).parameters.values())
    for kind in KINDS:
        got = list(inspect.signature(type(mgk.build_attention(kind, E, H)).forward).parameters.values())
        assert [p.name for p in got[:len(want)]] == [p.name for p in want]
        for g, w in zip(got, want):
            assert g.default == w.default or g.name in ("key", "value"), (kind, g.name)  # key/value: None = self
        extra = got[len(want):]
        assert [(p.name, p.kind, p.default) for p in extra] == [
            ("past_key_values", inspect.Parameter.KEYWORD_ONLY, None)], kind


# nn.MultiheadAttention's constructor keywords with no counterpart here (learned key/value rows, a zero key row)
_NO_COUNTERPART = {"add_bias_kv", "add_zero_attn"}


def test_constructor_takes_torchs_keywords_for_every_kind():
    """Every other keyword of nn.MultiheadAttention.__init__ (now with device and dtype, torch's factory keywords)
    builds every kind's class; a keyword torch adds later fails here until it is handled."""
    names = [n for n in inspect.signature(nn.MultiheadAttention.__init__).parameters if n != "self"]
    assert set(names) - _NO_COUNTERPART == {"embed_dim", "num_heads", "dropout", "bias", "kdim", "vdim",
                                             "batch_first", "device", "dtype"}
    torch_kwargs = dict(dropout=0.0, bias=True, kdim=KDIM, vdim=VDIM, batch_first=True, device=torch.device("cpu"),
                        dtype=torch.float64)
    ref = nn.MultiheadAttention(E, H, **torch_kwargs)
    for kind in KINDS:
        m = mgk.attention.get_kind(kind).factory(E, H, **torch_kwargs, **(
            {"max_len": 8} if "max_len" in mgk.attention.get_kind(kind).options.names() else {}))
        assert {p.dtype for p in m.parameters()} == {p.dtype for p in ref.parameters()} == {torch.float64}, kind
    ours = mgk.MultiheadAttention(E, H, **torch_kwargs)
    ours.load_state_dict(ref.state_dict())
    q, k, v = _inputs(True, True)
    torch.testing.assert_close(ours(q, k, v)[0], ref(q, k, v)[0], **TOL)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "length_first"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("masks", ["none", "bool", "float", "padding_only", "attn_only", "per_head",
                                   "float_padding_per_head"])
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_every_argument_positionally_against_nn_multihead_attention(batch_first, batched, masks, need_weights,
                                                                     average):
    ref, ours = _pair(batch_first)
    q, k, v = _inputs(batch_first, batched)
    kpm, am = _masks(masks, batched)
    want_out, want_w = ref(q, k, v, kpm, need_weights, am, average)
    out, w = ours(q, k, v, kpm, need_weights, am, average)
    torch.testing.assert_close(out, want_out, **TOL)
    if need_weights:
        assert w.shape == want_w.shape
        torch.testing.assert_close(w, want_w, **TOL)
    else:
        assert w is None and want_w is None


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("batched", [True, False])
def test_defaults_return_head_averaged_weights_as_torch(batch_first, batched):
    ref, ours = _pair(batch_first)
    q, k, v = _inputs(batch_first, batched)
    (want_out, want_w), (out, w) = ref(q, k, v), ours(q, k, v)
    assert w.shape == ((B, L, S) if batched else (L, S))
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(w, want_w, **TOL)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("float_mask", [True, False])
def test_is_causal_with_its_attn_mask_against_torch(batched, padding, need_weights, float_mask):
    """torch's is_causal is a hint that attn_mask is the causal mask (torch then may use either); both give the
    causal result. Self-attention, bool or float causal mask, with and without padding."""
    ref, ours = _pair(False, kdim=E, vdim=E)
    x = _inputs(False, batched, Sk=L, kdim=E, vdim=E)[0]
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    mask = causal if float_mask else torch.isinf(causal)
    kpm = None
    if padding:
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[1, -1] = True
        kpm = kpm if batched else kpm[1]
    want = ref(x, x, x, key_padding_mask=kpm, need_weights=need_weights, attn_mask=mask, is_causal=True)
    got = ours(x, x, x, key_padding_mask=kpm, need_weights=need_weights, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(got[0], want[0], **TOL)
    if need_weights:
        torch.testing.assert_close(got[1], want[1], **TOL)


def test_state_dicts_of_nn_multihead_attention_load_in_every_form():
    """Packed in_proj (kdim = vdim = E) and separate q/k/v_proj_weight (kdim / vdim differ); bias_k / bias_v
    (add_bias_kv=True) are refused naming them; our own state dicts still load."""
    for kdim, vdim in ((E, E), (KDIM, VDIM)):
        ref, ours = _pair(True, kdim, vdim)
        assert torch.equal(ours.k_proj.weight, ref.in_proj_weight[E:2 * E] if kdim == E else ref.k_proj_weight)
        assert torch.equal(ours.v_proj.bias, ref.in_proj_bias[2 * E:])
        again = mgk.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, batch_first=True).double()
        again.load_state_dict(ours.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))
    with pytest.raises(RuntimeError, match=r"bias_k and bias_v come from nn.MultiheadAttention\(add_bias_kv=True\)"):
        mgk.MultiheadAttention(E, H, batch_first=True).load_state_dict(
            nn.MultiheadAttention(E, H, add_bias_kv=True).state_dict())


@pytest.mark.parametrize("kind", KINDS)
def test_unbatched_input_is_a_batch_of_one_for_every_kind(build, kind):
    """(L, E) input with an (S,) padding mask gives the first element of the batched call, (L, S) / (H, L, S)
    weights likewise; wrong ranks are refused naming the argument."""
    m = build(kind, batch_first=False)
    x = torch.randn(6, 16)
    pad = torch.tensor([False] * 5 + [True])
    out, w = m(x, x, x, pad, average_attn_weights=False)
    out_b, w_b = m(x[:, None], x[:, None], x[:, None], pad[None], average_attn_weights=False)
    torch.testing.assert_close(out, out_b[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(w, w_b[0], rtol=0, atol=0)
    assert m(x, x, x, pad)[1].shape == (6, 6)
    with pytest.raises(ValueError, match="key must have shape"):
        m(x, x[:, None], x[:, None])
    with pytest.raises(MaskError, match=r"key_padding_mask of unbatched inputs must have shape \(S,\)"):
        m(x, x, x, pad[None])


@pytest.mark.parametrize("kind", KINDS)
def test_averaged_weights_are_the_mean_of_the_heads_and_self_attention_shortcut(build, kind):
    m = build(kind)
    x = torch.randn(2, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    out, w = m(x, x, x, pad, average_attn_weights=False)
    out_avg, w_avg = m(x, x, x, pad)
    assert w.shape == (2, 2, 5, 5) and w_avg.shape == (2, 5, 5)
    torch.testing.assert_close(w_avg, w.mean(dim=1), rtol=0, atol=0)
    torch.testing.assert_close(out_avg, out, rtol=0, atol=0)
    short, none = m(x, key_padding_mask=pad, need_weights=False)
    assert none is None
    torch.testing.assert_close(short, out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm_first", [True, False])
def test_mgk_blocks_never_ask_for_weights(norm_first):
    """mgk's models (LRA, retrieval, LM) call attention through TransformerBlock, with need_weights=False, so
    training never builds the (B, H, L, S) weights."""
    seen = []
    attn = mgk.build_attention("mgk", 16, 2)
    attn.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs.get("need_weights")),
                                   with_kwargs=True)
    block = TransformerBlock(16, attn, 32, 0.0, norm_first=norm_first)
    block(torch.randn(2, 5, 16), key_padding_mask=torch.zeros(2, 5, dtype=torch.bool), is_causal=True)
    assert seen == [False] and isinstance(attn, AttentionBase)
