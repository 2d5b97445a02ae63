"""A list of attention kinds written out by hand in the code or the docs names them all: a kind registered later
(gmgk came after the lists were written) must not leave ``help(mgk.swap_attention)`` or a page offering the old set.
Where the list is not meant to be whole, name the rule or point to ``mgk.attention_kinds()`` instead."""
from __future__ import annotations

import re
from pathlib import Path

from mgk.attention.registry import attention_kinds, get_kind

REPO = Path(__file__).resolve().parents[1]
# The kinds mgk itself registers (a test may register more for the length of the session).
BUILT_IN = sorted(k for k in attention_kinds() if get_kind(k).options.__module__.startswith("mgk."))
_NAME = r"[`\"']?(?:%s)[`\"']?" % "|".join(sorted(BUILT_IN, key=len, reverse=True))
# Five or more kind names in a row, separated by commas, slashes, "and" or "or" (line breaks allowed): a whole list.
_LIST = re.compile(rf"(?<![\w-]){_NAME}(?:(?:,| /|,? and|,? or)\s+{_NAME}(?![\w-])){{4,}}")


def stale_lists(text: str) -> list[tuple[int, str]]:
    """(line, list) of every hand-written kind list in ``text`` that misses a built-in kind."""
    found = []
    for m in _LIST.finditer(text):
        if set(re.findall(r"\w+", m.group(0))) != set(BUILT_IN):
            found.append((text.count("\n", 0, m.start()) + 1, " ".join(m.group(0).split())))
    return found


def test_the_check_finds_a_list_missing_a_kind():
    assert BUILT_IN and "gmgk" in BUILT_IN
    assert stale_lists('kind ("softmax", "mgk", "smgk", "linear", "mlk",\n    "smlk", "gqa")') == [
        (1, '"softmax", "mgk", "smgk", "linear", "mlk", "smlk", "gqa"')]
    assert stale_lists(", ".join(BUILT_IN)) == [] and stale_lists("softmax, linear, smgk") == []


def test_no_hand_written_kind_list_misses_a_kind():
    files = [*sorted((REPO / "src" / "mgk").rglob("*.py")), *sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]
    stale = [f"{p.relative_to(REPO)}:{line}: {text}" for p in files for line, text in stale_lists(p.read_text())]
    assert not stale, "lists missing a kind (name them all or point to mgk.attention_kinds()):\n" + "\n".join(stale)
