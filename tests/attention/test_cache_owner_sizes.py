"""A decoding cache serves only a layer of the sizes that filled it: a state dict saved from a layer with other
key/value heads or other mixture components, loaded into a new cache of another layer, is refused in one line at its
first call (naming past_key_values and both layers' sizes), never read as if its entries had this layer's shape
(GQA's 2 key/value heads read by a layer of 1 attended over the wrong heads silently; gmgk's group centres failed
deep inside the step)."""
import pytest
import torch

import mgk

E, H = 32, 4

PAIRS = [  # (kind, options of the layer that filled the cache, options of the layer that loads it)
    ("gqa", {"num_kv_heads": 2}, {"num_kv_heads": 1}),
    ("gmgk", {"num_kv_heads": 2}, {"num_kv_heads": 4}),
    ("gmgk", {"num_kv_heads": 1}, {"num_kv_heads": 2}),
    ("gmgk", {"num_kv_heads": 2, "keys": "shifted"}, {"num_kv_heads": 2, "keys": "shifted", "num_keys": 3}),
    ("mgk", {"num_keys": 2}, {"num_keys": 3}),
    ("smgk", {"num_keys": 2}, {"num_keys": 3}),
]


def _filled_and_loaded(a, b):
    """(a's cache after a 4-token prompt, a new cache of b holding its state dict, a next token's input)."""
    torch.manual_seed(0)
    x, y = torch.randn(2, 4, E), torch.randn(2, 1, E)
    with torch.no_grad():
        cache = a.new_cache()
        a(x, past_key_values=cache, is_causal=True, need_weights=False)
    other = b.new_cache()
    other.load_state_dict(cache.state_dict())
    return cache, other, y


@pytest.mark.parametrize("kind, filled, loading", PAIRS, ids=[f"{k}-{a}-{b}" for k, a, b in PAIRS])
def test_a_cache_of_other_sizes_is_refused_at_its_first_call(kind, filled, loading):
    a, b = mgk.build_attention(kind, E, H, **filled).eval(), mgk.build_attention(kind, E, H, **loading).eval()
    cache, other, y = _filled_and_loaded(a, b)
    with torch.no_grad():
        with pytest.raises(ValueError, match="past_key_values holds the cache of another layer") as err:
            b(y, past_key_values=other, is_causal=True, need_weights=False)
    text = str(err.value)
    assert "\n" not in text
    changed = next(k for k in loading if loading[k] != filled.get(k))
    assert f"{changed.replace('num_kv_heads', 'kv_heads')}=" in text, text


def test_a_cache_of_the_same_sizes_still_loads_and_decodes_as_the_original():
    a = mgk.build_attention("gmgk", E, H, num_kv_heads=2).eval()
    b = mgk.build_attention("gmgk", E, H, num_kv_heads=2).eval()
    b.load_state_dict(a.state_dict())
    cache, other, y = _filled_and_loaded(a, b)
    with torch.no_grad():
        want = a(y, past_key_values=cache, is_causal=True, need_weights=False)[0]
        got = b(y, past_key_values=other, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
