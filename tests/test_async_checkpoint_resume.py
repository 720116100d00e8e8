"""Background (async) commits under kills: real `trainpod run pretrain` processes with
checkpoint.mode=async, killed or stopped at exact points of a background commit by
tests/crash_driver.py, then resumed: the exported weights are byte-identical to an uninterrupted run.

Also here: a SIGTERM during a (sync) commit stops right after it, and a resume with dropout on is
exact (the RNG restore matters only when something draws from it).
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import pytest

from support import (
    REPO,
    RUN,
    TINY_PRETRAIN,
    exported_weights,
    run_trainpod,
    signal_when_step_reached,
    start_trainpod,
    status_step,
    trainpod_cmd,
)

pytestmark = pytest.mark.slow
PRETRAIN = ("run", "pretrain", "--config", str(TINY_PRETRAIN), "--set", "train.log_every=1")
SHORT = ("--set", "train.max_steps=40")  # checkpoints every 10 steps (tiny.yaml)
ASYNC = ("--set", "checkpoint.mode=async")
SYNC = ("--set", "checkpoint.mode=sync")
DROPOUT = ("--set", "model.dropout=0.2")


def reference(tmp_path_factory: pytest.TempPathFactory, dataset: Path, *args: str) -> bytes:
    volume = tmp_path_factory.mktemp("uninterrupted")
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(dataset / folder, volume / folder)
    result = run_trainpod(*PRETRAIN, *SHORT, *args, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    return exported_weights(volume)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tiny_dataset_volume: Path) -> bytes:
    """The default mode's weights (sync on CPU): async commits must not change what is trained."""
    return reference(tmp_path_factory, tiny_dataset_volume)


def checkpoints(volume: Path) -> Path:
    return volume / "runs" / RUN / "checkpoints"


def latest(volume: Path) -> str:
    return (checkpoints(volume) / "LATEST").read_text().strip()


def run_driver(volume: Path, phase: str, step: int, *args: str) -> tuple[int, str]:
    driver = [sys.executable, str(REPO / "tests/crash_driver.py"), phase, str(step), "--"]
    proc = start_trainpod(
        volume=volume, cmd=[*driver, *trainpod_cmd(*PRETRAIN, *SHORT, *args, volume=volume)[3:]]
    )
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def resume_and_compare(volume: Path, expected: bytes, *args: str) -> None:
    result = run_trainpod(*PRETRAIN, *SHORT, *args, volume=volume)
    assert result.returncode == 0, f"the resumed run failed:\n{result.stdout}\n{result.stderr}"
    assert "resumed from step-" in result.stdout
    assert exported_weights(volume) == expected, (
        "the resumed run must end with the uninterrupted run's weights"
    )
    leftovers = list(checkpoints(volume).glob("*.tmp-*"))
    assert not leftovers, f"the resumed run must clean up what the interruption left: {leftovers}"


def test_sigkill_during_a_background_commit_resumes_exactly(volume, uninterrupted):
    code, out = run_driver(volume, "background-writing", 20, *ASYNC)
    assert code == -signal.SIGKILL, out
    assert latest(volume) == "step-10", "a half-written background commit must never become LATEST"
    assert "committed checkpoint step-10 in" in out and "in the background" in out
    resume_and_compare(volume, uninterrupted, *ASYNC)


def test_sigkill_while_the_loop_waits_for_a_background_commit_resumes_exactly(volume, uninterrupted):
    code, out = run_driver(volume, "waiting", 20, *ASYNC)
    assert code == -signal.SIGKILL, out
    assert latest(volume) == "step-10"
    assert status_step(volume) >= 29, (
        "training goes on while step 20 is written, until step 30's commit waits"
    )
    resume_and_compare(volume, uninterrupted, *ASYNC)


def test_sigterm_with_a_commit_in_flight_finishes_it_then_commits_the_current_step(volume, uninterrupted):
    code, out = run_driver(volume, "sigterm-in-flight", 20, *ASYNC)
    assert code == 143, out
    assert "committed checkpoint step-20 in" in out, "the commit in flight fits the 5 s window: finished"
    stopped_at = status_step(volume)
    assert latest(volume) == f"step-{stopped_at}", "then the step training stopped at is committed too"
    resume_and_compare(volume, uninterrupted, *ASYNC)


def test_sigterm_with_a_commit_in_flight_that_cannot_finish_in_time_abandons_it(volume, uninterrupted):
    no_time = ("--set", "checkpoint.preemption_window_seconds=0.0001")
    code, out = run_driver(volume, "sigterm-in-flight", 20, *ASYNC, *no_time)
    assert code == 143, out
    assert "abandoned the commit of step 20" in out
    assert latest(volume) == "step-10", "an abandoned commit never becomes LATEST"
    assert not (checkpoints(volume) / "step-20").exists()
    resume_and_compare(volume, uninterrupted, *ASYNC)


def test_sigterm_during_a_commit_exits_143_right_after_it_without_training_another_step(
    volume, uninterrupted
):
    code, out = run_driver(volume, "sigterm-writing", 20, *SYNC)
    assert code == 143, out
    assert latest(volume) == "step-20"
    metrics = (volume / "runs" / RUN / "logs/metrics.jsonl").read_text().splitlines()
    trained = max(json.loads(line)["step"] for line in metrics)
    assert trained == 20, f"SIGTERM came during step 20's commit, yet step {trained} was trained"
    resume_and_compare(volume, uninterrupted, *SYNC)


def test_pretrain_resume_with_dropout_is_exact(volume, tmp_path_factory, tiny_dataset_volume):
    expected = reference(tmp_path_factory, tiny_dataset_volume, *DROPOUT)
    proc = start_trainpod(*PRETRAIN, *SHORT, *DROPOUT, volume=volume)
    out = signal_when_step_reached(proc, volume, 15, signal.SIGTERM)
    assert proc.returncode == 143, out
    resume_and_compare(volume, expected, *DROPOUT)
