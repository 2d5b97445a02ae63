"""The backend-selection protocol every op of :mod:`mgk.functional` follows (softmax, MGK and its Soft-E statistics,
linear / MLK, the MGK decoding step).

Each op lists its implementations in order of preference and has one ``why_not(name, automatic)`` function that
says why an implementation cannot serve a call (None when it can). :func:`pick` then answers ``backend=None`` with
the first that serves, and ``backend=NAME`` with that one or a :class:`BackendError` carrying the reason, so that
every op refuses a named backend in the same words. :func:`is_transformed` is the test every op shares for
forward-mode AD and torch.func transforms, which only the explicit implementations have rules for.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["BackendError", "is_transformed", "pick"]


class BackendError(ValueError):
    """A backend was asked for by name that cannot serve the inputs (the message says why)."""


def pick(backend: str | None, names: tuple[str, ...], why_not: Callable[[str, bool], str | None]) -> str:
    """``backend`` if ``why_not(backend, False)`` is None (else BackendError naming the reason), or the first of
    ``names`` for which ``why_not(name, True)`` is None when ``backend`` is None (BackendError listing every reason when
    none serves)."""
    if backend is None:
        reasons = {}
        for name in names:
            reasons[name] = why_not(name, True)
            if reasons[name] is None:
                return name
        raise BackendError("no backend can serve these inputs: " + "; ".join(f"{n}: {w}" for n, w in reasons.items()))
    why = why_not(backend, False)
    if why is not None:
        raise BackendError(f"backend={backend!r} cannot serve these inputs: {why}")
    return backend


def is_transformed(*tensors: Tensor) -> bool:
    """Whether forward-mode AD (dual tensors) or a torch.func transform (vmap, grad, jvp) sees these tensors."""
    if torch.compiler.is_compiling():
        return False
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        return True
    from torch.autograd import forward_ad

    return forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)
