"""Atomic file writes: the one helper every writer of checkpoints, caches, vocabularies and records uses.

A file is written to a temporary name in the destination folder, flushed and fsynced, then renamed over the
destination with ``os.replace`` (atomic on POSIX and Windows within one file system). A crash, a kill or a
concurrent writer at any moment leaves either the previous file or the complete new one under the final name, never
a truncated one; the temporary file is removed when the write fails. This is the write-then-rename pattern of
POSIX ``rename(2)`` ("If newpath already exists, it will be atomically replaced").

This module is the lowest layer of mgk: it imports nothing from the package.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_write", "write_bytes_atomic", "write_text_atomic"]


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable; best effort (not every platform can open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", *, encoding: str | None = None,
                 newline: str | None = None) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on a clean exit of the ``with`` block it replaces ``path``.

    Args:
        path: the destination; its parent folders are created.
        mode: ``"wb"`` (bytes) or ``"w"`` (text, with ``encoding``, default UTF-8, and ``newline``).

    Yields:
        the open file object. If the block raises, the destination is untouched and the temporary file removed.

    Raises:
        ValueError: a mode other than ``"w"``/``"wb"``. OSError: the folder cannot be written.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        text = mode == "w"
        with os.fdopen(fd, mode, encoding=(encoding or "utf-8") if text else None,
                       newline=newline if text else None) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`); returns the path."""
    with atomic_write(path, "wb") as fh:
        fh.write(data)
    return Path(path)


def write_text_atomic(path: str | os.PathLike, text: str, *, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically with ``\\n`` line ends as given (no newline translation)."""
    with atomic_write(path, "w", encoding=encoding, newline="") as fh:
        fh.write(text)
    return Path(path)


def save_figure_atomic(fig, path: str | os.PathLike, *, dpi: int, **savefig) -> Path:
    """Write the matplotlib figure ``fig`` to ``path`` as a PNG atomically (a reader never sees half an image), then
    close it; returns the path. ``savefig``: further options of ``Figure.savefig`` (e.g. ``bbox_inches``)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        with atomic_write(path) as fh:
            fig.savefig(fh, format="png", dpi=dpi, **savefig)
    finally:
        plt.close(fig)
    return path
