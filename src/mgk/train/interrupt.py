"""SIGINT (Ctrl-C) and SIGTERM (what schedulers such as Slurm send before killing a job) during training.

Inside the training loop a signal is only recorded: the loop finishes its step (validation and checkpoint
included, so that a resumed run stays bitwise exact), writes ``last.pt`` and raises :class:`Interrupted`; under
torchrun the ranks agree on the step through an all-reduce of the recorded signal. Outside the loop (data set-up,
final evaluation) a signal interrupts at once, as KeyboardInterrupt does. Repeated signals while the step finishes
are ignored: torchrun forwards a Ctrl-C that its workers already received.
"""
from __future__ import annotations

import abc
import signal
import threading

__all__ = ["Interrupted", "SignalHandlers", "SignalStop", "StopSignals", "signal_name"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
    """"SIGINT", "SIGTERM", ..."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Interrupted(Exception):
    """Training stopped on a signal. ``str(e)`` is the one line for the user (step, checkpoint, the --resume
    command); ``exit_code`` is 128 + the signal number (130 for SIGINT, 143 for SIGTERM), the shell convention;
    ``is_main`` says whether this process is the one that reports it (rank 0)."""

    def __init__(self, message: str, signum: int, step: int, *, is_main: bool = True):
        super().__init__(message)
        self.signum, self.step, self.is_main = signum, step, is_main
        self.exit_code = 128 + signum


class SignalStop(BaseException):
    """Raised by the handler outside the training loop (a BaseException, like KeyboardInterrupt, so that ordinary
    ``except Exception`` blocks do not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum = signum


class SignalHandlers(abc.ABC):
    """Context manager that installs ``self._handle(signum, frame)`` for SIGINT and SIGTERM on entry and restores
    the previous handlers on exit. Installs nothing outside the main thread (Python allows handlers only there).
    Subclasses define ``_handle``."""

    _previous: dict

    def __enter__(self):
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    @abc.abstractmethod
    def _handle(self, signum, frame) -> None:
        """What a signal does while the handlers are installed (the subclass's policy)."""


class StopSignals(SignalHandlers):
    """Routes SIGINT and SIGTERM to :attr:`signum` while :attr:`graceful` is True, and raises :class:`SignalStop`
    otherwise (a :class:`SignalHandlers` context manager)."""

    def __init__(self):
        self.signum = 0
        self.graceful = False
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.graceful:
            self.signum = self.signum or signum
            return
        raise SignalStop(signum)
