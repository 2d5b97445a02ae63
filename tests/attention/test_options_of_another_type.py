"""A module's ``options`` that is not its kind's options dataclass (a plain dict of options, a string) is a one-line
TypeError naming ``options``, for every registered kind, never dataclasses' own message from inside."""
from __future__ import annotations

import dataclasses

import pytest

from mgk.attention.mgk import MGKOptions
from mgk.attention.registry import attention_kinds, get_kind

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# the kinds whose modules take options (softmax has none, and no options keyword)
KINDS = [kind for kind in attention_kinds() if dataclasses.fields(get_kind(kind).options)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("options", [{}, "shifted"], ids=["dict", "str"])
def test_options_of_another_type_is_one_line_naming_options(kind, options):
    with pytest.raises(TypeError, match=r"^options must be a \w+Options or None, got (dict|str)$"):
        get_kind(kind).factory(16, 4, head_dim=4, batch_first=True, options=options)


def _other_kinds_options(kind):
    """Instances (defaults) of every other kind's options dataclass that differs from this kind's."""
    own = get_kind(kind).options
    return [get_kind(other).options() for other in attention_kinds() if get_kind(other).options is not own]


@pytest.mark.parametrize("kind", KINDS)
def test_another_kinds_options_are_refused_even_when_they_subclass_ours(kind):
    # gmgk's GMGKOptions subclasses MGKOptions and GQAOptions, mlk's MLKOptions subclasses LinearOptions: given to
    # the parent kind's module they passed isinstance and their own fields (num_kv_heads, num_keys) went unread
    for options in _other_kinds_options(kind):
        name = type(options).__name__
        with pytest.raises(TypeError, match=rf"^options (must be a \w+Options or None, got {name}|is a {name}, "
                                            rf"whose [\w, ]+ a module taking \w+Options would not read: )"):
            get_kind(kind).factory(16, 4, head_dim=4, batch_first=True, options=options)
        with pytest.raises(ValueError, match=rf"^attention kind '{kind}' takes \w+Options, got {name}$"):
            get_kind(kind).build(16, 4, options)


@dataclasses.dataclass(frozen=True)
class _ChangedDefault(MGKOptions):
    """A user's options that only change a default: MGKAttention's own options, taken."""

    num_keys: int = 3


def test_a_subclass_that_only_changes_defaults_is_taken():
    module = get_kind("mgk").factory(16, 4, head_dim=4, batch_first=True, options=_ChangedDefault())
    assert module.num_keys == 3
    assert get_kind("mgk").build(16, 4, _ChangedDefault()).num_keys == 3
