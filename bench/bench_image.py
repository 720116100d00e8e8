"""Image benchmark: image sizes and container cold start (docker run -> first optimizer step).

    python bench/bench_image.py [--quick]       # or: python bench/run_all.py --only image
    python bench/bench_image.py --cuda-only 1.79 0.60 0.49   # no docker: the cuda estimates alone, from
                                # the stand-in image, its CPU torch and the local base (GB) measured before

Makes the engine ready with the container tier's helpers (tests/container/engine.py: dockerd, base,
wheelhouse, offline `cpu` build, the stand-in cuda build), then measures:
- the `cpu` image's size (`docker image inspect`), target <= 1.8 GB;
- each cuda flavour's size, ESTIMATED (no CUDA wheel can be installed here): the stand-in cuda image
  (the cuda target built with CPU torch, tests/container/test_cuda_stand_in.py), minus the CPU torch
  it holds (measured in it), plus what each CUDA wheel installs (the sum of its files' sizes, read
  from the wheel's own zip directory with HTTP range requests on the index's URL from
  `pip install --dry-run --report`: a few hundred KB per wheel, nothing installed) less the files
  docker/prune_cuda_libs.py deletes in the build (its own glob list, matched against the same zip
  entries), plus the nvidia/cuda base's extra over the local Debian base (published size). Where the index cannot be
  read from here (PyTorch's cu128 index; a pin missing from the reachable PyPI), the row says which
  stand-in size it used. Target <= 7 GB per flavour;
- cold start with `train.compile=true`: `docker run` to the first logged optimizer step on the tiny
  config, and to the first resumed step after a `docker stop -t 5` (Inductor's cache then on the volume).
"""

from __future__ import annotations

import io
import json
import os
import re
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "container"))
sys.path.insert(0, str(REPO / "docker"))

from prune_cuda_libs import is_pruned  # noqa: E402 - the build step's own list, not a copy

from engine import (  # noqa: E402
    BASE_IMAGE,
    CPU_IMAGE,
    CUDA_STAND_IN_IMAGE,
    build_cuda_stand_in,
    docker,
    ensure_engine,
    image_size_bytes,
)

GB = 1e9
# Every glibc level up to Ubuntu 24.04's that the CUDA wheels use (nvidia-cuda-cupti 13.0.85 is 2_25 only).
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_25_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]  # fmt: skip
# nvidia/cuda:<ver>-base-ubuntu24.04 over the local Debian base: ubuntu:24.04 (~78 MB) + cuda-cudart and
# cuda-compat (~170 MB), Docker Hub's published sizes, uncompressed; the local base is measured.
CUDA_BASE_GB = 0.25
# The cu130 lock's CUDA pins (cuda-toolkit's extras resolve to its nvidia-* components).
CU130_PINS = [
    "torch==2.13.0",
    "cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3",
    "cuda-bindings==13.5.0",
    "nvidia-cudnn-cu13==9.20.0.48",
    "nvidia-cusparselt-cu13==0.8.1",
    "nvidia-nccl-cu13==2.29.7",
    "nvidia-nvshmem-cu13==3.4.5",
    "triton==3.7.1",
]
# torch 2.13.0+cu128's own pins cannot be read here (PyTorch's index is unreachable): these are
# torch 2.8.0+cu128's nvidia-*-cu12 pins, the same CUDA 12.8 libraries, from PyPI.
CU128_PINS = [
    "nvidia-cuda-nvrtc-cu12==12.8.93",
    "nvidia-cuda-runtime-cu12==12.8.90",
    "nvidia-cuda-cupti-cu12==12.8.90",
    "nvidia-cudnn-cu12==9.10.2.21",
    "nvidia-cublas-cu12==12.8.4.1",
    "nvidia-cufft-cu12==11.3.3.83",
    "nvidia-curand-cu12==10.3.9.90",
    "nvidia-cusolver-cu12==11.7.3.90",
    "nvidia-cusparse-cu12==12.5.8.93",
    "nvidia-cusparselt-cu12==0.7.1",
    "nvidia-nccl-cu12==2.27.3",
    "nvidia-nvtx-cu12==12.8.90",
    "nvidia-nvjitlink-cu12==12.8.93",
    "nvidia-cufile-cu12==1.13.1.3",
    "triton==3.7.1",
]


def resolve(pin: str) -> dict | None:
    """pip's report entry for one pin (cp312 linux, no dependencies) from the index's metadata; None
    when the index reachable here does not have it."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--no-deps", "--ignore-installed",
               "--only-binary=:all:", *[arg for p in PLATFORMS for arg in ("--platform", p)],
               "--python-version", "3.12", "--implementation", "cp", "--target", str(Path(tmp) / "t"),
               "--report", str(report), pin]  # fmt: skip
        if subprocess.run(cmd, capture_output=True, timeout=600).returncode != 0:
            return None
        (item,) = json.loads(report.read_text())["install"]
    return item


def components(item: dict) -> list[str]:
    """A meta-package's pins for the extras it was asked with (cuda-toolkit[cublas,...] -> nvidia-cublas==...)."""
    wanted = set(item.get("requested_extras") or [])
    pins = []
    for requirement in item["metadata"].get("requires_dist", []):
        spec, _, marker = requirement.partition(";")
        extra = re.search(r"extra == ['\"]([^'\"]+)['\"]", marker)
        if extra and extra.group(1) in wanted:
            pins.append(spec.strip().replace(" ", ""))
    return list(dict.fromkeys(pins))  # extras share components (cusolver needs cublas): each once


class RemoteFile(io.RawIOBase):
    """A file on the index read by HTTP range requests: enough for zipfile to read a wheel's directory
    (the end of the file) without downloading the rest."""

    def __init__(self, url: str):
        self.url = url
        self._context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
        self.size = int(self._open("HEAD").headers["Content-Length"])
        self.position = 0

    def _open(self, method: str = "GET", first: int | None = None, last: int | None = None):
        request = urllib.request.Request(self.url, method=method)
        if first is not None:
            request.add_header("Range", f"bytes={first}-{last}")
        return urllib.request.urlopen(request, timeout=60, context=self._context)  # noqa: S310 - the index

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence] + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self.size - self.position)
        if count <= 0:
            return 0
        with self._open("GET", self.position, self.position + count - 1) as response:
            data = response.read()
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


@dataclass(frozen=True)
class Installed:
    """Bytes that wheels install: what the image keeps, and what docker/prune_cuda_libs.py deletes."""

    kept: int = 0
    pruned: int = 0

    def __add__(self, other: Installed) -> Installed:
        return Installed(self.kept + other.kept, self.pruned + other.pruned)


def installed_bytes(url: str) -> Installed:
    """What a wheel on the index installs: its files' uncompressed sizes (its zip directory), split by
    whether the build's prune step deletes them (a wheel's entries are paths relative to site-packages)."""
    local = urllib.parse.urlparse(url)
    source = urllib.request.url2pathname(local.path) if local.scheme == "file" else RemoteFile(url)
    with zipfile.ZipFile(source) as wheel:
        files = [info for info in wheel.infolist() if not info.is_dir()]
    pruned = sum(info.file_size for info in files if is_pruned(info.filename))
    return Installed(sum(info.file_size for info in files) - pruned, pruned)


def cuda_wheel_bytes(pins: list[str], notes: list[str]) -> Installed:
    """Installed size of every CUDA wheel of `pins` (`installed_bytes`); a pin the index reachable here
    lacks is sized by the newest release of that package it has, and noted."""
    total = Installed()
    for pin in pins:
        item = resolve(pin)
        if item is None:
            name = re.split(r"[\[=<>]", pin)[0]
            item = resolve(name)
            if item is None:
                notes.append(f"{pin}: not on the index reachable here, not counted")
                continue
            notes.append(
                f"{pin}: not on the index reachable here, sized as {name} {item['metadata']['version']}"
            )
        if item["metadata"].get("requires_dist") and item.get("requested_extras"):
            total += cuda_wheel_bytes(components(item), notes)
        total += installed_bytes(item["download_info"]["url"])
    return total


def torch_in_image_bytes(image: str) -> int:
    script = "du -sb /opt/trainpod/venv/lib/python3*/site-packages/torch | cut -f1"
    return int(docker("run", "--rm", "--network", "none", "--entrypoint", "sh", image, "-c", script).stdout)


def stand_in_sizes() -> tuple[int, int, int]:
    """(stand-in cuda image, the CPU torch in it, the local Debian base), bytes, measured in the engine."""
    stand_in = image_size_bytes(build_cuda_stand_in())
    return stand_in, torch_in_image_bytes(CUDA_STAND_IN_IMAGE), image_size_bytes(BASE_IMAGE)


def cuda_estimates(
    stand_in: int, cpu_torch: int, local_base: int
) -> tuple[float, dict[str, float], list[str]]:
    """(stand-in image GB, {flavour: estimated GB}, notes on how each number was had), from the stand-in
    image's sizes (`stand_in_sizes`) and the CUDA wheels' zip directories."""
    notes = [
        f"stand-in cuda image (measured): {stand_in / GB:.2f} GB, of which CPU torch {cpu_torch / GB:.2f} GB "
        f"and the local Debian base {local_base / GB:.2f} GB",
        "CUDA wheels: what each installs, the sum of its files' sizes from its own zip directory (read by "
        f"range requests on the index); nvidia/cuda base (published, est.): {CUDA_BASE_GB:.2f} GB",
    ]
    estimates = {}
    torch_cu130 = None
    for flavour, pins in (("cu130", CU130_PINS), ("cu128", CU128_PINS)):
        wheels = cuda_wheel_bytes(pins, notes)
        if flavour == "cu130":  # CU130_PINS holds torch itself
            torch_cu130 = installed_bytes(resolve("torch==2.13.0")["download_info"]["url"])
        else:  # PyTorch's cu128 index is not reachable here: its torch wheel sized as PyPI's cu130 one
            wheels += torch_cu130
            notes.append(
                "torch 2.13.0+cu128 (PyTorch's index, unreachable here): sized as PyPI's cu130 wheel"
            )
        estimates[flavour] = (stand_in - cpu_torch - local_base + wheels.kept) / GB + CUDA_BASE_GB
        notes.append(
            f"{flavour}: CUDA wheels (torch's own included) install {(wheels.kept + wheels.pruned) / GB:.2f} GB, "
            f"of which docker/prune_cuda_libs.py deletes {wheels.pruned / GB:.2f} GB: the image keeps "
            f"{wheels.kept / GB:.2f} GB"
        )
    return stand_in / GB, estimates, notes


def first_step_seconds(volume: Path, pod: str, after_step: int = 0) -> tuple[float, str]:
    """`docker run` of the tiny pretrain until a log line `step N/` with N > after_step appears."""
    env = ["-e", "TRAINPOD_WORKLOAD=pretrain", "-e", "TRAINPOD_CONFIG=configs/pretrain/tiny.yaml",
           "-e", "TRAINPOD_SET=train.log_every=1 train.max_steps=200 train.compile=true",
           "-e", f"RUNPOD_POD_ID={pod}"]  # fmt: skip
    start = time.monotonic()
    cid = docker(
        "run", "-d", "--network", "none", "--hostname", pod, "-v", f"{volume}:/workspace", *env, CPU_IMAGE
    )
    cid = cid.stdout.strip()
    while time.monotonic() - start < 900:
        logs = docker("logs", cid).stderr + docker("logs", cid).stdout
        steps = [
            int(line.split(" step ")[1].split("/")[0])
            for line in logs.splitlines()
            if " step " in line and "/" in line
        ]
        if any(s > after_step for s in steps):
            return time.monotonic() - start, cid
        time.sleep(0.1)
    raise RuntimeError(f"no optimizer step logged within 900 s:\n{logs[-2000:]}")


def cold_start() -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="bench-image-") as tmp:
        volume = Path(tmp)
        docker("run", "--rm", "--network", "none", "-v", f"{volume}:/workspace", "-e", "TRAINPOD_WORKLOAD=datagen",
               "-e", "TRAINPOD_CONFIG=configs/datagen/tiny.yaml", CPU_IMAGE, timeout=300)  # fmt: skip
        first, cid = first_step_seconds(volume, "bench-pod")
        deadline = time.monotonic() + 300
        while not (volume / "runs/tiny-pretrain/checkpoints/LATEST").exists() and time.monotonic() < deadline:
            time.sleep(0.2)  # a checkpoint (every 10 steps) to resume from
        docker("stop", "-t", "5", cid, timeout=60)
        latest = (volume / "runs/tiny-pretrain/checkpoints/LATEST").read_text().strip()
        resumed, cid2 = first_step_seconds(volume, "bench-pod", after_step=int(latest.split("-")[-1]))
        docker("rm", "-f", cid, cid2, check=False)
        subprocess.run(["rm", "-rf", str(volume / "runs"), str(volume / "datasets")], check=False)
    return first, resumed


def row(metric: str, value: str, target: str, ok: bool) -> str:
    return f"| {metric} | {value} | {target} | {'pass' if ok else 'FAIL'} |"


def cuda_rows(stand_in: float, cuda: dict[str, float]) -> list[str]:
    return [
        f"| stand-in cuda image size (CPU torch, local base) | {stand_in:.2f} GB | (measured) | |",
        *[
            row(f"`{flavour}` image size, ESTIMATED (method below)", f"{gb:.2f} GB", "<= 7 GB", gb <= 7.0)
            for flavour, gb in cuda.items()
        ],
    ]


def run(workdir: Path, quick: bool = False) -> str:
    engine = ensure_engine()
    try:
        cpu = image_size_bytes(CPU_IMAGE) / GB
        stand_in, cuda, notes = cuda_estimates(*stand_in_sizes())
        first, resumed = cold_start()
    finally:
        engine.stop()

    lines = [
        "## Image (docker/Dockerfile)",
        "",
        "| metric | measured | target | result |",
        "| --- | --- | --- | --- |",
        row("`cpu` image size (docker image inspect)", f"{cpu:.2f} GB", "<= 1.8 GB", cpu <= 1.8),
        *cuda_rows(stand_in, cuda),
        row(
            "cold start, compile=true: docker run -> first optimizer step (tiny, CPU)",
            f"{first:.1f} s", "(measured)", True,
        ),
        row("restart after docker stop -> first resumed step (compile cache on the volume)",
            f"{resumed:.1f} s", "(measured)", True),
        "",
        "cuda estimates, how:",
        "",
        *[f"- {note}" for note in notes],
        "",
    ]  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    return "\n".join(lines)


def cuda_only(stand_in_gb: str, cpu_torch_gb: str, local_base_gb: str) -> str:
    """The cuda estimates without docker, from the stand-in sizes measured earlier (GB)."""
    sizes = [round(float(gb) * GB) for gb in (stand_in_gb, cpu_torch_gb, local_base_gb)]
    stand_in, cuda, notes = cuda_estimates(*sizes)
    notes[0] = notes[0].replace("(measured)", "(measured earlier, given on the command line)")
    return "\n".join([*cuda_rows(stand_in, cuda), "", *[f"- {note}" for note in notes], ""])


if __name__ == "__main__":
    if "--cuda-only" in sys.argv:
        print(cuda_only(*sys.argv[sys.argv.index("--cuda-only") + 1 :][:3]))
    else:
        print(run(REPO / "bench-out", quick="--quick" in sys.argv))
