"""Atomic file writes: the one helper every writer of checkpoints, caches, vocabularies and records uses.

A file is written to a temporary name in the destination folder, flushed and fsynced, then renamed over the
destination with ``os.replace`` (atomic on POSIX and Windows within one file system). A crash, a kill or a
concurrent writer at any moment leaves either the previous file or the complete new one under the final name, never
a truncated one; the temporary file is removed when the write fails. This is the write-then-rename pattern of
POSIX ``rename(2)`` ("If newpath already exists, it will be atomically replaced"). A destination that is a symbolic
link is replaced by the file, never written through. Only a kill (SIGKILL, power loss) leaves the temporary file
(``.NAME.XXXXXXXX.tmp``) behind: the owner of the folder removes those of its own files with
:func:`remove_stale_temps` when it next holds the folder (``mgk train`` does, for the run directory). The file gets
the permissions a plain ``open(path, "w")`` would: a new file ``0o666`` less the process's umask (and the folder's
default ACL); a file it replaces keeps its own permission bits (a checkpoint made private on purpose stays so).

This module is the lowest layer of mgk: it imports nothing from the package.
"""
from __future__ import annotations

import contextlib
import os
import random
import re
import stat
from pathlib import Path
from typing import IO, Iterable, Iterator

__all__ = ["atomic_write", "remove_stale_temps", "stale_temps", "write_bytes_atomic", "write_text_atomic"]

# The temporary file of a write to NAME is ".NAME.<8 characters of mkstemp>.tmp", beside NAME.
_TEMP_PREFIX, _TEMP_SUFFIX = ".", ".tmp"
_TEMP_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"  # tempfile's alphabet, so older temporaries still match
_TEMP_RANDOM = re.compile(r"[a-z0-9_]{8}")
_TEMP_ATTEMPTS = 10000  # tempfile.TMP_MAX: a folder full of colliding names is an error, not an endless loop
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)


def _create_temp(path: Path) -> tuple[int, str]:
    """Create the temporary file of a write to ``path`` exclusively; returns its descriptor and name.

    mkstemp creates files 0o600 whatever the umask, and the rename keeps that: results and checkpoints of a run
    would be unreadable to the colleagues a plain open() lets read them. Creating with mode 0o666 lets the kernel
    apply the umask (and a default ACL) itself, which reading the umask (os.umask twice) could not do without a
    window in which another thread creates files with umask 0.
    """
    rng = random.SystemRandom()
    for _ in range(_TEMP_ATTEMPTS):
        name = "".join(rng.choice(_TEMP_CHARS) for _ in range(8))
        tmp = str(path.parent / f"{_TEMP_PREFIX}{path.name}.{name}{_TEMP_SUFFIX}")
        try:
            return os.open(tmp, _TEMP_FLAGS, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"atomic_write: no free temporary name for {path} after {_TEMP_ATTEMPTS} attempts")


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
        The written file has the permissions ``open(path, "w")`` leaves: ``0o666 & ~umask`` for a new file, the
        permission bits ``path`` had where it existed.

    Raises:
        ValueError: a mode other than ``"w"``/``"wb"``. OSError: the folder cannot be written.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        if hasattr(os, "fchmod"):  # the file replaced keeps its permissions, as open() would have kept them
            with contextlib.suppress(FileNotFoundError):
                os.fchmod(fd, stat.S_IMODE(os.stat(path).st_mode))
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


def stale_temps(folder: str | os.PathLike, names: Iterable[str]) -> list[Path]:
    """The temporary files of :func:`atomic_write` in ``folder`` for the destinations ``names`` (``.NAME.XXXXXXXX.tmp``,
    exactly this writer's naming), sorted: what a kill during a write leaves behind for good. Only a caller that
    knows no write to ``folder`` is under way (one holding the folder's lock) may delete them. [] when ``folder``
    does not exist."""
    wanted = set(names)
    try:
        children = list(Path(folder).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for p in children:
        n = p.name
        if not (n.startswith(_TEMP_PREFIX) and n.endswith(_TEMP_SUFFIX)):
            continue
        stem, _, random = n[len(_TEMP_PREFIX):-len(_TEMP_SUFFIX)].rpartition(".")
        if stem in wanted and _TEMP_RANDOM.fullmatch(random) and (p.is_file() or p.is_symlink()):
            found.append(p)
    return sorted(found)


def remove_stale_temps(folder: str | os.PathLike, names: Iterable[str]) -> list[Path]:
    """Delete :func:`stale_temps` ``(folder, names)`` (a link is removed, never followed) and return them; only
    while no write to ``folder`` is under way (see there)."""
    removed = []
    for p in stale_temps(folder, names):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed


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
