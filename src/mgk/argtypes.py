"""argparse ``type=`` callables for bounded numbers, shared by the commands so that every option says the same
thing about a value out of range: "must be > 0, got -3", "must be in (0, 1], got 0"."""
from __future__ import annotations

import argparse
import math

from .seeds import INT64_MAX, SEED_MAX

__all__ = ["THREADS_MAX", "number", "seed", "threads"]


def _show(x) -> str:
    """A bound as typed: an int in full (2**64 - 1 is not 1.84467e+19), a float in short form."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def number(kind: type = int, low: float | None = None, high: float | None = None, *, low_open: bool = False,
           note: str = ""):
    """A parser of ``kind`` (int or float) in ``[low, high]`` (``(low, ...`` with ``low_open``; either bound may be
    None). NaN and infinities are refused. ``note`` follows the range in the message (e.g. "(0 = greedy)").
    An int without ``high`` is still refused above :data:`mgk.seeds.INT64_MAX`, the most a torch integer holds.
    The parser raises argparse.ArgumentTypeError, which argparse prints as one line naming the option."""
    if low is not None and high is not None:
        shown = f"in {'(' if low_open else '['}{_show(low)}, {_show(high)}]"
    elif low is not None:
        shown = f"{'>' if low_open else '>='} {_show(low)}"
    else:
        shown = f"<= {_show(high)}" if high is not None else "a finite number"
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
        if kind is int and high is None and value > INT64_MAX:
            raise argparse.ArgumentTypeError(f"must be <= {INT64_MAX} (a 64-bit integer), got {text}")
        return value
    return parse


# A seed as torch takes it (mgk.seeds): every --seed of every command.
seed = number(int, 0, SEED_MAX, note="(64 bits)")


# A count of CPU threads: torch.set_num_threads (and OpenMP's OMP_NUM_THREADS) take a C int, and fail beyond it
# with "Overflow when unpacking long".
THREADS_MAX = 2 ** 31 - 1
threads = number(int, 1, THREADS_MAX)
