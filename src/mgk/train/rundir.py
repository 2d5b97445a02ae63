"""The run directory: where each of its files lives (:class:`RunFiles`), reading and writing them (every file that a
resume, an evaluation or a table reads is written atomically through :mod:`mgk.atomic`; a damaged one is an error
naming it), and who may write it (an OS file lock).

Layout (the run-directory format; checkpoints themselves are :mod:`mgk.train.checkpoint`'s)::

    config.yaml      the resolved RunConfig (``mgk.config.to_dict``)
    env.json         seed, world size, package/torch/python versions, git commit when known, CPU
    metrics.jsonl    one JSON object per logged step, appended as training goes
    train.log        the lines the run printed, appended
    tb/              TensorBoard events
    checkpoints/     last.pt (for --resume) and best.pt (best validation)
    results.json     final figures, written last: its presence means the run finished
    eval.json        ``mgk eval --json`` of a reproduce grid (validation split)
    eval_test.json   the same on the test split, when the data has one
    vocab.txt        the vocabulary of a task that learns one from its data (language modelling)
    data/            data generated for a run without --data
    plots/, analysis/  learning curves; ``mgk analyze``'s default output
    .mgk-lock        the lock of a live run
    .mgk-run         written by ``mgk train`` when it starts a new run (mgk 0.2.0 on): the proof that the folder's
                     run files are mgk's, without which ``--overwrite`` clears nothing
    .mgk-previous/   the run that ``--overwrite`` set aside until the new run has taken its first step

Appended files (metrics.jsonl, train.log) are not atomic: a crash can cut their last line, and readers drop a cut
last line (:func:`read_metrics`). Everything else is replaced whole.

Writing never leaves the run directory: a resumed run refuses a run file that is a symbolic link, the lock file and
the appended logs are opened with ``O_NOFOLLOW``, atomic replacement renames over a link instead of writing through
it, and an appended line has its control characters escaped, so that text taken from a path (a folder named with a
line break) never starts a line of its own. The temporary files that a kill during an atomic write leaves behind
(:func:`mgk.atomic.stale_temps`) are removed when the next run claims the directory.

``--overwrite`` clears only a directory that holds the marker and nothing but run files, and not at once: the earlier
run is moved into ``.mgk-previous/``, deleted once the new run has taken its first optimiser step
(:func:`discard_previous`), and put back when the new run fails before that (:func:`abandon`) or was killed (the next
:func:`claim`, or the first command that reads the directory: :func:`recover`).

The lock is ``flock(2)`` on ``.mgk-lock``: the kernel releases it when its process ends, however it ends (SIGKILL
included), so a crashed run never leaves a stale lock. Training holds it exclusively (rank 0 only under torchrun:
the ranks of one run must not block each other, and the other ranks write nothing into the directory); ``mgk eval``
holds it shared, so evaluations may run side by side but not while the run trains. The lock file itself stays
behind and does not make a directory "non-empty". On systems without ``fcntl`` (Windows) nothing is locked.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import time
import unicodedata
from pathlib import Path

import yaml

from .. import __version__
from ..atomic import remove_stale_temps, write_text_atomic

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["LOCK_NAME", "MARKER_NAME", "PREVIOUS_NAME", "RUN_ENTRIES", "RunDirError", "RunDirLock", "RunFileError",
           "RunFiles", "append_line", "abandon", "claim", "discard_previous", "find_runs", "holder_pid",
           "load_config", "log_text", "read_config", "read_json", "read_metrics", "read_results", "read_run_results",
           "recover", "write_config", "write_json"]

LOCK_NAME = ".mgk-lock"
MARKER_NAME = ".mgk-run"
# Not run entries: what they hold is an earlier run's (put back or deleted whole), never the current run's.
PREVIOUS_NAME = ".mgk-previous"
_DISCARDED_NAME = ".mgk-discarded"  # .mgk-previous renamed before its deletion, so that a kill never half-restores it
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # absent on Windows, where creating links needs privileges


def _entry(name: str, doc: str) -> property:
    return property(lambda self: self.root / name, doc=f"``{name}``: {doc}")


class RunFiles:
    """The path of every file of the run directory ``root`` (the one place their names are written)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    config = _entry("config.yaml", "the resolved run config")
    env = _entry("env.json", "versions, seed, world size")
    metrics = _entry("metrics.jsonl", "one JSON object per logged step (appended)")
    log = _entry("train.log", "what the run printed (appended)")
    results = _entry("results.json", "final figures; present once the run finished")
    eval = _entry("eval.json", "the `mgk eval --json` result of a reproduce grid")
    eval_test = _entry("eval_test.json", "the `mgk eval --split test --json` result of a reproduce grid")
    vocab = _entry("vocab.txt", "a vocabulary learned from the data")
    init = _entry("init.json", "where the weights started (`mgk train --init-from`) and how they were converted")
    checkpoints = _entry("checkpoints", "the folder of last.pt and best.pt")
    tb = _entry("tb", "TensorBoard events")
    plots = _entry("plots", "learning curves")
    data = _entry("data", "data generated for a run without --data")
    analysis = _entry("analysis", "`mgk analyze`'s default output folder")
    lock = _entry(LOCK_NAME, "the lock of a live run")
    marker = _entry(MARKER_NAME, "written when `mgk train` starts a new run: the folder's run files are mgk's")

    def checkpoint(self, which: str) -> Path:
        """``checkpoints/<which>.pt`` for ``which`` in ("last", "best"); ValueError otherwise."""
        if which not in ("last", "best"):
            raise ValueError(f"checkpoint must be 'best' or 'last', got {which!r}")
        return self.checkpoints / ("last.pt" if which == "last" else "best.pt")

    def existing_checkpoint(self, which: str) -> Path:
        """:meth:`checkpoint`, where "best" falls back to last.pt when the run has no best.pt (a run without a
        validation split). The path may not exist."""
        path = self.checkpoint(which)
        return self.checkpoint("last") if which == "best" and not path.is_file() else path


# What `mgk` writes into a run directory; --overwrite clears only folders that hold nothing else, marker included.
RUN_ENTRIES = frozenset(entry.fget(RunFiles("")).name for entry in vars(RunFiles).values()
                        if isinstance(entry, property))


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked: another process uses it, or a new run would overwrite it."""


def holder_pid(run_dir: str | os.PathLike) -> int | None:
    """The pid of the live process that trains in ``run_dir``, read from its lock file (which the holder fills
    and empties on release), or None. Reads only: it never takes the lock, so it cannot disturb a run starting."""
    try:
        pid = int(RunFiles(run_dir).lock.read_text().strip() or "0")
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
        self.path = RunFiles(self.run_dir).lock
        self._fd: int | None = None
        # Set by claim() for a new run, read by abandon(): the highest folder the claim created (None when run_dir
        # existed), and whether the run directory held nothing of value when claimed (new, empty, or emptied).
        self.made: Path | None = None
        self.new_run = False
        self.previous: Path | None = None  # the earlier run that claim(overwrite=True) set aside, until discarded

    def acquire(self) -> "RunDirLock":
        """Take the lock (exclusive, or shared for readers such as ``mgk eval``) without waiting; RunDirError
        naming the directory and the holder's pid when another process holds it. Returns self."""
        if fcntl is None or self._fd is not None:
            return self
        if self.path.is_symlink():  # O_NOFOLLOW below would refuse it too, in words naming no file
            raise RunDirError(_link_message(self.path))
        try:  # O_NOFOLLOW: the pid written below must never truncate a file outside the run directory
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
        except OSError:
            if not self.shared:
                raise
            try:  # a read-only finished run can still be evaluated
                fd = os.open(self.path, os.O_RDONLY | _NOFOLLOW)
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
    """What ``run_dir`` holds, but its lock file and an earlier run that --overwrite set aside."""
    return sorted(p.name for p in run_dir.iterdir() if p.name not in (LOCK_NAME, PREVIOUS_NAME, _DISCARDED_NAME))


def claim(run_dir: str | os.PathLike, *, resume: bool = False, overwrite: bool = False,
          data: str | None = None) -> RunDirLock:
    """Lock ``run_dir`` for training (creating it) and check that the run may write it; returns the held lock.

    First, what a killed process left half done is settled (:func:`_settle`). A new run needs an empty or absent
    directory; with ``overwrite``, a directory that holds mgk's marker (:data:`MARKER_NAME`) and nothing but run
    files (:data:`RUN_ENTRIES`) has its run set aside into :data:`PREVIOUS_NAME` (deleted by
    :func:`discard_previous` once the new run has taken a step, put back by :func:`abandon`), unless ``data`` (the
    run's data folder) lies inside it. A new run then writes its marker. A resumed run needs the directory to exist
    and none of its run files to be a symbolic link.

    Raises:
        RunDirError: one line naming the directory (or the file) and what to do instead.
    """
    run_dir = Path(run_dir)
    if resume and not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: no such run directory to resume")
    made = _highest_missing(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(run_dir).acquire()
    lock.made, lock.new_run = made, not resume
    try:
        _settle(run_dir, resume=resume)
        if resume:
            _refuse_links(run_dir)
        else:
            entries = _entries(run_dir)
            if entries and not overwrite:
                raise RunDirError(_not_empty(run_dir, entries))
            if entries:
                lock.previous = _set_aside(run_dir, entries, data)
            write_json(RunFiles(run_dir).marker, {"written_by": "mgk train", "mgk": __version__,
                                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    except BaseException:
        if lock.previous is not None:  # the marker could not be written: the earlier run goes back as it was
            _restore_previous(run_dir)
        lock.release()
        raise
    return lock


def _settle(run_dir: Path, *, resume: bool) -> None:
    """Finish what a killed mgk process left half done (called under the lock: no live mgk process writes here). An
    earlier run that a killed ``--overwrite`` had set aside goes back (its new run never took a step); one whose
    deletion had begun is deleted; the temporary files of atomic writes cut short are removed, in a marked run
    directory or one being resumed (only names :mod:`mgk.atomic` gives the temporaries of run files)."""
    files = RunFiles(run_dir)
    discarded = run_dir / _DISCARDED_NAME
    if files.marker.is_file() and discarded.is_dir() and not discarded.is_symlink():
        shutil.rmtree(discarded)
    _restore_previous(run_dir)
    if resume or files.marker.is_file():
        remove_stale_temps(run_dir, RUN_ENTRIES)
        if files.checkpoints.is_dir() and not files.checkpoints.is_symlink():
            remove_stale_temps(files.checkpoints, (files.checkpoint("last").name, files.checkpoint("best").name))


def _not_empty(run_dir: Path, entries: list[str]) -> str:
    """The one line refusing a new run in a directory that holds ``entries``, with what the user may do instead:
    --resume and --overwrite are offered for a run mgk marked as its own only."""
    shown = [e for e in entries if e != MARKER_NAME] or entries
    listed = ", ".join(shown[:4]) + (", ..." if len(shown) > 4 else "")
    if MARKER_NAME not in entries:
        return (f"{run_dir} is not empty ({listed}) and holds no run started by `mgk train` (it has no {MARKER_NAME} "
                "marker): choose another --out")
    return (f"{run_dir} is not empty ({listed}): continue it with `mgk train --resume {shlex.quote(str(run_dir))}`, "
            "replace it with --overwrite, or choose another --out")


def _set_aside(run_dir: Path, entries: list[str], data: str | None) -> Path:
    """Move the run in ``run_dir`` (its ``entries``) into :data:`PREVIOUS_NAME` for --overwrite, and return that
    folder; RunDirError when the directory holds anything mgk did not write, lacks mgk's marker, or holds ``data``."""
    foreign = [e for e in entries if e not in RUN_ENTRIES]
    if foreign:
        raise RunDirError(f"{run_dir} holds files `mgk train` did not write ({', '.join(foreign[:4])}); "
                          "--overwrite clears only run directories: choose another --out")
    if MARKER_NAME not in entries:
        raise RunDirError(f"{run_dir} has no {MARKER_NAME}, the marker `mgk train` writes into each run it starts, so "
                          "nothing proves that its files are a run's (a run of an earlier mgk, or a folder of yours): "
                          "--overwrite leaves it alone; delete it yourself or choose another --out")
    if data is not None:
        inside = Path(os.path.abspath(data))
        root = Path(os.path.abspath(run_dir))
        if inside == root or root in inside.parents:
            raise RunDirError(f"--data {data} lies inside {run_dir}: --overwrite would delete it; choose another "
                              "--out")
    previous = run_dir / PREVIOUS_NAME
    previous.mkdir()
    for name in entries:
        os.rename(run_dir / name, previous / name)  # a rename: links move as links, nothing is followed
    return previous


def _restore_previous(run_dir: Path) -> bool:
    """Put back the run that --overwrite set aside in ``run_dir``, in place of the run files of the new run (which
    never took a step); False when nothing was set aside (a folder of that name without mgk's marker in it was not
    set aside by mgk, which sets aside marked runs only)."""
    previous = run_dir / PREVIOUS_NAME
    if not previous.is_dir() or previous.is_symlink() or not (previous / MARKER_NAME).is_file():
        return False
    _remove(run_dir, [e for e in _entries(run_dir) if e in RUN_ENTRIES])
    for entry in sorted(previous.iterdir()):
        os.rename(entry, run_dir / entry.name)
    previous.rmdir()
    return True


def recover(run_dir: str | os.PathLike) -> bool:
    """Settle what a killed mgk process left half done in ``run_dir`` (:func:`_settle`), under the run's lock, before
    anything reads it: above all, put back, byte for byte (renames), the run that a killed ``--overwrite`` had set
    aside into :data:`PREVIOUS_NAME` (its new run never took a step, or the earlier run would be gone). Called by
    every reader of a run directory (:func:`read_config`, :func:`read_results`, :func:`find_runs`), so ``mgk train
    --resume``, ``mgk eval``, ``mgk generate`` and ``mgk table`` see the earlier run, not a folder without
    config.yaml. Nothing is done while a live process holds the lock (an ``--overwrite`` that has not taken its first
    step yet puts the run back or deletes it itself), nor where the directory cannot be written. Returns whether a
    run was put back."""
    run_dir = Path(run_dir)
    previous = run_dir / PREVIOUS_NAME
    if fcntl is None or not previous.is_dir() or previous.is_symlink() or not (previous / MARKER_NAME).is_file():
        return False  # without a lock (Windows), a live --overwrite cannot be told from a killed one: its claim settles
    lock = RunDirLock(run_dir)
    try:
        lock.acquire()
    except (RunDirError, OSError):
        return False
    try:
        _settle(run_dir, resume=False)
    except OSError:
        return False  # a folder it cannot change (read-only): read as it is, as before
    finally:
        lock.release()
    return not previous.exists()


def discard_previous(lock: RunDirLock) -> None:
    """Delete the run that ``claim(overwrite=True)`` set aside, once the new run has taken its first optimiser
    step (before, :func:`abandon` puts it back). Nothing to do when nothing was set aside; idempotent."""
    previous, lock.previous = lock.previous, None
    if previous is None or not previous.is_dir():
        return
    discarded = previous.with_name(_DISCARDED_NAME)
    try:
        os.rename(previous, discarded)  # one step: from here a kill leaves nothing to put back, and claim deletes it
    except OSError:  # a .mgk-discarded that could not be deleted before: delete the earlier run in place
        discarded = previous
    shutil.rmtree(discarded, ignore_errors=True)


def _refuse_links(run_dir: Path) -> None:
    """RunDirError naming the first run file of ``run_dir`` that is a symbolic link: writing the run (appending to
    its logs, writing into its folders) would write wherever the link points."""
    for name in _entries(run_dir):
        if name in RUN_ENTRIES and (run_dir / name).is_symlink():
            raise RunDirError(_link_message(run_dir / name))


def _link_message(path: Path) -> str:
    try:
        target = f" (to {os.readlink(path)!r})"
    except OSError:
        target = ""
    return (f"{path} is a symbolic link{target}: mgk writes only inside a run directory, never through a link; "
            "replace it with a copy of what it points to")


def _highest_missing(path: Path) -> Path | None:
    """The highest folder of ``path`` (``path`` or one of its parents) that does not exist yet; None when it does."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists() or folder.is_symlink():
            break
        missing = folder
    return missing


def abandon(lock: RunDirLock) -> None:
    """Undo :func:`claim` for a new run that stopped before its first optimiser step, then release ``lock``.

    What the run wrote (the entries of :data:`RUN_ENTRIES`: its marker, data it generated, config.yaml, train.log,
    ...) is removed, and the run that ``--overwrite`` set aside is put back, so that no empty or half-replaced run
    folder is left and the same command can be run again. The folders the claim created go too (the run directory
    and parents it made, each only while empty: a parent that another process filled meanwhile stays). A directory
    that existed before is never removed, and files that ``mgk train`` does not write are never touched; a resumed
    run's directory (``claim(resume=True)``) is left as it is."""
    run_dir = lock.run_dir
    try:
        if lock.new_run and run_dir.is_dir():
            _remove(run_dir, [e for e in _entries(run_dir) if e in RUN_ENTRIES])
            _restore_previous(run_dir)
            lock.previous = None
            if lock.made is not None:
                lock.path.unlink(missing_ok=True)
                for folder in (run_dir, *run_dir.parents):
                    folder.rmdir()  # OSError when not empty: someone else's files stay, and so do their parents
                    if folder == lock.made:
                        break
    except OSError:
        pass  # a clean-up that fails leaves what it could not remove, as a failed run would
    finally:
        lock.release()


def _remove(run_dir: Path, names: list[str]) -> None:
    for name in names:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


# --------------------------------------------------------------------------- reading and writing the files


class RunFileError(ValueError):
    """A file of a run directory is damaged or is not what mgk writes there; the message names the file."""


def _damaged(path: Path, what: str) -> RunFileError:
    return RunFileError(f"{path}: {what}; the file is damaged (a crash while it was written, or an edit?): "
                        "restore it or start the run again")


def read_config(run_dir: str | os.PathLike) -> dict:
    """config.yaml of ``run_dir`` as a dict. FileNotFoundError naming it when absent (or when ``run_dir`` is not
    a run directory); :class:`RunFileError` naming the file (and line) when it is not a YAML mapping or was cut
    short (its last line has no line end)."""
    run_dir = Path(run_dir)
    recover(run_dir)
    path = RunFiles(run_dir).config
    if not path.is_file():
        what = "no such folder" if not run_dir.exists() else "a file" if not run_dir.is_dir() else f"no {path.name}"
        raise FileNotFoundError(f"{run_dir} is not a run directory made by `mgk train` ({what})")
    try:
        text = path.read_text(encoding="utf-8")
        cfg = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise _damaged(path, f"{where}not valid YAML ({e.problem or e.context})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise _damaged(path, f"not valid YAML ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise _damaged(path, f"holds a {type(cfg).__name__}, not a mapping of config fields")
    if not text.endswith("\n"):  # mgk ends it with a line end: a file cut short mostly still parses as YAML
        raise _damaged(path, f"cut short: its last line ({text.splitlines()[-1][:40]!r}) has no line end (if you "
                             "edited the file, end it with one)")
    return cfg


def load_config(run_dir: str | os.PathLike):
    """config.yaml of ``run_dir`` as a :class:`~mgk.config.RunConfig` (flat 0.1.0 files included). Errors of
    :func:`read_config`, and RunFileError naming the file for fields the config does not have."""
    from .. import config as config_mod

    path = RunFiles(run_dir).config
    try:
        return config_mod.from_dict(read_config(run_dir))
    except RunFileError:
        raise
    except (TypeError, ValueError) as e:
        raise RunFileError(f"{path}: {e}") from None


def write_config(run_dir: str | os.PathLike, cfg_dict: dict) -> None:
    """Write config.yaml (atomically: a resume reads it)."""
    write_text_atomic(RunFiles(run_dir).config, yaml.safe_dump(cfg_dict, sort_keys=False))


def read_json(path: str | os.PathLike) -> dict:
    """A JSON object file of a run directory (results.json, eval.json, env.json). FileNotFoundError when absent;
    RunFileError naming the file when it is not a JSON object."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except IsADirectoryError:
        raise _damaged(path, "is a folder, not a file") from None
    except json.JSONDecodeError as e:
        raise _damaged(path, f"line {e.lineno}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise _damaged(path, "not UTF-8 text") from None
    if not isinstance(value, dict):
        raise _damaged(path, f"holds a JSON {type(value).__name__}, not an object")
    return value


def write_json(path: str | os.PathLike, value: dict) -> Path:
    """Write ``value`` as indented JSON, atomically (NaN and inf as JSON's extensions ``NaN`` / ``Infinity``)."""
    return write_text_atomic(path, json.dumps(value, indent=2) + "\n")


def read_results(run_dir: str | os.PathLike) -> dict | None:
    """results.json of ``run_dir``, or None when the run has not finished; RunFileError when it is damaged."""
    recover(run_dir)
    path = RunFiles(run_dir).results
    return read_json(path) if path.exists() else None


def log_text(text: str) -> str:
    """``text`` made one line of a log: its control characters (line breaks, escape sequences) and Unicode line
    separators written as Python escapes (``\\n``, ``\\x1b``, ``\\u2028``), tabs kept. Text taken from a path (a
    folder named with a line break and a command) then never starts a line of its own, nor drives a terminal."""
    if text.isprintable():
        return text
    return "".join(ch if ch == "\t" or unicodedata.category(ch) not in ("Cc", "Zl", "Zp")
                   else ch.encode("unicode_escape").decode("ascii") for ch in text)


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append ``line`` (through :func:`log_text`: one line whatever it holds) and a newline to an append-only log
    (metrics.jsonl, train.log), flushed. A crash can cut only this last line, which :func:`read_metrics` drops.

    Raises:
        RunFileError: ``path`` is a symbolic link (opened with ``O_NOFOLLOW``: a log is never written through one).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o644)
    except OSError:
        if Path(path).is_symlink():
            raise RunFileError(_link_message(Path(path))) from None
        raise
    with open(fd, "a", encoding="utf-8") as f:
        f.write(log_text(line) + "\n")


def read_metrics(run_dir: str | os.PathLike, *, torn: list | None = None) -> list[dict]:
    """The records of metrics.jsonl ([] when absent). A last line that is not a JSON object is the line a crash cut
    short: it is dropped (and appended to ``torn`` when given, so that a caller can say so). RunFileError naming
    the file and line for a damaged line before the last, or a record without its ``step``."""
    path = RunFiles(run_dir).metrics
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for lineno, line in enumerate(lines, start=1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            records.append(rec)
        elif lineno == len(lines):
            if torn is not None:
                torn.append(line)
        elif line.strip():
            raise RunFileError(f"{path}: line {lineno}: not a metrics record ({line[:60]!r}); the file is damaged")
    return records


def rewrite_metrics(run_dir: str | os.PathLike, records: list[dict]) -> None:
    """Replace metrics.jsonl by ``records`` (atomically)."""
    write_text_atomic(RunFiles(run_dir).metrics, "".join(json.dumps(r) + "\n" for r in records))


def find_runs(paths) -> tuple[list[Path], list[Path]]:
    """``(results.json files, unfinished run directories)`` of ``paths``: each a run directory, a results.json file,
    or a folder whose sub-folders (any depth) are run directories. A run directory (it has config.yaml) without
    results.json is unfinished: failed, stopped or still running.

    Raises:
        FileNotFoundError: a path that does not exist or holds no run at all (the message names it).
    """
    config, results = RunFiles("").config.name, RunFiles("").results.name
    done: list[Path] = []
    unfinished: list[Path] = []
    for p in map(Path, paths):
        files = RunFiles(p)
        for previous in [p / PREVIOUS_NAME, *(p.rglob(PREVIOUS_NAME) if p.is_dir() else ())]:
            recover(previous.parent)  # a run set aside by a killed --overwrite is a run again before it is looked for
        if p.is_file() and p.name == results:
            done.append(p)
        elif files.results.is_file():
            done.append(files.results)
        elif files.config.is_file():
            unfinished.append(p)
        elif p.is_dir() and (runs := sorted({c.parent for c in p.rglob(config)}
                                            | {r.parent for r in p.rglob(results)})):
            done.extend(RunFiles(r).results for r in runs if RunFiles(r).results.is_file())
            unfinished.extend(r for r in runs if not RunFiles(r).results.is_file())
        elif not p.exists():
            raise FileNotFoundError(f"{p}: no such run directory")
        else:
            raise FileNotFoundError(f"{files.results} not found: is {p} a finished `mgk train` run?")
    return done, unfinished


def read_run_results(files: list[Path]) -> list[tuple[Path, dict]]:
    """``(results.json path, its dict)`` of each file. RunFileError naming a file that is damaged or lacks
    task/attention/num_heads."""
    out = []
    for f in files:
        res = read_json(f)
        missing = [k for k in ("task", "attention", "num_heads") if k not in res]
        if missing:
            raise RunFileError(f"{f}: missing {', '.join(missing)} (not written by `mgk train`?)")
        out.append((f, res))
    return out
