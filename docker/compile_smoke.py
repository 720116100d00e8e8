"""Build step of docker/Dockerfile: torch.compile works in this image, or the build fails.

    python docker/compile_smoke.py        # at build time, after the pip step; needs no GPU

Every pretrain preset sets `train.compile: true`. Inductor compiles CPU kernels with g++ against the
Python headers; Triton (GPU) builds a small C launcher with gcc at its first kernel. A missing
compiler used to surface only on a paid GPU pod ("Failed to find C compiler"); here it fails the
build: the tools Triton looks for are checked, then a small function is compiled and run on CPU.
"""

import os
import shutil
import sysconfig
import tempfile

# The compile caches in a temporary folder, set before torch reads it: none may end up in a layer.
CACHE = tempfile.mkdtemp(prefix="inductor-smoke-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = CACHE
os.environ["TRITON_CACHE_DIR"] = os.path.join(CACHE, "triton")

import torch  # noqa: E402


def check_toolchain() -> None:
    missing = [tool for tool in ("gcc", "g++") if shutil.which(tool) is None]
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.isfile(headers):
        missing.append(headers)
    assert not missing, f"torch.compile needs {', '.join(missing)}: add them in docker/system_packages.sh"


def smoke() -> None:
    def gelu_mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ w).sum(dim=-1) + x.cos().mean()

    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(gelu_mlp, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x, w), gelu_mlp(x, w), rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
    check_toolchain()
    try:
        smoke()
    finally:
        shutil.rmtree(CACHE, ignore_errors=True)
    print(f"torch.compile (inductor, CPU) works with torch {torch.__version__}")
