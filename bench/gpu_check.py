"""`make gpu-check`: every GPU claim of trainpod measured on the machine it runs on, written as a dated
GPU section of BENCHMARKS.md, the raw results and logs kept under bench/results/gpu-<date>/.

    python bench/gpu_check.py                      # every part, then the report (a CUDA machine)
    python bench/gpu_check.py --part pretrain      # one part (each unit fits a 10-minute call)
    python bench/gpu_check.py --part memory --preset 4b   # one preset of a part
    python bench/gpu_check.py --resume --deadline-s 540   # what is not yet done, within 9 minutes
    python bench/gpu_check.py --report-only        # the report from the results already there
    python bench/gpu_check.py --dry                # on CPU: tiny sizes, GPU-only steps skipped

A bare GPU machine with no internet has a CUDA torch, transformers, peft and accelerate but not
bitsandbytes or pydantic: `make gpu-wheels` (on a machine with the package index) downloads those
wheels into .whl/, and `make gpu-check` installs them offline (--no-index) before it runs. Where the
machine has no make, the same in Python alone (a fresh machine per call: results under bench/results
travel with the repository, and --resume picks up from them):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD/src python3 bench/gpu_check.py --resume --deadline-s 540 --results bench/results/gpu-<date>
    tar czf $OUT/results.tgz --exclude='*/work' bench/results/gpu-<date>   # back to where the next call starts

What the units took on an H100 (2026-11-27, bench/results/gpu-2026-11-27/, the seconds in each JSON): env
13 s; pretrain-125m 206 s (181 s of it the first step's compile, since cut: the chunked loss's loop
unrolled 128 times), pretrain-1b 154 s (78 s compile), checkpoint-125m 98 s, memory-125m 67 s, memory-1b
49 s, memory-2b over 111 s; qlora-32b failed after 44 s. Since then the pretrain units also measure their
presets' memory (memory-125m and memory-1b were a second compile each) and the memory part runs the 2b and
4b presets alone. A lent machine gives a session 15 minutes in all, its start (a minute or two) included:
two calls, the second on the still-warm machine (it waits 30 s), with results kept outside the tree
(`--results /tmp/gr`: a warm machine keeps /tmp and its compile caches, and --resume there skips what the
first call finished); tar them back each call. The parts run in PARTS's order, those with a target first;
near the deadline a unit that needs more time than is left (SHORTEST_ON_GPU_S) gives way to the next that fits.

Name the --results folder every call (the default is named from the machine's date, and a run across
midnight UTC would start a new one) and leave each unit's work/ folder out of what comes back (a unit
cut off by the call's limit leaves its scratch volume there, gigabytes for qlora-32b).

Each unit (a part, for one preset where it has presets) runs in a process of its own, so one unit's
memory does not count in another's peak and a crash in one leaves the others' results; each writes
<results>/<unit>.json and <unit>.log, and its scratch volume under <results>/work/ is removed after it.
--dry runs the same code on CPU with a tiny model, so the unit tier (tests/test_gpu_check.py) keeps this
harness working between GPU runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

UNIT_TIMEOUT_S = 540  # under the 10 minutes one call to a lent GPU machine may take
# Less than this before the deadline and a unit is not started: its process alone takes longer to start,
# and comparing against zero made "the deadline has passed" depend on how fast the machine reached the check.
TOO_LITTLE_TIME_TO_START_S = 0.1
# The least each unit took on a GPU (the H100 of 2026-11-27, rounded down; a unit cut off there: the seconds it
# had), so that a call near its deadline starts the next unit that can finish instead of one that cannot: a lent
# machine's 15 minutes are all the GPU time a session gets. A unit a call cut off once needs more than it had
# there (its result's `cut_at_s`); a unit not listed is started whenever time is left. Not used in --dry mode.
SHORTEST_ON_GPU_S = {
    "env": 10,
    "pretrain-125m": 60,  # 206 s on 2026-11-27, 181 of them a compile since cut down
    "pretrain-1b": 120,
    "checkpoint-125m": 90,
    "memory-2b": 110,
    "packing": 70,
}
TARGETS = {
    "mfu_125m": 0.45,
    "mfu_1b": 0.50,
    "qlora_vs_trainer": 1.5,
    "qlora_32b_peak_gb": 65.0,
    "estimate_error": 0.15,
    "async_5min": 0.99,
}


# The versions the GPU section names: the machine's own (a version nobody read until this run, or one
# carried by `make gpu-wheels`), so that a unit failing on a version can be told from the report alone.
ENV_PACKAGES = (
    "transformers",
    "peft",
    "accelerate",
    "torchvision",
    "triton",
    "tokenizers",
    "safetensors",
    "huggingface-hub",
    "numpy",
    "typing-extensions",
    "pydantic",
    "datasets",
    "pyarrow",
    "fsspec",
)


def _env_part(volume: Path, preset: str | None, dry: bool) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "dry": dry}
    info["packages"] = {name: _version(name) for name in ENV_PACKAGES}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "gpu_memory_bytes": props.total_memory,
            "capability": [props.major, props.minor],
        }
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ) if _has("nvidia-smi") else None  # fmt: skip
    info["nvidia_smi"] = smi.stdout.strip() if smi is not None else None
    info |= _bitsandbytes()
    from trainpod.train.reporting import peak_flops

    info["peak_bf16_flops"] = peak_flops(torch.device("cuda", 0)) if torch.cuda.is_available() else None
    return info


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _bitsandbytes() -> dict[str, Any]:
    try:
        import bitsandbytes as bnb
        import torch
    except ImportError as exc:
        return {"bitsandbytes": None, "bitsandbytes_error": str(exc)}
    loaded = None
    if torch.cuda.is_available():  # a 4-bit round trip on the GPU proves the CUDA library loaded
        try:
            from bitsandbytes.functional import dequantize_4bit, quantize_4bit

            weight = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
            packed, state = quantize_4bit(weight, quant_type="nf4")
            loaded = bool((dequantize_4bit(packed, state) - weight).abs().max() < 0.5)
        except Exception as exc:  # the report shows why the CUDA kernels are unusable
            loaded = f"failed: {type(exc).__name__}: {exc}"
    return {"bitsandbytes": bnb.__version__, "bitsandbytes_cuda": loaded}


def _has(program: str) -> bool:
    return any((Path(p) / program).exists() for p in os.environ.get("PATH", "").split(os.pathsep))


def gpu_test_files() -> list[str]:
    """The test files that hold `gpu`-marked tests. pytest imports every file it is given before `-m gpu`
    deselects, and the rest of the suite needs packages a bare GPU machine lacks (jsonschema, boto3, mlx):
    naming these files alone keeps one missing test-only package from failing the whole collection."""
    tests = REPO / "tests"
    return sorted(
        str(path.relative_to(REPO))
        for path in tests.glob("test_*.py")
        if "pytest.mark.gpu" in path.read_text()
    )


# The seconds a unit's process may run, set by run_units (the unit's share of the call's deadline).
UNIT_LIMIT_ENV = "GPU_CHECK_UNIT_LIMIT_S"
# Set for the units of a --resume call: the gpu-tests unit runs only the tests no earlier call passed.
RESUME_ENV = "GPU_CHECK_RESUME"
# What the gpu-tests unit keeps of its limit to end pytest and write its result before run_units kills it.
PYTEST_END_MARGIN_S = 20.0
# Beside the results, one node id a line: the GPU tests passed so far (not .json: done_units reads those).
GPU_TESTS_PASSED = "gpu-tests.passed.txt"
PYTEST_OUTCOME = re.compile(r"^(\S+::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def _gpu_tests_part(volume: Path, preset: str | None, dry: bool) -> dict[str, Any]:
    """`pytest -m gpu`; in --dry mode only collected (the tests need CUDA). Any test failed, or a file that
    did not import, fails the unit, with pytest's summary as the error.

    The tests take 7 to 8 minutes on an H100 (2026-11-27: 8 of the 15 passed in the 4.5 to 5.5 minutes of a
    first call before its time limit, 6 more in 2.7 in a second), near the unit's 540 s and over a short
    call's deadline. pytest runs with one line per test, streamed into the unit's log, and is ended inside
    the unit's limit, so the tests that ran are in its result (a unit killed by run_units records
    nothing); the tests passed are kept beside the results, and a --resume call runs only the others."""
    passed_file = volume.parents[1] / GPU_TESTS_PASSED
    passed_before: list[str] = []
    if os.environ.get(RESUME_ENV) and passed_file.exists() and not dry:
        passed_before = passed_file.read_text().splitlines()
    junit = volume / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    cmd += gpu_test_files() + [f"--deselect={node}" for node in passed_before]
    if dry:
        cmd.append("--collect-only")
    limit = float(os.environ.get(UNIT_LIMIT_ENV, UNIT_TIMEOUT_S)) - PYTEST_END_MARGIN_S
    lines: list[str] = []
    tests = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )

    def stream() -> None:
        for line in tests.stdout:  # type: ignore[union-attr]
            lines.append(line.rstrip("\n"))
            print(line, end="", flush=True)

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    try:
        code: int | None = tests.wait(timeout=max(limit, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(tests.pid, signal.SIGKILL)  # with the trainpod runs the tests started
        tests.wait()
        code = None
    reader.join(timeout=10)
    by_outcome: dict[str, list[str]] = {}
    for found in filter(None, map(PYTEST_OUTCOME.match, lines)):
        by_outcome.setdefault(found.group(2).lower(), []).append(found.group(1))
    if not dry:
        passed_file.write_text("".join(f"{node}\n" for node in passed_before + by_outcome.get("passed", [])))
    earlier = f"; {len(passed_before)} passed in an earlier call" if passed_before else ""
    outcome: dict[str, Any] = {"collected_only": dry, "tests": by_outcome, "passed_earlier": passed_before}
    if code is None:
        ran = ", ".join(f"{len(names)} {kind}" for kind, names in by_outcome.items()) or "none finished"
        summary = f"cut off by the unit's limit after {limit:.0f} s: {ran}; the rest not run{earlier}"
        return outcome | {"exit_code": "cut off", "summary": summary, "ok": False, "error": summary}
    summary = next((line.strip("= ") for line in reversed(lines) if line.strip()), "") + earlier
    outcome |= {"exit_code": code, "summary": summary}
    no_tests_left = code == 5 and passed_before  # pytest's exit 5: every test was deselected
    if code != 0 and not no_tests_left:
        outcome |= {"ok": False, "error": f"pytest exit {code}: {summary}"}
    return outcome


def _pretrain_part(volume: Path, preset: str | None, dry: bool) -> dict[str, Any]:
    from gpu_pretrain import throughput

    return throughput(volume, preset or "125m", dry)


def _memory_part(volume: Path, preset: str | None, dry: bool) -> dict[str, Any]:
    from gpu_pretrain import preset_memory

    return preset_memory(volume, preset or "125m", dry)


def _checkpoint_part(volume: Path, preset: str | None, dry: bool) -> dict[str, Any]:
    from gpu_pretrain import checkpoint_cost

    return checkpoint_cost(volume, preset or "125m", dry)


def _qlora_32b_part(volume: Path, preset: str | None, dry: bool) -> dict[str, Any]:
    from gpu_finetune import qlora_32b_memory

    return qlora_32b_memory(volume, dry)


def _qlora_speed_part(volume: Path, preset: str | None, dry: bool) -> dict[str, Any]:
    from gpu_finetune import qlora_speed

    return qlora_speed(volume, dry)


def _packing_part(volume: Path, preset: str | None, dry: bool) -> dict[str, Any]:
    from gpu_finetune import packing_attention

    return packing_attention(volume, dry)


def _vlm_generation_part(volume: Path, preset: str | None, dry: bool) -> dict[str, Any]:
    from gpu_finetune import vlm_generation

    return vlm_generation(volume, dry)


Part = Callable[[Path, "str | None", bool], dict[str, Any]]
# part -> (function, presets on a GPU, presets in --dry mode); None: the part has no presets.
PARTS: dict[str, tuple[Part, list[str] | None, list[str] | None]] = {
    # The parts that carry a target first: where GPU time is cut short (a lent machine's 15 minutes), the
    # targets are measured and what is left is the packing figures, the GPU tests and the VLM figures.
    "env": (_env_part, None, None),
    # Also the 125m and 1b presets' peak memory against the estimate, from the same steps.
    "pretrain": (_pretrain_part, ["125m", "1b"], ["125m"]),
    "checkpoint": (_checkpoint_part, ["125m"], ["125m"]),
    "qlora-32b": (_qlora_32b_part, None, None),
    "qlora-speed": (_qlora_speed_part, None, None),
    # The presets the pretrain part does not run (`--preset 125m` still measures one of those on its own).
    "memory": (_memory_part, ["2b", "4b"], ["125m"]),
    # Why the packing probe refused flex attention on the first H100 (qlora-32b, 2026-11-27): each attention
    # on packed rows of the probe's sizes and others, no target. Seconds.
    "packing": (_packing_part, None, None),
    "gpu-tests": (_gpu_tests_part, None, None),
    "vlm-generation": (_vlm_generation_part, None, None),
}


def units(parts: list[str], dry: bool, presets: list[str] | None = None) -> list[tuple[str, str | None]]:
    """(part, preset) to run; `presets` (--preset) replace the list of each part that has presets."""
    out = []
    for part in parts:
        _, gpu_presets, dry_presets = PARTS[part]
        chosen = dry_presets if dry else gpu_presets
        if chosen and presets:
            chosen = presets
        out += [(part, preset) for preset in (chosen or [None])]
    return out


def unit_name(part: str, preset: str | None) -> str:
    return f"{part}-{preset}" if preset else part


def run_unit(part: str, preset: str | None, results: Path, dry: bool) -> dict[str, Any]:
    """One unit in this process: its result (or the error that ended it) as <results>/<unit>.json."""
    name = unit_name(part, preset)
    volume = results / "work" / name
    volume.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        result = {"ok": True, **PARTS[part][0](volume, preset, dry)}
    except Exception as exc:
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    result |= {"unit": name, "dry": dry, "seconds": time.perf_counter() - started}
    (results / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def run_units(
    todo: list[tuple[str, str | None]],
    results: Path,
    dry: bool,
    deadline: float | None = None,
    shortest: dict[str, float] | None = None,
) -> int:
    """Each unit in a process group of its own, killed whole at its time limit (a unit's pytest or trainer
    children would otherwise hold the GPU's memory into the next unit). `deadline` (time.monotonic()):
    no unit starts after it and none runs past it, so a caller with a hard limit gets its results back; nor
    does one start with less time left than it needs (`shortest`, by unit name; SHORTEST_ON_GPU_S on a GPU):
    the units after it that fit run instead."""
    if shortest is None:
        shortest = {} if dry else SHORTEST_ON_GPU_S
    failures = 0
    for part, preset in todo:
        name = unit_name(part, preset)
        limit = UNIT_TIMEOUT_S if deadline is None else min(UNIT_TIMEOUT_S, deadline - time.monotonic())
        if limit < TOO_LITTLE_TIME_TO_START_S:
            print(f"gpu-check: {name} not started: the deadline has passed", flush=True)
            failures += 1
            continue
        needs = max(shortest.get(name, 0.0), _load(results, name).get("cut_at_s", 0.0))
        if deadline is not None and limit < needs:
            print(
                f"gpu-check: {name} not started: it needs more than {needs:.0f} s, {limit:.0f} s are left",
                flush=True,
            )
            failures += 1
            continue
        print(f"gpu-check: {name} ...", flush=True)
        (results / f"{name}.json").unlink(missing_ok=True)  # a unit that dies writes none: no stale result
        cmd = [sys.executable, __file__, "--unit", f"{part}:{preset or ''}", "--results", str(results)]
        with open(results / f"{name}.log", "w") as log:
            unit = subprocess.Popen(
                cmd + (["--dry"] if dry else []),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=os.environ | {UNIT_LIMIT_ENV: f"{limit:.1f}"},
            )
            try:
                code: int | str = unit.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(unit.pid, signal.SIGKILL)
                unit.wait()
                code = "timeout"
                error = f"timeout after {limit:.0f} s" + (" (the deadline)" if limit < UNIT_TIMEOUT_S else "")
                cut = {"unit": name, "ok": False, "error": error}
                if (
                    limit < UNIT_TIMEOUT_S
                ):  # cut by the call's deadline: a later call gives it more or skips it
                    cut["cut_at_s"] = limit
                (results / f"{name}.json").write_text(json.dumps(cut))
        # Its scratch volume (data, models, checkpoints: GBs at 1b) goes; the results and the log stay.
        shutil.rmtree(results / "work" / name, ignore_errors=True)
        outcome = _load(results, name)
        ok = code == 0 and outcome.get("ok")
        failures += not ok
        print(f"gpu-check: {name} {'ok' if ok else 'FAILED: ' + str(outcome.get('error', code))}", flush=True)
    return failures


def done_units(results: Path, dry: bool) -> set[str]:
    """The units whose result in `results` is a success of the same mode (--resume skips them)."""
    done = set()
    for path in results.glob("*.json"):
        outcome = _load(results, path.stem)
        if outcome.get("ok") and outcome.get("dry") == dry:
            done.add(path.stem)
    return done


def _load(results: Path, name: str) -> dict[str, Any]:
    try:
        return json.loads((results / f"{name}.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part", action="append", choices=list(PARTS), help="run only these parts (repeatable)"
    )
    parser.add_argument(
        "--preset",
        action="append",
        help="the parts with presets run these instead of their own (repeatable): 1b, 4b, ...",
    )
    parser.add_argument("--dry", action="store_true", help="CPU, tiny sizes: exercises the harness")
    parser.add_argument("--results", help="results folder (default bench/results/gpu-<date>/)")
    parser.add_argument(
        "--benchmarks", help="the report goes into this file's GPU section (default BENCHMARKS.md)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="skip the units whose result in --results is already a success"
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        help="start no unit after this many seconds and end any still running then (a call's time limit)",
    )
    parser.add_argument("--report-only", action="store_true", help="write the report from existing results")
    parser.add_argument("--unit", help=argparse.SUPPRESS)  # part:preset, run in this process
    args = parser.parse_args(argv)
    today = datetime.date.today().isoformat()
    results = Path(args.results or REPO / "bench/results" / f"gpu-{today}")
    results.mkdir(parents=True, exist_ok=True)
    if args.unit:
        part, _, preset = args.unit.partition(":")
        return 0 if run_unit(part, preset or None, results, args.dry)["ok"] else 1
    failures = 0
    if not args.report_only:
        todo = units(args.part or list(PARTS), args.dry, args.preset)  # a part without presets: its one unit
        if args.resume:
            done = done_units(results, args.dry)
            todo = [(part, preset) for part, preset in todo if unit_name(part, preset) not in done]
        deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
        if args.resume:
            os.environ[RESUME_ENV] = "1"  # the units inherit it
        failures = run_units(todo, results, args.dry, deadline)
    from gpu_report import write_report

    # A dry run's report stays beside its results unless a file is named: it measures nothing.
    target = Path(args.benchmarks) if args.benchmarks else (None if args.dry else REPO / "BENCHMARKS.md")
    write_report(results, target, TARGETS, units(list(PARTS), args.dry))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
