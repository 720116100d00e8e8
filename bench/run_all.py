"""`make bench`: every benchmark, each a ratio against a baseline measured in the same run,
written to BENCHMARKS.md with the machine it ran on.

    python bench/run_all.py [--quick] [--only datagen,pretrain,checkpoint]

With --only, the named benchmarks' sections of an existing BENCHMARKS.md are replaced and the others kept.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(
    0, str(REPO / "tests/container")
)  # bench_image drives the engine through the test tier's helpers
BENCHES = [
    "bench_datagen",
    "bench_pretrain",
    "bench_loss",
    "bench_dpo",
    "bench_checkpoint",
    "bench_checkpoint_async",
    "bench_finetune",
    "bench_finetune_vlm",
    "bench_convert",
    "bench_image",
    "bench_supervise",
]


def machine() -> str:
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB RAM, GPU: {gpu}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, {platform.system()} {platform.release()}"
    )


def gpu_section() -> str:
    return (
        "## GPU\n\nNot measured yet: `make gpu-check` on a CUDA machine writes this section (bench/gpu_check.py: "
        "MFU of the 125m and 1b presets, peak memory against the preflight estimate, checkpoint stalls, QLoRA "
        "memory and speed, `pytest -m gpu`).\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smaller inputs (a smoke run, not for the report)"
    )
    parser.add_argument(
        "--only",
        help="comma-separated subset: datagen, pretrain, loss, dpo, checkpoint, checkpoint_async, finetune, "
        "finetune_vlm, convert, image, supervise",
    )
    parser.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    args = parser.parse_args()
    names = [f"bench_{n}" for n in args.only.split(",")] if args.only else BENCHES
    workdir = REPO / "bench-out"
    sections = []
    for name in names:
        print(f"running {name} ...", flush=True)
        section = importlib.import_module(name).run(workdir, quick=args.quick)
        print(section, flush=True)
        sections.append(section)
    header = [
        "# Benchmarks",
        "",
        f"Written by `make bench` on {datetime.date.today().isoformat()}{' (quick mode)' if args.quick else ''}.",
        f"Machine: {machine()}.",
        "",
        "Each figure is a ratio against a baseline measured in the same command on the same machine.",
        "",
    ]
    out = Path(args.out)
    # The GPU section is `make gpu-check`'s (bench/gpu_check.py): a CPU run keeps a measured one.
    measured_gpu = (
        [s for s in split_sections(out.read_text())[1] if _heading(s) == "## GPU"] if out.exists() else []
    )
    sections += measured_gpu or [gpu_section()]
    if args.only and out.exists():
        # A subset rewrites its own sections and keeps the others, so one slow bench can be rerun alone.
        sections = merge_sections(split_sections(out.read_text())[1], sections)
    out.write_text("\n".join(header + sections))
    print(f"wrote {out}")
    return 0


def split_sections(text: str) -> tuple[str, list[str]]:
    """(what precedes the first `## ` heading, each `## ` section with its text up to the next one)."""
    parts = re.split(r"(?m)^(?=## )", text)
    return parts[0], [part.rstrip("\n") + "\n" for part in parts[1:]]


def _heading(section: str) -> str:
    return section.split("\n", 1)[0]


def merge_sections(existing: list[str], fresh: list[str]) -> list[str]:
    """`existing` with each section of `fresh` in the place of the one of the same heading (new ones last)."""
    by_heading = {_heading(section): section for section in fresh}
    merged = [by_heading.pop(_heading(section), section) for section in existing]
    return merged + list(by_heading.values())


if __name__ == "__main__":
    sys.exit(main())
