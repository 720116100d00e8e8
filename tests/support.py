"""Shared helpers for tests that run trainpod as a user would: as a subprocess on a temp volume."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
TINY_PRETRAIN = CONFIGS / "pretrain/tiny.yaml"
TINY_DATAGEN = CONFIGS / "datagen/tiny.yaml"
RUN = "tiny-pretrain"


def trainpod_cmd(*args: str, volume: Path) -> list[str]:
    return [sys.executable, "-m", "trainpod", *args, "--volume", str(volume)]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRAINPOD_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env | (extra or {})


def run_trainpod(*args: str, volume: Path, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run(
        trainpod_cmd(*args, volume=volume),
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_trainpod(*args: str, volume: Path, env: dict[str, str] | None = None, cmd: list[str] | None = None):
    return subprocess.Popen(
        cmd or trainpod_cmd(*args, volume=volume),
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def status_step(volume: Path, run: str = RUN) -> int:
    try:
        return json.loads((volume / "runs" / run / "status.json").read_text())["step"]
    except (FileNotFoundError, ValueError, KeyError):
        return -1


def signal_when_step_reached(
    proc: subprocess.Popen, volume: Path, step: int, signum: int, timeout: float = 120, run: str = RUN
) -> str:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and status_step(volume, run) < step:
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"step {step} was never reached; output:\n{proc.communicate()[0]}")
        time.sleep(0.02)
    if proc.poll() is None:
        proc.send_signal(signum)
    out, _ = proc.communicate(timeout=60)
    return out


def tree_snapshot(root: Path) -> dict[str, tuple[int, float, str]]:
    """Every file under `root` with size, mtime and sha256: equal snapshots mean nothing changed."""
    snap = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            stat = path.stat()
            snap[str(path.relative_to(root))] = (
                stat.st_size,
                stat.st_mtime_ns,
                hashlib.sha256(path.read_bytes()).hexdigest(),
            )
        elif path.is_dir():
            snap[str(path.relative_to(root)) + "/"] = (0, 0, "")
    return snap


def exported_weights(volume: Path, run: str = RUN) -> bytes:
    return (volume / "runs" / run / "export" / "hf" / "model.safetensors").read_bytes()
