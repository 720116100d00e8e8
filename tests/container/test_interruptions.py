"""Spot interruptions of a real container: `docker stop -t 5` (SIGTERM, SIGKILL 5 s later, as on
RunPod) at three moments and `docker kill -s KILL`, each followed by a fresh `docker run` of the
same pod (same env, hostname and RUNPOD_POD_ID): the final weights equal an uninterrupted run's.

The "during a checkpoint write" moment is made exact rather than lucky: the test polls the volume
for `checkpoints/step-*.tmp-*`, freezes the container's processes (SIGSTOP, from the host) while that
folder exists, runs `docker stop -t 5`, waits until SIGTERM is pending in the frozen workload, then
lets it continue: SIGTERM lands in the middle of the write.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import EXPORT, INTERRUPT_ENV, Container, Pods, unique, wait_for

from engine import DOCKER, docker, docker_env

pytestmark = pytest.mark.container
RUN = Path("runs/tiny-pretrain")


def latest_step(volume: Path) -> int:
    try:
        return int((volume / RUN / "checkpoints/LATEST").read_text().strip().split("-")[-1])
    except (FileNotFoundError, ValueError):
        return -1


def descendants(pid: int) -> list[int]:
    """Host pids of every process below `pid` (the container's tini), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def sigterm_pending(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    masks = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & (1 << (signal.SIGTERM - 1)) for mask in masks)


def stop_during_checkpoint_write(box: Container, volume: Path) -> str:
    init_pid = int(docker("inspect", "-f", "{{.State.Pid}}", box.cid).stdout.strip())
    checkpoints = volume / RUN / "checkpoints"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        temps = [n for n in os.listdir(checkpoints) if ".tmp-" in n] if checkpoints.is_dir() else []
        if temps:
            frozen = descendants(init_pid)
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            if (checkpoints / temps[0]).exists():
                break
            for pid in frozen:  # that commit finished before the freeze: catch the next one
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.002)
    else:
        raise AssertionError("never saw a checkpoint being written (checkpoints/step-*.tmp-*) in 90 s")
    stopper = subprocess.Popen(
        [DOCKER, "stop", "-t", "5", box.cid], env=docker_env(), stdout=subprocess.DEVNULL
    )
    try:
        wait_for(lambda: any(sigterm_pending(p) for p in frozen), 10, what="SIGTERM pending in the workload")
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    stopper.wait(timeout=30)
    return temps[0]


def interrupt(moment: str, box: Container, volume: Path) -> None:
    if moment == "stop-during-startup":
        time.sleep(0.5)  # Python is importing torch: no handler yet, the default action exits 143
        box.stop(5)
    elif moment == "stop-between-commits":
        wait_for(lambda: latest_step(volume) >= 10, 90, what="checkpoint step-10")
        box.stop(5)
    elif moment == "stop-during-checkpoint-write":
        stop_during_checkpoint_write(box, volume)
    elif moment == "kill":
        wait_for(lambda: latest_step(volume) >= 20, 90, what="checkpoint step-20")
        box.kill()
    box.wait(30)


@pytest.mark.parametrize(
    ("moment", "code"),
    [
        ("stop-during-startup", 143),
        ("stop-between-commits", 143),
        ("stop-during-checkpoint-write", 143),
        ("kill", 137),
    ],
)
def test_interrupted_container_resumes_to_weights_identical_to_an_uninterrupted_run(
    moment: str, code: int, pods: Pods, fresh_volume: Path, baseline: tuple[Path, bytes]
) -> None:
    pod = unique("spot")
    first = pods.start(fresh_volume, INTERRUPT_ENV, pod=pod)
    interrupt(moment, first, fresh_volume)
    assert first.exit_code() == code, (
        f"after {moment} the container exited {first.exit_code()}, expected {code}; "
        f"a 137 after `docker stop` means SIGTERM was not handled within 5 s:\n{first.logs()[-3000:]}"
    )
    assert not (fresh_volume / EXPORT).exists(), f"{moment} came too late: the run had already finished"

    second = pods.run(fresh_volume, INTERRUPT_ENV, pod=pod)
    logs = second.logs()
    assert second.exit_code() == 0, f"the restarted pod exited {second.exit_code()}:\n{logs[-3000:]}"
    weights = (fresh_volume / EXPORT).read_bytes()
    assert weights == baseline[1], (
        f"after {moment} + restart the exported weights differ from the uninterrupted run's; "
        f"the resumed start logged:\n{logs[-3000:]}"
    )
