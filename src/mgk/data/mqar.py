"""Multi-query associative recall (MQAR) and its compositional form: token sequences whose answers are recalled
from key-value bindings earlier in the same sequence.

Source: Arora, Eyuboglu, Timalsina, Johnson, Poli, Zou, Rudra, Re, "Zoology: Measuring and Improving Recall in
Efficient Language Models", 2023 (arXiv:2312.04927), Section 3 and the task generators of their code
(HazyResearch/zoology, ``zoology/data/multiquery_ar.py`` and ``zoology/data/compositional_ar.py``). This generator is
ours, written from those definitions; the layout and the distributions are theirs.

Plain MQAR (``compositional=False``), vocabulary V, length L, n key-value pairs:

- keys are n distinct tokens from ``[1, V // 2)``, values n distinct tokens from ``[V // 2, V)``, drawn per sequence;
- positions ``0 .. 2n-1`` hold ``k_1 v_1 k_2 v_2 ... k_n v_n``;
- the rest, ``L - 2n`` positions, is the query region of ``space = (L - 2n) // 2`` slots: each key is asked once, at
  region position ``2 * g_j`` for n distinct slots ``g_j`` drawn without replacement with probabilities
  ``p(g) ~ a (g + 1)^(a - 1)`` (``power_a`` a = 0.01 in Zoology: short gaps are far more likely; a = 1 is uniform);
- the target at the position of an asked key is its value; every other position has no target
  (:data:`IGNORE_INDEX`), so the loss and the accuracy count the n answers only;
- every other query-region position holds a token drawn uniformly from ``[0, V)`` (Zoology's
  ``random_non_queries``; such a filler may equal a key, and has no target).

Compositional MQAR (``compositional=True``), n = g^2 pairs:

- first keys from ``[1, V // 3)``, second keys from ``[V // 3, 2 (V // 3))``, values from ``[2 (V // 3), V)``;
- per sequence g distinct first keys and g distinct second keys, all g^2 compound keys ``(a, b)`` in a random order,
  each bound to its own value (n distinct values): positions ``0 .. 3n-1`` hold ``a_1 b_1 v_1 a_2 b_2 v_2 ...``.
  Every first key occurs with g second keys and every second key with g first keys, each time with a different
  value, so neither half of a key alone determines the value;
- the query region has ``space = (L - 3n) // 3`` slots; compound key j is asked at region positions ``3 g_j`` and
  ``3 g_j + 1`` (gaps as above); the target sits at the second half of the key (position ``3 g_j + 1``).

A sequence is the model's input as given (the targets are aligned with the input positions: the answer to a query
is predicted at the query's last token, from that token and the ones before it). Splits: train, val and test are
drawn with seeds ``3 * seed + 0/1/2``; rows of val and test whose input repeats an earlier split's are dropped.
Files: ``mqar_<split>.npz`` (read with ``allow_pickle=False``): ``inputs`` int16 (N, L), ``targets`` int16 (N, L)
with -100 where there is no answer, ``meta`` (a JSON string of the settings).
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

__all__ = ["SPLITS", "VERSION", "IGNORE_INDEX", "MQARSpec", "MQARSplit", "MQARFormatError", "gap_probabilities",
           "generate", "generate_dir", "split_path", "load_split", "check_answers"]

SPLITS = ("train", "val", "test")
VERSION = 1
IGNORE_INDEX = -100  # a position without an answer (the value torch's cross-entropy skips)
_MAX_VOCAB = 32767  # stored as int16


class MQARFormatError(ValueError):
    """A malformed MQAR file; the message names the file."""


@dataclass(frozen=True)
class MQARSpec:
    """The task: ``vocab`` V, ``seq_len`` L, ``num_kv_pairs`` n, ``power_a`` of the gaps, ``compositional``.

    ValueError (naming the setting) when the key or value pools are smaller than n (or g), the sequence cannot hold
    the context and n queries, or n is not a square for the compositional form."""

    vocab: int
    seq_len: int
    num_kv_pairs: int
    power_a: float = 0.01
    compositional: bool = False

    def __post_init__(self):
        for name, low in (("vocab", 4), ("seq_len", 2), ("num_kv_pairs", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"mqar {name} must be an int >= {low}, got {value!r}")
        if self.vocab > _MAX_VOCAB:
            raise ValueError(f"mqar vocab must be <= {_MAX_VOCAB}, got {self.vocab}")
        if not 0.0 < float(self.power_a) <= 1.0:
            raise ValueError(f"mqar power_a must be in (0, 1], got {self.power_a!r}")
        n, per = self.num_kv_pairs, (3 if self.compositional else 2)
        if self.compositional:
            g = math.isqrt(n)
            if g * g != n:
                raise ValueError(f"compositional mqar needs num_kv_pairs a square (4, 9, 16, ...), got {n}")
            wants = {"first key": g, "second key": g, "value": n}
        else:
            wants = {"key": n, "value": n}
        for name, (lo, hi) in self.pools().items():
            if hi - lo < wants[name]:
                raise ValueError(f"mqar: vocab={self.vocab} leaves {hi - lo} {name} tokens, fewer than the "
                                 f"{wants[name]} that num_kv_pairs={n} needs")
        if self.space() < n:
            raise ValueError(f"mqar: seq_len={self.seq_len} holds {per * n} context tokens and {self.space()} query "
                             f"slots, fewer than num_kv_pairs={n} (need seq_len >= {2 * per * n})")

    def pools(self) -> dict[str, tuple[int, int]]:
        """Token ranges ``[lo, hi)``: {"key", "value"} or {"first key", "second key", "value"}."""
        if not self.compositional:
            half = self.vocab // 2
            return {"key": (1, half), "value": (half, self.vocab)}
        third = self.vocab // 3
        return {"first key": (1, third), "second key": (third, 2 * third), "value": (2 * third, self.vocab)}

    def space(self) -> int:
        """Query slots: ``(L - 2n) // 2``, or ``(L - 3n) // 3`` for the compositional form."""
        per = 3 if self.compositional else 2
        return (self.seq_len - per * self.num_kv_pairs) // per


def gap_probabilities(space: int, power_a: float) -> np.ndarray:
    """float64 (space,): ``p(g) ~ a (g + 1)^(a - 1)`` for slots g = 0..space-1, normalised (Zoology's power law)."""
    g = np.arange(1, space + 1, dtype=np.float64)
    p = power_a * g ** (power_a - 1.0)
    return p / p.sum()


def _distinct(rng: np.random.Generator, n_rows: int, lo: int, hi: int, k: int) -> np.ndarray:
    """int64 (n_rows, k): per row k distinct tokens drawn uniformly from ``[lo, hi)``."""
    return rng.random((n_rows, hi - lo)).argsort(axis=1)[:, :k] + lo


def _gaps(rng: np.random.Generator, n_rows: int, spec: MQARSpec) -> np.ndarray:
    """int64 (n_rows, n): per row n distinct slots drawn without replacement with :func:`gap_probabilities`
    (successive weighted draws, done at once with the Gumbel top-k equivalence)."""
    logp = np.log(gap_probabilities(spec.space(), spec.power_a))
    keys = logp[None, :] + rng.gumbel(size=(n_rows, spec.space()))
    return np.argsort(-keys, axis=1)[:, :spec.num_kv_pairs]


def _keys(rng: np.random.Generator, n_rows: int, spec: MQARSpec) -> list[np.ndarray]:
    """The key halves (one array (n_rows, n) each) of every pair, in context order."""
    pools = list(spec.pools().values())
    n = spec.num_kv_pairs
    if not spec.compositional:
        return [_distinct(rng, n_rows, *pools[0], n)]
    g = math.isqrt(n)
    first, second = _distinct(rng, n_rows, *pools[0], g), _distinct(rng, n_rows, *pools[1], g)
    a, b = np.repeat(first, g, axis=1), np.tile(second, (1, g))  # every (first, second) combination once
    order = rng.random((n_rows, n)).argsort(axis=1)
    return [np.take_along_axis(a, order, 1), np.take_along_axis(b, order, 1)]


@dataclass
class MQARSplit:
    """One split: ``inputs`` int (N, L), ``targets`` int (N, L) (:data:`IGNORE_INDEX` where no answer), ``spec`` and
    ``source`` (the file, or "" in memory)."""

    inputs: np.ndarray
    targets: np.ndarray
    spec: MQARSpec
    source: str = ""

    def __len__(self) -> int:
        return int(self.inputs.shape[0])


def generate(spec: MQARSpec, num_examples: int, seed: int) -> MQARSplit:
    """``num_examples`` sequences of ``spec`` from ``numpy.random.default_rng(seed)`` (deterministic in its
    arguments). ValueError for a negative ``num_examples``."""
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 0:
        raise ValueError(f"num_examples must be an int >= 0, got {num_examples!r}")
    rng = np.random.default_rng(seed)
    N, n, L = num_examples, spec.num_kv_pairs, spec.seq_len
    per = 3 if spec.compositional else 2
    halves = _keys(rng, N, spec)
    values = _distinct(rng, N, *spec.pools()["value"], n)
    inputs = rng.integers(0, spec.vocab, size=(N, L))  # fillers everywhere a key or value is not written
    targets = np.full((N, L), IGNORE_INDEX, dtype=np.int64)
    for j, part in enumerate(halves + [values]):
        inputs[:, j:per * n:per] = part
    slot = per * n + per * _gaps(rng, N, spec)  # first position of each asked key
    rows = np.arange(N)[:, None]
    for j, part in enumerate(halves):
        inputs[rows, slot + j] = part
    targets[rows, slot + len(halves) - 1] = values
    return MQARSplit(inputs.astype(np.int16), targets.astype(np.int16), spec)


def split_path(data_dir: str | os.PathLike, split: str) -> Path:
    """``<data_dir>/mqar_<split>.npz``; ValueError for an unknown split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return Path(data_dir) / f"mqar_{split}.npz"


def generate_dir(out_dir: str | os.PathLike, spec: MQARSpec, *, num_train: int, num_val: int, num_test: int,
                 seed: int = 0) -> Path:
    """Write the three splits (seeds ``3 * seed + 0/1/2``; val and test rows that repeat an earlier split's input
    dropped) as ``mqar_<split>.npz``, each atomically. Returns ``Path(out_dir)``."""
    out = Path(out_dir)
    seen: set[bytes] = set()
    meta = json.dumps({"task": "mqar", "version": VERSION, **asdict(spec), "seed": seed}, sort_keys=True)
    for offset, (name, count) in enumerate((("train", num_train), ("val", num_val), ("test", num_test))):
        split = generate(spec, count, 3 * seed + offset)
        keep = np.array([row.tobytes() not in seen for row in split.inputs], dtype=bool)
        seen.update(row.tobytes() for row in split.inputs[keep])
        with atomic_write(split_path(out, name)) as fh:
            np.savez(fh, inputs=split.inputs[keep], targets=split.targets[keep], meta=np.array(meta))
    return out


def check_answers(inputs: np.ndarray, targets: np.ndarray, spec: MQARSpec) -> np.ndarray:
    """bool (N,): rows whose answers follow the definition: exactly n answers, each in the value pool, each the
    value bound in the context to the key that precedes it (both halves for the compositional form)."""
    per = 3 if spec.compositional else 2
    n, nk = spec.num_kv_pairs, per - 1
    lo, hi = spec.pools()["value"]
    ctx = inputs[:, :per * n].reshape(len(inputs), n, per).astype(np.int64)
    answered = targets != IGNORE_INDEX
    ok = answered.sum(axis=1) == n
    for i in np.flatnonzero(ok):
        binding = {tuple(t[:nk]): t[nk] for t in ctx[i]}
        for pos in np.flatnonzero(answered[i]):
            key = tuple(int(x) for x in inputs[i, pos - nk + 1:pos + 1])
            if pos < per * n or not lo <= targets[i, pos] < hi or binding.get(key) != targets[i, pos]:
                ok[i] = False
                break
    return ok


def _read(path: Path) -> tuple[dict, MQARSpec]:
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise MQARFormatError(f"{path}: not a readable .npz file ({exc})") from None
    missing = [k for k in ("inputs", "targets", "meta") if k not in arrays]
    if missing:
        raise MQARFormatError(f"{path}: missing arrays {missing}")
    try:
        meta = json.loads(str(arrays["meta"]))
        if meta.get("task") != "mqar" or meta.get("version") != VERSION:
            raise ValueError(f"task {meta.get('task')!r} version {meta.get('version')!r}")
        spec = MQARSpec(meta["vocab"], meta["seq_len"], meta["num_kv_pairs"], meta["power_a"], meta["compositional"])
    except (KeyError, ValueError, TypeError) as exc:
        raise MQARFormatError(f"{path}: bad meta ({exc}); expected an mqar version {VERSION} file written by mgk"
                              ) from None
    return arrays, spec


def load_split(data_dir: str | os.PathLike, split: str) -> MQARSplit | None:
    """Read ``mqar_<split>.npz`` of ``data_dir``; None when absent. Every row's answers are checked
    (:func:`check_answers`).

    Raises:
        MQARFormatError: naming the file: unreadable, missing arrays, bad meta, shapes or tokens that disagree with
            the meta, or a row whose answers do not follow the definition (the first such row is named).
    """
    path = split_path(data_dir, split)
    if not path.is_file():
        return None
    arrays, spec = _read(path)
    x, y = arrays["inputs"], arrays["targets"]
    if x.ndim != 2 or x.shape[1] != spec.seq_len or y.shape != x.shape:
        raise MQARFormatError(f"{path}: inputs {x.shape} and targets {y.shape} must both be (N, {spec.seq_len})")
    if x.size and (x.min() < 0 or x.max() >= spec.vocab):
        raise MQARFormatError(f"{path}: input tokens outside 0..{spec.vocab - 1}")
    ok = check_answers(x, y, spec)
    if not ok.all():
        raise MQARFormatError(f"{path}: row {int(np.argmin(ok))} (and {int((~ok).sum()) - 1} more): answers do not "
                              "follow the key-value bindings of the row")
    return MQARSplit(x, y, spec, source=str(path))
