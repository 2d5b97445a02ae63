"""ListOps (LRA): read the official TSV files, encode them as tensors, and generate our own data.

Source format (LRA release, ``lra_release/listops-1000/basic_{train,val,test}.tsv``; Tay et al. 2021, "Long Range
Arena", section 2.2.1, https://github.com/google-research/long-range-arena): a header row ``Source\\tTarget``, then
one row per example. ``Source`` is space-separated tokens; ``(`` and ``)`` are grouping marks that the LRA input
pipeline drops before tokenising, the real tokens are the operator openers ``[MIN [MAX [MED [SM``, the closing ``]``
and the digits ``0``-``9``. ``Target`` is the integer value of the expression, 0-9. Some copies use CRLF line
endings; files may be gzip-compressed (``.tsv.gz``).

The generator here is our own, written from the published task definition (Nangia & Bowman 2018,
"ListOps"; Tay et al. 2021, "Long Range Arena"), not copied from the LRA code. It writes the same
textual form as the real files, e.g. ``( ( ( [MAX 2 ) 9 ) ] )`` for MAX(2, 9).
"""
from __future__ import annotations

import gzip
import operator
import os
import random
import re
import zlib
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from ..atomic import write_bytes_atomic
from .cache import TokenDataset, cached_arrays

__all__ = [
    "PAD_ID",
    "VOCAB",
    "TOKEN_TO_ID",
    "NUM_CLASSES",
    "OPERATORS",
    "SPLITS",
    "ListOpsFormatError",
    "tokenize_source",
    "read_listops_tsv",
    "encode_rows",
    "find_split_file",
    "listops_value",
    "generate_listops",
    "write_listops_tsv",
    "generate_listops_dir",
    "CLASS_NAMES",
    "RELEASE_MAX_LEN",
    "READER_VERSION",
    "dataset_from_rows",
    "load_listops_split",
]

PAD_ID = 0
VOCAB: list[str] = ["<pad>"] + [str(d) for d in range(10)] + ["[MIN", "[MAX", "[MED", "[SM", "]"]
TOKEN_TO_ID: dict[str, int] = {tok: i for i, tok in enumerate(VOCAB)}
NUM_CLASSES = 10
OPERATORS: tuple[str, ...] = ("[MIN", "[MAX", "[MED", "[SM")
SPLITS: tuple[str, ...] = ("train", "val", "test")
# Longest row of the LRA release after dropping ( and ): the length LRA trains ListOps with (Tay et al. 2021,
# "Long Range Arena", section 2.2.1: "sequence lengths of up to 2K").
RELEASE_MAX_LEN = 2000
READER_VERSION = 1  # part of the cache key: bump when the tokenisation changes

_HEADER = "Source\tTarget"
_GROUPING = frozenset({"(", ")"})
_LABEL_RE = re.compile(r"[0-9]+")
_LABELS = frozenset(range(NUM_CLASSES))
_GZIP_MAGIC = b"\x1f\x8b"
# Token id lookup used by the reader: grouping marks map to 0 (= PAD_ID, never a real token) and are
# then removed with filter(None, ...), which runs at C speed.
_READ_LOOKUP: dict[str, int] = {**{t: i for t, i in TOKEN_TO_ID.items() if t != "<pad>"}, "(": 0, ")": 0}


class ListOpsFormatError(ValueError):
    """Malformed ListOps input. The message names the file (when known) and the 1-based line number."""


def _where(source: str | os.PathLike | None, line: int | None) -> str:
    src = str(source) if source else "<rows>"
    return f"{src}: line {line}" if line is not None else src


def tokenize_source(text: str, *, source: str = "", line: int | None = None) -> list[int]:
    """Token ids of one ``Source`` string, grouping marks ``(`` ``)`` dropped.

    Args:
        text: space-separated ListOps tokens, e.g. ``"( ( [MAX 2 ) 9 ) ] )"``.
        source, line: only used in error messages.

    Returns:
        list of int ids into ``VOCAB`` (never ``PAD_ID``), e.g. ``[12, 3, 10, 15]`` for the above.

    Raises:
        ListOpsFormatError: unknown token, or nothing left after dropping the grouping marks.
    """
    parts = text.split()
    try:
        ids = list(filter(None, map(_READ_LOOKUP.__getitem__, parts)))
    except KeyError:
        bad = next(t for t in parts if t not in _READ_LOOKUP)
        raise ListOpsFormatError(
            f"{_where(source, line)}: unknown token {bad!r} in Source (known: {' '.join(VOCAB[1:])} and ( ))"
        ) from None
    if not ids:
        raise ListOpsFormatError(f"{_where(source, line)}: empty Source (no tokens besides ( and ))")
    return ids


def _parse_label(text: str, where: str) -> int:
    t = text.strip()
    if not _LABEL_RE.fullmatch(t):
        raise ListOpsFormatError(f"{where}: Target {text!r} is not an integer 0-{NUM_CLASSES - 1}")
    value = int(t)
    if not 0 <= value < NUM_CLASSES:
        raise ListOpsFormatError(f"{where}: Target {value} is outside 0-{NUM_CLASSES - 1}")
    return value


def _iter_raw_lines(path: Path):
    """Yield the raw byte lines of ``path``, gunzipping when the file starts with the gzip magic."""
    with open(path, "rb") as fh:
        is_gzip = fh.read(2) == _GZIP_MAGIC
    opener = gzip.open if is_gzip else open
    with opener(path, "rb") as fh:
        yield from fh


def read_listops_tsv(path: str | os.PathLike) -> list[tuple[list[int], int]]:
    """Read a ListOps TSV file (LRA ``basic_{split}.tsv`` format, plain or gzip) into token ids and labels.

    The first line must be the header ``Source\\tTarget``; every following line is ``<source>\\t<target>``.
    LF and CRLF line endings are both accepted; gzip is detected from the file's magic bytes, so
    ``.tsv.gz`` works (and a misnamed file too). Blank lines are errors (row ``i`` is on line ``i + 2``,
    which ``encode_rows`` relies on for its messages); a missing newline at the end is fine.

    Returns:
        list of ``(token_ids, label)`` per data row, in file order: ``token_ids`` is a list of int ids
        into ``VOCAB`` with ``(`` and ``)`` dropped, ``label`` an int in 0-9.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ListOpsFormatError: message names the file and the 1-based line: missing or wrong header,
            wrong number of tab-separated columns (including blank lines), unknown token, empty source,
            Target not an integer or outside 0-9, undecodable (non UTF-8) bytes, or a truncated /
            corrupt gzip stream.
    """
    path = Path(path)
    rows: list[tuple[list[int], int]] = []
    lineno = 0
    try:
        for raw in _iter_raw_lines(path):
            lineno += 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ListOpsFormatError(f"{_where(path, lineno)}: not valid UTF-8 ({exc.reason})") from None
            if line.endswith("\n"):
                line = line[:-1]
            if line.endswith("\r"):
                line = line[:-1]
            if lineno == 1:
                line = line.lstrip("\ufeff")
                if line.strip() != _HEADER:
                    raise ListOpsFormatError(
                        f"{_where(path, 1)}: expected header {_HEADER!r}, got {line[:60]!r}"
                    )
                continue
            cols = line.split("\t")
            if len(cols) != 2:
                what = "blank line" if not line.strip() else f"{len(cols)} tab-separated columns"
                raise ListOpsFormatError(
                    f"{_where(path, lineno)}: {what}, expected 2 columns (Source, Target)"
                )
            ids = tokenize_source(cols[0], source=str(path), line=lineno)
            rows.append((ids, _parse_label(cols[1], _where(path, lineno))))
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ListOpsFormatError(
            f"{path}: truncated or corrupt gzip data after line {lineno} ({type(exc).__name__}: {exc})"
        ) from None
    if lineno == 0:
        raise ListOpsFormatError(f"{_where(path, 1)}: empty file, expected header {_HEADER!r}")
    return rows


def _too_long_error(lengths: np.ndarray, max_len: int, where) -> ListOpsFormatError:
    """The error for rows longer than ``max_len``: names the first and the longest such row and the setting that
    fits them all. Truncation is not offered: cutting a ListOps expression changes its value."""
    long_rows = np.flatnonzero(lengths > max_len)
    first, longest = int(long_rows[0]), int(np.argmax(lengths))
    need = int(lengths[longest])
    fits = f"--set max_len={need}"
    if need <= RELEASE_MAX_LEN:
        fits += f" (or --preset listops-paper, max_len={RELEASE_MAX_LEN}, the length of the LRA release)"
    return ListOpsFormatError(
        f"{where(first)}: sequence has {int(lengths[first])} tokens, more than max_len={max_len} "
        f"({len(long_rows)} of {len(lengths)} rows are longer; the longest, {where(longest)}, has {need} tokens): "
        f"use {fits}; a ListOps expression cannot be cut without changing its value"
    )


def _check_label(label, where: str) -> int:
    try:
        ok = not isinstance(label, bool) and operator.index(label) in _LABELS
    except TypeError:
        ok = False
    if not ok:
        raise ListOpsFormatError(f"{where}: label {label!r} is not an int in 0-{NUM_CLASSES - 1}")
    return operator.index(label)


def _flatten_rows(rows: Sequence[tuple[Sequence[int], int]], where) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, lengths, labels)``: every row's token ids one after another (int64), tokens per row and labels (int64
    ``(N,)``). Raises ListOpsFormatError for an empty row, a token id outside ``1..len(VOCAB)-1`` or a bad label."""
    lengths = np.fromiter((len(ids) for ids, _ in rows), dtype=np.int64, count=len(rows))
    labels = np.fromiter((_check_label(lab, where(i)) for i, (_, lab) in enumerate(rows)), dtype=np.int64,
                         count=len(rows))
    if (lengths == 0).any():
        raise ListOpsFormatError(f"{where(int(np.argmax(lengths == 0)))}: empty token sequence")
    flat = (np.concatenate([np.asarray(ids, dtype=np.int64) for ids, _ in rows]) if len(rows)
            else np.zeros(0, dtype=np.int64))
    bad = (flat < 1) | (flat >= len(VOCAB))
    if bad.any():
        row = int(np.searchsorted(np.cumsum(lengths), int(np.argmax(bad)), side="right"))
        raise ListOpsFormatError(f"{where(row)}: token id outside 1..{len(VOCAB) - 1}")
    return flat, lengths, labels


def _pad(flat: np.ndarray, lengths: np.ndarray, max_len: int, truncate: bool, where
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens (N, max_len), kept lengths (N,), truncated (N,) bool)`` from flat ids; tokens keep ``flat``'s
    dtype, padded with ``PAD_ID``. Rows longer than ``max_len`` are an error unless ``truncate``."""
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    truncated = lengths > max_len
    if truncated.any() and not truncate:
        raise _too_long_error(lengths, max_len, where)
    kept = np.minimum(lengths, max_len)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths
    tokens = np.full((len(lengths), max_len), PAD_ID, dtype=flat.dtype)
    pos = np.arange(max_len)
    real = pos[None, :] < kept[:, None]
    tokens[real] = flat[(starts[:, None] + pos[None, :])[real]]
    return tokens, kept, truncated


def _row_where(source: str):
    """Where row ``i`` came from, for error messages: ``source`` and line ``i + 2`` (the header is line 1), else
    ``row i``."""
    return (lambda i: _where(source, i + 2)) if source else (lambda i: f"row {i}")


def encode_rows(
    rows: Sequence[tuple[Sequence[int], int]],
    max_len: int,
    *,
    truncate: bool = False,
    source: str = "",
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Pad token-id rows into tensors.

    Args:
        rows: ``(token_ids, label)`` pairs, e.g. from ``read_listops_tsv``.
        max_len: padded length (>= 1).
        truncate: if True, a sequence longer than ``max_len`` keeps its first ``max_len`` tokens and
            is counted; if False (the default, and the only meaningful choice for ListOps, whose answer depends on
            the whole expression) it is an error.
        source: file the rows came from, for error messages; row ``i`` is reported as line ``i + 2``
            (the header is line 1), as ``read_listops_tsv`` lays them out.

    Returns:
        ``(tokens, labels, lengths, num_truncated)``: tokens int64 ``(N, max_len)`` padded with
        ``PAD_ID`` on the right; labels int64 ``(N,)``; lengths int64 ``(N,)`` = number of real tokens
        kept (after truncation, so ``<= max_len``); num_truncated the count of cut rows.

    Raises:
        ValueError: ``max_len < 1``.
        ListOpsFormatError: sequences longer than ``max_len`` without ``truncate`` (the message gives the first and
            the longest such row, by source/line and length, and the ``max_len`` that fits); an empty sequence; a
            token id outside ``1..len(VOCAB)-1``; a label that is not an integer (``operator.index``) in 0-9.
    """
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    where = _row_where(source)
    flat, lengths, labels = _flatten_rows(rows, where)
    tokens, kept, truncated = _pad(flat, lengths, max_len, truncate, where)
    return torch.from_numpy(tokens), torch.from_numpy(labels), torch.from_numpy(kept), int(truncated.sum())


def find_split_file(data_dir: str | os.PathLike, split: str) -> Path | None:
    """Locate the ListOps file of ``split`` under ``data_dir``.

    Looks, in this order, for ``basic_{split}.tsv``, ``basic_{split}.tsv.gz``,
    ``listops-1000/basic_{split}.tsv`` and ``listops-1000/basic_{split}.tsv.gz`` (the LRA release
    layout); the first regular file found wins.

    Returns:
        the path, or None if none of them exists (also when ``data_dir`` does not exist).

    Raises:
        ValueError: ``split`` is not one of ``"train"``, ``"val"``, ``"test"``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    base = Path(data_dir)
    for folder in (base, base / "listops-1000"):
        for name in (f"basic_{split}.tsv", f"basic_{split}.tsv.gz"):
            candidate = folder / name
            if candidate.is_file():
                return candidate
    return None


# --------------------------------------------------------------------------- generator


def _median_floor(values: Sequence[int]) -> int:
    # The LRA generator's rule, int(numpy.median(x)): the floor of the mean of the two middle values for an even
    # count. It reproduces every label of the shared real val split, so generated and real data agree.
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2


_APPLY = {
    "[MIN": min,
    "[MAX": max,
    "[MED": _median_floor,
    "[SM": lambda v: sum(v) % 10,
}


def listops_value(op: str, values: Sequence[int]) -> int:
    """Value of operator ``op`` (one of ``OPERATORS``) applied to the digit values ``values``.

    ``[MIN``/``[MAX``: minimum/maximum; ``[SM``: sum modulo 10; ``[MED``: the median, for an even
    count the floor of the mean of the two middle elements (``int(numpy.median(values))``, the rule of the
    LRA generator that made the release files).

    Raises:
        ValueError: unknown operator or empty ``values``.
    """
    if op not in _APPLY:
        raise ValueError(f"unknown operator {op!r}, expected one of {OPERATORS}")
    if not values:
        raise ValueError(f"{op} needs at least one argument")
    return int(_APPLY[op](values))


class _TooLong(Exception):
    pass


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_generator_args(num_samples, max_depth, max_args, min_length, max_length, branch_prob) -> int:
    """Validate :func:`generate_listops`'s arguments; returns the minimum number of arguments of a node. ValueError
    for a bad value or a length range that no tree with these limits can reach."""
    _check_int("num_samples", num_samples, 0)
    _check_int("max_depth", max_depth, 1)
    _check_int("max_args", max_args, 1)
    _check_int("min_length", min_length, 1)
    _check_int("max_length", max_length, 1)
    if min_length > max_length:
        raise ValueError(f"min_length={min_length} > max_length={max_length}")
    if not 0.0 <= float(branch_prob) <= 1.0:
        raise ValueError(f"branch_prob must be in [0, 1], got {branch_prob!r}")
    min_args = min(2, max_args)
    shortest = 2 + min_args
    longest = 2 + max_args  # depth-1 tree; deeper: T(d) = 2 + max_args * T(d-1)
    for _ in range(max_depth - 1):
        longest = 2 + max_args * longest
        if longest >= min_length:
            break
    if max_length < shortest or min_length > longest:
        raise ValueError(
            f"no tree with max_depth={max_depth}, max_args={max_args} has length in "
            f"[{min_length}, {max_length}] (possible lengths start at {shortest}"
            + (f" and end at {longest})" if longest < min_length else ")")
        )
    return min_args


def generate_listops(
    num_samples: int,
    *,
    seed: int,
    max_depth: int = 3,
    max_args: int = 5,
    min_length: int = 10,
    max_length: int = 100,
    branch_prob: float = 0.25,
) -> list[tuple[str, int]]:
    """Generate random ListOps expressions and their values (our own generator, deterministic in ``seed``).

    Each expression is a tree: an operator node (MIN, MAX, MED, SM, chosen uniformly) has between
    ``min(2, max_args)`` and ``max_args`` arguments (uniform); each argument is, with probability
    ``branch_prob`` and while the node's depth is below ``max_depth`` (the root has depth 1), another
    operator node, otherwise a digit 0-9 (uniform). Values are computed exactly with
    ``listops_value`` (MED of an even count is the lower middle element). Trees whose length, in tokens
    after dropping ``(`` ``)``, lies outside ``[min_length, max_length]`` are discarded and resampled.
    All randomness comes from one ``random.Random(seed)``.

    Returns:
        ``num_samples`` pairs ``(source, value)``: ``source`` in the textual form of the LRA files
        (an operator node with k arguments is written ``( `` * (k+1) + op, then `` arg )`` per
        argument, then `` ] )``; e.g. ``( ( ( [MAX 2 ) 9 ) ] )``), ``value`` an int 0-9.

    Raises:
        ValueError: bad argument (negative ``num_samples``, ``max_depth``/``max_args``/``min_length``
            < 1, ``min_length > max_length``, ``branch_prob`` outside [0, 1]) or a length range no tree
            with these limits can reach.
        RuntimeError: 100,000 consecutive draws all fell outside the length range.
    """
    min_args = _check_generator_args(num_samples, max_depth, max_args, min_length, max_length, branch_prob)
    rng = random.Random(seed)

    def build(depth: int, budget: list[int]) -> tuple[str, int]:
        """A random operator node at ``depth``: ``(source text, value)``. Adds its tokens (brackets excluded) to
        ``budget[0]``; raises ``_TooLong`` once that exceeds ``max_length``."""
        k = rng.randint(min_args, max_args)
        op = rng.choice(OPERATORS)
        budget[0] += 2
        parts = ["( " * (k + 1) + op]
        values = []
        for _ in range(k):
            if depth < max_depth and rng.random() < branch_prob:
                text, value = build(depth + 1, budget)
            else:
                value = rng.randint(0, 9)
                text = str(value)
                budget[0] += 1
            if budget[0] > max_length:
                raise _TooLong
            parts.append(f" {text} )")
            values.append(value)
        parts.append(" ] )")
        return "".join(parts), listops_value(op, values)

    out: list[tuple[str, int]] = []
    misses = 0
    while len(out) < num_samples:
        budget = [0]
        try:
            text, value = build(1, budget)
        except _TooLong:
            text = None
        if text is None or budget[0] < min_length:
            misses += 1
            if misses >= 100_000:
                raise RuntimeError(
                    f"100000 consecutive trees fell outside [{min_length}, {max_length}] tokens; "
                    "widen the length range or change max_depth/max_args/branch_prob"
                )
            continue
        misses = 0
        out.append((text, value))
    return out


def write_listops_tsv(path: str | os.PathLike, rows: Iterable[tuple[str, int]]) -> Path:
    """Write ``(source, target)`` rows as a ListOps TSV: header ``Source\\tTarget``, tab-separated, LF endings.

    A ``path`` ending in ``.gz`` is written gzip-compressed. Parent folders are created.

    Returns:
        the path written.

    Raises:
        ValueError: a source containing a tab or newline, or a target not an int in 0-9.
    """
    path = Path(path)
    lines = [_HEADER]
    for i, (src, target) in enumerate(rows):
        if any(c in src for c in "\t\r\n"):
            raise ValueError(f"row {i}: source contains a tab or newline")
        if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < NUM_CLASSES:
            raise ValueError(f"row {i}: target {target!r} is not an int in 0-{NUM_CLASSES - 1}")
        lines.append(f"{src}\t{target}")
    data = ("\n".join(lines) + "\n").encode("utf-8")
    # atomic: a run without --data generates its ListOps into the run directory and reads it again on resume
    return write_bytes_atomic(path, gzip.compress(data) if path.suffix == ".gz" else data)


def generate_listops_dir(
    out_dir: str | os.PathLike,
    *,
    num_train: int = 10_000,
    num_val: int = 1_000,
    num_test: int = 1_000,
    seed: int = 0,
    **gen_kwargs,
) -> Path:
    """Generate a train/val/test ListOps set with ``generate_listops`` and write ``basic_{split}.tsv`` files.

    Split ``train``/``val``/``test`` uses seed ``3 * seed + 0/1/2``, so no two splits (of any ``seed``)
    share a random stream. Val and test rows whose source string also appears in train are dropped,
    so val/test may hold fewer than ``num_val``/``num_test`` rows. ``gen_kwargs`` go to
    ``generate_listops`` (``max_depth``, ``max_args``, ``min_length``, ``max_length``, ``branch_prob``).

    Returns:
        ``Path(out_dir)``, which then holds ``basic_train.tsv``, ``basic_val.tsv``, ``basic_test.tsv``
        (readable with ``read_listops_tsv`` / ``load_listops_split``).

    Raises:
        ValueError: as ``generate_listops``; also ``seed`` not an int.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    out = Path(out_dir)
    train = generate_listops(num_train, seed=3 * seed, **gen_kwargs)
    seen = {src for src, _ in train}
    write_listops_tsv(out / "basic_train.tsv", train)
    for offset, (split, count) in enumerate((("val", num_val), ("test", num_test)), start=1):
        rows = generate_listops(count, seed=3 * seed + offset, **gen_kwargs)
        write_listops_tsv(out / f"basic_{split}.tsv", [r for r in rows if r[0] not in seen])
    return out


# --------------------------------------------------------------------------- dataset


CLASS_NAMES: tuple[str, ...] = tuple(str(d) for d in range(NUM_CLASSES))


def _dataset(flat: np.ndarray, lengths: np.ndarray, labels: np.ndarray, max_len: int, *, truncate: bool,
             source: str) -> TokenDataset:
    tokens, kept, truncated = _pad(flat.astype(np.uint8), lengths, max_len, truncate, _row_where(source))
    return TokenDataset(tokens, labels, kept, truncated=truncated, source=source, class_names=CLASS_NAMES)


def dataset_from_rows(rows: Sequence[tuple[Sequence[int], int]], max_len: int, *, truncate: bool = False,
                      source: str = "") -> TokenDataset:
    """``(token_ids, label)`` rows as a :class:`~mgk.data.cache.TokenDataset` (tokens uint8 ``(N, max_len)``,
    ``class_names`` "0".."9"); arguments and errors as :func:`encode_rows`."""
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    flat, lengths, labels = _flatten_rows(rows, _row_where(source))
    return _dataset(flat, lengths, labels, max_len, truncate=truncate, source=source)


def load_listops_split(
    data_dir: str | os.PathLike,
    split: str,
    max_len: int,
    *,
    truncate: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> TokenDataset | None:
    """Read and encode one split found by ``find_split_file(data_dir, split)``, through the cache.

    The cache entry (see :mod:`mgk.data.cache`) holds the unpadded token ids, keyed by the file's size and mtime, so
    one entry serves every ``max_len``, and a too-long row is reported without reading the file again.

    Returns:
        a :class:`~mgk.data.cache.TokenDataset` (tokens uint8 ``(N, max_len)``, ``source`` = the file path as a
        string, ``num_truncated`` set), or None when the split's file is absent.

    Raises:
        ValueError: unknown ``split`` or bad ``max_len``.
        ListOpsFormatError: malformed file, or sequences longer than ``max_len`` without ``truncate`` (naming the
            first and the longest, and the ``max_len`` or preset that fits them).
    """
    path = find_split_file(data_dir, split)
    if path is None:
        return None
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")

    def build():
        """Arrays to cache: ``ids`` uint8 (every row's token ids, one row after another), ``lengths`` int64 (N,)
        tokens per row, ``labels`` int64 (N,) 0-9."""
        flat, lengths, labels = _flatten_rows(read_listops_tsv(path), _row_where(str(path)))
        return {"ids": flat.astype(np.uint8), "lengths": lengths, "labels": labels}

    a, _ = cached_arrays(cache_dir, f"listops-{split}", [path], {"reader": READER_VERSION}, build)
    return _dataset(a["ids"], a["lengths"], a["labels"], max_len, truncate=truncate, source=str(path))
