"""SIGTERM/SIGINT handling: the signal only sets a flag; the workload decides what to commit.

A RunPod spot pod gets SIGTERM and, 5 s later, SIGKILL. Doing work inside a signal handler is
unsafe (it can interrupt a half-written file), so the handler records the time and returns; the
training loop polls `requested` at step boundaries and asks `seconds_left` whether a commit fits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator

from trainpod.errors import ExitCode

log = logging.getLogger(__name__)

# Run once at the first SIGTERM or SIGINT that any handler of trainpod sees in this process: boot forgets
# its START marker there (runpod/finish.py), since a stop by signal is a preemption, not a start that
# died without a word, even when the platform's SIGKILL comes before the workload could exit.
_at_first_signal: list[Callable[[], None]] = []


def call_at_first_signal(hook: Callable[[], None]) -> None:
    _at_first_signal.append(hook)


def first_signal_seen() -> None:
    """Called by every SIGTERM/SIGINT handler trainpod installs (here and in launch.py)."""
    while _at_first_signal:
        hook = _at_first_signal.pop()
        try:
            hook()
        except OSError as exc:  # an unreachable volume must not turn a signal into a traceback
            log.warning("at the stop signal: %s", exc)


def end_by_default_at_sigterm_meanwhile() -> None:
    """Until a workload installs its own handler, SIGTERM keeps its default action (the process ends) but
    runs the first-signal hooks before."""

    def end(signum: int, _frame: object) -> None:
        first_signal_seen()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    signal.signal(signal.SIGTERM, end)


class WorkAbandoned(BaseException):
    """Raised by the stop signal's handler inside `PreemptionWatch.abandoning()`. A BaseException, as
    KeyboardInterrupt is: a library's `except Exception` must not swallow it and write on."""


class PreemptionWatch:
    def __init__(self, window_seconds: float = 5.0):
        self.window_seconds = window_seconds
        self.signal_time: float | None = None
        self.signal_name: str | None = None
        self._abandoning = False

    def install(self) -> PreemptionWatch:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.signal_time is None:  # the first signal starts the clock; repeats change nothing
            self.signal_time = time.monotonic()
            self.signal_name = signal.Signals(signum).name
            first_signal_seen()
            if self._abandoning:
                self._abandoning = False  # once: the unwinding itself is not interrupted again
                raise WorkAbandoned(self.signal_name)

    @contextlib.contextmanager
    def abandoning(self) -> Iterator[None]:
        """Inside, a stop signal ends the work at once: its handler raises WorkAbandoned in the main thread.

        For work that is long and writes nothing but a temp folder the next start removes (a conversion
        of a large model, minutes long, which would otherwise run on into the SIGKILL with the run's lease
        held: a replacement pod on another host then waits the lease's TTL out). Never around a publish
        (a rename into place), which must finish once begun. A stop that came before raises at once.
        """
        if self.requested:
            raise WorkAbandoned(self.signal_name)
        self._abandoning = True
        try:
            yield
        finally:
            self._abandoning = False

    def request(self, name: str = "request") -> None:
        """Ask for a stop as if a signal had arrived (used by the budget check and by tests)."""
        if self.signal_time is None:
            self.signal_time = time.monotonic()
            self.signal_name = name

    @property
    def requested(self) -> bool:
        return self.signal_time is not None

    def seconds_left(self) -> float:
        """Seconds until the platform's SIGKILL is expected (infinite when no signal came)."""
        if self.signal_time is None:
            return float("inf")
        return self.window_seconds - (time.monotonic() - self.signal_time)


def exit_now_when_preempted(code: int) -> None:
    """After SIGTERM everything is committed: exit at once, before SIGKILL comes 5 s after SIGTERM.
    For a process's own end only (boot, `python -m trainpod`), never a call inside a test.

    The interpreter's normal exit joins library threads and runs their atexit hooks; with
    `train.compile=true` Inductor's compile-worker pool alone took over 5 s to shut down in the
    container tier (exit 137 instead of 143), and a rank of a two-rank FSDP run now and then aborted in
    the process group's teardown ("terminate called without an active exception", exit 134). Logs are
    flushed first; nothing else is pending.
    """
    if code != ExitCode.PREEMPTED:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
