"""torch.compile inside the cpu image: a tiny pretrain with `train.compile=true` is started, stopped
by `docker stop -t 5` (a spot interruption) after a checkpoint, started again and finished. Inductor
compiles C++ kernels with the image's g++ against its Python headers: without them the first step
fails. The same container shows that no SSH server runs when PUBLIC_KEY is unset.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DONE, EXPORT, PRETRAIN_ENV, Pods, unique, wait_for

from engine import docker

pytestmark = pytest.mark.container

# An eval every 4 steps: its graph is compiled before the first step (a SIGTERM during a compile between
# two commits could not be answered in the 5 s before SIGKILL), and a stop during an eval ends the eval.
COMPILE_ENV = {
    **PRETRAIN_ENV,
    "TRAINPOD_SET": "train.compile=true train.max_steps=24 checkpoint.every_steps=4 train.eval_every=4 "
    "train.eval_batches=2 train.cpu_threads=1 train.log_every=1",
}


def latest_step(volume: Path) -> int:
    try:
        return int((volume / "runs/tiny-pretrain/checkpoints/LATEST").read_text().strip().split("-")[-1])
    except (FileNotFoundError, ValueError):
        return -1


def process_names(cid: str) -> list[str]:
    res = docker("exec", cid, "sh", "-c", "cat /proc/[0-9]*/comm", check=False)
    return res.stdout.split()


def test_compiled_pretrain_is_stopped_resumed_and_finished_in_the_cpu_image(pods: Pods, fresh_volume: Path):
    pod = unique("compile")
    first = pods.start(fresh_volume, COMPILE_ENV, pod=pod)
    # Compiling takes minutes on 2 busy cores (Inductor builds C++ kernels with g++): a long wait.
    wait_for(lambda: latest_step(fresh_volume) >= 4 or not first.running(), 1200, 0.2, "the first checkpoint")
    assert first.running(), f"the compiled run ended early:\n{first.logs()[-3000:]}"
    assert "sshd" not in process_names(first.cid), "no SSH server without PUBLIC_KEY"
    first.stop(5)
    assert first.wait(60) == 143, f"docker stop gave {first.exit_code()}:\n{first.logs()[-3000:]}"
    assert not (fresh_volume / DONE).exists(), "stopped too late: the run had already finished"

    second = pods.run(fresh_volume, COMPILE_ENV, pod=pod, timeout=1500)
    logs = second.logs()
    assert second.exit_code() == 0, f"the resumed compiled run exited {second.exit_code()}:\n{logs[-3000:]}"
    assert "resum" in logs.lower(), f"the second start did not resume from the checkpoint:\n{logs[-3000:]}"
    assert "compiled the eval graph before the first step" in logs, logs[-3000:]
    assert (fresh_volume / DONE).is_file() and (fresh_volume / EXPORT).stat().st_size > 0
