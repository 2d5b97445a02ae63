"""A bench row's ``--set`` that gives another value to what its ``--kinds`` entry or the bench itself sets (the
kind, an option of it, num_heads, decode's max_len) is refused in one line naming the user's pair and where the
other comes from; before, it named a ``--set`` pair the user never typed (the bench's own), or earlier still the
later silently won and the row measured a model other than its label."""
from __future__ import annotations

import pytest

from mgk.bench.decode import _preset_model
from mgk.bench.model import with_kind
from mgk.tasks import all_presets


@pytest.mark.parametrize("pair, theirs", [("num_heads=4", "num_heads=2"), ("attention=softmax", "attention=mgk"),
                                          ("num_keys=3", "attention.options.num_keys=2"),
                                          ("attention.options.num_keys=3", "attention.options.num_keys=2")])
def test_a_set_against_the_kinds_entry_names_both(pair, theirs):
    with pytest.raises(ValueError) as err:
        with_kind(all_presets()["lm-small"], "mgk+num_keys=2", 2, [pair])
    assert str(err.value) == f"--set {pair} conflicts with --kinds mgk+num_keys=2, which sets {theirs}; set it there"


def test_agreeing_and_unrelated_sets_are_taken():
    cfg = with_kind(all_presets()["lm-small"], "mgk+num_keys=2", 2, ["num_heads=2", "lr=0.002"])
    assert (cfg.attention.kind, cfg.attention.options.num_keys, cfg.optim.lr) == ("mgk", 2, 0.002)
    assert with_kind(all_presets()["lm-small"], None, None, ["num_heads=4"]).attention.kind  # no --kinds: free


def test_decodes_max_len_is_named_by_the_flags_that_set_it():
    with pytest.raises(ValueError, match=r"^--set max_len=64 conflicts with --contexts and --steps"):
        _preset_model("lm-small", "mgk", 2, ["max_len=64"], context=128, steps=4)


@pytest.mark.parametrize("kinds, pair", [("mgk+sigma2=0.50", "sigma2=0.5"), ("mgk+sigma2=0.5", "sigma2=0.50"),
                                         ("gqa+num_kv_heads=2", "num_kv_heads=+2")])
def test_values_are_compared_as_parsed_not_as_text(kinds, pair):
    cfg = with_kind(all_presets()["lm-small"], kinds, 4, [pair, "num_heads=04"])
    name, value = pair.split("=")
    assert getattr(cfg.attention.options, name) == float(value)
    assert (cfg.attention.kind, cfg.attention.num_heads) == (kinds.split("+")[0], 4)
