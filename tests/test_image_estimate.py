"""bench/bench_image.py's cuda estimate counts what the image keeps: a wheel's zip entries less exactly the
files docker/prune_cuda_libs.py deletes when the same wheel is installed (one glob list, read by both)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import bench_image  # noqa: E402

PRUNE_STEP = REPO / "docker" / "prune_cuda_libs.py"

# A wheel laid out like the CUDA ones (entries are paths relative to site-packages), sizes in bytes.
ENTRIES = {
    "nvidia/cusolver/lib/libcusolverMg.so.11": 700,
    "nvidia/cusolver/lib/libcusolver.so.11": 1100,
    "nvidia/cu13/lib/libnvrtc.alt.so.13": 300,
    "nvidia/cu13/lib/libnvrtc-builtins.alt.so.13.0": 30,
    "nvidia/cu13/lib/libnvrtc.so.13": 290,
    "triton/backends/nvidia/lib/cupti/libcupti_static.a": 50,
    "triton/backends/nvidia/lib/cupti/libcupti.so": 40,
    "nvidia_cusolver_cu12-11.7.3.90.dist-info/RECORD": 13,
}


def test_the_estimate_leaves_out_exactly_the_files_the_build_step_deletes(tmp_path):
    wheel = tmp_path / "cuda_parts-1.0-py3-none-manylinux_2_27_x86_64.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, size in ENTRIES.items():
            archive.writestr(name, b"x" * size)
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)

    step = subprocess.run([sys.executable, str(PRUNE_STEP), str(site)], capture_output=True, text=True)

    assert step.returncode == 0, step.stderr
    deleted = {name for name in ENTRIES if not (site / name).exists()}
    assert deleted == {
        "nvidia/cusolver/lib/libcusolverMg.so.11",
        "nvidia/cu13/lib/libnvrtc.alt.so.13",
        "nvidia/cu13/lib/libnvrtc-builtins.alt.so.13.0",
        "triton/backends/nvidia/lib/cupti/libcupti_static.a",
    }, step.stdout
    expected = bench_image.Installed(
        kept=sum(size for name, size in ENTRIES.items() if name not in deleted),
        pruned=sum(ENTRIES[name] for name in deleted),
    )
    assert bench_image.installed_bytes(wheel.as_uri()) == expected, (
        "bench_image must subtract what docker/prune_cuda_libs.py deletes: both read PRUNED_GLOBS"
    )
