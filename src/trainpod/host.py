"""Can this machine run the image? `trainpod boot` asks before any work; exit 4 (MachineUnfit) when not.

    TRAINPOD_IMAGE_CUDA=12.8 RUNPOD_GPU_COUNT=1 trainpod boot     # the image sets the first, RunPod the second

The cuda images bake the CUDA they are built for into TRAINPOD_IMAGE_CUDA (docker/Dockerfile). On a
pod that RunPod gave GPUs (RUNPOD_GPU_COUNT > 0), boot compares it with what the host offers: the
NVIDIA driver's version (/proc/driver/nvidia/version) and the newest CUDA that driver supports
(cuDriverGetVersion from libcuda, which the NVIDIA container runtime mounts into the container). A
driver older than the image's CUDA, no driver, or CUDA unusable for another reason is the machine's
fault, not the config's: starting the same pod again lands on the same machine and fails the same
way, a new pod on another machine with the same volume does not. So the exit is 4, not 2, and the
supervisor replaces the pod (runpod/supervise.py). CPU pods and runs outside RunPod promise no GPU:
nothing is checked there.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainpod.errors import MachineUnfit

IMAGE_CUDA_ENV = "TRAINPOD_IMAGE_CUDA"
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
WHAT_TO_DO = (
    "this machine cannot run the image: replace the pod (`trainpod supervise` does on exit 4) and keep "
    "allowedCudaVersions at the image's CUDA or newer (deploy image.cuda_version)"
)


@dataclass(frozen=True)
class GpuHost:
    """What the container sees of the host's GPUs."""

    driver: str | None  # the NVIDIA kernel driver, e.g. "570.124.06"; None when no driver is visible
    driver_cuda: str | None  # the newest CUDA that driver supports, e.g. "12.8"
    usable_gpus: int  # GPUs torch can use (0 when CUDA does not initialise)


def probe() -> GpuHost:
    """The real host: driver file, libcuda's version, torch's view. No GPU needed to ask."""
    import torch

    usable = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return GpuHost(driver_version(), driver_cuda_version(), usable)


def driver_version(path: Path = DRIVER_VERSION_FILE) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else None


def driver_cuda_version() -> str | None:
    """cuDriverGetVersion: 12080 means the driver runs CUDA up to 12.8. None without libcuda."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def check_host(environ: dict[str, str], probe: Callable[[], GpuHost] = probe) -> None:
    """Raise MachineUnfit (exit 4) with one line when a GPU pod cannot run the image's CUDA."""
    pod_gpus = int(environ.get("RUNPOD_GPU_COUNT") or 0)
    if pod_gpus <= 0:
        return
    image_cuda = environ.get(IMAGE_CUDA_ENV) or "unknown"
    host = probe()
    driver = f"NVIDIA driver {host.driver}" if host.driver else "no NVIDIA driver visible in the container"
    if host.driver_cuda and image_cuda != "unknown" and _version(host.driver_cuda) < _version(image_cuda):
        raise MachineUnfit(
            f"{driver} supports CUDA up to {host.driver_cuda}; this image is built for CUDA {image_cuda}: {WHAT_TO_DO}"
        )
    if host.usable_gpus < pod_gpus:
        supports = f" (CUDA up to {host.driver_cuda})" if host.driver_cuda else ""
        raise MachineUnfit(
            f"the pod has {pod_gpus} GPU(s) (RUNPOD_GPU_COUNT) but CUDA can use {host.usable_gpus}; {driver}"
            f"{supports}, image built for CUDA {image_cuda}: {WHAT_TO_DO}"
        )


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text))
