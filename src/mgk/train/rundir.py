"""Who may write a run directory: an OS file lock held while a process trains or evaluates in it, and the rules
for starting a new run in a folder that already exists.

The lock is ``flock(2)`` on the file ``.mgk-lock`` inside the run directory: the kernel releases it when its
process ends, however it ends (SIGKILL included), so a crashed run never leaves a stale lock. Training holds it
exclusively (rank 0 only under torchrun: the ranks of one run must not block each other, and the other ranks write
nothing into the directory); ``mgk eval`` holds it shared, so evaluations may run side by side but not while the
run trains. The lock file itself stays behind and does not make a directory "non-empty". On systems without
``fcntl`` (Windows) nothing is locked.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["LOCK_NAME", "RUN_ENTRIES", "RunDirError", "RunDirLock", "claim", "holder_pid"]

LOCK_NAME = ".mgk-lock"
# What `mgk train` writes into a run directory; --overwrite clears only folders that hold nothing else.
RUN_ENTRIES = frozenset({LOCK_NAME, "config.yaml", "env.json", "metrics.jsonl", "tb", "checkpoints", "results.json",
                         "plots", "train.log", "data", "vocab.txt"})


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked: another process uses it, or a new run would overwrite it."""


def holder_pid(run_dir: str | os.PathLike) -> int | None:
    """The pid of the live process that trains in ``run_dir``, read from its lock file (which the holder fills
    and empties on release), or None. Reads only: it never takes the lock, so it cannot disturb a run starting."""
    try:
        pid = int((Path(run_dir) / LOCK_NAME).read_text().strip() or "0")
        if pid > 0:
            os.kill(pid, 0)  # a pid left by a killed run names no live process
            return pid
    except PermissionError:  # alive, owned by another user
        return pid
    except (OSError, ValueError):
        pass
    return None


def _holder(run_dir: Path) -> str:
    pid = holder_pid(run_dir)
    return f" (pid {pid})" if pid is not None else ""


class RunDirLock:
    """The lock of one run directory. ``acquire()`` raises :class:`RunDirError` naming the directory when another
    process holds it (exclusively, or shared when this one asks for it exclusively); ``release()`` is idempotent
    and also happens when the process ends."""

    def __init__(self, run_dir: str | os.PathLike, *, shared: bool = False):
        self.run_dir, self.shared = Path(run_dir), shared
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        """Take the lock (exclusive, or shared for readers such as ``mgk eval``) without waiting; RunDirError
        naming the directory and the holder's pid when another process holds it. Returns self."""
        if fcntl is None or self._fd is not None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            if not self.shared:
                raise
            try:  # a read-only finished run can still be evaluated
                fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                return self  # no lock file and none can be made: nobody can be training here
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirError(f"{self.run_dir} is in use by another mgk process{_holder(self.run_dir)}: wait for it "
                              "to finish, or use another directory") from None
        if not self.shared:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the OS also drops it when the process dies, however it dies)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if not self.shared:
            os.ftruncate(fd, 0)  # no stale pid for the next holder's error messages
        os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


def _entries(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_NAME)


def claim(run_dir: str | os.PathLike, *, resume: bool = False, overwrite: bool = False,
          data: str | None = None) -> RunDirLock:
    """Lock ``run_dir`` for training (creating it) and check that the run may write it; returns the held lock.

    A new run needs an empty or absent directory; with ``overwrite`` a directory that holds only what
    ``mgk train`` writes (:data:`RUN_ENTRIES`) is emptied first, unless ``data`` (the run's data folder) lies
    inside it. A resumed run needs the directory to exist.

    Raises:
        RunDirError: one line naming the directory and what to do instead.
    """
    run_dir = Path(run_dir)
    if resume and not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: no such run directory to resume")
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(run_dir).acquire()
    try:
        entries = [] if resume else _entries(run_dir)
        if entries and not overwrite:
            hint = (f"continue it with `mgk train --resume {run_dir}`, replace it with --overwrite, "
                    if "config.yaml" in entries else "")
            raise RunDirError(f"{run_dir} is not empty ({', '.join(entries[:4])}{', ...' if len(entries) > 4 else ''})"
                              f": {hint}or choose another --out")
        if entries:
            _clear(run_dir, entries, data)
    except BaseException:
        lock.release()
        raise
    return lock


def _clear(run_dir: Path, entries: list[str], data: str | None) -> None:
    """Empty ``run_dir`` (but its lock file) for --overwrite; refuse when it holds anything mgk did not write."""
    foreign = [e for e in entries if e not in RUN_ENTRIES]
    if foreign:
        raise RunDirError(f"{run_dir} holds files `mgk train` did not write ({', '.join(foreign[:4])}); "
                          "--overwrite clears only run directories: choose another --out")
    if data is not None:
        inside = Path(os.path.abspath(data))
        root = Path(os.path.abspath(run_dir))
        if inside == root or root in inside.parents:
            raise RunDirError(f"--data {data} lies inside {run_dir}: --overwrite would delete it; choose another "
                              "--out")
    for name in entries:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
