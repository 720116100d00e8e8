"""The spot supervisor end to end with real containers: a fake RunPod API (the mock of RunPod)
whose pods are containers of the `cpu` image. create/start = `docker run` with the pod's env and the
volume bind mount (a start is a fresh container: RunPod wipes the container disk), interrupt =
`docker stop -t 5` (SIGTERM, SIGKILL 5 s later). Deploy, two interruptions, the supervisor brings
the run back each time, DONE, the pod stops itself; the weights equal an uninterrupted run's.

Containers use host networking (not `--network none` like the other scenarios): the in-pod finish
must reach the fake API on 127.0.0.1 to stop its own pod, as a real pod reaches rest.runpod.io.
Writes bench-out/supervise_e2e.json: seconds from each interruption to the first resumed step and
the steps lost per interruption.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from conftest import EXPORT, INTERRUPT_ENV, unique, wait_for

from engine import DOCKER, REPO, docker, docker_env

pytestmark = pytest.mark.container
RUN = Path("runs/tiny-pretrain")


def status_step(volume: Path) -> int:
    try:
        return int(json.loads((volume / RUN / "status.json").read_text())["step"])
    except (FileNotFoundError, ValueError, KeyError):
        return -1


def latest_step(volume: Path) -> int:
    try:
        return int((volume / RUN / "checkpoints/LATEST").read_text().strip().split("-")[-1])
    except (FileNotFoundError, ValueError):
        return -1


class ContainerPods:
    """The fake's backend: each pod start is a `docker run` of the image with the pod's env."""

    def __init__(self, image: str, volume: Path, fake) -> None:
        self.image, self.volume, self.fake = image, volume, fake
        self.current: dict[str, str] = {}  # pod id -> container id
        self.all: list[str] = []

    def run(self, pod: dict) -> None:
        env = {**pod["env"], "RUNPOD_POD_ID": pod["id"], "RUNPOD_API_KEY": self.fake.key}
        env["TRAINPOD_RUNPOD_API_URL"] = self.fake.url
        args = [
            "run",
            "-d",
            "--network",
            "host",
            "--hostname",
            pod["id"],
            "-v",
            f"{self.volume}:/workspace:rw",
        ]
        for key, value in env.items():
            args += ["-e", f"{key}={value}"]
        cid = docker(*args, self.image).stdout.strip()
        self.current[pod["id"]] = cid
        self.all.append(cid)

    def stop_async(self, pod: dict) -> None:
        # RunPod stops asynchronously; the pod asking to be stopped is waiting for this very answer.
        cid = self.current.get(pod["id"])
        if cid:
            subprocess.Popen([DOCKER, "stop", "-t", "5", cid], env=docker_env(), stdout=subprocess.DEVNULL)

    def terminate(self, pod: dict) -> None:
        cid = self.current.pop(pod["id"], None)
        if cid:
            docker("rm", "-f", cid, check=False)

    def logs(self) -> str:
        return "\n".join(docker("logs", cid, check=False).stdout[-1500:] for cid in self.all[-2:])

    def cleanup(self) -> None:
        for cid in self.all:
            docker("rm", "-f", cid, check=False)


def test_supervisor_brings_interrupted_spot_pods_back_to_identical_weights(
    engine, fresh_volume: Path, baseline: tuple[Path, bytes]
) -> None:
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from trainpod.config.deploy import DeployConfig
    from trainpod.runpod.deploy import deploy
    from trainpod.runpod.supervise import Supervisor
    from trainpod.volume import Volume

    from fake_runpod import Backend, FakeRunPodServer, client_for

    config = DeployConfig.model_validate(
        {
            "run": "tiny-pretrain",
            "workload": "pretrain",
            "config": INTERRUPT_ENV["TRAINPOD_CONFIG"],
            "image": {"name": engine.image, "flavour": "cpu"},
            "volume": {"name": "vol", "data_center": "EU-RO-1"},
            "env": {"set": INTERRUPT_ENV["TRAINPOD_SET"]},
            "secrets": [],
            "supervise": {"poll_s": 0.5},
        }
    )
    with FakeRunPodServer() as fake:
        pods = ContainerPods(engine.image, fresh_volume, fake)
        fake.backend = Backend(
            create=pods.run, start=pods.run, stop=pods.stop_async, terminate=pods.terminate
        )
        try:
            client = client_for(fake)
            pod_id = deploy(client, config).pod.id
            state = fresh_volume.parent / f"{unique('supervise')}.json"
            supervisor = Supervisor(client, config, Volume(fresh_volume), state)
            figures = []
            for at_step in (10, 24):
                wait_for(
                    lambda s=at_step: latest_step(fresh_volume) >= s, 240, what=f"checkpoint step-{at_step}"
                )
                reached = status_step(fresh_volume)
                interrupted = time.monotonic()
                docker("stop", "-t", "5", pods.current[pod_id], timeout=60)  # the spot interruption
                fake.pods[pod_id]["desiredStatus"] = "EXITED"
                stopped_at = max(status_step(fresh_volume), reached)
                committed = latest_step(fresh_volume)
                assert (
                    supervisor.step() is None
                    and fake.pods_named(config.pod_name)[0]["desiredStatus"] == "RUNNING"
                )
                wait_for(
                    lambda c=committed: status_step(fresh_volume) > c, 240, what="the first resumed step"
                )
                figures.append(
                    {
                        "interrupted_at_step": stopped_at,
                        "resumed_from_checkpoint": committed,
                        "steps_lost": stopped_at - committed,
                        "seconds_to_first_resumed_step": round(time.monotonic() - interrupted, 1),
                    }
                )
            deadline = time.monotonic() + 300
            verdict = None
            while verdict is None and time.monotonic() < deadline:
                time.sleep(1)
                verdict = supervisor.step()
            assert verdict == 0, f"the supervisor did not see DONE (verdict {verdict}):\n{pods.logs()}"
            wait_for(
                lambda: fake.pods_named(config.pod_name)[0]["desiredStatus"] == "EXITED", 30, what="pod stop"
            )
            assert len(fake.pods) == 1, "the run was brought back by starting its pod, not by new ones"
            weights = (fresh_volume / EXPORT).read_bytes()
            assert weights == baseline[1], f"weights differ from the uninterrupted run:\n{pods.logs()}"
        finally:
            pods.cleanup()
    out = REPO / "bench-out"
    out.mkdir(exist_ok=True)
    (out / "supervise_e2e.json").write_text(json.dumps({"interruptions": figures}, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    for figure in figures:
        assert figure["steps_lost"] <= 2, f"more steps lost than one checkpoint interval (2): {figure}"
