"""docker/flash_attn_wheel.py, the cuda build's check of an optional flash-attn wheel: its file name's
torch, CUDA, Python and ABI tags must fit the flavour, or the build fails (exit 1, one line)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "docker" / "flash_attn_wheel.py"
spec = importlib.util.spec_from_file_location("flash_attn_wheel", SCRIPT)
flash_attn_wheel = importlib.util.module_from_spec(spec)
sys.modules["flash_attn_wheel"] = flash_attn_wheel  # dataclasses look their module up while it loads
spec.loader.exec_module(flash_attn_wheel)

CU128_WHEEL = "flash_attn-2.8.3+cu12torch2.13cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"


def problems(name: str, torch_version="2.13.0+cu128", cuda="12.8", python="cp312", abi=True) -> list[str]:
    return flash_attn_wheel.mismatches(flash_attn_wheel.wheel_tags(name), torch_version, cuda, python, abi)


def test_the_readmes_cu128_wheel_fits_the_cu128_image():
    assert problems(CU128_WHEEL) == []
    assert problems(CU128_WHEEL.replace("cu12torch", "cu128torch")) == [], "an exact CUDA tag fits too"


@pytest.mark.parametrize(
    ("name", "kwargs", "expected"),
    [
        (
            CU128_WHEEL.replace("torch2.13", "torch2.8"),
            {},
            "built for torch 2.8, the image has torch 2.13.0+cu128",
        ),
        (CU128_WHEEL, {"torch_version": "2.13.0+cu130", "cuda": "13.0"}, "built for CUDA 12"),
        (CU128_WHEEL.replace("cp312-cp312", "cp311-cp311"), {}, "built for cp311, the image runs cp312"),
        (CU128_WHEEL.replace("abiTRUE", "abiFALSE"), {}, "cxx11abi=False"),
        (CU128_WHEEL, {"cuda": None}, "the image's torch is built for CUDA None"),
    ],
)
def test_a_wheel_for_another_torch_cuda_python_or_abi_is_refused(name, kwargs, expected):
    found = problems(name, **kwargs)
    assert any(expected in problem for problem in found), found


def test_a_name_without_tags_is_refused_by_name():
    with pytest.raises(ValueError, match="not a flash-attn wheel name"):
        flash_attn_wheel.wheel_tags("flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl")


def test_the_build_step_fails_with_one_line_on_a_mismatch(tmp_path):
    """Run as the Dockerfile runs it, against this machine's CPU torch: any CUDA wheel must fail."""
    wheel = tmp_path / CU128_WHEEL
    wheel.write_bytes(b"")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(wheel)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "FLASH_ATTN_WHEEL_URL does not fit this image" in line and f"CUDA {torch.version.cuda}" in line
