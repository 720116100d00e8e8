"""Build step of docker/Dockerfile (cuda target): a flash-attn wheel fits this image's torch, or the build fails.

    python docker/flash_attn_wheel.py /wheelhouse/flash_attn-2.8.3+cu12torch2.13cxx11abiTRUE-cp312-cp312-linux_x86_64.whl

flash-attn is optional (SDPA is the default attention). Its wheels are compiled against one torch
minor version, one CUDA major (or major.minor) and one Python, with or without the C++11 ABI, and
say so in their file name (`+cu12torch2.13cxx11abiTRUE-cp312`). A wheel built for another torch
imports fine and then fails at the first call with "undefined symbol": the file name is checked
against the installed torch and this Python before pip installs it, and the build then imports it.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

LOCAL_TAGS = re.compile(r"cu(?P<cuda>\d+)torch(?P<torch>\d+\.\d+)(?:cxx11abi(?P<abi>TRUE|FALSE))?")


@dataclass(frozen=True)
class WheelTags:
    cuda: str  # "12" (any 12.x) or "128" (12.8 exactly), as the file name says
    torch: str  # "2.13"
    python: str  # "cp312"
    cxx11_abi: bool | None  # None when the name does not say


def wheel_tags(filename: str) -> WheelTags:
    """The CUDA, torch, Python and ABI tags of a flash-attn wheel's file name; ValueError if absent."""
    name = Path(filename).name.replace("%2B", "+")
    match = re.fullmatch(r"flash_attn-[^+-]+\+(?P<local>[^-]+)-(?P<python>cp\d+)-[^-]+-[^-]+\.whl", name)
    local = LOCAL_TAGS.fullmatch(match.group("local")) if match else None
    if local is None:
        raise ValueError(
            f"{name} is not a flash-attn wheel name with CUDA/torch tags (like "
            "flash_attn-2.8.3+cu12torch2.13cxx11abiTRUE-cp312-cp312-linux_x86_64.whl)"
        )
    abi = local.group("abi")
    return WheelTags(
        local.group("cuda"),
        local.group("torch"),
        match.group("python"),
        None if abi is None else abi == "TRUE",
    )


def mismatches(
    tags: WheelTags, torch_version: str, torch_cuda: str | None, python: str, cxx11_abi: bool
) -> list[str]:
    """What in the wheel's name does not fit the image (empty when it fits)."""
    problems = []
    torch_minor = ".".join(torch_version.split("+")[0].split(".")[:2])
    if tags.torch != torch_minor:
        problems.append(f"built for torch {tags.torch}, the image has torch {torch_version}")
    cuda_digits = (torch_cuda or "").replace(".", "")
    if not torch_cuda or tags.cuda not in (cuda_digits, torch_cuda.split(".")[0]):
        problems.append(f"built for CUDA {tags.cuda}, the image's torch is built for CUDA {torch_cuda}")
    if tags.python != python:
        problems.append(f"built for {tags.python}, the image runs {python}")
    if tags.cxx11_abi is not None and tags.cxx11_abi != cxx11_abi:
        problems.append(f"built with cxx11abi={tags.cxx11_abi}, the image's torch with {cxx11_abi}")
    return problems


def main(wheel: str) -> int:
    import torch

    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    try:
        problems = mismatches(
            wheel_tags(wheel), torch.__version__, torch.version.cuda, python, torch.compiled_with_cxx11_abi()
        )
    except ValueError as exc:
        problems = [str(exc)]
    if problems:
        print(f"FLASH_ATTN_WHEEL_URL does not fit this image: {Path(wheel).name}: {'; '.join(problems)}. "
              "Pick the wheel for this flavour (README, Images) or leave it unset (SDPA).", file=sys.stderr)  # fmt: skip
        return 1
    print(f"{Path(wheel).name} fits torch {torch.__version__} (CUDA {torch.version.cuda}), {python}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
