"""Two ``--set`` mistakes are answered in one line naming the field, before any data is read: an empty value
(``--set num_kv_heads=``: a forgotten value, never taken for None or "") and head counts the attention module would
refuse (``num_kv_heads`` not dividing ``num_heads``; ``head_dim=none`` with ``num_heads`` not dividing ``d_model``),
which the module itself reported only after the data was prepared, in its own argument names."""
from __future__ import annotations

import pytest

from mgk import config as config_mod
from mgk.attention.registry import attention_kinds, get_kind
from mgk.cli import main
from mgk.config.keys import flat_keys

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

GROUPED = [k for k in attention_kinds() if "num_kv_heads" in get_kind(k).options.names()]


def _kind_taking(path: str) -> list[str]:
    """``--set attention=<a kind that takes the option>`` for an option's path; nothing for other fields."""
    if not path.startswith("attention.options."):
        return []
    name = path.rsplit(".", 1)[-1]
    return [f"attention={next(k for k in attention_kinds() if name in get_kind(k).options.names())}"]


def _empty_value_is_refused(key: str) -> None:
    pairs = [*_kind_taking(flat_keys()[key]), f"{key}="]
    # the kind is chosen before the other values parse, among the registered names
    expected = "config field attention must be one of .*, got ''" if key == "attention" else \
        rf"--set {key}=: empty value, expected [^\n]+"
    with pytest.raises(ValueError, match=rf"^{expected}$"):
        config_mod.apply_overrides(config_mod.RunConfig(), pairs)


# Optional fields (an empty value used to become None), a str field and required numbers.
@pytest.mark.parametrize("key", ["num_kv_heads", "head_dim", "data", "max_len", "lr", "level"])
def test_an_empty_set_value_is_one_line_naming_the_field(key):
    _empty_value_is_refused(key)


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(flat_keys()))
def test_an_empty_set_value_is_refused_for_every_field(key):
    _empty_value_is_refused(key)


def test_none_still_sets_an_optional_field_to_none():
    cfg = config_mod.apply_overrides(config_mod.RunConfig(), ["attention=gqa", "num_kv_heads=none", "head_dim=None"])
    assert cfg.attention.options.num_kv_heads is None and cfg.attention.head_dim is None


@pytest.mark.parametrize("kind", GROUPED)
def test_num_kv_heads_not_dividing_num_heads_is_named_by_its_field(kind):
    cfg = config_mod.apply_overrides(config_mod.RunConfig(), [f"attention={kind}", "num_heads=8", "num_kv_heads=3"])
    with pytest.raises(ValueError, match=r"^config field num_kv_heads must divide num_heads \(8\), got 3$"):
        config_mod.validate(cfg)
    config_mod.validate(config_mod.replace(cfg, num_kv_heads=4))


def test_head_dim_none_with_num_heads_not_dividing_d_model_is_named_by_its_field():
    cfg = config_mod.apply_overrides(config_mod.RunConfig(), ["d_model=64", "num_heads=3", "head_dim=none"])
    with pytest.raises(ValueError, match=r"^config field head_dim is None, so num_heads \(3\) must divide d_model "
                                         r"\(64\); set head_dim$"):
        config_mod.validate(cfg)
    config_mod.validate(config_mod.replace(cfg, num_heads=4))


@pytest.mark.parametrize("sets,line", [
    (["num_kv_heads=3"], "mgk train: config field num_kv_heads must divide num_heads (8), got 3"),
    (["num_kv_heads="], "mgk train: --set num_kv_heads=: empty value, expected int or None (write none for None)"),
])
def test_mgk_train_names_the_field_before_reading_data(tmp_path, capsys, sets, line):
    out = tmp_path / "run"
    argv = ["train", "--preset", "dretrieval-small", "--attention", "gqa", "--heads", "8", "--steps", "1",
            "--device", "cpu", "--out", str(out)]
    with pytest.raises(SystemExit) as e:
        main(argv + [a for s in sets for a in ("--set", s)])
    err = capsys.readouterr().err
    got = e.value.code if isinstance(e.value.code, str) else err.strip().splitlines()[-1]
    assert got == line
    assert not out.exists()  # refused before the run directory and its data were made
