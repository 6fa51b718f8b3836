"""SIGINT and SIGTERM during an experiment: turned into one exception, at a safe moment.

:func:`sparsecomm.lab.experiment.runner.run_experiment` installs the handlers; a signal raises
:class:`Interrupt` in the main thread, except inside a :meth:`InterruptSignals.deferred`
section (killing and recording a run), where it is held until the section ends. A second
signal while the first is handled is ignored: cleanup is bounded (the kill's deadline), and
SIGKILL of the command still cleans up (the ranks die with it).
"""
import signal
import threading
from contextlib import contextmanager


class Interrupt(BaseException):
    """Raised (once) by the SIGINT/SIGTERM handler of run_experiment; not an Exception, so
    no ``except Exception`` on the way swallows it."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def signal_name(stop: BaseException) -> str:
    return stop.signal_name if isinstance(stop, Interrupt) else "SIGINT"


class InterruptSignals:
    """SIGINT and SIGTERM raise Interrupt once, and never inside a deferred() section
    (killing and recording a run); a signal that arrives there is raised by check()."""

    def __init__(self):
        self.received: str | None = None
        self.raised = False
        self._depth = 0
        self._previous: dict = {}

    def install(self, which=(signal.SIGINT, signal.SIGTERM)) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread receives signals (and may set handlers)
        for sig in which:
            self._previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.interrupt(signal.Signals(signum).name)

    def interrupt(self, name: str) -> None:
        """As if signal ``name`` arrived (another handler that wants the run stopped)."""
        if self.received is None:
            self.received = name
        self.check()

    def check(self) -> None:
        if self.received is not None and not self.raised and self._depth == 0:
            self.raised = True
            raise Interrupt(self.received)

    @contextmanager
    def deferred(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
