"""The range of a seed, and the one reduction of derived seeds to what torch takes.

``torch.manual_seed`` and ``torch.Generator.manual_seed`` take an integer in [-2^63, 2^64 - 1] and fail beyond it
with "Overflow when unpacking long long", which names nothing a user can change. Every seed a user
gives (``--seed``, ``--set seed=``) is therefore an integer in [0, :data:`SEED_MAX`], and every seed derived from it
(``seed * 7919 + rank``, ``seed * 1_000_003 + epoch``, ...) goes to torch through :func:`torch_seed`. A library
function that takes a seed checks it with :func:`check_seed`.
"""
from __future__ import annotations

import operator

__all__ = ["SEED_MAX", "INT64_MAX", "check_seed", "torch_seed"]

SEED_MAX = 2 ** 64 - 1  # the largest seed torch takes (an unsigned 64-bit integer)
INT64_MAX = 2 ** 63 - 1  # the largest size, count or index a torch integer holds


def torch_seed(value: int) -> int:
    """``value`` modulo 2^64: the same integer for every value in [0, SEED_MAX] (so the streams of seeds that fit
    are unchanged), and one torch takes for a derived seed that does not."""
    return int(value) % (SEED_MAX + 1)


def check_seed(value, name: str = "seed") -> int:
    """``value`` as an int when it is an integer in [0, :data:`SEED_MAX`] (numpy integers included, bools not).

    Raises:
        ValueError: one line naming ``name`` and the range, e.g. "seed must be an integer in [0, 18446744073709551615]
            (64 bits), got 18446744073709551616", instead of torch's "Overflow when unpacking long long".
    """
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or not 0 <= number <= SEED_MAX:
        raise ValueError(f"{name} must be an integer in [0, {SEED_MAX}] (64 bits), got {value!r}")
    return number
