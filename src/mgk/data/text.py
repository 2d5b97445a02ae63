"""Byte-level IMDb (LRA "Text"): read the ``aclImdb`` release, folder or ``.tar.gz``, and encode reviews as bytes.

Source format (Maas et al. 2011, "Learning Word Vectors for Sentiment Analysis"):
``aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt``, one review per file. ``--data`` may name the ``aclImdb``
folder, a folder that contains it, or a tar archive of it (``.tar.gz``, ``.tgz``, ``.tar``, ...; the members may or
may not start with ``aclImdb/``). Other members (``train/unsup``, ``imdb.vocab``, ``urls_*.txt``, ...) are ignored.
The shared copy (``shared/data/imdb/aclImdb_train.tar.gz``) holds only the train split; a missing ``test`` split is
not an error.

Encoding (the LRA byte-level task): the file's bytes are the tokens (the files are UTF-8, so a non-ASCII character
is several tokens: "é" is 2). Byte ``b`` becomes id ``b + 1``; id 0 is padding; vocabulary 257. A review longer
than ``max_len`` bytes keeps its first ``max_len`` bytes (the LRA task definition: inputs are cut to the maximum
length), and the cut reviews are counted. Labels: ``neg`` = 0, ``pos`` = 1 (as tfds ``imdb_reviews``).

Order: within a split, ``neg`` files then ``pos`` files, each by file name, whatever the order on disk or in the
archive, so splits carved with a seed are the same for a folder and its archive.
"""
from __future__ import annotations

import gzip
import os
import re
import tarfile
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np

from .cache import TokenDataset, cached_arrays

__all__ = ["PAD_ID", "VOCAB_SIZE", "CLASS_NAMES", "SPLITS", "READER_VERSION", "TextFormatError", "encode_text",
           "encode_texts", "ImdbSplit", "find_imdb_root", "read_imdb", "load_imdb"]

PAD_ID = 0
VOCAB_SIZE = 257
CLASS_NAMES = ("neg", "pos")
SPLITS = ("train", "test")
READER_VERSION = 1  # part of the cache key: bump when the encoding changes

_MEMBER_RE = re.compile(r"^(?:(.*)/)?(train|test)/(pos|neg)/([^/]+\.txt)$")


class TextFormatError(ValueError):
    """Malformed or missing IMDb input; the message names the file or archive member."""


def encode_text(text: str | bytes) -> np.ndarray:
    """Token ids of one text: its UTF-8 bytes (a ``str`` is encoded as UTF-8), byte ``b`` -> ``b + 1``.

    Returns:
        int16 array ``(len(bytes),)`` with values 1..256.
    """
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(np.int16) + 1


def encode_texts(texts: Sequence[str | bytes], max_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encode texts with :func:`encode_text`, keep the first ``max_len`` tokens, pad with ``PAD_ID`` on the right.

    Returns:
        ``(tokens, lengths, truncated)``: int16 ``(N, max_len)``; int64 ``(N,)`` real tokens kept (``<= max_len``);
        bool ``(N,)`` True where a text had more than ``max_len`` bytes.

    Raises:
        ValueError: ``max_len`` is not a positive int.
    """
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    n = len(texts)
    tokens = np.full((n, max_len), PAD_ID, dtype=np.int16)
    lengths = np.empty(n, dtype=np.int64)
    truncated = np.zeros(n, dtype=bool)
    for i, t in enumerate(texts):
        ids = encode_text(t)
        truncated[i] = ids.shape[0] > max_len
        ids = ids[:max_len]
        tokens[i, :ids.shape[0]] = ids
        lengths[i] = ids.shape[0]
    return tokens, lengths, truncated


class ImdbSplit:
    """Raw reviews of one split: ``texts`` (list of bytes), ``labels`` (list of int 0/1), ``names`` (where each came
    from: a path, or ``archive:member``), ``source`` (the folder or archive)."""

    def __init__(self, texts: list[bytes], labels: list[int], names: list[str], source: str):
        self.texts, self.labels, self.names, self.source = texts, labels, names, source

    def __len__(self) -> int:
        return len(self.texts)


def _is_archive(path: Path) -> bool:
    return path.is_file()


def find_imdb_root(path: str | os.PathLike) -> Path:
    """The ``aclImdb`` folder for a folder ``path``: ``path`` itself when it holds ``train/``, else
    ``path/aclImdb``.

    Raises:
        FileNotFoundError: neither holds a ``train`` folder (the message names both candidates).
    """
    path = Path(path)
    for root in (path, path / "aclImdb"):
        if (root / "train").is_dir():
            return root
    raise FileNotFoundError(f"{path}: no IMDb train folder: expected {path / 'train'} or {path / 'aclImdb' / 'train'} "
                            "with pos/ and neg/ subfolders of .txt reviews")


def _sort_key(item):
    label, name = item[1], item[2]
    return label, name


def _read_folder(path: Path, splits: Sequence[str]) -> dict[str, ImdbSplit | None]:
    root = find_imdb_root(path)
    out: dict[str, ImdbSplit | None] = {}
    for split in splits:
        folder = root / split
        if not folder.is_dir():
            if split == "train":
                raise FileNotFoundError(f"{folder}: IMDb train folder not found")
            out[split] = None
            continue
        items = []
        for label, cls in enumerate(CLASS_NAMES):
            sub = folder / cls
            if not sub.is_dir():
                raise TextFormatError(f"{sub}: folder missing (an IMDb split needs pos/ and neg/)")
            names = sorted(e.name for e in os.scandir(sub) if e.name.endswith(".txt"))
            if not names:
                raise TextFormatError(f"{sub}: no .txt reviews")
            for name in names:
                p = sub / name
                if not p.is_file():
                    raise TextFormatError(f"{p}: not a regular file")
                items.append((p.read_bytes(), label, name, str(p)))
        out[split] = _finish(items, str(folder))
    return out


def _finish(items: list, source: str) -> ImdbSplit:
    items.sort(key=_sort_key)
    for data, _, _, where in items:
        if not data.strip():
            raise TextFormatError(f"{where}: empty review")
    return ImdbSplit([i[0] for i in items], [i[1] for i in items], [i[3] for i in items], source)


def _read_archive(path: Path, splits: Sequence[str]) -> dict[str, ImdbSplit | None]:
    found: dict[str, list] = {s: [] for s in splits}
    classes: dict[str, set] = {s: set() for s in splits}
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                m = _MEMBER_RE.match(member.name)
                if not m or m.group(2) not in found:
                    continue
                where = f"{path}:{member.name}"
                if not member.isfile():
                    if member.isdir():
                        continue
                    raise TextFormatError(f"{where}: not a regular file")
                fh = tar.extractfile(member)
                data = fh.read()
                if len(data) != member.size:
                    raise TextFormatError(f"{where}: truncated member ({len(data)} of {member.size} bytes)")
                split, cls = m.group(2), m.group(3)
                classes[split].add(cls)
                found[split].append((data, CLASS_NAMES.index(cls), m.group(4), where))
    except tarfile.ReadError as exc:
        raise TextFormatError(f"{path}: not a readable tar archive, or truncated ({exc})") from None
    except (EOFError, zlib.error, gzip.BadGzipFile, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise TextFormatError(f"{path}: truncated or corrupt archive ({type(exc).__name__}: {exc})") from None
    out: dict[str, ImdbSplit | None] = {}
    for split in splits:
        items = found[split]
        if not items:
            if split == "train":
                raise TextFormatError(f"{path}: no train/pos/*.txt or train/neg/*.txt members (aclImdb layout)")
            out[split] = None
            continue
        for cls in CLASS_NAMES:
            if cls not in classes[split]:
                raise TextFormatError(f"{path}: no {split}/{cls}/*.txt members (an IMDb split needs pos and neg)")
        out[split] = _finish(items, f"{path}:{split}")
    return out


def read_imdb(path: str | os.PathLike, splits: Sequence[str] = SPLITS) -> dict[str, ImdbSplit | None]:
    """Read the raw reviews of ``splits`` from an ``aclImdb`` folder or tar archive (one pass over an archive).

    Returns:
        split -> :class:`ImdbSplit`, or None for an absent ``test`` split.

    Raises:
        FileNotFoundError: ``path`` does not exist, or a folder has no ``train`` split.
        TextFormatError: naming the file, folder or archive: a split without ``pos``/``neg``, an empty review, a
            member that is not a regular file, a truncated or corrupt archive, an archive without train reviews.
        ValueError: an unknown split name.
    """
    path = Path(path)
    for s in splits:
        if s not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {s!r}")
    if not path.exists():
        raise FileNotFoundError(f"{path}: IMDb data not found (give the aclImdb folder or its .tar.gz)")
    return _read_archive(path, splits) if _is_archive(path) else _read_folder(path, splits)


def _sources(path: Path) -> list[Path]:
    """Files whose fingerprints key the cache: the archive, or every review file of the folder."""
    if _is_archive(path):
        return [path]
    root = find_imdb_root(path)
    files = []
    for split in SPLITS:
        for cls in CLASS_NAMES:
            sub = root / split / cls
            if sub.is_dir():
                files.append(sub)
                files.extend(sorted(sub / e.name for e in os.scandir(sub) if e.name.endswith(".txt")))
    return files


def load_imdb(path: str | os.PathLike, max_len: int, *, cache_dir: str | os.PathLike | None = None
              ) -> tuple[dict[str, TokenDataset | None], str]:
    """Read and encode every split (train, test) with :func:`encode_texts`, through the cache.

    Args:
        path: ``aclImdb`` folder, its parent, or a tar archive of it.
        max_len: tokens per review (longer reviews are cut to their first ``max_len`` bytes and counted).
        cache_dir: cache folder (None: no cache); see :mod:`mgk.data.cache`.

    Returns:
        ``(splits, cache_status)``: "train"/"test" -> :class:`~mgk.data.cache.TokenDataset` (tokens int16
        ``(N, max_len)``, ``class_names`` ("neg", "pos")) or None for an absent test split.

    Raises:
        as :func:`read_imdb`; ValueError for a bad ``max_len``.
    """
    path = Path(path)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    if not path.exists():
        raise FileNotFoundError(f"{path}: IMDb data not found (give the aclImdb folder or its .tar.gz)")

    def build():
        """Arrays to cache, per present split: ``<split>_tokens`` int16 (N, max_len), ``_lengths`` int64 (N,),
        ``_truncated`` bool (N,), ``_labels`` int64 (N,), ``_source``."""
        raw = read_imdb(path)
        arrays = {}
        for split, sp in raw.items():
            if sp is None:
                continue
            tokens, lengths, truncated = encode_texts(sp.texts, max_len)
            arrays.update({f"{split}_tokens": tokens, f"{split}_lengths": lengths, f"{split}_truncated": truncated,
                           f"{split}_labels": np.asarray(sp.labels, dtype=np.int64),
                           f"{split}_source": np.array(sp.source)})
        return arrays

    arrays, status = cached_arrays(cache_dir, "imdb", _sources(path),
                                   {"max_len": max_len, "reader": READER_VERSION}, build)
    out: dict[str, TokenDataset | None] = {}
    for split in SPLITS:
        if f"{split}_tokens" not in arrays:
            out[split] = None
            continue
        out[split] = TokenDataset(arrays[f"{split}_tokens"], arrays[f"{split}_labels"], arrays[f"{split}_lengths"],
                                  truncated=arrays[f"{split}_truncated"], source=str(arrays[f"{split}_source"]),
                                  class_names=CLASS_NAMES)
    return out, status
