"""Image benchmark: image sizes and container cold start (docker run -> first optimizer step).

    python bench/bench_image.py [--quick]       # or: python bench/run_all.py --only image

Makes the engine ready with the container tier's helpers (tests/container/engine.py: dockerd, base,
wheelhouse, offline `cpu` build), then measures:
- the `cpu` image's size (`docker image inspect`), target <= 1.8 GB;
- the `cuda` image's EXPECTED size, which cannot be built here (no GPU wheels on this mirror):
  base image (documented estimate) + apt layer (estimate) + every wheel of docker/constraints-cuda.txt
  as installed. Installed size = the sum of the uncompressed sizes in the wheel's zip directory,
  for each wheel that can be downloaded here (torch's own, measured); the packages shared with the
  cpu image are measured inside it (its site-packages without torch; bitsandbytes and wandb
  included); bitsandbytes' CUDA 13.0 kernels, the only CUDA build of them the cuda stage keeps, from
  its wheel; wheels this mirror lacks (nvidia-*-cu13, flash-attn) get estimates from their
  published sizes, marked "est.". Target <= 7 GB;
- cold start: `docker run` to the first logged optimizer step on the tiny config (target <= 20 s),
  and to the first resumed step after a `docker stop -t 5`.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "container"))

from engine import CACHE, CPU_IMAGE, docker, ensure_engine, image_size_bytes  # noqa: E402

GB = 1e9
# Estimates for what cannot be measured on this machine (uncompressed, installed), with the source.
ESTIMATES_GB = {
    "base image nvidia/cuda:13.0.1-base-ubuntu24.04": (0.25, "ubuntu:24.04 ~78 MB + cuda-cudart/cuda-compat"),
    "apt: python3 python3-venv git tini": (0.12, "Ubuntu 24.04 package sizes"),
    "nvidia-* CUDA 13 libraries (cuda-toolkit 13.0.3 extras, cudnn, cusparselt, nccl, nvshmem)": (
        3.3,
        "PyPI wheel sizes of the cu13 components x ~1.1 unpacked",
    ),
    "triton 3.7.1": (0.45, "triton wheel ~170 MB, unpacked"),
    "flash-attn 2.8.3 prebuilt wheel": (0.4, "GitHub release wheel ~250 MB, unpacked"),
}


def wheel_installed_bytes(wheel: Path) -> int:
    with zipfile.ZipFile(wheel) as zf:
        return sum(info.file_size for info in zf.infolist())


def torch_cuda_installed_bytes() -> int:
    """Download PyPI's torch==2.13.0 cp312 wheel (~530 MB, cached) and sum its unpacked sizes."""
    out = CACHE / "measure"
    out.mkdir(parents=True, exist_ok=True)
    wheels = list(out.glob("torch-2.13.0-cp312-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out),
             "--platform", "manylinux_2_28_x86_64", "--python-version", "3.12", "--implementation", "cp",
             "torch==2.13.0"],
            check=True, capture_output=True,
        )  # fmt: skip
        wheels = list(out.glob("torch-2.13.0-cp312-*.whl"))
    return wheel_installed_bytes(wheels[0])


def bnb_cuda_kernels_bytes() -> int:
    """bitsandbytes' CUDA 13.0 kernels, the one CUDA library the cuda stage keeps of its wheel (the
    wheel is the same for both images; its Python code and CPU kernels are in the cpu image)."""
    wheel = next((CACHE / "wheelhouse" / "cpu").glob("bitsandbytes-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        return sum(i.file_size for i in zf.infolist() if i.filename.endswith("libbitsandbytes_cuda130.so"))


def cpu_site_packages_bytes() -> tuple[int, int]:
    """(all site-packages, torch alone) inside the cpu image, in bytes."""
    script = (
        "cd /opt/trainpod/venv/lib/python3*/site-packages && du -sb . | cut -f1 && du -sb torch | cut -f1"
    )
    res = docker("run", "--rm", "--network", "none", "--entrypoint", "sh", CPU_IMAGE, "-c", script)
    total, torch = (int(x) for x in res.stdout.split())
    return total, torch


def cuda_expected_size() -> tuple[float, list[str]]:
    rows = []
    torch_bytes = torch_cuda_installed_bytes()
    total, torch_cpu = cpu_site_packages_bytes()
    shared = total - torch_cpu
    rows.append(f"torch 2.13.0+cu130 (measured, wheel unpacked): {torch_bytes / GB:.2f} GB")
    rows.append(f"packages shared with the cpu image (measured in it): {shared / GB:.2f} GB")
    bnb_cuda = bnb_cuda_kernels_bytes()
    rows.append(f"bitsandbytes CUDA 13.0 kernels (measured, in its wheel): {bnb_cuda / GB:.3f} GB")
    size = (torch_bytes + shared + bnb_cuda) / GB
    for name, (gb, source) in ESTIMATES_GB.items():
        rows.append(f"{name} (est., {source}): {gb:.2f} GB")
        size += gb
    return size, rows


def first_step_seconds(volume: Path, pod: str, after_step: int = 0) -> tuple[float, str]:
    """`docker run` of the tiny pretrain until a log line `step N/` with N > after_step appears."""
    env = ["-e", "TRAINPOD_WORKLOAD=pretrain", "-e", "TRAINPOD_CONFIG=configs/pretrain/tiny.yaml",
           "-e", "TRAINPOD_SET=train.log_every=1 train.max_steps=200", "-e", f"RUNPOD_POD_ID={pod}"]  # fmt: skip
    start = time.monotonic()
    cid = docker(
        "run", "-d", "--network", "none", "--hostname", pod, "-v", f"{volume}:/workspace", *env, CPU_IMAGE
    )
    cid = cid.stdout.strip()
    while time.monotonic() - start < 120:
        logs = docker("logs", cid).stderr + docker("logs", cid).stdout
        steps = [
            int(line.split(" step ")[1].split("/")[0])
            for line in logs.splitlines()
            if " step " in line and "/" in line
        ]
        if any(s > after_step for s in steps):
            return time.monotonic() - start, cid
        time.sleep(0.1)
    raise RuntimeError(f"no optimizer step logged within 120 s:\n{logs[-2000:]}")


def cold_start() -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="bench-image-") as tmp:
        volume = Path(tmp)
        docker("run", "--rm", "--network", "none", "-v", f"{volume}:/workspace", "-e", "TRAINPOD_WORKLOAD=datagen",
               "-e", "TRAINPOD_CONFIG=configs/datagen/tiny.yaml", CPU_IMAGE, timeout=300)  # fmt: skip
        first, cid = first_step_seconds(volume, "bench-pod")
        time.sleep(2)  # past a checkpoint (every 10 steps)
        docker("stop", "-t", "5", cid, timeout=60)
        latest = (volume / "runs/tiny-pretrain/checkpoints/LATEST").read_text().strip()
        resumed, cid2 = first_step_seconds(volume, "bench-pod", after_step=int(latest.split("-")[-1]))
        docker("rm", "-f", cid, cid2, check=False)
        subprocess.run(["rm", "-rf", str(volume / "runs"), str(volume / "datasets")], check=False)
    return first, resumed


def run(workdir: Path, quick: bool = False) -> str:
    engine = ensure_engine()
    try:
        cpu = image_size_bytes(CPU_IMAGE) / GB
        cuda, rows = cuda_expected_size()
        first, resumed = cold_start()
    finally:
        engine.stop()

    def row(metric: str, value: str, target: str, ok: bool) -> str:
        return f"| {metric} | {value} | {target} | {'pass' if ok else 'FAIL'} |"

    lines = [
        "## Image (docker/Dockerfile)",
        "",
        "| metric | measured | target | result |",
        "| --- | --- | --- | --- |",
        row("`cpu` image size (docker image inspect)", f"{cpu:.2f} GB", "<= 1.8 GB", cpu <= 1.8),
        row("`cuda` image expected size (method below)", f"{cuda:.2f} GB", "<= 7 GB", cuda <= 7.0),
        row(
            "cold start: docker run -> first optimizer step (tiny)", f"{first:.1f} s", "<= 20 s", first <= 20
        ),
        row("restart after docker stop -> first resumed step", f"{resumed:.1f} s", "<= 20 s", resumed <= 20),
        "",
        "`cuda` expected size, by part:",
        "",
        *[f"- {r}" for r in rows],
        "",
    ]
    (workdir).mkdir(parents=True, exist_ok=True)
    return "\n".join(lines)


if __name__ == "__main__":
    print(run(REPO / "bench-out", quick="--quick" in sys.argv))
