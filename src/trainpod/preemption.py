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
import threading
import time
from collections.abc import Callable, Iterator

from trainpod.errors import ExitCode

log = logging.getLogger(__name__)

# Run once at the first SIGTERM or SIGINT that any handler of trainpod sees in this process: boot forgets
# its START marker there (runpod/finish.py), since a stop by signal is a preemption, not a start that
# died without a word, even when the platform's SIGKILL comes before the workload could exit.
_at_first_signal: list[Callable[[], None]] = []
# How many stop signals trainpod's handlers have seen in this process: a caller compares two readings (one taken
# before a wait, one after) to learn whether a stop came meanwhile, when its hook was not registered yet.
_signals_seen = 0


def call_at_first_signal(hook: Callable[[], None]) -> None:
    _at_first_signal.append(hook)


def signals_seen() -> int:
    return _signals_seen


def first_signal_seen() -> None:
    """Called by every SIGTERM/SIGINT handler trainpod installs (here and in launch.py)."""
    global _signals_seen
    _signals_seen += 1
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
    """Raised by the stop signal's handler inside `PreemptionWatch.abandoning()`, and by `Lease.publishing()` once
    the lease is released. A BaseException, as KeyboardInterrupt is: a library's `except Exception` must not
    swallow it and write on."""


class PreemptionWatch:
    def __init__(self, window_seconds: float = 5.0):
        self.window_seconds = window_seconds
        self.signal_time: float | None = None
        self.signal_name: str | None = None
        self._killed_elsewhere_at: float | None = None  # another rank's expected SIGKILL (expect_kill_within)
        self._abandoning = False
        # Called from a thread when the main thread is still inside `abandoning()` LAST_RESORT_SHARE of the
        # window after a stop signal; it must end the process (the conversion's releases the lease, exits 143).
        self.last_resort: Callable[[], None] | None = None
        # Called from a thread at once when a stop signal comes inside `releasing()`, while the work runs on
        # (the lifecycle's, on rank 0 under several ranks: releases the run's lease). One of the two is set:
        # each thread takes the signal's wakeup fd for its own.
        self.release_at_stop: Callable[[], None] | None = None

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
        overrun = None
        if self.last_resort is not None and _in_main_thread():
            overrun = _AtStopSignal(self, self.window_seconds * LAST_RESORT_SHARE, self._overran)
        try:
            self._abandoning = True
            if self.requested:  # came while the overrun thread started, before the handler would raise
                raise WorkAbandoned(self.signal_name)
            yield
        finally:
            self._abandoning = False
            if overrun is not None:
                overrun.close()

    def _overran(self) -> None:
        log.warning(
            "the work in hand did not stop within %.1f s of the stop signal; ending it",
            self.window_seconds * LAST_RESORT_SHARE,
        )
        self.last_resort()

    @contextlib.contextmanager
    def releasing(self) -> Iterator[None]:
        """Inside, a stop signal runs `release_at_stop` at once from a thread while the work runs on.

        For work a stop cannot end where it stands, since every rank must finish it together (the final
        export under several ranks: the gather of the weights, then the ranks' agreement), but whose lease
        must not be held into the SIGKILL: a replacement pod on another host would wait its TTL out. The
        thread runs while the main thread is inside one long C call (a collective) too. A stop that came
        before runs it at entry.
        """
        action = self.release_at_stop
        if action is None or not _in_main_thread():
            yield
            return
        thread = _AtStopSignal(self, 0.0, action)
        try:
            if self.requested:  # came before, or while the thread started (it may run `action` too)
                action()
            yield
        finally:
            thread.close()

    @contextlib.contextmanager
    def ended_when_stuck(self, action: Callable[[], None]) -> Iterator[None]:
        """Inside, `action` runs from a thread LAST_RESORT_SHARE of the window after a stop signal, unless the
        work leaves first; it must end the process (release what it holds, exit 143).

        For work that answers a stop itself wherever it comes back to Python (it polls `requested`), but
        may be inside one long C call when the stop comes: the tokenizers library's BPE merges, tens of
        seconds on a large corpus after the last document is read, during which the signal's handler
        never runs. Look at `requested` once inside: a stop that came before is not the thread's.
        """
        if not _in_main_thread():
            yield
            return
        thread = _AtStopSignal(self, self.window_seconds * LAST_RESORT_SHARE, action)
        try:
            yield
        finally:
            thread.close()

    def request(self, name: str = "request") -> None:
        """Ask for a stop as if a signal had arrived (used by the budget check and by tests)."""
        if self.signal_time is None:
            self.signal_time = time.monotonic()
            self.signal_name = name

    @property
    def requested(self) -> bool:
        return self.signal_time is not None

    def seconds_left(self) -> float:
        """Seconds until the platform's SIGKILL is expected (infinite when no signal came), here or, when sooner,
        on another rank (`expect_kill_within`)."""
        now = time.monotonic()
        left = float("inf") if self.signal_time is None else self.window_seconds - (now - self.signal_time)
        if self._killed_elsewhere_at is not None:
            left = min(left, self._killed_elsewhere_at - now)
        return left

    def expect_kill_within(self, seconds: float) -> None:
        """Another rank's SIGKILL is expected in `seconds`: `seconds_left` counts to it when it is the sooner.

        Ranks are signalled each at its own moment (one node of a cluster preempted, one rank stopped by
        hand), and rank 0 decides for every rank whether a commit fits, which the others take part in.
        """
        if seconds < self.seconds_left():
            self._killed_elsewhere_at = time.monotonic() + seconds


LAST_RESORT_SHARE = 0.6  # of the window: what is left releases a lease and exits, well before the SIGKILL


def _in_main_thread() -> bool:
    # Signals reach Python's main thread alone: elsewhere the handler never runs, nor set_wakeup_fd.
    return threading.current_thread() is threading.main_thread()


class _AtStopSignal:
    """Runs `action` in a thread `patience` seconds after a stop signal, unless `close()` comes first.

    The signal's Python handler runs between two bytecodes of the main thread, so one long C call delays
    it: transformers' save_pretrained writes a whole shard (up to 50 GB by default) in one safetensors call,
    a collective waits for every rank. Such calls release the GIL, and the C-level handler writes the
    signal's number to the wakeup fd at once, so this thread learns of the stop while the main thread cannot.
    """

    def __init__(self, watch: PreemptionWatch, patience: float, action: Callable[[], None]):
        self._patience = patience
        self._action = action
        self._left = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._wait, name="at-stop-signal", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        stops = {signal.SIGTERM, signal.SIGINT}
        while not self._left.is_set():
            if stops & set(os.read(self._read, 64)):
                if not self._left.wait(self._patience):
                    self._action()
                return

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)
        self._left.set()
        os.write(self._write, b"\0")  # wakes the thread's read
        self._thread.join()
        os.close(self._read)
        os.close(self._write)


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
