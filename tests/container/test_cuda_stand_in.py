"""The cuda target's build path and boot contract, proven here by a STAND-IN build.

What the stand-in replaces, and only that (no GPU, no CUDA wheels and no registry are reachable
here; engine.CUDA_STAND_IN_ARGS): the base nvidia/cuda:12.8.1-base-ubuntu24.04 is the local Debian
base; the cu128 wheelhouse and lock (torch 2.13.0+cu128 and its nvidia-* wheels) are the cpu ones
(CPU torch), so torch.version.cuda is asserted as "none" instead of "12.8". Everything else is the
real cu128 build: the `cuda` stage of docker/Dockerfile, its system packages, venv, one pip step,
the check for bitsandbytes' CUDA 12.8 kernels, the torch.compile smoke test, the kit's wheel, the
entrypoints and TRAINPOD_IMAGE_CUDA=12.8. The real cuda images are built by GitHub Actions
(.github/workflows/images.yml) and run on GPUs only there.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import DONE, EXPORT, PRETRAIN_ENV, Pods

from engine import Engine, EngineError, build_cuda_stand_in, docker

pytestmark = pytest.mark.container


@pytest.fixture(scope="module")
def stand_in(engine: Engine) -> str:
    try:
        return build_cuda_stand_in()
    except EngineError as exc:
        pytest.fail(f"the stand-in cuda build failed:\n{exc}", pytrace=False)


def test_the_stand_in_cuda_image_knows_its_cuda_and_has_the_compile_toolchain(stand_in: str) -> None:
    env = docker("image", "inspect", "-f", "{{range .Config.Env}}{{println .}}{{end}}", stand_in).stdout
    assert "TRAINPOD_IMAGE_CUDA=12.8" in env.split(), env
    script = "for tool in gcc g++ tini /usr/sbin/sshd; do command -v $tool || echo missing-$tool; done; ls /etc/ssh"
    listing = docker("run", "--rm", "--network", "none", "--entrypoint", "sh", stand_in, "-c", script).stdout
    assert "missing-" not in listing, f"the compile toolchain, tini or sshd is missing:\n{listing}"
    assert "ssh_host_" not in listing, f"host keys baked into the image (they are made per start):\n{listing}"


def test_a_gpu_pod_on_a_host_without_a_usable_gpu_exits_4_with_one_line(
    stand_in: str, tmp_path: Path
) -> None:
    pods = Pods(stand_in)
    try:
        box = pods.run(tmp_path, {**PRETRAIN_ENV, "RUNPOD_GPU_COUNT": "1"}, pod="gpu-pod-without-gpu")
        code, logs = box.exit_code(), box.logs()
    finally:
        pods.cleanup()
    assert code == 4, f"expected exit 4 (machine unfit), got {code}:\n{logs[-3000:]}"
    (line,) = [line for line in logs.splitlines() if "ERROR" in line]
    assert "no NVIDIA driver" in line and "CUDA 12.8" in line and "replace the pod" in line, line


def test_the_stand_in_cuda_image_runs_a_pretrain_from_env_alone(
    stand_in: str, dataset_volume: Path, tmp_path: Path
) -> None:
    volume = tmp_path / "volume"
    shutil.copytree(dataset_volume, volume, symlinks=True)
    pods = Pods(stand_in)
    try:
        box = pods.run(volume, {**PRETRAIN_ENV, "TRAINPOD_SET": "train.max_steps=20"}, pod="cuda-stand-in")
        code, logs = box.exit_code(), box.logs()
    finally:
        pods.cleanup()
    assert code == 0, f"pretrain in the stand-in cuda image exited {code}:\n{logs[-3000:]}"
    assert (volume / DONE).is_file() and (volume / EXPORT).stat().st_size > 0
