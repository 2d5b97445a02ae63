"""Cached decoding (``forward(..., past_key_values=cache)``) equals the uncached causal forward, for every kind and
option set: at every step, after prefills of 1, 63, 65 and 300 tokens, with single- and several-token steps, and for
left-padded batches of prompts of different lengths; the bytes the caches hold are the registry's formula; the
bugs other libraries shipped (flash-linear-attention#747, gpt-fast#233, x-transformers#219/#311, litgpt#298) are
cases here."""
from __future__ import annotations

import pytest
import torch

import mgk
from attention.conftest import D, E, H, build_kind
from mgk.attention.cache import DecodingCache, LayerCache
from mgk.attention.registry import get_kind, kind_variants, variant_name

TOL = dict(atol=1e-5, rtol=1e-5)  # float32


def _close(got, want, scale, msg=""):
    """Within 1e-5 of the outputs' scale (float32): unnormalised linear attention (normalize='none') sums hundreds
    of terms whose rounding depends on the order of summation, chunks against a running state."""
    tol = 1e-5 * max(1.0, scale)
    torch.testing.assert_close(got, want, atol=tol, rtol=1e-5, msg=lambda s: f"{msg}: {s}")
STEPS = (1, 1, 3, 1, 2, 1)  # after the prefill: single tokens and k-token steps (bottom-right causal alignment)
# Beyond the registry's variants: per-position learned weights, and every form of linear attention and MLK.
_FORMS = ({"normalize": "length"}, {"normalize": "none"},
          {"feature_map": "elu_sum", "output_scale": D ** -0.5, "eps": 1e-5, "eps_mode": "add"})
CASES = [*kind_variants(), ("mgk", {"pi_shape": "position"}), ("smgk", {"pi_shape": "position"}),
         ("mlk", {"pi_shape": "position"}), ("smlk", {"pi_shape": "position", "pi_norm": "none"}),
         *(("linear", f) for f in _FORMS), *(("mlk", f) for f in _FORMS), ("mlk", {"mix": "keys", **_FORMS[0]})]
IDS = [variant_name(k, v) for k, v in CASES]


def _module(kind, options, max_len=400, batch_first=True):
    """The attention tests' module (E=16, H=2, D=8, eval mode, non-uniform mixture weights), ``max_len`` long enough
    for the longest prefill here."""
    return build_kind(kind, {"max_len": max_len, **options} if "max_len" in get_kind(kind).options.names()
                      else options, batch_first=batch_first)


def _uncached(m, x):
    with torch.no_grad():
        return m(x, need_weights=False, is_causal=True)[0]


def _decode(m, x, prefill, steps=STEPS, key_padding_mask=None, cache=None):
    """Outputs of a prefill then ``steps``, and the cache."""
    cache = m.new_cache() if cache is None else cache
    outs, t = [], prefill
    with torch.no_grad():
        outs.append(m(x[:, :prefill], past_key_values=cache, is_causal=True, need_weights=False,
                      key_padding_mask=None if key_padding_mask is None else key_padding_mask[:, :prefill])[0])
        for k in steps:
            outs.append(m(x[:, t:t + k], past_key_values=cache, is_causal=True, need_weights=False)[0])
            t += k
    return outs, cache


@pytest.mark.parametrize("prefill", [1, 63, 65, 300])
@pytest.mark.parametrize("kind,options", CASES, ids=IDS)
def test_cached_decoding_equals_the_uncached_causal_forward_at_every_step(kind, options, prefill):
    m = _module(kind, options)
    torch.manual_seed(1)
    x = torch.randn(2, prefill + sum(STEPS), E)
    outs, cache = _decode(m, x, prefill)
    scale = float(_uncached(m, x).abs().max())
    _close(outs[0], _uncached(m, x[:, :prefill]), scale, "prefill")
    t = prefill
    for k, out in zip(STEPS, outs[1:]):
        t += k  # the step's tokens are the last k rows of the uncached forward over everything so far
        _close(out, _uncached(m, x[:, :t])[:, -k:], scale, f"step to {t}")
    assert cache.length == t and cache.seen.tolist() == [t, t]


@pytest.mark.parametrize("kind,options", CASES, ids=IDS)
def test_a_left_padded_batch_decodes_each_row_as_that_row_alone(kind, options):
    """Prompts of 9, 4 and 1 tokens left-padded to 9 (padding filled with NaN: inert); positions count from each
    row's first real token, so per-position weights and normalize='length' give each row its own numbers."""
    m = _module(kind, options)
    torch.manual_seed(2)
    lengths, P = [9, 4, 1], 9
    x = torch.randn(3, P + sum(STEPS), E)
    pad = torch.zeros(3, P, dtype=torch.bool)
    for b, n in enumerate(lengths):
        pad[b, :P - n] = True
    x[:, :P][pad] = float("nan")
    outs, cache = _decode(m, x, P, key_padding_mask=pad)
    assert cache.seen.tolist() == [n + sum(STEPS) for n in lengths]
    for b, n in enumerate(lengths):
        row = x[b:b + 1, P - n:]
        scale = float(_uncached(m, row).abs().max())
        _close(outs[0][b:b + 1, P - n:], _uncached(m, row[:, :n]), scale, f"row {b} prefill")
        t = n
        for k, out in zip(STEPS, outs[1:]):
            t += k  # as the row alone: the last k rows of the uncached forward over its own tokens so far
            _close(out[b:b + 1], _uncached(m, row[:, :t])[:, -k:], scale, f"row {b} step to {t}")


@pytest.mark.parametrize("kind,options", kind_variants(), ids=[variant_name(k, v) for k, v in kind_variants()])
def test_every_kind_fills_the_one_layer_cache_with_the_slots_it_declares(kind, options):
    m = _module(kind, options)
    cache = m.new_cache()
    assert type(cache) is LayerCache and cache.slots == m.cache_slots and cache.layout == m.cache_layout
    assert get_kind(kind).cache.recurrent == (not m.cache_slots)  # a recurrent state, or per-token entries


@pytest.mark.parametrize("kind,options", CASES, ids=IDS)
def test_measured_cache_bytes_are_the_registry_formula(kind, options):
    m = _module(kind, options)
    spec, opts = get_kind(kind), get_kind(kind).make_options(**{**options, **(
        {"max_len": 400} if "max_len" in get_kind(kind).options.names() else {})})
    for T in (5, 37):
        cache = m.new_cache()
        with torch.no_grad():
            m(torch.randn(3, T, E), past_key_values=cache, is_causal=True, need_weights=False)
        assert cache.nbytes() == 3 * spec.cache.cache_bytes(opts, num_heads=H, head_dim=D, length=T)


def _bytes_per_token(kind, heads, T=64, head_dim=16, **options):
    m = mgk.build_attention(kind, 64, heads, head_dim=head_dim, **options).eval()
    cache = m.new_cache()
    with torch.no_grad():
        m(torch.randn(1, T, 64), past_key_values=cache, is_causal=True, need_weights=False)
    return cache.nbytes() / T


@pytest.mark.parametrize("head_dim", [16, 32])
def test_mgk4_holds_three_quarters_and_smgk4_half_of_softmax8s_keys_and_values(head_dim):
    """Per token and layer: softmax-8 16 D floats; MGK-4 (M = 2) 12 D (0.75x) and sMGK-4 8 D (0.5x, the shifts
    applied on read), each plus its M per-key scalars (M / (4 D) of softmax-8's bytes)."""
    softmax8 = _bytes_per_token("softmax", 8, head_dim=head_dim)
    mgk4, smgk4 = _bytes_per_token("mgk", 4, head_dim=head_dim), _bytes_per_token("smgk", 4, head_dim=head_dim)
    scalars = 4 * 2 * 4  # 4 heads x M = 2 scalars x 4 bytes
    assert softmax8 == 8 * 2 * head_dim * 4
    assert (mgk4 - scalars) / softmax8 == 0.75 and (smgk4 - scalars) / softmax8 == 0.5
    assert mgk4 / softmax8 == 0.75 + 2 / (4 * head_dim) and smgk4 / softmax8 == 0.5 + 2 / (4 * head_dim)


def test_mlk4_state_is_the_same_size_from_256_to_4096_tokens():
    m = mgk.build_attention("mlk", 64, 4, head_dim=16).eval()
    cache, sizes = m.new_cache(), []
    with torch.no_grad():
        m(torch.randn(1, 256, 64), past_key_values=cache, is_causal=True, need_weights=False)
        sizes.append(cache.nbytes())
        m(torch.randn(1, 4096 - 256, 64), past_key_values=cache, is_causal=True, need_weights=False)
        sizes.append(cache.nbytes())
    assert cache.length == 4096 and sizes == [4 * (16 * 16 + 16) * 4] * 2


@pytest.mark.parametrize("kind", ["softmax", "mgk", "smgk"])
def test_reserved_slots_are_never_attended(kind):
    """gpt-fast#233: slots allocated ahead hold NaN here, and the steps read none of them."""
    m = _module(kind, {})
    x = torch.randn(2, 12, E)
    cache = m.new_cache(capacity=64)
    with torch.no_grad():
        m(x[:, :4], past_key_values=cache, is_causal=True, need_weights=False)
        for name, buf in cache._buffers.items():
            buf.narrow(cache.slots[name], 4, 60).fill_(float("nan"))
    with torch.no_grad():
        got = [m(x[:, t:t + 1], past_key_values=cache, is_causal=True, need_weights=False)[0] for t in range(4, 12)]
    assert cache.capacity == 64
    torch.testing.assert_close(torch.cat(got, 1), _uncached(m, x)[:, 4:], **TOL)


def test_buffers_grow_geometrically_and_keep_their_contents():
    m = _module("mgk", {})
    x = torch.randn(1, 40, E)
    cache = m.new_cache(capacity=3)
    capacities = []
    with torch.no_grad():
        for t in range(40):
            m(x[:, t:t + 1], past_key_values=cache, is_causal=True, need_weights=False)
            capacities.append(cache.capacity)
    assert sorted(set(capacities)) == [3, 6, 12, 24, 48]
    assert cache.allocated_bytes() == cache.nbytes() * 48 // 40


def _shifted_as_separate():
    """A cache filled by a separate-key MGK layer, of the sMGK cache's class (sMGK's is a subclass)."""
    cache = _module("smgk", {}).new_cache()
    cache.bind(("MGKAttention", H, D, "separate"), 2, "cpu")
    return cache


def test_each_layer_of_a_model_counts_its_own_tokens():
    """flash-linear-attention#747 counted the length once for all layers: here each layer's cache has its own
    length and per-row counts, and a layer refuses another layer's cache."""
    a, b = _module("softmax", {}), _module("mgk", {})
    cache = DecodingCache([a.new_cache(), b.new_cache()])
    with torch.no_grad():
        a(torch.randn(2, 5, E), past_key_values=cache[0], is_causal=True, need_weights=False)
        b(torch.randn(2, 3, E), past_key_values=cache[1], is_causal=True, need_weights=False)
    assert [layer.length for layer in cache] == [5, 3]
    with torch.no_grad(), pytest.raises(ValueError, match="another layer"):  # a separate-key MGK cache given to sMGK
        _module("smgk", {})(torch.randn(2, 1, E), past_key_values=_shifted_as_separate(), is_causal=True,
                            need_weights=False)
    with torch.no_grad(), pytest.raises(ValueError, match="batch of 2 rows"):
        b(torch.randn(3, 1, E), past_key_values=cache[1], is_causal=True, need_weights=False)


def test_per_position_weights_refuse_to_decode_past_their_trained_length():
    m = _module("mgk", {"pi_shape": "position"}, max_len=8)
    cache = m.new_cache()
    with torch.no_grad():
        m(torch.randn(1, 8, E), past_key_values=cache, is_causal=True, need_weights=False)  # positions 0..7: fine
        with pytest.raises(ValueError, match=r"pi_shape='position' has mixture weights for max_len=8 .*position 8"):
            m(torch.randn(1, 1, E), past_key_values=cache, is_causal=True, need_weights=False)
    soft = _module("smgk", {"pi": "soft_e"}, max_len=4)
    with torch.no_grad(), pytest.raises(ValueError, match="pi='soft_e' has mixture weights for max_len=4"):
        soft(torch.randn(1, 5, E), past_key_values=soft.new_cache(), is_causal=True, need_weights=False)


@pytest.mark.parametrize("kwargs,message", [
    ({"need_weights": True}, "need_weights=False"),
    ({"is_causal": False}, "is_causal=True"),
    ({"attn_mask": torch.zeros(3, 3, dtype=torch.bool)}, "no attn_mask"),
])
def test_a_cached_call_that_cannot_be_decoding_is_refused(kwargs, message):
    m = _module("softmax", {})
    call = {"need_weights": False, "is_causal": True, **kwargs}
    with pytest.raises(ValueError, match=message):
        m(torch.randn(1, 3, E), past_key_values=m.new_cache(), **call)
    with pytest.raises(ValueError, match="self-attention"):
        m(torch.randn(1, 3, E), torch.randn(1, 3, E), past_key_values=m.new_cache(), is_causal=True,
          need_weights=False)
    with pytest.raises(ValueError, match=r"a MultiheadAttention cache, from new_cache\(\)\), got a MLKAttention"):
        m(torch.randn(1, 3, E), past_key_values=_module("mlk", {}).new_cache(), is_causal=True, need_weights=False)


@pytest.mark.parametrize("batch_first", [True, False])
def test_layouts_and_unbatched_inputs_decode_alike(batch_first):
    m = _module("mgk", {}, batch_first=batch_first)
    x = torch.randn(2, 7, E)
    want = _uncached(_module("mgk", {}), x)
    cache, single = m.new_cache(), m.new_cache()
    with torch.no_grad():
        first = x[:, :5] if batch_first else x[:, :5].transpose(0, 1)
        out = m(first, past_key_values=cache, is_causal=True, need_weights=False)[0]
        out = out if batch_first else out.transpose(0, 1)
        lone = [m(x[0, :5], past_key_values=single, is_causal=True, need_weights=False)[0]]
        for t in (5, 6):
            step = x[:, t:t + 1] if batch_first else x[:, t:t + 1].transpose(0, 1)
            o = m(step, past_key_values=cache, is_causal=True, need_weights=False)[0]
            out = torch.cat([out, o if batch_first else o.transpose(0, 1)], dim=1)
            lone.append(m(x[0, t:t + 1], past_key_values=single, is_causal=True, need_weights=False)[0])
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(torch.cat(lone), want[0], **TOL)


@pytest.mark.parametrize("kind,options", CASES, ids=IDS)
def test_gated_heads_and_components_decode_as_the_gated_forward(kind, options):
    """The pruning gates (head_gate; component_gate of mixtures, per-position weights included) act on cached decoding
    as on the full forward."""
    m = _module(kind, options)
    m.head_gate = torch.tensor([1.0, 0.0])
    mixture = getattr(m, "mixture", None)
    if mixture is not None and getattr(m, "pi_mode", "learned") != "hard_e":
        # one row per head of the mixture (gmgk: per key group, whose components its query heads share)
        mixture.component_gate = torch.tensor([[1.0, 0.0], [0.5, 1.0]])[:mixture.num_heads]
    torch.manual_seed(1)
    x = torch.randn(2, 5 + sum(STEPS), E)
    outs, _ = _decode(m, x, 5)
    scale = float(_uncached(m, x).abs().max())
    _close(outs[0], _uncached(m, x[:, :5]), scale, "prefill")
    t = 5
    for k, out in zip(STEPS, outs[1:]):
        t += k
        _close(out, _uncached(m, x[:, :t])[:, -k:], scale, f"step to {t}")


MIXTURE_CASES = [(k, v) for k, v in CASES if get_kind(k).family == "mixture"]


@pytest.mark.parametrize("kind,options", MIXTURE_CASES, ids=[variant_name(k, v) for k, v in MIXTURE_CASES])
def test_a_far_first_token_decoded_from_a_one_token_prefill_stays_within_float32_rounding(kind, options):
    """A beginning-of-sequence token far from the rest (its input of norm 1000: query and key far) prefilled alone,
    as ``generate`` from BOS does, then single tokens; and in a left-padded batch beside a longer prompt. The one
    token's centre is provisional: the second token's query replaces it and the first token's entries are remade,
    so every step is within 1e-5 of the float64 module's uncached forward (with the first query kept as the centre
    the steps were off by about 3 eps 1000^2 / (2 sigma^2)). At key_scale c != 1 (a converted layer, centred on 0)
    the scores are dot-product attention's, whose rounding on the far key (eps |q| |k_far| / sigma^2) is not
    negligible: there the steps are held to twice the uncached float32 forward's own error."""
    m = _module(kind, options)
    torch.manual_seed(3)
    T = 12
    x = torch.randn(2, T, E)
    far = torch.randn(E)
    x[:, 0] = far / far.norm() * 1000
    x[1, 1:4] = float("nan")  # row 1: left padding ...
    x[1, 4] = x[0, 0]  # ... then its own far first token
    pad = torch.zeros(2, T, dtype=torch.bool)
    pad[1, 1:5] = True  # row 1's prompt is the far token at 4 alone (slots 0-4 as padding but for it)
    pad[1, 4] = False
    pad[1, 0] = True
    want = m.double()
    alone = [x[0:1].double(), x[1:2, 4:].double()]
    reference = [want(r, need_weights=False, is_causal=True)[0].float() for r in alone]
    m.float()
    atol = [1e-5, 1e-5]
    if options.get("key_scale", 1.0) != 1.0:
        with torch.no_grad():
            atol = [max(1e-5, 2 * (m(r.float(), need_weights=False, is_causal=True)[0] - ref).abs().max().item())
                    for r, ref in zip(alone, reference)]
    for rows, mask, prefill in (([0], None, 1), ([0, 1], pad[:, :5], 5)):
        cache, outs = m.new_cache(), []
        with torch.no_grad():
            outs.append(m(x[rows, :prefill], past_key_values=cache, is_causal=True, need_weights=False,
                          key_padding_mask=mask)[0])
            for t in range(prefill, T):
                outs.append(m(x[rows, t:t + 1], past_key_values=cache, is_causal=True, need_weights=False)[0])
        got = torch.cat(outs, dim=1)
        for i, b in enumerate(rows):
            start = 0 if b == 0 else 4
            torch.testing.assert_close(got[i:i + 1, start:], reference[b], atol=atol[b], rtol=1e-6,
                                       msg=lambda s, b=b: f"row {b}: {s}")
        assert cache.state.provisional is False and cache.state.raw_key is None  # nothing kept once final


@pytest.mark.parametrize("kind", ["mgk", "smgk"])
def test_a_row_that_stays_provisional_keeps_one_slot_of_keys_whatever_the_steps(kind):
    """While any row was provisional (fewer than two real tokens), every call's raw keys were kept
    for all rows: an empty row held 4.2 MiB beside a 6.1 MiB cache after 2,000 steps. Only each provisional row's
    one real token is needed to remake its entry, so what is kept does not grow with the steps; the decoded rows
    still equal the uncached forward."""
    m = _module(kind, {})
    torch.manual_seed(5)
    x = torch.randn(2, 30, E)
    empty = torch.zeros(2, 1, dtype=torch.bool)
    empty[1] = True  # row 1 is padding at every call: it never leaves its provisional centre
    cache, kept, outs = m.new_cache(), [], []
    with torch.no_grad():
        outs.append(m(x[:, :3], past_key_values=cache, is_causal=True, need_weights=False,
                      key_padding_mask=empty.expand(2, 3))[0])
        for t in range(3, 30):
            outs.append(m(x[:, t:t + 1], past_key_values=cache, is_causal=True, need_weights=False,
                          key_padding_mask=empty)[0])
            kept.append(cache.extra_bytes())
    assert cache.state.provisional is True
    assert kept[-1] == kept[0] <= 2 * cache.nbytes() / 30  # one slot per row, not one per step
    _close(torch.cat(outs, dim=1)[:1], _uncached(m, x[:1]), 1.0, "row 0")


@pytest.mark.parametrize("kind,options", CASES, ids=IDS)
def test_cached_decoding_under_vmap_over_stacked_batches_is_each_batch_decoded_alone(kind, options):
    """torch.func.vmap over a prefill and two steps (a function of the tokens that builds its own cache): no
    data-dependent branch on the cache's entries, and each stacked batch gets the outputs it gets alone."""
    m = _module(kind, options)
    torch.manual_seed(3)
    x = torch.randn(2, 2, 7, E)

    def decode(tokens):
        outs, _ = _decode(m, tokens, 5, steps=(1, 1))
        return torch.cat(outs, dim=1)

    got = torch.func.vmap(decode)(x)
    want = torch.stack([decode(batch) for batch in x])
    _close(got, want, float(want.abs().max()), "vmap")


@pytest.mark.parametrize("kind,options", CASES, ids=IDS)
def test_a_row_whose_prompt_is_all_padding_decodes_as_its_new_tokens_alone(kind, options):
    """A left-padded batch may hold an empty prompt: that row's prefill is padding only (NaN: inert), its outputs
    there are finite, and its steps equal the uncached forward over its own tokens, which start at the first step;
    the other row is unaffected."""
    m = _module(kind, options)
    torch.manual_seed(4)
    P = 6
    x = torch.randn(2, P + sum(STEPS), E)
    pad = torch.zeros(2, P, dtype=torch.bool)
    pad[1] = True
    x[1, :P] = float("nan")
    outs, cache = _decode(m, x, P, key_padding_mask=pad)
    assert torch.isfinite(outs[0]).all()
    assert cache.seen.tolist() == [P + sum(STEPS), sum(STEPS)]
    for b, start in ((0, 0), (1, P)):
        row = x[b:b + 1, start:]
        scale = float(_uncached(m, row).abs().max())
        t = P - start
        for k, out in zip(STEPS, outs[1:]):
            t += k
            _close(out[b:b + 1], _uncached(m, row[:, :t])[:, -k:], scale, f"row {b} step to {t}")
