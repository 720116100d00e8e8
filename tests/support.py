"""Shared helpers for tests that run trainpod as a user would: as a subprocess on a temp volume."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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


def sigterm_once_marked(
    driver: str, args: tuple[str, ...], volume: Path, marker: Path, env: dict[str, str], what: str
) -> tuple[int, str]:
    """Run `trainpod ARGS` under `driver` (python -c: it touches $STOP_MARKER once `what` is under way),
    SIGTERM it then, and return its exit code and output. Fails the test when `what` never starts or goes
    on after the SIGTERM (a spot pod's SIGKILL would come after 5 s; no time is asserted)."""
    cmd = [sys.executable, "-c", driver, *trainpod_cmd(*args, volume=volume)[3:]]
    proc = subprocess.Popen(
        cmd,
        env=child_env({"STOP_MARKER": str(marker), **env}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.exists(), f"the {what} never started:\n{proc.communicate()[0]}"
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the {what} went on after SIGTERM:\n{proc.communicate()[0]}")
    return proc.returncode, out


def debian_binary(package: str, binary: str) -> Path:
    """`binary` (e.g. git-lfs) as installed, else from Debian's `package` unpacked under .cache/debs: a tool
    the image has that a fresh test machine may lack, taken with `apt-get download` + `dpkg-deb -x`, which
    installs and starts nothing. Fails, naming the fix, where neither can be had (not a Debian machine)."""
    import shutil

    installed = shutil.which(binary)
    if installed:
        return Path(installed)
    downloads = REPO / ".cache" / "debs"
    unpacked = downloads / package
    found = unpacked / "usr/bin" / binary
    if found.exists():
        return found
    downloads.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    download = ["apt-get", "download", "-qq", package]
    try:
        if subprocess.run(download, cwd=downloads, capture_output=True, env=env).returncode != 0:
            # A fresh machine may have no package lists yet.
            subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True, env=env)
            subprocess.run(download, cwd=downloads, check=True, capture_output=True, env=env)
        deb = max(downloads.glob(f"{package}_*.deb"))
        partial = unpacked.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(partial)], check=True, capture_output=True)
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        pytest.fail(
            f"{binary} is not installed and Debian's {package} could not be unpacked ({exc}); install {binary}"
        )
    shutil.rmtree(unpacked, ignore_errors=True)
    partial.rename(unpacked)
    return found


@contextlib.contextmanager
def small_filesystem(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `folder` for the block; unmounted after, whatever happened."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; run as root to test a full volume")
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"the kernel refused a tmpfs mount here ({mounted.stderr.strip()}); cannot fill a volume")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def refused_with_exit_2(call, caplog) -> None:
    """`call()` ends the program with exit 2 and its line, as the kit's checkpoint API ends a program it refuses
    (trainpod.checkpointer.end_the_program): the test's process sees the SystemExit."""
    import logging

    import pytest

    with caplog.at_level(logging.ERROR, logger="trainpod.checkpointer"), pytest.raises(SystemExit) as exited:
        call()
    assert exited.value.code == 2, caplog.text
    assert caplog.records[-1].getMessage() == "exiting 2", caplog.text
