"""Build step of docker/Dockerfile (cuda target): delete the CUDA library files nothing in the image loads.

    python docker/prune_cuda_libs.py /opt/trainpod/venv/lib/python3.12/site-packages

torch's CUDA wheels bring whole CUDA components, and a few of their files are never loaded by torch,
Triton or anything else in the image: about 350 MB in cu128 (7.15 GB estimated, over the 7 GB target
without them) and 300 MB in cu130 (BENCHMARKS.md "Image"). PRUNED_GLOBS lists them, relative to
site-packages, each with its reason; bench/bench_image.py subtracts the same list from its estimate.

Before deleting anything, the step reads the dynamic section of every other ELF file in site-packages
(DT_SONAME, DT_NEEDED) and refuses, with one line naming the file and what needs it and with nothing
deleted, when any of them lists a doomed file's soname or name: the loader would then fail on it.
Where no listed file exists (the stand-in cuda build with CPU torch, a cpu image) it does nothing.
The build's `import torch` and warm imports run after it, so torch's own load chain is proven too.

dlopen by name leaves no DT_NEEDED, so that was checked by hand, 2026-11-23, on PyPI's torch 2.13.0
(the cu130 build; torch 2.13.0+cu128 is on PyTorch's index, unreachable from where this was written,
built from the same sources), triton 3.7.1, cuda-bindings 13.5.0 / cuda-pathfinder 1.8.3, and
the nvrtc, cudnn and cusolver wheels of both flavours (`readelf -d`, `strings -a`, grep):
- no torch library names "cusolverMg", "nvrtc.alt", "builtins.alt", "cupti_static" or
  "nvperf_host_static", and no torch Python source does either;
- torch loads NVRTC as libnvrtc.so.<major>: DT_NEEDED of libtorch_cuda.so and libcaffe2_nvrtc.so,
  torch/__init__.py's preload globs "libnvrtc.so.*[0-9]" and "libnvrtc-builtins.so.*[0-9]" (neither
  matches an .alt file), torch/cuda/_utils.py's ctypes fallback "libnvrtc.so.<major>";
- cuDNN (libcudnn_graph, both flavours) and cuBLASLt (cu13; its 750 MB cu12 build was not read) dlopen
  "libnvrtc.so.<major>", and libnvrtc.so.<major> itself dlopens libnvrtc-builtins.so.<major.minor>;
  only libnvrtc.alt names the .alt builtins;
- torch links cuSOLVER as libcusolver.so.<N> (libtorch_cuda_linalg.so); cuda-pathfinder can load
  cusolverMg, but only when asked by name, and nothing in the image asks (cuda-bindings has no
  cuSOLVER bindings);
- Triton compiles its launcher against libcuda.so.1 only (triton/backends/nvidia/driver.py), and its
  profiler (libproton.so) dlopens libcupti.so, the shared CUPTI, which stays.
Then this step ran on a real cu130 site-packages (Python 3.12; torch 2.13.0, triton 3.7.1 and the
nvidia-* cu13 wheels, cudnn 9.24 and nccl 2.30.7 standing in for the pinned 9.20 and 2.29.7): it deleted
the 5 listed files there (295 MB) and refused nothing; the other 69 ELF libraries of torch, triton and nvidia/*,
each loaded with ctypes in a fresh process, behaved exactly as before it (56 load; 13 did not before
either: no driver's libcuda.so.1, no MPI/UCX/InfiniBand libraries on that machine), and `import torch`
plus an NVRTC compile to PTX (no GPU needed) mapped libnvrtc.so.13, libnvrtc-builtins.so.13.0 and
libcusolver.so.12, no .alt file.
On a GPU, tests/test_gpu_pruned_libs.py checks what torch maps at run time.

binutils' readelf reads the ELF headers rather than a Python library: binutils is in every image
already (gcc needs it, docker/system_packages.sh), and pyelftools would be one more package pinned in
three locks for one build step. Exit codes: 0 pruned or nothing to prune, 1 refused (the build fails).
"""

from __future__ import annotations

import os
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

# Relative to site-packages. "*" matches within one path segment only (see `is_pruned`).
# cu12 wheels keep each component in nvidia/<component>/lib; the cu13 ones put all of CUDA 13 in
# nvidia/cu13/lib.
PRUNED_GLOBS: tuple[str, ...] = (
    # NVRTC's "alt" build, a second NVRTC of the same size under another soname for applications that
    # link it by that name. torch, cuDNN and cuBLASLt load libnvrtc.so.<major> (above).
    # 105 MB (cu12), 110 MB (cu13).
    "nvidia/cuda_nvrtc/lib/libnvrtc.alt.so.*",
    "nvidia/cu13/lib/libnvrtc.alt.so.*",
    # The alt build's builtins: only libnvrtc.alt names them. 6 MB (cu12), 4 MB (cu13).
    "nvidia/cuda_nvrtc/lib/libnvrtc-builtins.alt.so.*",
    "nvidia/cu13/lib/libnvrtc-builtins.alt.so.*",
    # Multi-GPU cuSOLVER (cusolverMg*, one solve spread over several GPUs): torch links only
    # libcusolver.so.<N>. 161 MB (cu12), 104 MB (cu13).
    "nvidia/cusolver/lib/libcusolverMg.so.*",
    "nvidia/cu13/lib/libcusolverMg.so.*",
    # Triton's copy of CUPTI's static archives (libcupti_static.a 44 MB, libnvperf_host_static.a
    # 33 MB): inputs for a linker, which nothing can load at run time; Triton's profiler uses the
    # shared libcupti.so beside them. Both flavours (the same triton wheel).
    "triton/backends/nvidia/lib/cupti/*.a",
)

ELF_MAGIC = b"\x7fELF"


def is_pruned(relative: str, globs: tuple[str, ...] = PRUNED_GLOBS) -> bool:
    """Whether a path relative to site-packages (a file on disk or a wheel's zip entry) is deleted:
    it matches a glob segment by segment, so "*" never crosses a "/"."""
    parts = PurePosixPath(relative).parts
    for glob in globs:
        pattern = PurePosixPath(glob).parts
        if len(pattern) == len(parts) and all(map(fnmatchcase, parts, pattern)):
            return True
    return False


def site_files(site: Path) -> list[Path]:
    """Every regular file under site-packages (symbolic links are not files of their own)."""
    files = []
    for folder, _, names in os.walk(site):
        files += [Path(folder, name) for name in names if not Path(folder, name).is_symlink()]
    return files


def is_elf(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(4) == ELF_MAGIC


def dynamic_section(path: Path) -> tuple[str | None, set[str]]:
    """(DT_SONAME or None, the DT_NEEDED names) of one ELF file, from `readelf -d`."""
    try:
        result = subprocess.run(
            ["readelf", "--dynamic", "--wide", str(path)],
            capture_output=True,
            text=True,
            env={**os.environ, "LC_ALL": "C"},
            check=False,
        )
    except FileNotFoundError:
        raise SystemExit("prune_cuda_libs.py: readelf not found; install binutils (gcc brings it)") from None
    soname, needed = None, set()
    for line in result.stdout.splitlines():
        name = line.partition("[")[2].rpartition("]")[0]
        if "(SONAME)" in line:
            soname = name
        elif "(NEEDED)" in line:
            needed.add(name)
    return soname, needed


def names_of(path: Path) -> set[str]:
    """The names a loader could look this file up by: its file name, and its soname if it is ELF."""
    soname = dynamic_section(path)[0] if is_elf(path) else None
    return {path.name} | ({soname} if soname else set())


def needers(doomed: list[Path], kept: list[Path]) -> list[tuple[Path, Path, str]]:
    """(doomed file, kept ELF file that lists it as DT_NEEDED, the name it lists) for every such pair."""
    names = {name: path for path in doomed for name in names_of(path)}
    found = []
    for path in kept:
        if is_elf(path):
            found += [(names[name], path, name) for name in sorted(dynamic_section(path)[1] & names.keys())]
    return found


def prune(site: Path, globs: tuple[str, ...] = PRUNED_GLOBS) -> int:
    """Delete the files of `globs` under site-packages, or none of them if one is needed; the exit code."""
    files = site_files(site)
    doomed = [path for path in files if is_pruned(path.relative_to(site).as_posix(), globs)]
    if not doomed:
        print(f"prune_cuda_libs.py: nothing to prune in {site}")
        return 0
    doomed_set = set(doomed)
    conflicts = needers(doomed, [path for path in files if path not in doomed_set])
    if conflicts:
        file, needer, name = conflicts[0]
        print(
            f"prune_cuda_libs.py: refusing to delete {file.relative_to(site)}: "
            f"{needer.relative_to(site)} lists {name} as DT_NEEDED; remove its glob from PRUNED_GLOBS "
            f"in docker/prune_cuda_libs.py ({len(conflicts)} such file(s) in all, nothing deleted)",
            file=sys.stderr,
        )
        return 1
    for path in doomed:
        size = path.stat().st_size
        path.unlink()
        print(f"prune_cuda_libs.py: deleted {path.relative_to(site)} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python prune_cuda_libs.py SITE_PACKAGES (an existing folder)")
    sys.exit(prune(Path(sys.argv[1])))
