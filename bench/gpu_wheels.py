"""`make gpu-wheels`: the wheels a bare GPU machine lacks, for its Python and platform, into .whl/.

    python bench/gpu_wheels.py [--python 3.12] [--dest .whl]

A lent GPU machine (and many a fresh cloud image) has a CUDA torch, transformers, peft (of a version
nobody has read) and accelerate but not bitsandbytes or pydantic, and no package index. This downloads,
on a machine that has the index, the versions installed here (so the GPU runs the code with what the
tests ran it with) as binary wheels for CPython `--python` on manylinux x86_64; `make gpu-check` there
installs them with --no-index.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What trainpod and the GPU check import that such a machine lacks (with their own missing needs).
PACKAGES = [
    "bitsandbytes",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "jiwer",  # the generation eval's CER/WER (the VLM part)
    "rapidfuzz",
    "datasets",  # the Trainer baseline's Dataset
    "dill",
    "multiprocess",
    # The machine has a peft of a version nobody has read, and trainpod needs 0.21 (peft.utils.error's
    # NoMatchingPeftModuleError, imported by every LoRA/QLoRA finetune): carried, the finetune parts run
    # the peft the tests ran. Pure Python, 0.8 MB; its needs (transformers, accelerate...) are there.
    "peft",
    # pydantic 2.14 imports typing_extensions.Sentinel (4.14+) and asks for 4.16; torch asks only for 4.10,
    # and the machine's version is unknown: an older one would fail every trainpod import (the config).
    # Newer is compatible with what torch and the rest need. 45 kB.
    "typing-extensions",
]
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64"]


def pins() -> list[str]:
    out = []
    for name in PACKAGES:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            out.append(name)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor)")
    parser.add_argument("--dest", default=str(REPO / ".whl"))
    args = parser.parse_args()
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    # One wheel per package: dependencies are named above, not resolved (--no-deps), so nothing already
    # on the GPU machine (torch above all) is downloaded again or replaced.
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--implementation",
        "cp",
    ]
    cmd += ["--python-version", args.python, *platforms, "-d", args.dest, *pins()]
    print(" ".join(cmd), flush=True)
    return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
