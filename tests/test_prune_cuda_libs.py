"""docker/prune_cuda_libs.py, the cuda build's step that deletes CUDA library files nothing loads, on real
ELF shared libraries built here with gcc, and run as the Dockerfile runs it (nothing is mocked: the
libraries stand in for CUDA's only by their names and sonames)."""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "docker" / "prune_cuda_libs.py"
spec = importlib.util.spec_from_file_location("prune_cuda_libs", SCRIPT)
prune_cuda_libs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prune_cuda_libs)

MG = "nvidia/cusolver/lib/libcusolverMg.so.11"
CUSOLVER = "nvidia/cusolver/lib/libcusolver.so.11"
CUPTI_ARCHIVE = "triton/backends/nvidia/lib/cupti/libcupti_static.a"
LINALG = "torch/lib/libtorch_cuda_linalg.so"


def shared_library(site: Path, relative: str, *needed: str) -> Path:
    """A real shared library at site/relative, soname = its file name, linked (-l) against `needed`
    (paths relative to site), with a RUNPATH to find them as torch's own libraries do."""
    assert shutil.which("gcc") and shutil.which("readelf"), "these tests need gcc and binutils (readelf)"
    path = site / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    source = path.with_name(path.name.replace(".", "_") + ".c")
    source.write_text(f"int {source.stem.replace('-', '_')}(void) {{ return 1; }}\n")
    links = ["-Wl,--no-as-needed"]  # keep DT_NEEDED though no symbol is used (some gcc default to as-needed)
    for other in needed:
        folder = (site / other).parent
        links += [f"-L{folder}", f"-l:{Path(other).name}", f"-Wl,-rpath,{folder}"]
    subprocess.run(
        ["gcc", "-shared", "-fPIC", f"-Wl,-soname,{path.name}", "-o", str(path), str(source), *links],
        check=True,
    )
    source.unlink()
    return path


def run_step(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(site)], capture_output=True, text=True)


def files_under(site: Path) -> set[str]:
    return {path.relative_to(site).as_posix() for path in site.rglob("*") if path.is_file()}


def test_the_step_deletes_listed_files_no_remaining_library_needs_and_the_rest_still_loads(tmp_path):
    shared_library(tmp_path, CUSOLVER)
    shared_library(tmp_path, MG, CUSOLVER)  # multi-GPU cuSOLVER needs cuSOLVER, never the reverse
    linalg = shared_library(tmp_path, LINALG, CUSOLVER)
    (tmp_path / CUPTI_ARCHIVE).parent.mkdir(parents=True)
    (tmp_path / CUPTI_ARCHIVE).write_bytes(b"!<arch>\n")  # a static archive: not ELF, never loaded

    result = run_step(tmp_path)

    assert result.returncode == 0, result.stderr
    assert files_under(tmp_path) == {CUSOLVER, LINALG}, result.stdout
    assert f"deleted {MG}" in result.stdout and f"deleted {CUPTI_ARCHIVE}" in result.stdout
    ctypes.CDLL(str(linalg))  # its DT_NEEDED chain still resolves after the prune


def test_the_step_refuses_a_listed_file_a_remaining_library_needs_and_deletes_nothing(tmp_path):
    shared_library(tmp_path, CUSOLVER)
    shared_library(tmp_path, MG, CUSOLVER)
    shared_library(tmp_path, LINALG, MG)  # as if torch linked multi-GPU cuSOLVER
    (tmp_path / CUPTI_ARCHIVE).parent.mkdir(parents=True)
    (tmp_path / CUPTI_ARCHIVE).write_bytes(b"!<arch>\n")
    before = files_under(tmp_path)

    result = run_step(tmp_path)

    assert result.returncode != 0, result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert f"refusing to delete {MG}" in line and LINALG in line and "libcusolverMg.so.11" in line, line
    assert files_under(tmp_path) == before, "a refused prune must delete nothing, not even the archive"


def test_the_step_refuses_a_file_needed_by_its_file_name_when_it_has_no_soname(tmp_path):
    mg = tmp_path / MG
    mg.parent.mkdir(parents=True)
    source = tmp_path / "mg.c"
    source.write_text("int mg(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(mg), str(source)], check=True)
    shared_library(tmp_path, LINALG, MG)

    result = run_step(tmp_path)

    assert result.returncode != 0 and f"refusing to delete {MG}" in result.stderr, result.stderr
    assert mg.exists()


def test_the_step_does_nothing_where_no_listed_file_exists(tmp_path):
    """The stand-in cuda build (CPU torch) and a cpu image have none of the listed files."""
    shared_library(tmp_path, CUSOLVER)
    shared_library(tmp_path, LINALG, CUSOLVER)
    (tmp_path / "triton/backends/nvidia/lib/cupti/libcupti.so").parent.mkdir(parents=True)
    (tmp_path / "triton/backends/nvidia/lib/cupti/libcupti.so").write_bytes(b"\x7fELF")
    before = files_under(tmp_path)

    result = run_step(tmp_path)

    assert result.returncode == 0, result.stderr
    assert "nothing to prune" in result.stdout
    assert files_under(tmp_path) == before


@pytest.mark.parametrize(
    "relative",
    [
        "nvidia/cuda_nvrtc/lib/libnvrtc.alt.so.12",
        "nvidia/cuda_nvrtc/lib/libnvrtc-builtins.alt.so.12.8",
        "nvidia/cusolver/lib/libcusolverMg.so.11",
        "nvidia/cu13/lib/libnvrtc.alt.so.13",
        "nvidia/cu13/lib/libnvrtc-builtins.alt.so.13.0",
        "nvidia/cu13/lib/libcusolverMg.so.12",
        "triton/backends/nvidia/lib/cupti/libcupti_static.a",
        "triton/backends/nvidia/lib/cupti/libnvperf_host_static.a",
    ],
)
def test_the_list_prunes_the_unloaded_files_of_both_flavours(relative):
    assert prune_cuda_libs.is_pruned(relative)


@pytest.mark.parametrize(
    "relative",
    [
        # what torch links or preloads (torch/__init__.py's globs), cu12 and cu13 layouts
        "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
        "nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.8",
        "nvidia/cusolver/lib/libcusolver.so.11",
        "nvidia/cu13/lib/libnvrtc.so.13",
        "nvidia/cu13/lib/libnvrtc-builtins.so.13.0",
        "nvidia/cu13/lib/libcusolver.so.12",
        # Triton's profiler dlopens the shared CUPTI
        "triton/backends/nvidia/lib/cupti/libcupti.so",
        "triton/backends/nvidia/lib/cupti/libnvperf_host.so",
        # a glob's "*" stays within one folder
        "triton/backends/nvidia/lib/cupti/extra/libcupti_static.a",
    ],
)
def test_the_list_keeps_what_torch_and_triton_load(relative):
    assert not prune_cuda_libs.is_pruned(relative)
