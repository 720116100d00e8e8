"""The learning-rate schedule is a pure function of the step."""

from __future__ import annotations

import pytest

from trainpod.train.schedule import cosine_with_warmup


def test_warmup_rises_linearly_to_the_peak_then_cosine_decays_to_the_floor():
    lrs = [cosine_with_warmup(step, 100, 1.0, 10, 0.1) for step in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert cosine_with_warmup(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)


def test_no_warmup_starts_at_the_peak():
    assert cosine_with_warmup(0, 10, 3e-4, 0, 0.0) == pytest.approx(3e-4)


@pytest.mark.parametrize("max_steps, warmup_steps", [(10, 0), (10, 2), (10, 9), (1000, 30)])
def test_the_last_step_trains_at_the_final_learning_rate(max_steps, warmup_steps):
    # The trainers ask for steps 0 .. max_steps - 1 (step - 1 of their 1-based steps); min_lr_ratio is
    # documented as the final learning rate, so the last step trains at it, not above it.
    last = cosine_with_warmup(max_steps - 1, max_steps, 1.0, warmup_steps, 0.1)
    assert last == pytest.approx(0.1, abs=1e-12)


@pytest.mark.parametrize("max_steps, warmup_steps", [(10, 0), (10, 3), (50, 5)])
def test_the_peak_is_reached_once_and_every_step_after_it_decays(max_steps, warmup_steps):
    lrs = [cosine_with_warmup(step, max_steps, 1.0, warmup_steps, 0.0) for step in range(max_steps)]
    peak = max(warmup_steps - 1, 0)
    assert lrs[peak] == pytest.approx(1.0) and lrs.count(1.0) == 1
    assert all(a > b for a, b in zip(lrs[peak:], lrs[peak + 1 :], strict=False))
    assert lrs[-1] == 0.0


def test_a_single_step_run_trains_at_the_peak():
    assert cosine_with_warmup(0, 1, 3e-4, 0, 0.1) == pytest.approx(3e-4)
    assert cosine_with_warmup(0, 1, 3e-4, 1, 0.1) == pytest.approx(3e-4)
