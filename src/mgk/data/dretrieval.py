"""Generalized D-retrieval: a sequence-to-scalar task whose target needs D separate retrievals from the sequence.

Source: Yu, Jiang, Bao, Yu, Li, "The Effect of Attention Head Count on Transformer Approximation", ICLR 2026
(arXiv:2510.06662). The paper has no public code; this generator is ours, written from the task definition. What the
paper fixes (read from the stored copies of arXiv:2510.06662 and of its public summaries): the input is a sequence
``X_T = (x^(1), ..., x^(T))`` of points ``x^(s)`` in ``[0, 1]^d``; there are D distinct C^2 feature functions
``f_i : [0, 1]^d -> [0, 1]``; each feature is *retrieved* from the sequence, and a fixed continuous outer function
``F_0 : [0, 1]^D -> R`` combines the D retrieved features into the target; the model is a one-layer, h-head
transformer that reads its output at an appended class token, and the error is the normalised mean squared error
(NMSE). A one-layer transformer approximates such a target efficiently when h >= D and needs a number of parameters
exponential in T when h < D (their Figure 1: NMSE against h for T in {8, 16, 32, 64, 128} at hidden size N = 32,
with a transition at h = D). The retrieval of feature i is the minimum over positions,
``z_i = min_s f_i(x^(s))`` (one head with a sharp softmax attends to the arg-min of its own score): that is our
reading of their definition, not checked against the full text.

Our instance (all of it fixed here, so that every run sees the same task):

- Inputs on a grid (d = 1): ``x^(s) = (v_s + 1/2) / V`` for a token ``v_s`` in ``{0, ..., V-1}``, drawn uniformly and
  independently per position. The model sees the token ``v_s`` (a learned embedding is the encoder of the point).
- Features: ``f_i(x_v) = pi_i(v) / (V - 1)`` where ``pi_1 .. pi_D`` are independent uniformly random permutations of
  ``{0, ..., V-1}`` drawn from ``task_seed`` (default 0). Each is the restriction to the grid of a C^2 function of x
  (any table on finitely many points is), the D are distinct, and distinct tokens never tie. Independent
  permutations make the D arg-mins unrelated, so no head can retrieve two features with one score.
- Retrieved features ``z_i = min_s f_i(x^(s))`` (in [0, 1]); outer function ``F_0(z) = (1/D) sum_i sqrt(z_i)``:
  continuous on [0, 1]^D, nonlinear, and every z_i changes it. (The square root spreads the minima, which
  concentrate near 0 as T grows.)
- Target ``y = F_0(z_1, ..., z_D)`` (float64); the metric is ``NMSE = mean((y_hat - y)^2) / Var(y)`` over a split
  (:func:`nmse`), 1 for the best constant prediction and 0 for a perfect one.

Splits: train, val and test are drawn with seeds ``3 * seed + 0/1/2``; val and test rows whose input sequence is a
train row are dropped, and test rows that repeat a val row too, so the three splits share no input. Files: one
``dretrieval_<split>.npz`` per split (read with ``allow_pickle=False``): ``inputs`` int16 (N, T), ``targets``
float64 (N,), ``features`` float64 (N, D) (the z_i), ``tables`` float64 (D, V) (the f_i on the grid) and ``meta``
(a JSON string: the settings above).
"""
from __future__ import annotations

import json
import math
import os
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..atomic import atomic_write

__all__ = ["SPLITS", "VERSION", "DRetrievalSpec", "DRetrievalSplit", "DRetrievalFormatError", "feature_tables",
           "outer_function", "retrieve", "generate", "generate_dir", "split_path", "load_split", "nmse"]

SPLITS = ("train", "val", "test")
VERSION = 1  # of the definition and file layout; bump when either changes
_MAX_VOCAB = 32767  # inputs are stored as int16


class DRetrievalFormatError(ValueError):
    """A malformed D-retrieval file; the message names the file."""


@dataclass(frozen=True)
class DRetrievalSpec:
    """The task: ``seq_len`` T positions, ``num_features`` D, ``vocab`` V grid points, and ``task_seed`` of the
    feature permutations. ValueError for T < 1, D < 1 or V < 2, or more features than V! distinct permutations."""

    seq_len: int
    num_features: int
    vocab: int
    task_seed: int = 0

    def __post_init__(self):
        for name, low in (("seq_len", 1), ("num_features", 1), ("vocab", 2), ("task_seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"dretrieval {name} must be an int >= {low}, got {value!r}")
        if self.vocab > _MAX_VOCAB:
            raise ValueError(f"dretrieval vocab must be <= {_MAX_VOCAB}, got {self.vocab}")
        if self.num_features > math.factorial(min(self.vocab, 20)):
            raise ValueError(f"dretrieval: {self.num_features} distinct features need more than {self.vocab} "
                             "grid points")


def feature_tables(spec: DRetrievalSpec) -> np.ndarray:
    """float64 (D, V): ``f_i`` on the grid, ``pi_i(v) / (V - 1)`` for independent random permutations ``pi_i``
    drawn from ``numpy.random.default_rng(task_seed)``, redrawn until the D rows are distinct."""
    rng = np.random.default_rng(spec.task_seed)
    rows: list[np.ndarray] = []
    while len(rows) < spec.num_features:
        row = rng.permutation(spec.vocab)
        if not any(np.array_equal(row, r) for r in rows):
            rows.append(row)
    return np.stack(rows).astype(np.float64) / (spec.vocab - 1)


def outer_function(z: np.ndarray) -> np.ndarray:
    """``F_0(z) = mean_i sqrt(z_i)`` over the last axis: z float (..., D) in [0, 1] -> (...,)."""
    return np.sqrt(np.asarray(z, dtype=np.float64)).mean(axis=-1)


def retrieve(tables: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    """The retrieved features ``z_i = min_s f_i(x^(s))``: tables (D, V), inputs int (N, T) -> float64 (N, D)."""
    return tables[:, inputs].min(axis=2).T


@dataclass
class DRetrievalSplit:
    """One split: ``inputs`` int (N, T) tokens in 0..V-1, ``targets`` float64 (N,), ``features`` float64 (N, D),
    ``tables`` float64 (D, V), ``spec`` and ``source`` (the file, or "" in memory)."""

    inputs: np.ndarray
    targets: np.ndarray
    features: np.ndarray
    tables: np.ndarray
    spec: DRetrievalSpec
    source: str = ""

    def __len__(self) -> int:
        return int(self.inputs.shape[0])


def generate(spec: DRetrievalSpec, num_examples: int, seed: int) -> DRetrievalSplit:
    """``num_examples`` sequences of ``spec`` with tokens from ``numpy.random.default_rng(seed)``, and their targets.
    Deterministic in (spec, num_examples, seed). ValueError for a negative ``num_examples``."""
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 0:
        raise ValueError(f"num_examples must be an int >= 0, got {num_examples!r}")
    tables = feature_tables(spec)
    inputs = np.random.default_rng(seed).integers(0, spec.vocab, size=(num_examples, spec.seq_len))
    features = retrieve(tables, inputs)
    return DRetrievalSplit(inputs.astype(np.int16), outer_function(features), features, tables, spec)


def _without(split: DRetrievalSplit, seen: set[bytes]) -> DRetrievalSplit:
    """``split`` without the rows whose input bytes are in ``seen``."""
    keep = np.array([row.tobytes() not in seen for row in split.inputs], dtype=bool)
    return DRetrievalSplit(split.inputs[keep], split.targets[keep], split.features[keep], split.tables, split.spec)


def split_path(data_dir: str | os.PathLike, split: str) -> Path:
    """``<data_dir>/dretrieval_<split>.npz``; ValueError for an unknown split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return Path(data_dir) / f"dretrieval_{split}.npz"


def _write(path: Path, split: DRetrievalSplit, seed: int) -> None:
    meta = {"task": "dretrieval", "version": VERSION, **asdict(split.spec), "seed": seed,
            "outer": "mean_sqrt", "features": "random_permutations"}
    with atomic_write(path) as fh:
        np.savez(fh, inputs=split.inputs, targets=split.targets, features=split.features, tables=split.tables,
                 meta=np.array(json.dumps(meta, sort_keys=True)))


def generate_dir(out_dir: str | os.PathLike, spec: DRetrievalSpec, *, num_train: int, num_val: int, num_test: int,
                 seed: int = 0) -> Path:
    """Write the three splits of ``spec`` (seeds ``3 * seed + 0/1/2``; val and test rows that repeat an earlier
    split's input dropped) as ``dretrieval_<split>.npz`` files, each atomically. Returns ``Path(out_dir)``."""
    out = Path(out_dir)
    seen: set[bytes] = set()
    for offset, (name, count) in enumerate((("train", num_train), ("val", num_val), ("test", num_test))):
        split = _without(generate(spec, count, 3 * seed + offset), seen)
        seen.update(row.tobytes() for row in split.inputs)
        _write(split_path(out, name), split, seed)
    return out


def _read_meta(path: Path, arrays: dict) -> DRetrievalSpec:
    try:
        meta = json.loads(str(arrays["meta"]))
        if meta.get("task") != "dretrieval" or meta.get("version") != VERSION:
            raise ValueError(f"task {meta.get('task')!r} version {meta.get('version')!r}")
        return DRetrievalSpec(meta["seq_len"], meta["num_features"], meta["vocab"], meta["task_seed"])
    except (KeyError, ValueError, TypeError) as exc:
        raise DRetrievalFormatError(f"{path}: bad meta ({exc}); expected a dretrieval version {VERSION} file "
                                    "written by mgk") from None


def _check_arrays(path: Path, a: dict, spec: DRetrievalSpec) -> None:
    """DRetrievalFormatError naming ``path`` for shapes, token range or targets that disagree with ``spec``."""
    n = a["inputs"].shape[0] if a["inputs"].ndim == 2 else -1
    shapes = {"inputs": (n, spec.seq_len), "targets": (n,), "features": (n, spec.num_features),
              "tables": (spec.num_features, spec.vocab)}
    for name, shape in shapes.items():
        if a[name].shape != shape:
            raise DRetrievalFormatError(f"{path}: {name} has shape {a[name].shape}, expected {shape}")
    if n and (a["inputs"].min() < 0 or a["inputs"].max() >= spec.vocab):
        raise DRetrievalFormatError(f"{path}: input tokens outside 0..{spec.vocab - 1}")
    z = retrieve(a["tables"], a["inputs"].astype(np.int64))
    bad = ~(np.isclose(z, a["features"]).all(axis=1) & np.isclose(outer_function(z), a["targets"]))
    if bad.any():
        raise DRetrievalFormatError(f"{path}: row {int(np.argmax(bad))} (and {int(bad.sum()) - 1} more): features "
                                    "or target differ from F_0(min_s f_i(x_s)) of its inputs")


def load_split(data_dir: str | os.PathLike, split: str) -> DRetrievalSplit | None:
    """Read ``dretrieval_<split>.npz`` of ``data_dir``; None when the file is absent. The targets are checked
    against the definition (recomputed from the inputs and the stored feature tables).

    Raises:
        DRetrievalFormatError: naming the file: unreadable, missing arrays, bad meta, shapes or tokens that
            disagree with the meta, or targets that are not ``F_0(min_s f_i(x^(s)))``.
    """
    path = split_path(data_dir, split)
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DRetrievalFormatError(f"{path}: not a readable .npz file ({exc})") from None
    missing = [k for k in ("inputs", "targets", "features", "tables", "meta") if k not in arrays]
    if missing:
        raise DRetrievalFormatError(f"{path}: missing arrays {missing}")
    spec = _read_meta(path, arrays)
    _check_arrays(path, arrays, spec)
    return DRetrievalSplit(arrays["inputs"], arrays["targets"].astype(np.float64), arrays["features"],
                           arrays["tables"], spec, source=str(path))


def nmse(predictions, targets) -> float:
    """``mean((p - y)^2) / Var(y)`` (population variance) of two equal-length 1-D arrays; nan when Var(y) = 0."""
    p, y = np.asarray(predictions, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    var = float(y.var()) if y.size else 0.0
    return float(((p - y) ** 2).mean()) / var if var > 0 else float("nan")
