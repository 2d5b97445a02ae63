"""Names chosen from a known set (tasks, attention kinds, presets, experiments, scales): the one message for a name
that is not in it, with the close matches that :func:`difflib.get_close_matches` finds (as argparse does for
``choices`` from Python 3.14), so that ``--task listop`` answers ``did you mean 'listops'?``.
"""
from __future__ import annotations

import argparse
import difflib
from typing import Callable, Iterable

__all__ = ["did_you_mean", "unknown", "require", "argparse_type"]


def did_you_mean(value, choices: Iterable) -> str:
    """``" (did you mean 'listops'?)"`` (up to three close matches of ``value`` among ``choices``), or ``""``."""
    if not isinstance(value, str):
        return ""
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(value, names, n=3, cutoff=0.6)
    if not close:  # a prefix or a part of a longer name ("wt103" for "wt103-paper") is a match too
        close = [c for c in names if value and (c.startswith(value) or value in c.split("-"))][:3]
    if not close:
        return ""
    quoted = [repr(c) for c in close]
    return " (did you mean " + (f"{', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else quoted[0]) + "?)"


def unknown(what: str, value, choices: Iterable) -> str:
    """``"unknown <what> 'x' (did you mean 'y'?); choose from a, b, c"``: the message of every name lookup."""
    names = list(choices)
    return f"unknown {what} {value!r}{did_you_mean(value, names)}; choose from {', '.join(map(str, names))}"


def require(what: str, value, choices: Iterable):
    """``value`` when it is one of ``choices``; ValueError with :func:`unknown`'s message otherwise."""
    names = list(choices)
    if value not in names:
        raise ValueError(unknown(what, value, names))
    return value


def argparse_type(what: str, choices: Callable[[], Iterable] | Iterable) -> Callable[[str], str]:
    """An argparse ``type=`` that accepts a name among ``choices`` (an iterable, or a callable giving one, read when
    the argument is parsed) and answers any other with :func:`unknown`'s message (argparse prefixes the flag)."""

    def parse(text: str) -> str:
        """``text`` when it names a choice; argparse.ArgumentTypeError with close matches otherwise."""
        names = list(choices() if callable(choices) else choices)
        if text not in names:
            raise argparse.ArgumentTypeError(unknown(what, text, names))
        return text

    parse.__name__ = what.replace(" ", "_")  # argparse names the type in its fallback message
    return parse
