"""A module built with option keywords and an ``options`` object takes both only when they agree: a keyword that
disagrees with ``options`` is a one-line ValueError naming both values, never silently ignored (a dropped
``num_kv_heads=2`` would train four key/value heads while the caller asked for two). Every option of every registered
kind is covered, so a new kind or option is checked without an edit here."""
from __future__ import annotations

import dataclasses

import pytest

from mgk.attention.gmgk import GMGKOptions, GroupedMGKAttention
from mgk.attention.gqa import GQAOptions, GroupedQueryAttention
from mgk.attention.registry import attention_kinds, get_kind

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _other(field: dataclasses.Field):
    """A value of option ``field`` other than its default: another declared choice, twice a number, or 2."""
    default = field.default
    choices = [c for c in field.metadata.get("choices") or () if c != default]
    if choices:
        return choices[0]
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return default * 2
    return 2  # None defaults (num_kv_heads, max_len), and str options with one choice: the conflict is found first


PAIRS = [(kind, f) for kind in attention_kinds() for f in dataclasses.fields(get_kind(kind).options)]


def _build(kind: str, **keywords):
    return get_kind(kind).factory(16, 4, head_dim=4, batch_first=True, **keywords)


@pytest.mark.parametrize("kind,field", PAIRS, ids=[f"{k}-{f.name}" for k, f in PAIRS])
def test_a_keyword_that_disagrees_with_options_is_one_line_naming_both(kind, field):
    value = _other(field)
    with pytest.raises(ValueError) as e:
        _build(kind, options=get_kind(kind).options(), **{field.name: value})
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{field.name}={value!r} conflicts with options.{field.name}={field.default!r}" in msg, msg


@pytest.mark.parametrize("kind", [k for k in attention_kinds() if get_kind(k).options.names()])
def test_keywords_that_agree_with_options_build(kind):
    options = get_kind(kind).options()
    module = _build(kind, options=options, **options.as_kwargs())
    assert module.num_heads == 4


def test_the_grouped_kinds_named_cases():
    with pytest.raises(ValueError, match=r"^num_kv_heads=2 conflicts with options.num_kv_heads=4; give one$"):
        GroupedQueryAttention(64, 8, num_kv_heads=2, options=GQAOptions(num_kv_heads=4), batch_first=True)
    with pytest.raises(ValueError, match=r"^keys='shifted' conflicts with options.keys='separate'; give one$"):
        GroupedMGKAttention(64, 8, keys="shifted", options=GMGKOptions(num_kv_heads=2), batch_first=True)
    assert GroupedQueryAttention(64, 8, num_kv_heads=4, options=GQAOptions(num_kv_heads=4),
                                 batch_first=True).kv_heads == 4
