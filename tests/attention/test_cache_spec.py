"""CacheSpec's per-token counts: a number, an option's name, or a function of the options (a count that depends on
more than one option, such as a key mode that stores M keys or one)."""
from dataclasses import dataclass

from mgk.attention.registry import CacheSpec


@dataclass(frozen=True)
class _Options:
    num_keys: int = 3
    keys: str = "separate"
    num_kv_heads: int | None = None


def _keys(options):
    """M key vectors for separate keys, the one unshifted key for shifted ones."""
    return options.num_keys if options.keys == "separate" else 1


def test_a_count_may_be_a_function_of_the_options():
    spec = CacheSpec(keys_per_token=_keys, scalars_per_token="num_keys", heads="num_kv_heads")
    assert spec.stored_per_token(_Options()) == (3, 1, 3)
    assert spec.stored_per_token(_Options(keys="shifted")) == (1, 1, 3)
    # G = 2 heads of D = 16 for 5 tokens: G (M D + D + M) and G (2 D + M) elements a token
    assert spec.cache_bytes(_Options(num_kv_heads=2), num_heads=8, head_dim=16, length=5) == 2 * 5 * (67) * 4
    assert spec.cache_bytes(_Options(keys="shifted", num_kv_heads=2), num_heads=8, head_dim=16, length=5) == \
        2 * 5 * (35) * 4
    scalars = CacheSpec(scalars_per_token=lambda options: 2 * options.num_keys)
    assert scalars.stored_per_token(_Options()) == (1, 1, 6)
