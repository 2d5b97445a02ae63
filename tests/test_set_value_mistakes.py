"""Two ``--set`` mistakes are answered in one line naming the field, before any data is read: an empty value
(``--set num_kv_heads=``: a forgotten value, never taken for None or "") and head counts the attention module would
refuse (``num_kv_heads`` not dividing ``num_heads``; ``head_dim=none`` with ``num_heads`` not dividing ``d_model``),
which the module itself reported only after the data was prepared, in its own argument names. Two more that were
taken silently: one field given two values (``--set num_heads=4 --set num_heads=8``, an alias, or a flag and a
``--set``: the last one won) and a number with an underscore (``2_0``, which Python's int() reads as 20)."""
from __future__ import annotations

import re

import pytest

from mgk import config as config_mod
from mgk.attention.registry import attention_kinds, get_kind
from mgk.cli import main
from mgk.config.keys import flat_keys

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

GROUPED = [k for k in attention_kinds() if "num_kv_heads" in get_kind(k).options.names()]
UNDERSCORE = "a number with '_' in it (a typo?); write the number without it"


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
    (["num_kv_heads=2", "attention.options.num_kv_heads=4"], "mgk train: --set num_kv_heads=2 and --set "
     "attention.options.num_kv_heads=4 give num_kv_heads two values; keep one"),
    (["num_heads=4"], "mgk train: num_heads=8 (a flag) and --set num_heads=4 give num_heads two values; keep one"),
    (["gen_train=2_0"], f"mgk train: --set gen_train=2_0: {UNDERSCORE}"),
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


def _two_values(key: str) -> tuple[list[str], str, str] | None:
    """(pairs choosing a kind that takes ``key``, two texts ``key`` parses to different values), or None."""
    base = _kind_taking(flat_keys()[key])
    candidates = [("1", "2"), ("true", "false")]
    if key == "attention":
        candidates = [tuple(attention_kinds()[:2])]
    for a, b in candidates:
        try:
            for text in (a, b):
                config_mod.apply_overrides(config_mod.RunConfig(), [*base, f"{key}={text}"])
        except ValueError:
            continue
        return base, a, b
    return None


def test_every_field_given_two_values_is_one_line_naming_both():
    """Whatever the field, its flat name and its dotted path given different values: the later one used to win."""
    for key, path in flat_keys().items():
        found = _two_values(key)
        assert found is not None, key
        base, a, b = found
        for first, second in ((key, key), (key, path), (path, key)):
            pairs = [*base, f"{first}={a}", f"{second}={b}"]
            line = f"--set {first}={a} and --set {second}={b} give {key} two values; keep one"
            with pytest.raises(ValueError, match=f"^{re.escape(line)}$"):
                config_mod.apply_overrides(config_mod.RunConfig(), pairs)


@pytest.mark.parametrize("pairs,values,line", [
    (["lr=1e-3", "lr=2e-3"], {}, "--set lr=1e-3 and --set lr=2e-3 give lr two values; keep one"),
    (["pi=soft_e", "attention.options.pi=hard_e"], {},
     "--set pi=soft_e and --set attention.options.pi=hard_e give pi two values; keep one"),
    # a flag (a typed value) and a --set of one field
    (["num_heads=4"], {"num_heads": 8},
     r"num_heads=8 \(a flag\) and --set num_heads=4 give num_heads two values; keep one"),
    (["attention=softmax"], {"attention": "mgk"},
     r"attention=mgk \(a flag\) and --set attention=softmax give attention two values; keep one"),
    # two kinds are named before the options are parsed as one of them (num_keys is not softmax's)
    (["attention=mgk", "num_keys=3", "attention=softmax"], {},
     "--set attention=mgk and --set attention=softmax give attention two values; keep one"),
])
def test_one_field_given_two_values_is_refused(pairs, values, line):
    with pytest.raises(ValueError, match=f"^{line}$"):
        config_mod.apply_overrides(config_mod.RunConfig(), pairs, **values)


def test_replace_refuses_one_field_given_two_values_by_two_spellings():
    with pytest.raises(ValueError, match=r"^lr=0.001 and optim.lr=0.002 give lr two values; keep one$"):
        config_mod.replace(config_mod.RunConfig(), {"lr": 1e-3, "optim.lr": 2e-3})
    with pytest.raises(ValueError, match=r"^steps=5 and steps=6 give steps two values; keep one$"):
        config_mod.replace(config_mod.RunConfig(), {"steps": 5}, steps=6)


def test_one_field_given_the_same_value_twice_is_taken():
    """Nothing is lost when both say the same (1e-3 and 0.001 are one number; a flag repeated by --set)."""
    cfg = config_mod.apply_overrides(config_mod.RunConfig(), ["lr=1e-3", "optim.lr=0.001", "attention=mgk",
                                                              "pi=hard_e", "attention.options.pi=hard_e"],
                                     attention="mgk", steps=7)
    assert cfg.optim.lr == 1e-3 and cfg.attention.options.pi == "hard_e"
    assert config_mod.apply_overrides(config_mod.RunConfig(), ["steps=7"], steps=7).optim.steps == 7
    assert config_mod.replace(config_mod.RunConfig(), {"optim.lr": 1e-3}, lr=1e-3).optim.lr == 1e-3


def _numeric_example(key: str, value) -> list[str]:
    """Texts with a digit-group underscore of the kind of number ``value`` is (what ``key=10`` parsed to)."""
    if isinstance(value, tuple):
        return ["1_0", "1_0,20", "20,1_0", "[1_0, 20]"]
    return ["1_0", "+1_0", "1_000"] + (["1_0.5", "1.0_5", "1e1_0"] if isinstance(value, float) else [])


def test_every_numeric_field_refuses_a_number_with_an_underscore():
    """int("2_0") is 20 and float("1_0.5") is 10.5: for every field that reads ``10`` as a number (int, float, a
    tuple of them, sigma2's float-or-tuple-or-"learned"), the underscore is an error naming the key and the text."""
    numeric = 0
    for key, path in flat_keys().items():
        base = _kind_taking(path)
        try:
            value = config_mod.flat(config_mod.apply_overrides(config_mod.RunConfig(), [*base, f"{key}=10"]))[key]
        except ValueError:
            continue  # a bool, or the kind field
        if isinstance(value, str) or value is None:
            continue
        numeric += 1
        for text in _numeric_example(key, value):
            with pytest.raises(ValueError, match=rf"^--set {key}={re.escape(text)}: {re.escape(UNDERSCORE)}$"):
                config_mod.apply_overrides(config_mod.RunConfig(), [*base, f"{key}={text}"])
    assert numeric > 40  # the check above reached the numeric fields, not none of them


def test_an_underscore_stays_in_a_text_field_and_plain_numbers_still_parse():
    cfg = config_mod.apply_overrides(config_mod.RunConfig(), ["data=runs/1_000", "level=curv_contour_length_14",
                                                              "attention=mgk", "sigma2=learned", "lr=+1e-3",
                                                              "adaptive_cutoffs=20,60"])
    assert cfg.data.path == "runs/1_000" and cfg.attention.options.sigma2 == "learned" and cfg.optim.lr == 1e-3
    # the documented comma form of an int tuple gives ints (it gave floats, which the field then refused)
    assert cfg.model.adaptive_cutoffs == (20, 60)
    config_mod.validate(cfg)
    floats = config_mod.apply_overrides(config_mod.RunConfig(), ["attention=mgk", "sigma2=1,2"])
    assert floats.attention.options.sigma2 == (1.0, 2.0)
