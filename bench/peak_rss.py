"""Peak resident memory of a step, measured in a process of its own, and the table of a memory and speed comparison
(bench_loss.py, bench_dpo.py).

    before = reset_peak(); step(); peak = peak_bytes_since(before)
    result = in_fresh_process("bench_loss", "child", "plain", 4096, 2)

The peak is the kernel's high-water mark of the process (VmHWM), reset just before the step through
/proc/self/clear_refs, above what the process held then: it sees every allocation torch makes on the CPU, which
tracemalloc does not. Each variant runs in a fresh process, so that one's freed memory cannot hide the other's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """The resident KiB now, with the high-water mark reset to it."""
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    return before


def peak_bytes_since(before_kib: int) -> int:
    return (_status_kib("VmHWM") - before_kib) * 1024


def in_fresh_process(module: str, function: str, *args: object) -> dict:
    """`module.function(*args)` (a bench module's child, returning a JSON-able dict) in a new Python process."""
    code = (
        f"import sys, json; sys.path.insert(0, {str(REPO / 'bench')!r}); import {module}; "
        f"print(json.dumps({module}.{function}(*{args!r})))"
    )
    env = os.environ | {"PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def comparison_rows(
    baseline: tuple[str, str],
    ours: tuple[str, str],
    base_runs: list[dict],
    our_runs: list[dict],
    target: float,
) -> list[str]:
    """The table of peak memory, step time and loss of the best run of each: `baseline` and `ours` are (the name in
    a row, the short name in a ratio), e.g. ("plain loss", "plain"); each run a dict of peak_bytes, step_s, loss."""
    base_peak, our_peak = min(r["peak_bytes"] for r in base_runs), min(r["peak_bytes"] for r in our_runs)
    base_s, our_s = min(r["step_s"] for r in base_runs), min(r["step_s"] for r in our_runs)
    ratio = our_peak / base_peak
    same = abs(base_runs[0]["loss"] - our_runs[0]["loss"]) <= 1e-5 * abs(base_runs[0]["loss"])
    (base_name, base_short), (our_name, our_short) = baseline, ours
    mib = 2**20
    return [
        "| metric | measured | target | result |",
        "| --- | --- | --- | --- |",
        f"| {base_name}: peak memory of the step | {base_peak / mib:,.0f} MiB | | |",
        f"| {our_name}: peak memory of the step | {our_peak / mib:,.0f} MiB | | |",
        f"| {our_short} / {base_short} peak memory | {ratio:.3f}x | <= {target}x | "
        f"{'pass' if ratio <= target else 'FAIL'} |",
        f"| {base_name}: step time | {base_s * 1000:,.0f} ms | | |",
        f"| {our_name}: step time | {our_s * 1000:,.0f} ms | | |",
        f"| {our_short} / {base_short} speed | {base_s / our_s:.3f}x | | |",
        f"| same loss value | {'yes' if same else 'NO'} ({our_runs[0]['loss']:.6f}) | identical within fp32 | "
        f"{'pass' if same else 'FAIL'} |",
        "",
    ]
