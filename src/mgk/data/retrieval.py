"""Byte-level AAN document matching (LRA "Retrieval"): read the release TSV files and encode both documents.

Source format (LRA release ``lra_release/tsv_data/new_aan_pairs.{train,eval,test}.tsv``; Tay et al. 2021,
"Long Range Arena", section 2.2.3): one
pair per line, five tab-separated columns ``label, id1, id2, text1, text2``, no header (LRA reads them with
``header=False`` and no quote handling, so quotes are ordinary characters). ``label`` is 0 or 1 (LRA parses it as
a float, so ``0.0``/``1.0`` are accepted too): 1 when paper ``id1`` cites paper ``id2``. A header row
``label<TAB>id1<TAB>id2<TAB>text1<TAB>text2`` as the first line is skipped, for hand-made files. LF or CRLF line
endings; gzip-compressed files (``.tsv.gz``, detected from the magic bytes) are read too.

``--data`` is the folder holding the files, or a folder with a ``tsv_data/`` subfolder. ``eval`` is the validation
split. No copy of AAN is shipped with the project: the tests build small TSV files.

Encoding: each text's UTF-8 bytes, byte ``b`` -> id ``b + 1``, 0 = padding (as :mod:`mgk.data.text`); each document
keeps its first ``max_len`` bytes (the LRA task definition; 4,000 per document in the paper) and cut documents are
counted.
"""
from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from .cache import cached_arrays
from .text import PAD_ID, VOCAB_SIZE, encode_texts

__all__ = ["PAD_ID", "VOCAB_SIZE", "NUM_CLASSES", "SPLITS", "FILE_NAMES", "READER_VERSION", "RetrievalFormatError",
           "read_aan_tsv", "find_aan_file", "PairDataset", "load_aan_split"]

NUM_CLASSES = 2
SPLITS = ("train", "val", "test")
FILE_NAMES = {"train": "new_aan_pairs.train.tsv", "val": "new_aan_pairs.eval.tsv", "test": "new_aan_pairs.test.tsv"}
READER_VERSION = 1
_COLUMNS = ("label", "id1", "id2", "text1", "text2")
_LABELS = {b"0": 0, b"1": 1, b"0.0": 0, b"1.0": 1}
_GZIP_MAGIC = b"\x1f\x8b"


class RetrievalFormatError(ValueError):
    """Malformed AAN input; the message names the file and the 1-based line."""


def _raw_lines(path: Path):
    with open(path, "rb") as fh:
        is_gzip = fh.read(2) == _GZIP_MAGIC
    opener = gzip.open if is_gzip else open
    with opener(path, "rb") as fh:
        yield from fh


def read_aan_tsv(path: str | os.PathLike) -> tuple[list[int], list[bytes], list[bytes], list[tuple[str, str]]]:
    """Read one AAN pairs file.

    Returns:
        ``(labels, texts1, texts2, ids)`` in file order: int 0/1, raw UTF-8 bytes of each document, and the
        ``(id1, id2)`` strings.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        RetrievalFormatError: naming the file and line: not 5 tab-separated columns (blank lines included), a label
            that is not 0/1 (or 0.0/1.0), text that is not valid UTF-8, an empty file, truncated/corrupt gzip.
    """
    path = Path(path)
    labels: list[int] = []
    texts1: list[bytes] = []
    texts2: list[bytes] = []
    ids: list[tuple[str, str]] = []
    lineno = 0
    try:
        for raw in _raw_lines(path):
            lineno += 1
            line = raw[:-1] if raw.endswith(b"\n") else raw
            if line.endswith(b"\r"):
                line = line[:-1]
            cols = line.split(b"\t")
            if len(cols) != 5:
                what = "blank line" if not line.strip() else f"{len(cols)} tab-separated columns"
                raise RetrievalFormatError(f"{path}: line {lineno}: {what}, expected 5 "
                                           f"({', '.join(_COLUMNS)})")
            if lineno == 1 and cols[0].strip().lstrip(b"\xef\xbb\xbf") == b"label":
                continue  # optional header
            label = _LABELS.get(cols[0].strip())
            if label is None:
                raise RetrievalFormatError(f"{path}: line {lineno}: label {cols[0][:20].decode('utf-8', 'replace')!r}"
                                           " is not 0 or 1")
            for k, c in ((3, "text1"), (4, "text2")):
                try:
                    cols[k].decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise RetrievalFormatError(f"{path}: line {lineno}: {c} is not valid UTF-8 ({exc.reason})") \
                        from None
            labels.append(label)
            texts1.append(cols[3])
            texts2.append(cols[4])
            ids.append((cols[1].decode("utf-8", "replace"), cols[2].decode("utf-8", "replace")))
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise RetrievalFormatError(f"{path}: truncated or corrupt gzip data after line {lineno} "
                                   f"({type(exc).__name__}: {exc})") from None
    if lineno == 0:
        raise RetrievalFormatError(f"{path}: line 1: empty file, expected rows of {', '.join(_COLUMNS)}")
    return labels, texts1, texts2, ids


def find_aan_file(data_dir: str | os.PathLike, split: str) -> Path | None:
    """``new_aan_pairs.<train|eval|test>.tsv`` (or ``.tsv.gz``) in ``data_dir`` or ``data_dir/tsv_data``; None when
    absent. ``split`` is "train", "val" (the ``eval`` file) or "test"; ValueError otherwise."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    base = Path(data_dir)
    for folder in (base, base / "tsv_data"):
        for name in (FILE_NAMES[split], FILE_NAMES[split] + ".gz"):
            if (folder / name).is_file():
                return folder / name
    return None


class PairDataset(Dataset):
    """Encoded document pairs.

    Attributes:
        tokens1, tokens2: int16 ``(N, L)`` byte ids right-padded with ``PAD_ID``.
        lengths1, lengths2: int64 ``(N,)`` real tokens per document. labels: int64 ``(N,)`` 0/1.
        truncated1, truncated2: bool ``(N,)`` documents cut to ``L``; ``num_truncated`` counts cut documents.
        source: the file.
    ``lengths`` (the longer document of each pair) lets evaluation batch pairs of similar length.
    """

    def __init__(self, tokens1, tokens2, lengths1, lengths2, labels, *, truncated1=None, truncated2=None,
                 source: str = ""):
        t = [torch.as_tensor(x) for x in (tokens1, tokens2, lengths1, lengths2, labels)]
        n = t[4].shape[0]
        if any(x.shape[0] != n for x in t) or t[0].dim() != 2 or t[1].dim() != 2:
            raise ValueError("tokens1/tokens2 must be (N, L) and lengths1/lengths2/labels (N,) with one N; got "
                             + ", ".join(str(tuple(x.shape)) for x in t))
        self.tokens1, self.tokens2 = t[0], t[1]
        self.lengths1, self.lengths2, self.labels = t[2].long(), t[3].long(), t[4].long()
        zeros = torch.zeros(n, dtype=torch.bool)
        self.truncated1 = zeros if truncated1 is None else torch.as_tensor(truncated1).bool()
        self.truncated2 = zeros if truncated2 is None else torch.as_tensor(truncated2).bool()
        self.source = str(source)
        self.class_names = ("unrelated", "cites")

    @property
    def lengths(self) -> Tensor:
        """int64 (N,) real length of the longer document of each pair."""
        return torch.maximum(self.lengths1, self.lengths2)

    @property
    def num_truncated(self) -> int:
        """Documents cut to ``L`` (each pair counts 0, 1 or 2)."""
        return int(self.truncated1.sum() + self.truncated2.sum())

    @property
    def max_len(self) -> int:
        """L, the padded width of the token arrays."""
        return int(self.tokens1.shape[1])

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"tokens1": self.tokens1[i].long(), "tokens2": self.tokens2[i].long(), "label": self.labels[i]}

    def subset(self, index, *, source: str | None = None) -> "PairDataset":
        """The pairs at ``index`` (integer positions) as a new dataset; ``source`` replaces the file name when given."""
        index = torch.as_tensor(np.asarray(index, dtype=np.int64))
        return PairDataset(self.tokens1[index], self.tokens2[index], self.lengths1[index], self.lengths2[index],
                           self.labels[index], truncated1=self.truncated1[index], truncated2=self.truncated2[index],
                           source=self.source if source is None else source)

    def label_counts(self, num_classes: int = NUM_CLASSES) -> list[int]:
        """Pairs per label 0..num_classes-1 (``[unrelated, cites]`` by default)."""
        return torch.bincount(self.labels, minlength=num_classes).tolist()

    def majority_acc(self) -> float:
        """Share of the most common label (the majority-class baseline). ValueError when empty."""
        if len(self) == 0:
            raise ValueError("majority_acc of an empty dataset is undefined")
        return max(self.label_counts()) / len(self)


def load_aan_split(data_dir: str | os.PathLike, split: str, max_len: int, *,
                   cache_dir: str | os.PathLike | None = None) -> tuple[PairDataset | None, str]:
    """Read and encode one split (through the cache).

    Returns:
        ``(dataset or None when the file is absent, cache status)``.

    Raises:
        ValueError: unknown split or bad ``max_len``. RetrievalFormatError: as :func:`read_aan_tsv`.
    """
    path = find_aan_file(data_dir, split)
    if path is None:
        return None, "absent"

    def build():
        """Arrays to cache: ``tokens1``/``tokens2`` int16 (N, max_len), ``lengths1``/``lengths2`` int64 (N,),
        ``truncated1``/``truncated2`` bool (N,), ``labels`` int64 (N,) 0/1."""
        labels, t1, t2, _ = read_aan_tsv(path)
        tok1, len1, cut1 = encode_texts(t1, max_len)
        tok2, len2, cut2 = encode_texts(t2, max_len)
        return {"tokens1": tok1, "tokens2": tok2, "lengths1": len1, "lengths2": len2, "truncated1": cut1,
                "truncated2": cut2, "labels": np.asarray(labels, dtype=np.int64)}

    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    a, status = cached_arrays(cache_dir, f"aan-{split}", [path], {"max_len": max_len, "reader": READER_VERSION},
                              build)
    return PairDataset(a["tokens1"], a["tokens2"], a["lengths1"], a["lengths2"], a["labels"],
                       truncated1=a["truncated1"], truncated2=a["truncated2"], source=str(path)), status
