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
