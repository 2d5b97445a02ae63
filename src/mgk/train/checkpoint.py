"""Checkpoints: the one module that writes and reads them (``torch.save`` / ``torch.load``), atomically, loading
with ``weights_only=True`` (no code runs), and restoring every random stream.

Format (field ``format`` of every checkpoint; :data:`FORMAT`):

- 2: ``format``, ``kind`` ("last" or "best"), ``mgk`` (the writer's version), ``step``, ``model`` (state dict),
  ``config`` (``mgk.config.to_dict`` of the resolved run config); "last" adds ``optimizer``, ``scheduler``,
  ``scaler``, ``loop_state`` (:class:`~mgk.train.state.LoopState` fields) and ``rng`` (one
  :func:`rng_state` per rank).
- 1 (no ``format`` field): mgk 0.1.0 and the versions before 2. best.pt held ``model``, ``step``, ``config``;
  last.pt the loop state under ``state`` (0.1.0) or ``loop_state``, and no ``step``. :func:`load` returns them
  in format 2's field names.

A checkpoint of a later format than this mgk knows is refused with a message saying so.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..atomic import atomic_write

__all__ = ["FORMAT", "align_optimizer_state", "load", "rng_state", "save", "set_rng_state", "step_of"]

FORMAT = 2


def save(content: dict, path: str | os.PathLike, *, kind: str) -> None:
    """Write the checkpoint ``content`` (the fields of the format, :data:`FORMAT`) to ``path`` as ``kind`` ("last" or
    "best"), stamped with the format and the writer's version: ``torch.save`` to a temporary file in the same
    folder, fsync, then rename over ``path`` (:func:`mgk.atomic.atomic_write`). A crash at any moment leaves either
    the previous file or the new one, never a truncated file."""
    if kind not in ("last", "best"):
        raise ValueError(f"kind must be 'last' or 'best', got {kind!r}")
    with atomic_write(path) as f:
        torch.save({**content, "format": FORMAT, "kind": kind, "mgk": __version__}, f)


def load(path: str | os.PathLike, map_location="cpu") -> dict:
    """Load a checkpoint with ``weights_only=True`` (no arbitrary code runs), in the current format's field names
    whatever its own format (see the module docstring). Raises FileNotFoundError naming it when absent, ValueError
    naming it when it cannot be read or comes from a later mgk."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{path} is not a readable mgk checkpoint (corrupt, truncated or not made by mgk): "
                         f"{type(e).__name__}: {first}") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise ValueError(f"{path} is not an mgk checkpoint (no model weights in it)")
    version = ckpt.get("format", 1)
    if not isinstance(version, int) or version > FORMAT:
        raise ValueError(f"{path} has checkpoint format {version!r}, newer than this mgk {__version__} reads "
                         f"(up to {FORMAT}): upgrade mgk to load it")
    if version == 1:
        ckpt = _from_format_1(ckpt)
    return ckpt


def _from_format_1(ckpt: dict) -> dict:
    """A format-1 checkpoint (no ``format`` field) in format 2's names: the loop state under ``loop_state``, the
    step and the kind filled in."""
    ckpt = dict(ckpt)
    if "state" in ckpt and "loop_state" not in ckpt:  # mgk 0.1.0's name
        ckpt["loop_state"] = ckpt.pop("state")
    kind = "last" if "optimizer" in ckpt else "best"
    if "step" not in ckpt and isinstance(ckpt.get("loop_state"), dict):
        ckpt["step"] = ckpt["loop_state"].get("step")
    return {**ckpt, "format": 1, "kind": kind}


def step_of(ckpt: dict) -> int | None:
    """The optimiser step a checkpoint (as :func:`load` returns it) was written at."""
    return ckpt.get("step")


def rng_state() -> dict:
    """Python, numpy and torch (CPU and CUDA) random states as plain containers and tensors."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"name": np_state[0], "key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Inverse of :func:`rng_state`."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def align_optimizer_state(optimizer_state: dict, saved_model: dict, model: torch.nn.Module) -> dict:
    """Optimizer state of a checkpoint whose model registered its parameters in another order, re-indexed for
    ``model``.

    torch keys optimizer state by parameter position. 0.1.0 registered an MGK layer's mixture keys on the layer
    itself (``attn.pi_logits`` first, ``attn.k_proj`` last); they now live in the submodule ``attn.mixture``, so the
    same parameters come in another order. The saved model's state-dict order gives the old positions, its names
    (moved under ``mixture.`` where needed) the new ones. State of one parameter group only; anything else is
    returned unchanged (``load_state_dict`` then checks the sizes as usual)."""
    from ..attention.mixture_keys import LEGACY_NAMES

    new_order = [name for name, _ in model.named_parameters()]
    known = set(new_order)

    def upgraded(key: str) -> str | None:
        """The current name of a saved parameter name, or None for buffers and unknown names."""
        if key in known:
            return key
        for old in LEGACY_NAMES:
            if key == old or key.endswith("." + old):
                moved = key[: len(key) - len(old)] + "mixture." + old
                return moved if moved in known else None
        return None

    old_order = [n for n in (upgraded(k) for k in saved_model) if n is not None]
    groups = optimizer_state.get("param_groups", [])
    if old_order == new_order or len(groups) != 1 or sorted(old_order) != sorted(new_order) \
            or list(groups[0]["params"]) != list(range(len(new_order))):
        return optimizer_state
    position = {name: i for i, name in enumerate(new_order)}
    state = {position[old_order[i]]: s for i, s in optimizer_state["state"].items()}
    return {**optimizer_state, "state": state}
