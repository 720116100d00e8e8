"""Container tier: builds the `cpu` image once per session and runs it in a real Docker engine.

    .venv/bin/python -m pytest -m container tests/container -q

The session fixture makes the engine ready (engine.py: apt packages, dockerd, debootstrap base,
wheelhouse, offline build) and FAILS with the step's message when any of it fails: a skipped
container test would read as a pass. dockerd is stopped at the end only if this session started it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine import Engine, EngineError, docker, ensure_engine

EXPORT = Path("runs/tiny-pretrain/export/hf/model.safetensors")
DONE = Path("runs/tiny-pretrain/DONE")
PRETRAIN_ENV = {"TRAINPOD_WORKLOAD": "pretrain", "TRAINPOD_CONFIG": "configs/pretrain/tiny.yaml"}
# The interruption scenarios' run: the tiny config with a wider model (a 14 MB checkpoint that takes
# ~40 ms to commit) and a commit every 2 steps, so that a stop lands in every phase of the loop.
# One torch thread: with two on a 2-core machine that is busy with anything else, steps take seconds.
INTERRUPT_ENV = {
    **PRETRAIN_ENV,
    "TRAINPOD_SET": "model.hidden_size=192 model.intermediate_size=512 train.max_steps=40 "
    "checkpoint.every_steps=2 train.cpu_threads=1",
}
DATAGEN_ENV = {"TRAINPOD_WORKLOAD": "datagen", "TRAINPOD_CONFIG": "configs/datagen/tiny.yaml"}
_TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    try:
        eng = ensure_engine()
    except EngineError as exc:
        pytest.fail(f"container tier: the Docker engine could not be made ready.\n{exc}", pytrace=False)
    _TIMINGS.update(eng.timings)
    yield eng
    eng.stop()


@dataclass
class Container:
    """One `docker run -d` of the image: a pod start. Same hostname + RUNPOD_POD_ID = same pod."""

    cid: str

    def wait(self, timeout: float = 180) -> int:
        res = docker("wait", self.cid, timeout=timeout)
        return int(res.stdout.strip())

    def exit_code(self) -> int:
        return int(docker("inspect", "-f", "{{.State.ExitCode}}", self.cid).stdout.strip())

    def running(self) -> bool:
        return docker("inspect", "-f", "{{.State.Running}}", self.cid).stdout.strip() == "true"

    def logs(self) -> str:
        res = docker("logs", self.cid)
        return res.stdout + res.stderr

    def stop(self, seconds: int = 5) -> None:
        docker("stop", "-t", str(seconds), self.cid, timeout=60)

    def kill(self) -> None:
        docker("kill", "-s", "KILL", self.cid)


class Pods:
    """Starts containers the way RunPod starts a pod, and removes them all at the end of a test."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.started: list[str] = []

    def start(
        self,
        volume: Path,
        env: dict[str, str],
        pod: str = "pod-a",
        volume_mode: str = "rw",
        cmd: list[str] | None = None,
    ) -> Container:
        args = ["run", "-d", "--network", "none", "--hostname", pod, "-e", f"RUNPOD_POD_ID={pod}"]
        args += ["-v", f"{volume}:/workspace:{volume_mode}"]
        for key, value in env.items():
            args += ["-e", f"{key}={value}"]
        cid = docker(*args, self.image, *(cmd or [])).stdout.strip()
        self.started.append(cid)
        return Container(cid)

    def run(self, volume: Path, env: dict[str, str], timeout: float = 180, **kw) -> Container:
        """Start and wait for the exit (the exit code is then in `.exit_code()`)."""
        box = self.start(volume, env, **kw)
        box.wait(timeout)
        return box

    def cleanup(self) -> None:
        for cid in self.started:
            docker("rm", "-f", cid, check=False)


@pytest.fixture
def pods(engine: Engine) -> Iterator[Pods]:
    fleet = Pods(engine.image)
    yield fleet
    fleet.cleanup()


@pytest.fixture(scope="session")
def dataset_volume(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A volume with the tiny dataset, made once by a datagen container; tests copy it."""
    vol = tmp_path_factory.mktemp("dataset-volume")
    fleet = Pods(engine.image)
    try:
        box = fleet.run(vol, DATAGEN_ENV, pod="datagen-seed")
        code, logs = box.exit_code(), box.logs()
    finally:
        fleet.cleanup()
    assert code == 0, f"datagen in the container exited {code}; its log:\n{logs[-3000:]}"
    return vol


@pytest.fixture(scope="session")
def baseline(
    engine: Engine, dataset_volume: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, bytes]:
    """An uninterrupted container run of INTERRUPT_ENV: its volume and its exported weights."""
    vol = tmp_path_factory.mktemp("baseline") / "volume"
    shutil.copytree(dataset_volume, vol, symlinks=True)
    fleet = Pods(engine.image)
    try:
        box = fleet.run(vol, INTERRUPT_ENV, pod="pod-baseline")
        code, logs = box.exit_code(), box.logs()
    finally:
        fleet.cleanup()
    assert code == 0, f"the uninterrupted baseline run exited {code}:\n{logs[-3000:]}"
    return vol, (vol / EXPORT).read_bytes()


@pytest.fixture
def fresh_volume(dataset_volume: Path, tmp_path: Path) -> Path:
    """A copy of the dataset volume (datasets/, tokenizers/) with no run in it."""
    vol = tmp_path / "volume"
    shutil.copytree(dataset_volume, vol, symlinks=True)
    return vol


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root with its type, size, mtime and (files) sha256: 'nothing changed'."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            rel = str(path.relative_to(root))
            if path.is_file() and not path.is_symlink():
                out[rel] = ("f", st.st_size, st.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                out[rel] = ("d" if path.is_dir() else "l", st.st_mtime_ns)
    return out


def wait_for(predicate, timeout: float, interval: float = 0.01, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and "container" in report.keywords:
        _TIMINGS[report.nodeid.split("::")[-1]] = round(report.duration, 1)


def pytest_terminal_summary(terminalreporter) -> None:
    if _TIMINGS:
        terminalreporter.section("container tier phases (seconds)")
        for name, seconds in _TIMINGS.items():
            terminalreporter.write_line(f"{seconds:8.1f}  {name}")


__all__ = [
    "DATAGEN_ENV",
    "DONE",
    "EXPORT",
    "INTERRUPT_ENV",
    "PRETRAIN_ENV",
    "Container",
    "Pods",
    "snapshot",
    "unique",
    "wait_for",
]
