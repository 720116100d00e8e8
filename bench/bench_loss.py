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
from pathlib import Path

from abba import paired
from peak_rss import comparison_rows, in_fresh_process, peak_bytes_since, reset_peak

MEMORY_TARGET = 0.5
VOCAB, WIDTH = 32768, 256


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
    before = reset_peak()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        times.append(time.perf_counter() - start)
    return {"peak_bytes": peak_bytes_since(before), "step_s": min(times), "loss": loss.item()}


def run(workdir: Path, quick: bool = False) -> str:
    rows = 1024 if quick else 4096
    steps = 2
    pairs = 1 if quick else 2
    plain, chunked = paired(
        pairs,
        lambda: in_fresh_process("bench_loss", "child", "plain", rows, steps),
        lambda: in_fresh_process("bench_loss", "child", "chunked", rows, steps),
    )
    table = comparison_rows(
        ("plain loss", "plain"), ("chunked loss", "chunked"), plain, chunked, MEMORY_TARGET
    )
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
            *table,
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default="bench-out")
    args = parser.parse_args()
    print(run(Path(args.workdir), args.quick))
