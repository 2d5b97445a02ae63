"""argparse ``type=`` callables for bounded numbers, shared by the commands so that every option says the same
thing about a value out of range: "must be > 0, got -3", "must be in (0, 1], got 0"."""
from __future__ import annotations

import argparse
import math

__all__ = ["number"]


def number(kind: type = int, low: float | None = None, high: float | None = None, *, low_open: bool = False,
           note: str = ""):
    """A parser of ``kind`` (int or float) in ``[low, high]`` (``(low, ...`` with ``low_open``; either bound may be
    None). NaN and infinities are refused. ``note`` follows the range in the message (e.g. "(0 = greedy)").
    The parser raises argparse.ArgumentTypeError, which argparse prints as one line naming the option."""
    if low is not None and high is not None:
        shown = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    elif low is not None:
        shown = f"{'>' if low_open else '>='} {low:g}"
    else:
        shown = f"<= {high:g}" if high is not None else "a finite number"
    shown += f" {note}" if note else ""

    def parse(text: str):
        """``text`` as ``kind`` when finite and in range; argparse.ArgumentTypeError saying the range otherwise."""
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") \
                from None
        if (not math.isfinite(value) or (low is not None and (value <= low if low_open else value < low))
                or (high is not None and value > high)):
            raise argparse.ArgumentTypeError(f"must be {shown}, got {text}")
        return value
    return parse
