"""Ctrl-C (SIGINT) and SIGTERM during a grid: no new run starts, the running ones stop, the harness reports.

The first signal is recorded and passed on to every running ``mgk train`` / ``mgk eval`` child, which finishes its
step, writes its checkpoint and exits (128 + signal); no run starts after it. A child still alive gets the signal
again every ``resend`` seconds (one can lose it while it starts); one still alive ``grace`` seconds later, or any
child at a second signal, is killed (its run resumes from its last checkpoint). Whether the signal
reached the whole process group (a terminal's Ctrl-C) or the harness alone, the children get it: the training loop
ignores a repeated signal while its step finishes, as it does for torchrun's forwarded Ctrl-C.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from ..train.interrupt import SignalHandlers, signal_name

__all__ = ["GridStop"]


class GridStop(SignalHandlers):
    """Context manager holding the live children of a grid and the signal that stops it (``signum``, 0 while none).

    Children are started with :meth:`popen`, which starts nothing once a signal has come (returns None), and
    waited for with :meth:`wait`; :meth:`enforce_grace` (called by the waiting loop) kills those
    that outlive the grace period. Handlers are installed only in the main thread (Python's rule) and restored on
    exit."""

    def __init__(self, grace: float = 20.0, resend: float = 2.0):
        self.grace, self.resend = grace, resend
        self.signum = 0
        self._deadline: float | None = None
        self._sent = 0.0
        self._children: dict[int, subprocess.Popen] = {}
        self._lock = threading.RLock()  # re-entrant: a second signal may arrive while the first one's handler runs
        self._previous: dict = {}

    @property
    def name(self) -> str:
        """"SIGINT", "SIGTERM", or "" before any signal."""
        return signal_name(self.signum) if self.signum else ""

    def _say(self, text: str) -> None:
        os.write(2, f"mgk reproduce: {text}\n".encode())  # os.write: safe inside a signal handler, unlike print

    def _handle(self, signum, frame) -> None:
        with self._lock:
            if self.signum:
                self._say(f"{signal_name(signum)} again: killing {len(self._children)} running run(s) now")
                self._kill()
                return
            self.signum = signum
            self._sent = time.monotonic()
            self._deadline = self._sent + self.grace
            self._say(f"{signal_name(signum)}: no new run starts; stopping {len(self._children)} running run(s) "
                      f"(each saves its checkpoint; killed after {self.grace:g} s, or at once on a second signal)")
            for p in list(self._children.values()):
                self._send(p, signum)

    @staticmethod
    def _send(p: subprocess.Popen, signum: int) -> None:
        # os.kill, not Popen.send_signal: that one polls, and so could reap the child under :meth:`wait`. A held
        # child is never reaped (its pid cannot be reused) before :meth:`wait` releases it under the lock.
        try:
            os.kill(p.pid, signum)
        except ProcessLookupError:
            pass

    def _kill(self) -> None:
        for p in list(self._children.values()):
            self._send(p, signal.SIGKILL)

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen | None:
        """``subprocess.Popen(cmd, **kwargs)``, held until :meth:`wait`; None (nothing started) once stopped."""
        with self._lock:
            if self.signum:
                return None
            p = subprocess.Popen(cmd, **kwargs)
            self._children[p.pid] = p
            return p

    def wait(self, p: subprocess.Popen) -> tuple[int, object]:
        """Wait for ``p`` to exit, forget it and reap it: (exit code, its ``resource.struct_rusage`` from wait4)."""
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped yet: no signal can reach a new pid
        with self._lock:
            self._children.pop(p.pid, None)
            _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        return p.returncode, usage

    def enforce_grace(self) -> None:
        """Send the signal again, every ``resend`` seconds, to the children still alive after the first one, and
        kill them once the grace period is over. A child can lose a signal: a library's import code that catches
        every exception swallows the KeyboardInterrupt of a Ctrl-C that comes while it starts (seen with torch's),
        and the run then trains on; a training loop finishing its step ignores the repeats."""
        with self._lock:
            if self._deadline is not None and time.monotonic() > self._sent + self.resend:
                self._sent = time.monotonic()
                for p in list(self._children.values()):
                    self._send(p, self.signum)
            if self._deadline is not None and time.monotonic() > self._deadline and self._children:
                self._say(f"killing {len(self._children)} run(s) still running {self.grace:g} s after "
                          f"{self.name}")
                self._kill()
                self._deadline = None
