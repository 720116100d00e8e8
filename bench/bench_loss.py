"""The chunked linear cross-entropy (train/loss.py) vs the plain loss: peak memory and speed of a loss step.

    python bench/bench_loss.py [--quick]

A loss step is the head's matmul, the cross-entropy and the backward into the hidden states and
the head's weight, at a 32k vocabulary. Each variant runs in a fresh process (so one's freed memory
cannot hide the other's), which measures its peak resident memory above what it held before the
step: the kernel's high-water mark (VmHWM), reset just before through /proc/self/clear_refs. That
sees every allocation torch makes on the CPU, which tracemalloc does not. Processes alternate in
ABBA order; the best run of each is judged (interference only adds time and memory).
Target: chunked peak <= 0.5x the plain one; the speed ratio is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from abba import paired

REPO = Path(__file__).resolve().parents[1]
MEMORY_TARGET = 0.5
VOCAB, WIDTH = 32768, 256


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(variant: str, rows: int, steps: int) -> dict:
    """Runs in the fresh process: setup, reset the high-water mark, `steps` loss steps."""
    import time

    import torch
    import torch.nn.functional as F

    from trainpod.train.loss import linear_cross_entropy

    torch.set_num_threads(2)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, WIDTH, generator=generator, requires_grad=True)
    weight = (0.02 * torch.randn(VOCAB, WIDTH, generator=generator)).requires_grad_()
    targets = torch.randint(0, VOCAB, (rows,), generator=generator)
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)  # as in training
    if variant == "plain":
        loss_fn = lambda: F.cross_entropy((hidden @ weight.T).float(), targets)  # noqa: E731
    else:
        loss_fn = lambda: linear_cross_entropy(hidden, weight, targets)  # noqa: E731
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        times.append(time.perf_counter() - start)
    return {"peak_bytes": (_status_kib("VmHWM") - before) * 1024, "step_s": min(times), "loss": loss.item()}


def run_variant(variant: str, rows: int, steps: int) -> dict:
    code = (
        f"import sys, json; sys.path.insert(0, {str(REPO / 'bench')!r}); import bench_loss; "
        f"print(json.dumps(bench_loss.child({variant!r}, {rows}, {steps})))"
    )
    env = os.environ | {"PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(workdir: Path, quick: bool = False) -> str:
    rows = 1024 if quick else 4096
    steps = 2
    pairs = 1 if quick else 2
    plain, chunked = paired(
        pairs, lambda: run_variant("plain", rows, steps), lambda: run_variant("chunked", rows, steps)
    )
    plain_peak = min(r["peak_bytes"] for r in plain)
    our_peak = min(r["peak_bytes"] for r in chunked)
    plain_s = min(r["step_s"] for r in plain)
    our_s = min(r["step_s"] for r in chunked)
    memory_ratio = our_peak / plain_peak
    same = abs(plain[0]["loss"] - chunked[0]["loss"]) <= 1e-5 * abs(plain[0]["loss"])
    mib = 2**20
    return "\n".join(
        [
            "## Loss",
            "",
            f"A loss step (head matmul, cross-entropy, backward into the hidden states and the head) on {rows:,} "
            f"rows of width {WIDTH} at vocabulary {VOCAB:,}, fp32 on CPU, 2 threads: the plain "
            "`F.cross_entropy((hidden @ weight.T).float(), targets)` vs train/loss.py's `linear_cross_entropy` "
            f"(chunks of {min(rows, 512)} rows, 64 MiB of fp32 logits each). Each variant in a fresh process, peak "
            f"resident memory above the step's start (VmHWM reset through /proc/self/clear_refs), {pairs} pairs in "
            f"ABBA order, best of each; step time the best of {steps} steps. The machine is shared with other "
            "engineers' jobs (2 cores), so the times are noisy; the memory is not.",
            "",
            "| metric | measured | target | result |",
            "| --- | --- | --- | --- |",
            f"| plain loss: peak memory of the step | {plain_peak / mib:,.0f} MiB | | |",
            f"| chunked loss: peak memory of the step | {our_peak / mib:,.0f} MiB | | |",
            f"| chunked / plain peak memory | {memory_ratio:.3f}x | <= {MEMORY_TARGET}x | "
            f"{'pass' if memory_ratio <= MEMORY_TARGET else 'FAIL'} |",
            f"| plain loss: step time | {plain_s * 1000:,.0f} ms | | |",
            f"| chunked loss: step time | {our_s * 1000:,.0f} ms | | |",
            f"| chunked / plain speed | {plain_s / our_s:.3f}x | | |",
            f"| same loss value | {'yes' if same else 'NO'} ({chunked[0]['loss']:.6f}) | identical within fp32 | "
            f"{'pass' if same else 'FAIL'} |",
            "",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default="bench-out")
    args = parser.parse_args()
    print(run(Path(args.workdir), args.quick))
