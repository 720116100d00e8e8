"""The host check of `trainpod boot` (trainpod.host): a GPU pod that cannot run the image's CUDA exits 4.

No GPU or NVIDIA driver can be had here, so the driver/GPU readings are given to check_host as a
GpuHost (the one thing mocked); `probe()` itself runs for real and must see no driver on this machine.
The end-to-end exit 4 from a real `trainpod boot` is in tests/test_boot.py.
"""

from __future__ import annotations

import pytest

from trainpod.errors import ExitCode, MachineUnfit
from trainpod.host import GpuHost, check_host, driver_version, probe


def gpu_pod(image_cuda: str = "12.8", gpus: str = "1") -> dict[str, str]:
    return {"TRAINPOD_IMAGE_CUDA": image_cuda, "RUNPOD_GPU_COUNT": gpus}


def test_a_driver_older_than_the_images_cuda_is_machine_unfit_naming_both():
    old_driver = GpuHost(driver="535.129.03", driver_cuda="12.2", usable_gpus=0)
    with pytest.raises(MachineUnfit) as caught:
        check_host(gpu_pod("12.8"), probe=lambda: old_driver)
    message = str(caught.value)
    assert caught.value.exit_code == ExitCode.MACHINE_UNFIT == 4
    assert "NVIDIA driver 535.129.03" in message and "CUDA up to 12.2" in message
    assert "built for CUDA 12.8" in message and "replace the pod" in message
    assert "\n" not in message, "one line"


def test_a_driver_new_enough_with_every_gpu_usable_passes():
    check_host(gpu_pod("12.8", "2"), probe=lambda: GpuHost("580.65.06", "13.0", usable_gpus=2))
    check_host(gpu_pod("13.0"), probe=lambda: GpuHost("580.65.06", "13.0", usable_gpus=1))


def test_a_cu130_image_on_a_cuda_12_9_host_is_machine_unfit():
    with pytest.raises(MachineUnfit, match="supports CUDA up to 12.9; this image is built for CUDA 13.0"):
        check_host(gpu_pod("13.0"), probe=lambda: GpuHost("575.57.08", "12.9", usable_gpus=0))


def test_fewer_usable_gpus_than_the_pod_has_is_machine_unfit():
    with pytest.raises(MachineUnfit, match=r"has 2 GPU\(s\) \(RUNPOD_GPU_COUNT\) but CUDA can use 1"):
        check_host(gpu_pod("12.8", "2"), probe=lambda: GpuHost("570.124.06", "12.8", usable_gpus=1))


def test_a_cpu_pod_or_a_run_outside_runpod_checks_nothing():
    def never() -> GpuHost:
        raise AssertionError("no GPU was promised: the host must not be probed")

    check_host({"TRAINPOD_IMAGE_CUDA": "12.8"}, probe=never)
    check_host({"RUNPOD_GPU_COUNT": "0"}, probe=never)


def test_the_real_probe_on_this_gpu_less_machine_sees_no_driver_and_no_gpu():
    assert probe() == GpuHost(driver=None, driver_cuda=None, usable_gpus=0)


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Thu Feb 20 2025\n", "570.124.06"),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build\n", "580.65.06"),
        ("garbage\n", None),
    ],
)
def test_the_driver_version_is_read_from_the_kernel_modules_banner(tmp_path, text, version):
    banner = tmp_path / "version"
    banner.write_text(text)
    assert driver_version(banner) == version
