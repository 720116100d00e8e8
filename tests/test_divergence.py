"""A run whose loss goes NaN stops with exit 2 before committing it: the good checkpoints stay the newest.

Through gradient clipping a NaN gradient makes every weight NaN for good, so without the guard a diverged
run committed NaN states over its good ones (keep_last rotated them out) and ended DONE with a NaN model.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainpod import atomic

from support import RUN, TINY_PRETRAIN, run_trainpod

pytestmark = pytest.mark.slow
PRETRAIN = ("run", "pretrain", "--config", str(TINY_PRETRAIN))
DIVERGING = ("--set", "train.lr=1e6", "--set", "train.warmup_steps=0", "--set", "train.max_steps=40")


@pytest.mark.parametrize("log_every", [5, 100], ids=["seen-at-a-log-line", "seen-at-a-commit"])
def test_a_run_that_diverges_keeps_its_good_checkpoint_and_exits_2(volume: Path, log_every: int):
    good = run_trainpod(*PRETRAIN, "--set", "train.max_steps=10", volume=volume)
    assert good.returncode == 0, good.stdout + good.stderr
    run = volume / "runs" / RUN
    (run / "DONE").unlink()  # as if stopped right after the step-10 commit
    before = {p.name: p.read_bytes() for p in (run / "checkpoints/step-10").iterdir() if p.is_file()}

    diverged = run_trainpod(*PRETRAIN, *DIVERGING, "--set", f"train.log_every={log_every}", volume=volume)

    assert diverged.returncode == 2, diverged.stdout + diverged.stderr
    found = re.search(
        r"training diverged: the loss or gradient norm was NaN or inf at step (\d+);", diverged.stdout
    )
    assert found and 10 < int(found[1]) < 20, diverged.stdout
    assert "step-10 stays the newest checkpoint" in diverged.stdout and "Lower train.lr" in diverged.stdout
    assert (run / "checkpoints/LATEST").read_text().strip() == "step-10"
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-10"]
    assert {p.name: p.read_bytes() for p in (run / "checkpoints/step-10").iterdir() if p.is_file()} == before
    assert not (run / "DONE").exists()
    assert "training diverged" in atomic.read_json(run / "status.json")["reason"]
