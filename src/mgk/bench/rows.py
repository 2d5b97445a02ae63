"""Running one bench row in a fresh interpreter (:func:`run_row`, with :func:`failure` saying why one died) and
the load check every bench records (:data:`BUSY_LOAD`, :func:`load_record`, :func:`load_line`,
:func:`busy_warning`): shared by ``mgk bench attention``, ``model`` and ``decode``, which import it and nothing of
each other for it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

BUSY_LOAD = 0.5  # 1-minute load average above which the machine is called busy: other work held half a core
# The longest wait subprocess.run takes: its poll(2) counts milliseconds in a C int, and a longer timeout is an
# OverflowError ("timeout is too large") after the row has run (about 24.8 days).
MAX_TIMEOUT_S = (2 ** 31 - 1) // 1000


def failure(returncode: int, stderr: str) -> str:
    """One line saying why a row's subprocess failed: its exit status, the likely cause for a signal, and the
    last line of its error output (never empty)."""
    tail = (stderr.strip().splitlines() or [""])[-1].strip()
    if returncode < 0 or returncode in (128 + signal.SIGKILL, 128 + signal.SIGSEGV):
        number = -returncode if returncode < 0 else returncode - 128
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        cause = {signal.SIGKILL: "likely out of memory (the kernel's OOM killer sends SIGKILL)",
                 signal.SIGSEGV: "a crash in native code", signal.SIGTERM: "terminated from outside",
                 signal.SIGINT: "interrupted"}.get(number, "killed by a signal")
        text = f"killed by {name} (exit {returncode}): {cause}"
    else:
        text = f"exit status {returncode}"
        if "out of memory" in tail.lower() or "MemoryError" in tail:
            text += ": out of memory"
    return f"{text}; last error line: {tail}" if tail else f"{text}; no error output"


def run_row(code: str, timeout: float, *, rss: bool = True) -> dict:
    """Run Python ``code`` (which prints one JSON row last) in a fresh subprocess: the row, or ``{"error": ...}``
    naming the exit status and likely cause when it dies or times out. ``rss``: the row measures the resident set,
    so large blocks come straight from mmap and go back on free (glibc), and the resident set follows live memory;
    that costs page faults on every large allocation, so rows that measure only time (and tensor bytes) pass
    False and run under the allocator's defaults, as a user's process does."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536") if rss else dict(os.environ)
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=min(timeout, MAX_TIMEOUT_S), env=env)  # a cell's timeout x kinds may exceed it
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:g} s"}
    if p.returncode == 0:
        lines = p.stdout.strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            return {"error": "exit status 0 but no result row; last error line: "
                             + ((p.stderr.strip().splitlines() or ["none"])[-1])}
    return {"error": failure(p.returncode, p.stderr)}


def load_record(before: tuple[float, ...], after: tuple[float, ...]) -> dict:
    """The load fields of a bench result from ``os.getloadavg()`` taken before the first row and after the last:
    ``{"cores", "load_average": {"before", "after"}, "busy"}`` (busy: the 1-minute load before was above
    :data:`BUSY_LOAD`)."""
    return {"cores": os.cpu_count(), "load_average": {"before": list(before), "after": list(after)},
            "busy": before[0] > BUSY_LOAD}


def load_line(result: dict) -> str:
    """``load average B before, A after`` (1-minute) of a result holding :func:`load_record`'s fields, for the
    line above a bench's table."""
    load = result["load_average"]
    return f"load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after"


def busy_warning(result: dict) -> str | None:
    """The warning for a run on a busy machine, or None."""
    if not result.get("busy"):
        return None
    load = result["load_average"]["before"][0]
    return (f"warning: the machine was busy (1-minute load average {load:.2f} on {result['cores']} cores before the "
            "first row): other work changes the time of each kind differently, so ratios are not those of a quiet "
            "machine; re-run with nothing else running")
