"""The SIGTERM clock: the first signal starts the 5 s window; repeats do not extend it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from trainpod.preemption import PreemptionWatch


@pytest.fixture
def watch():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield PreemptionWatch(window_seconds=5.0).install()
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_second_sigterm_does_not_extend_the_time_left(watch):
    os.kill(os.getpid(), signal.SIGTERM)
    assert watch.requested and watch.signal_name == "SIGTERM"
    first_time = watch.signal_time
    left_before = watch.seconds_left()
    time.sleep(0.01)  # the second signal comes later; a handler restarting the clock would add time
    os.kill(os.getpid(), signal.SIGTERM)
    assert watch.signal_time == first_time, "the window runs from the first signal"
    assert watch.seconds_left() < left_before


def test_sigint_after_sigterm_keeps_the_first_signal_and_its_clock(watch):
    os.kill(os.getpid(), signal.SIGTERM)
    first_time = watch.signal_time
    os.kill(os.getpid(), signal.SIGINT)
    assert watch.signal_name == "SIGTERM"
    assert watch.signal_time == first_time


def test_no_signal_leaves_unlimited_time(watch):
    assert not watch.requested
    assert watch.seconds_left() == float("inf")
