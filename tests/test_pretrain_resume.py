"""Exact resume: interrupted runs, resumed, export weights byte-identical to an uninterrupted run.

These start real `trainpod` processes on a temp volume and interrupt them the way a spot pod is:
SIGTERM (a 5 s warning) or SIGKILL (none), at several steps and at every phase of a commit.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tiny_dataset_volume: Path) -> bytes:
    import shutil

    volume = tmp_path_factory.mktemp("uninterrupted")
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, volume / folder)
    result = run_trainpod(*PRETRAIN, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    return exported_weights(volume)


def finish(volume: Path) -> None:
    result = run_trainpod(*PRETRAIN, volume=volume)
    assert result.returncode == 0, f"the resumed run failed:\n{result.stdout}\n{result.stderr}"
    assert "resumed from step-" in result.stdout


def latest(volume: Path) -> str:
    return (volume / "runs" / RUN / "checkpoints" / "LATEST").read_text().strip()


@pytest.mark.parametrize("stop_at", [7, 33])
def test_sigterm_commits_the_current_step_and_resume_is_exact(volume, uninterrupted, stop_at):
    proc = start_trainpod(*PRETRAIN, volume=volume)
    out = signal_when_step_reached(proc, volume, stop_at, signal.SIGTERM)
    assert proc.returncode == 143, out
    stopped_at = int(latest(volume).split("-")[1])
    assert stopped_at >= stop_at, "SIGTERM must commit the step it finished, not fall back to an older one"
    assert json.loads((volume / "runs" / RUN / "status.json").read_text())["state"] == "preempted"
    finish(volume)
    assert exported_weights(volume) == uninterrupted


def test_sigterm_without_time_to_commit_exits_143_and_keeps_the_older_checkpoint(volume, uninterrupted):
    no_time = ("--set", "checkpoint.preemption_window_seconds=0.0001")
    proc = start_trainpod(*PRETRAIN, *no_time, volume=volume)
    out = signal_when_step_reached(proc, volume, 14, signal.SIGTERM)
    assert proc.returncode == 143, out
    assert "exiting without one" in out
    assert latest(volume) == "step-10"
    finish(volume)
    assert exported_weights(volume) == uninterrupted


@pytest.mark.parametrize("kill_at", [17, 44])
def test_sigkill_between_checkpoints_loses_only_uncommitted_steps(volume, uninterrupted, kill_at):
    proc = start_trainpod(*PRETRAIN, volume=volume)
    signal_when_step_reached(proc, volume, kill_at, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert int(latest(volume).split("-")[1]) >= (kill_at // 10) * 10
    finish(volume)
    assert exported_weights(volume) == uninterrupted


@pytest.mark.parametrize("phase", ["writing", "before-rename", "before-latest", "during-retention"])
def test_sigkill_during_a_checkpoint_commit_resumes_exactly(volume, uninterrupted, phase):
    driver = [
        sys.executable,
        str(REPO / "tests/crash_driver.py"),
        phase,
        "30",
        "--",
        *trainpod_cmd(*PRETRAIN, volume=volume)[3:],
    ]
    proc = start_trainpod(volume=volume, cmd=driver)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, out
    expected = "step-30" if phase == "during-retention" else "step-20"
    assert latest(volume) == expected
    finish(volume)
    assert exported_weights(volume) == uninterrupted
    leftovers = list((volume / "runs" / RUN / "checkpoints").glob("*.tmp-*"))
    assert not leftovers, f"the resumed run must clean up what the kill left: {leftovers}"


def test_two_processes_under_torchrun_resume_exactly_after_sigterm(volume, tiny_dataset_volume, tmp_path):
    import shutil
    import subprocess

    from support import child_env

    # Uninterrupted reference under torchrun itself (gloo on CPU).
    reference = tmp_path / "reference"
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, reference / folder)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "trainpod",
        *PRETRAIN,
        "--volume",
        str(reference),
    ]
    result = subprocess.run(torchrun, env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 rank(s)" in result.stdout

    # Interrupted with the built-in launcher, which forwards SIGTERM to both ranks and keeps exit 143.
    two = ("--nproc-per-node", "2")
    proc = start_trainpod(*PRETRAIN, *two, volume=volume)
    out = signal_when_step_reached(proc, volume, 25, signal.SIGTERM)
    assert proc.returncode == 143, out
    result = run_trainpod(*PRETRAIN, *two, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert exported_weights(volume) == exported_weights(reference)


def rank_process(launcher: int, rank: int) -> int:
    """The pid of one rank among the built-in launcher's children (Linux: their environment in /proc)."""
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no rank {rank} under the launcher {launcher}")


def test_a_sigterm_to_one_rank_alone_commits_only_if_the_commit_fits_that_ranks_window(volume):
    # One node of a cluster preempted, or one rank stopped by hand: rank 0, never signalled, decided by its
    # own clock that the commit had all the time, while the signalled rank's SIGKILL would cut it short.
    no_time = ("--set", "checkpoint.preemption_window_seconds=0.0001")
    proc = start_trainpod(*PRETRAIN, *no_time, "--nproc-per-node", "2", volume=volume)
    deadline = time.monotonic() + 120
    while status_step(volume) < 14 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert status_step(volume) >= 14, proc.communicate()[0]
    os.kill(rank_process(proc.pid, 1), signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, out
    assert "exiting without one" in out, f"rank 0 committed after rank 1's window had run out:\n{out}"
    assert latest(volume) == "step-10"


def test_bit_flipped_newest_checkpoint_falls_back_to_the_previous_one_and_stays_exact(volume, uninterrupted):
    proc = start_trainpod(*PRETRAIN, volume=volume)
    signal_when_step_reached(proc, volume, 35, signal.SIGKILL)
    newest = volume / "runs" / RUN / "checkpoints" / latest(volume)
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10
    weights.write_bytes(bytes(data))
    result = run_trainpod(*PRETRAIN, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"checkpoint {newest.name} is invalid" in result.stdout
    assert exported_weights(volume) == uninterrupted


def test_a_start_after_the_last_commit_that_trains_no_step_reports_the_runs_final_loss(volume):
    """Killed after the final step's commit, before the export and DONE: the next start loads that checkpoint,
    trains no step and finishes. Its DONE and status.json had no loss, the run's summary lost what it trained to;
    they carry the loss logged at the committed step now, as the uninterrupted run's do."""
    import shutil

    result = run_trainpod(*PRETRAIN, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    run = volume / "runs" / RUN
    finished = json.loads((run / "DONE").read_text())
    assert finished["loss"] is not None
    (run / "DONE").unlink()  # as if killed between the last commit and the end of the export
    shutil.rmtree(run / "export")
    finish(volume)
    again = json.loads((run / "DONE").read_text())
    assert again["step"] == finished["step"] and again["loss"] == finished["loss"], (again, finished)
    assert json.loads((run / "status.json").read_text())["loss"] == finished["loss"]


def test_a_grad_accum_steps_edited_before_a_resume_is_kept_as_the_run_began_and_said_so(
    volume, uninterrupted
):
    """train.grad_accum_steps edited between a stop and its resume, on the same rank count: the run keeps the
    checkpoint's (its global batch), and the warning said the rank count had changed, with the trainer's
    'continuing with the new one' beside it."""
    proc = start_trainpod(*PRETRAIN, volume=volume)
    out = signal_when_step_reached(proc, volume, 7, signal.SIGTERM)
    assert proc.returncode == 143, out
    result = run_trainpod(*PRETRAIN, "--set", "train.grad_accum_steps=3", volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "train.grad_accum_steps=3 is not what this run trains with" in output
    assert "start a new run name" in output and "rank(s); on" not in output
    assert exported_weights(volume) == uninterrupted, "the run trained on with the batch it began with"
