"""GPU tier (`pytest -m gpu`): torch never loads what docker/prune_cuda_libs.py deletes from the cuda images.

The prune step proves on CPU that no remaining library lists a deleted file as DT_NEEDED; dlopen at run
time is only visible on a GPU. Here the CUDA paths next to the deleted files run in a fresh process:
cuSOLVER (torch.linalg on CUDA), NVRTC (a jiterator kernel, compiled at run time), cuDNN (a conv) and
Triton (torch.compile). Then that process's /proc/self/maps must map no file PRUNED_GLOBS matches, and
must map the kept neighbours (libcusolver, libnvrtc), so the test cannot pass by running nothing.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU machine)"
    ),
]

SCRIPT = Path(__file__).resolve().parents[1] / "docker" / "prune_cuda_libs.py"
spec = importlib.util.spec_from_file_location("prune_cuda_libs", SCRIPT)
prune_cuda_libs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prune_cuda_libs)

CUDA_PATHS = r"""
import torch
import torch.nn.functional as F
from torch.cuda import jiterator

a = torch.randn(64, 64, device="cuda", dtype=torch.float64)
spd = a @ a.T + 64 * torch.eye(64, device="cuda", dtype=torch.float64)
torch.linalg.eigh(spd)
torch.linalg.cholesky(spd)
torch.linalg.solve(spd, torch.ones(64, 1, device="cuda", dtype=torch.float64))
plus_one = jiterator._create_jit_fn("template <typename T> T plus_one(T x) { return x + T(1); }")
assert plus_one(torch.zeros(8, device="cuda")).eq(1).all()
torch.backends.cudnn.enabled = True
F.conv2d(torch.randn(2, 3, 16, 16, device="cuda"), torch.randn(4, 3, 3, 3, device="cuda"))
compiled = torch.compile(lambda x: torch.sin(x) * 2 + 1)
compiled(torch.randn(1024, device="cuda"))
torch.cuda.synchronize()
for line in open("/proc/self/maps"):
    path = line.split()[-1]
    if "/site-packages/" in path:
        print(path.split("/site-packages/", 1)[1])
"""


def site_packages_files_mapped_after_cuda_paths() -> set[str]:
    result = subprocess.run([sys.executable, "-c", CUDA_PATHS], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"the CUDA paths failed to run:\n{result.stderr[-3000:]}"
    return set(result.stdout.split())


def test_torch_on_a_gpu_never_loads_a_file_the_cuda_image_prunes():
    mapped = site_packages_files_mapped_after_cuda_paths()

    names = {Path(path).name for path in mapped}
    assert any(name.startswith("libcusolver.so") for name in names), f"cuSOLVER never loaded: {sorted(names)}"
    assert any(name.startswith("libnvrtc.so") for name in names), f"NVRTC never loaded: {sorted(names)}"
    pruned = sorted(path for path in mapped if prune_cuda_libs.is_pruned(path))
    assert not pruned, (
        f"torch loaded {pruned}, which docker/prune_cuda_libs.py deletes from the cuda images: "
        "remove its glob from PRUNED_GLOBS"
    )
