"""Shared by the LRA readers: the on-disk cache of tokenised arrays, seeded splits, and the encoded dataset type.

Cache
-----

Reading and encoding a release (25,000 IMDb files, 50,000 CIFAR images, 200,000 Pathfinder PNGs) takes seconds to
minutes; the encoded arrays load in a fraction of that. An entry is one ``.npz`` file named
``<name>-<key[:20]>.npz`` whose key is the SHA-256 of

- every source file's absolute path, size in bytes and modification time (ns): touching, replacing or growing a
  file changes the key, so a stale entry is never read; and
- the preprocessing settings (a JSON-able dict: max_len, reader version, split, ...): a changed setting gives a
  different key.

Entries are written atomically (:func:`mgk.atomic.atomic_write`: a temporary file, then ``os.replace``), so
concurrent writers (DDP ranks) and interrupted runs never leave a half-written entry under the final name. They are
read with ``numpy.load(allow_pickle=False)``: a cache file cannot run code. An unreadable entry counts as a miss and
is rebuilt.

Where (:func:`resolve_cache_dir`): ``cfg.data.cache_dir`` when set (``"off"`` disables caching); otherwise
``<data>/.mgk-cache`` next to the data (inside the data folder, or beside an archive) when that folder is writable
(a folder without write permission bits counts as read-only, also for root: a shared read-only copy is never
written into); otherwise the user cache ``$XDG_CACHE_HOME/mgk`` (default ``~/.cache/mgk``).

Splits
------
:func:`seeded_split` carves validation (and test) sets out of a release split with a fixed, documented seed
(``cfg.data.split_seed``), independent of the training seed: the same files and settings always give the same
split.

Datasets
--------
:class:`TokenDataset` holds one encoded split in a compact integer dtype (uint8 pixels, int16 bytes: a 50,000 x
1,024 image split is 51 MB instead of 410 MB as int64); tasks cast batches to int64.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from ..atomic import atomic_write

__all__ = ["OFF", "file_fingerprint", "cache_key", "resolve_cache_dir", "entry_path", "load_arrays", "save_arrays",
           "cached_arrays", "seeded_split", "TokenDataset", "length_stats"]

OFF = "off"
_META = "__mgk_cache_meta__"


def file_fingerprint(paths: Iterable[str | os.PathLike]) -> list[list]:
    """``[absolute path, size, mtime_ns]`` of each path (in the given order).

    Raises:
        FileNotFoundError: a path does not exist (the message names it).
    """
    out = []
    for p in paths:
        p = Path(p).absolute()
        try:
            st = p.stat()
        except FileNotFoundError:
            raise FileNotFoundError(f"{p}: source file not found") from None
        out.append([str(p), int(st.st_size), int(st.st_mtime_ns)])
    return out


def cache_key(sources: Iterable[str | os.PathLike], settings: Mapping) -> str:
    """Hex SHA-256 of the sources' fingerprints (:func:`file_fingerprint`) and ``settings``.

    Args:
        sources: every file the arrays are made from (a folder counts by its own size/mtime only, which change when
            entries are added or removed but not when a file inside is rewritten: list the files too).
        settings: JSON-serialisable preprocessing settings; key order does not matter.

    Raises:
        FileNotFoundError: a source does not exist. TypeError: settings are not JSON-serialisable.
    """
    h = hashlib.sha256()
    h.update(json.dumps({"settings": settings}, sort_keys=True).encode("utf-8"))
    for fp in file_fingerprint(sources):  # streamed: a release can have 200,000 files
        h.update(b"\n" + json.dumps(fp).encode("utf-8"))
    return h.hexdigest()


def _writable_dir(folder: Path) -> bool:
    """Whether ``folder`` exists or can be made, and files can be written in it. A folder (or, for a new one, its
    parent) without any write permission bit counts as read-only even for root, so a read-only shared data copy is
    never written into."""
    probe = folder if folder.exists() else folder.parent
    try:
        if not probe.is_dir() or not probe.stat().st_mode & 0o222 or not os.access(probe, os.W_OK):
            return False
        folder.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".probe-")
        os.close(fd)
        os.unlink(tmp)
        return True
    except OSError:
        return False


def resolve_cache_dir(cache_dir: str | os.PathLike | None, data_path: str | os.PathLike | None, *,
                      user_subdir: str = "") -> Path | None:
    """The folder for cache entries, or None when caching is off.

    ``cache_dir`` wins when given (``"off"``, case-insensitive, means no cache). Otherwise ``.mgk-cache`` inside
    ``data_path`` (a folder) or beside it (a file such as a ``.tar.gz``) when that location is writable, else
    ``$XDG_CACHE_HOME/mgk[/<user_subdir>]`` / ``~/.cache/mgk[/<user_subdir>]``. The folder is created.
    """
    if cache_dir is not None:
        if str(cache_dir).strip().lower() == OFF:
            return None
        out = Path(cache_dir)
        out.mkdir(parents=True, exist_ok=True)
        return out
    if data_path is not None:
        base = Path(data_path)
        folder = (base if base.is_dir() else base.parent) / ".mgk-cache"
        if _writable_dir(folder):
            return folder
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mgk"
    if user_subdir:
        root = root / user_subdir
    root.mkdir(parents=True, exist_ok=True)
    return root


def entry_path(cache_dir: str | os.PathLike, name: str, key: str) -> Path:
    """Path of the entry ``name`` with ``key``: ``<cache_dir>/<name>-<key[:20]>.npz``."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return Path(cache_dir) / f"{safe}-{key[:20]}.npz"


def load_arrays(path: str | os.PathLike, key: str) -> dict[str, np.ndarray] | None:
    """The arrays of the entry at ``path`` if it exists, is readable and was written with ``key``; else None."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(str(arrays.pop(_META)))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, json.JSONDecodeError):
        return None
    if meta.get("key") != key:
        return None
    return arrays


def save_arrays(path: str | os.PathLike, key: str, arrays: Mapping[str, np.ndarray], settings: Mapping | None = None
                ) -> Path:
    """Write ``arrays`` (name -> numpy array, no object dtypes) atomically to ``path`` with ``key`` recorded.

    Raises:
        ValueError: an array name collides with the reserved metadata name, or an array has an object dtype.
    """
    path = Path(path)
    if _META in arrays:
        raise ValueError(f"array name {_META!r} is reserved")
    for k, a in arrays.items():
        if np.asarray(a).dtype == object:
            raise ValueError(f"array {k!r} has an object dtype; the cache stores plain arrays only")
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = json.dumps({"key": key, "settings": dict(settings or {})}, sort_keys=True)
    with atomic_write(path) as fh:
        np.savez(fh, **{k: np.asarray(v) for k, v in arrays.items()}, **{_META: np.array(meta)})
    return path


def cached_arrays(cache_dir: str | os.PathLike | None, name: str, sources: Iterable[str | os.PathLike],
                  settings: Mapping, build: Callable[[], Mapping[str, np.ndarray]]
                  ) -> tuple[dict[str, np.ndarray], str]:
    """Load the entry for (``name``, ``sources``, ``settings``) or ``build()`` it and store it.

    Returns:
        ``(arrays, status)``: status is ``"hit: <path>"``, ``"stored: <path>"``, ``"off"`` (``cache_dir`` None:
        built, not stored) or ``"not stored (<error>)"`` when writing failed (the arrays are still returned).
    """
    if cache_dir is None:
        return dict(build()), OFF
    key = cache_key(sources, {"name": name, **dict(settings)})
    path = entry_path(cache_dir, name, key)
    hit = load_arrays(path, key)
    if hit is not None:
        return hit, f"hit: {path}"
    arrays = {k: np.asarray(v) for k, v in build().items()}
    try:
        save_arrays(path, key, arrays, settings)
    except OSError as exc:
        return arrays, f"not stored ({exc})"
    return arrays, f"stored: {path}"


# --------------------------------------------------------------------------- seeded splits


def seeded_split(n: int, fractions: Iterable[float], seed: int) -> list[np.ndarray]:
    """Split ``range(n)`` at random into disjoint parts: one per fraction, then the rest.

    The permutation is ``numpy.random.default_rng(seed).permutation(n)``; part ``k`` takes the next
    ``round(n * fractions[k])`` positions, at least 1 when the fraction is > 0 and ``n`` leaves one example for the
    rest; the rest is the last part. Every part is returned sorted (file order is kept inside a part).

    Returns:
        ``len(fractions) + 1`` int64 arrays of indices, disjoint, covering ``range(n)``.

    Raises:
        ValueError: a fraction outside [0, 1) or fractions summing to 1 or more.
    """
    fractions = [float(f) for f in fractions]
    if any(not 0.0 <= f < 1.0 for f in fractions) or sum(fractions) >= 1.0:
        raise ValueError(f"split fractions must be in [0, 1) and sum to less than 1, got {fractions}")
    perm = np.random.default_rng(seed).permutation(n)
    parts, start = [], 0
    for f in fractions:
        k = int(round(n * f))
        if f > 0 and k == 0 and n - start - 1 >= 1:
            k = 1
        k = min(k, max(0, n - start - 1))
        parts.append(np.sort(perm[start:start + k]).astype(np.int64))
        start += k
    parts.append(np.sort(perm[start:]).astype(np.int64))
    return parts


# --------------------------------------------------------------------------- encoded datasets


def length_stats(lengths) -> dict:
    """``{"min", "mean", "median", "max"}`` of a 1-D array of lengths (zeros for an empty one)."""
    a = np.asarray(lengths, dtype=np.float64)
    if a.size == 0:
        return {"min": 0, "mean": 0.0, "median": 0.0, "max": 0}
    return {"min": int(a.min()), "mean": float(a.mean()), "median": float(np.median(a)), "max": int(a.max())}


class TokenDataset(Dataset):
    """One encoded classification split.

    Attributes:
        tokens: integer tensor ``(N, L)`` in a compact dtype (uint8 or int16), right-padded with 0 where a task has
            padding; positions ``>= lengths[i]`` are padding, whatever their value (padding is never derived from a
            token value).
        labels: int64 ``(N,)``. lengths: int64 ``(N,)`` real tokens per row (``<= L``).
        truncated: bool ``(N,)``, rows cut to ``L`` (``num_truncated`` counts them).
        source: where the rows came from. class_names: label names.

    ``ds[i]`` is ``{"tokens": int64 (L,), "label": int64 scalar}``.
    """

    def __init__(self, tokens, labels, lengths, *, truncated=None, source: str = "", class_names: Iterable[str] = ()):
        tokens, labels, lengths = (torch.as_tensor(t) for t in (tokens, labels, lengths))
        if tokens.dim() != 2 or labels.dim() != 1 or lengths.dim() != 1:
            raise ValueError(f"expected tokens (N, L), labels (N,), lengths (N,); got {tuple(tokens.shape)}, "
                             f"{tuple(labels.shape)}, {tuple(lengths.shape)}")
        if not tokens.shape[0] == labels.shape[0] == lengths.shape[0]:
            raise ValueError(f"row counts differ: tokens {tokens.shape[0]}, labels {labels.shape[0]}, "
                             f"lengths {lengths.shape[0]}")
        if tokens.is_floating_point():
            raise ValueError(f"tokens must be an integer tensor, got {tokens.dtype}")
        self.tokens = tokens
        self.labels = labels.long()
        self.lengths = lengths.long()
        self.truncated = (torch.zeros(len(labels), dtype=torch.bool) if truncated is None
                          else torch.as_tensor(truncated).bool())
        self.source = str(source)
        self.class_names = tuple(class_names)

    @property
    def num_truncated(self) -> int:
        """Rows that were cut to ``L``."""
        return int(self.truncated.sum())

    @property
    def max_len(self) -> int:
        """Padded length ``L``."""
        return int(self.tokens.shape[1])

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"tokens": self.tokens[index].long(), "label": self.labels[index]}

    def subset(self, index, *, source: str | None = None) -> "TokenDataset":
        """Rows ``index`` (int array) as a new dataset."""
        index = torch.as_tensor(np.asarray(index, dtype=np.int64))
        return TokenDataset(self.tokens[index], self.labels[index], self.lengths[index],
                            truncated=self.truncated[index], source=self.source if source is None else source,
                            class_names=self.class_names)

    def label_counts(self, num_classes: int | None = None) -> list[int]:
        """Examples per label ``0..num_classes-1`` (default: ``len(class_names)`` or max label + 1)."""
        k = num_classes or len(self.class_names) or (int(self.labels.max()) + 1 if len(self) else 0)
        return torch.bincount(self.labels, minlength=k).tolist()

    def majority_acc(self) -> float:
        """Share of the most common label (the majority-class baseline). ValueError when empty."""
        if len(self) == 0:
            raise ValueError("majority_acc of an empty dataset is undefined")
        return max(self.label_counts()) / len(self)
