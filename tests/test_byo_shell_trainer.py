"""examples/shell_trainer: a shell trainer on `trainpod checkpoint latest/commit`, run as a `command`
pod, stopped by SIGTERM, SIGKILL and kills inside a commit: it never resumes a partial or damaged
checkpoint and ends in the same state as an uninterrupted run (its state is a hash chain)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support import REPO, run_trainpod, start_trainpod

pytestmark = pytest.mark.slow
RUN = "shell-trainer"
ENV = {"MAX_STEPS": "20", "COMMIT_EVERY": "5", "SLEEP_PER_STEP": "0.1"}


def setup(tmp_path: Path, **env: str) -> tuple[Path, Path]:
    config = tmp_path / "command.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": RUN,
                "command": ["./examples/shell_trainer/train.sh"],
                "workdir": str(REPO),
                "env": ENV | env,
            }
        )
    )
    volume = tmp_path / "volume"
    volume.mkdir(exist_ok=True)
    return config, volume


def run_dir(volume: Path) -> Path:
    return volume / "runs" / RUN


def final_state(volume: Path) -> str:
    return (run_dir(volume) / "export/final.txt").read_text()


def latest_step(volume: Path) -> int:
    return int((run_dir(volume) / "checkpoints/LATEST").read_text().strip().split("-")[1])


def finish(volume: Path, config: Path) -> str:
    result = run_trainpod("run", "command", "--config", str(config), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def signal_at_step(proc: subprocess.Popen, volume: Path, step: int, signum: int) -> str:
    log = run_dir(volume) / "logs/program.log"
    deadline = time.monotonic() + 120
    while proc.poll() is None and not (log.exists() and re.search(rf"^step {step} ", log.read_text(), re.M)):
        assert time.monotonic() < deadline, f"step {step} was never reached"
        time.sleep(0.02)
    proc.send_signal(signum)
    return proc.communicate(timeout=120)[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    config, volume = setup(tmp_path_factory.mktemp("reference"))
    finish(volume, config)
    return final_state(volume)


def test_sigterm_commits_the_finished_step_and_the_resumed_run_ends_in_the_same_state(
    tmp_path, uninterrupted
):
    config, volume = setup(tmp_path)
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    out = signal_at_step(proc, volume, 7, signal.SIGTERM)
    assert proc.returncode == 143, out
    assert latest_step(volume) >= 7, "the shell trainer commits the step it finished inside the window"
    assert f"resumed from {run_dir(volume)}/checkpoints/step-{latest_step(volume)}" in finish(volume, config)
    assert final_state(volume) == uninterrupted


def test_after_sigkill_a_damaged_newest_checkpoint_is_set_aside_for_the_older_valid_one(
    tmp_path, uninterrupted
):
    config, volume = setup(tmp_path)
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    signal_at_step(proc, volume, 12, signal.SIGKILL)
    assert latest_step(volume) == 10
    state = run_dir(volume) / "checkpoints/step-10/state"
    state.write_text(
        state.read_text().replace(state.read_text()[0], "f" if state.read_text()[0] != "f" else "e", 1)
    )
    out = finish(volume, config)
    assert f"resumed from {run_dir(volume)}/checkpoints/step-5" in out
    assert final_state(volume) == uninterrupted
    assert list((run_dir(volume) / "checkpoints").glob("step-10.invalid-*")), "the damaged one is kept aside"


@pytest.mark.parametrize("phase", ["before-rename", "before-latest"])
def test_a_kill_inside_trainpod_checkpoint_commit_never_publishes_a_partial_checkpoint(
    tmp_path, uninterrupted, phase
):
    crashing_cli = f"{sys.executable} {REPO / 'tests/crash_driver.py'} {phase} 10 --"
    config, volume = setup(tmp_path, CHECKPOINT_CLI=crashing_cli)
    result = run_trainpod("run", "command", "--config", str(config), volume=volume)
    assert result.returncode == 75, result.stdout + result.stderr
    assert latest_step(volume) == 5
    config, _ = setup(tmp_path)
    finish(volume, config)
    assert final_state(volume) == uninterrupted
    assert not list((run_dir(volume) / "checkpoints").glob("*.tmp-*"))
