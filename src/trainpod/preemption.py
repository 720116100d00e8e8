"""SIGTERM/SIGINT handling: the signal only sets a flag; the workload decides what to commit.

A RunPod spot pod gets SIGTERM and, 5 s later, SIGKILL. Doing work inside a signal handler is
unsafe (it can interrupt a half-written file), so the handler records the time and returns; the
training loop polls `requested` at step boundaries and asks `seconds_left` whether a commit fits.
"""

from __future__ import annotations

import signal
import time


class PreemptionWatch:
    def __init__(self, window_seconds: float = 5.0):
        self.window_seconds = window_seconds
        self.signal_time: float | None = None
        self.signal_name: str | None = None

    def install(self) -> PreemptionWatch:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.signal_time is None:  # the first signal starts the clock; repeats change nothing
            self.signal_time = time.monotonic()
            self.signal_name = signal.Signals(signum).name

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
