"""examples/nanogpt: a custom loop on trainpod.Checkpointer, run as a `command` pod and interrupted
by SIGTERM and SIGKILL at several moments (also inside a commit), ends with the same weights, byte
for byte, as an uninterrupted run on CPU."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support import REPO, child_env, run_trainpod, start_trainpod

pytestmark = pytest.mark.slow
RUN = "nanogpt"
SCRIPT = REPO / "examples/nanogpt/train.py"
ARGS = ["--max-steps", "24", "--commit-every", "5", "--sleep-per-step", "0.05"]


def command_config(tmp_path: Path, prefix: list[str] | None = None) -> Path:
    path = tmp_path / "command.yaml"
    command = [*(prefix or ["python"]), str(SCRIPT), *ARGS]
    path.write_text(yaml.safe_dump({"name": RUN, "command": command, "workdir": str(REPO)}))
    return path


def new_volume(tmp_path: Path) -> Path:
    volume = tmp_path / "volume"
    volume.mkdir()
    return volume


def weights(volume: Path) -> bytes:
    return (volume / "runs" / RUN / "export/model.safetensors").read_bytes()


def latest_step(volume: Path) -> int:
    return int((volume / "runs" / RUN / "checkpoints/LATEST").read_text().strip().split("-")[1])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """Run alone, outside the command workload: the Checkpointer takes the run's lease itself."""
    run_dir = tmp_path_factory.mktemp("reference") / "runs" / RUN
    env = child_env({"TRAINPOD_RUN_DIR": str(run_dir)})
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *ARGS], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (run_dir / "LEASE").exists(), "the lease is released at the end"
    return (run_dir / "export/model.safetensors").read_bytes()


def signal_at_step(proc: subprocess.Popen, volume: Path, step: int, signum: int) -> str:
    log = volume / "runs" / RUN / "logs/program.log"
    deadline = time.monotonic() + 120
    while proc.poll() is None and not (log.exists() and re.search(rf"^step {step} ", log.read_text(), re.M)):
        assert time.monotonic() < deadline, f"step {step} was never reached"
        time.sleep(0.02)
    proc.send_signal(signum)
    return proc.communicate(timeout=120)[0]


def finish(volume: Path, config: Path) -> str:
    result = run_trainpod("run", "command", "--config", str(config), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("stop_at", [12])
def test_sigterm_commits_inside_the_window_and_the_resumed_run_is_byte_identical(
    tmp_path, uninterrupted, stop_at
):
    config, volume = command_config(tmp_path), new_volume(tmp_path)
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    out = signal_at_step(proc, volume, stop_at, signal.SIGTERM)
    assert proc.returncode == 143, out
    assert latest_step(volume) >= stop_at, "the step in flight is committed inside the 5 s window"
    assert f"resumed from step {latest_step(volume)}" in finish(volume, config)
    assert weights(volume) == uninterrupted


def test_sigkill_between_commits_resumes_from_the_last_commit_byte_identically(tmp_path, uninterrupted):
    config, volume = command_config(tmp_path), new_volume(tmp_path)
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    signal_at_step(proc, volume, 13, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert 10 <= latest_step(volume) < 24
    finish(volume, config)
    assert weights(volume) == uninterrupted


@pytest.mark.parametrize("phase", ["writing", "before-latest"])
def test_sigkill_inside_a_commit_never_resumes_the_half_written_checkpoint(tmp_path, uninterrupted, phase):
    crash = (
        "import runpy, sys; sys.path.insert(0, sys.argv[1]); import crash_driver; "
        f"crash_driver.install('{phase}', 15); sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    crashing = command_config(tmp_path, ["python", "-c", crash, str(REPO / "tests")])
    volume = new_volume(tmp_path)
    result = run_trainpod("run", "command", "--config", str(crashing), volume=volume)
    assert result.returncode == 75, "a program killed by a signal the kit did not send is a failed start"
    assert latest_step(volume) == 10, "the commit of step 15 never reached LATEST"
    finish(volume, command_config(tmp_path))
    assert weights(volume) == uninterrupted
    assert not list((volume / "runs" / RUN / "checkpoints").glob("*.tmp-*"))
