"""DPO's log-probabilities (train/preference.py) a chunk of rows at a time vs from whole logits: peak memory and
speed of a DPO loss step.

    python bench/bench_dpo.py [--quick]

A DPO loss step here is what follows the decoder in objective dpo: the head's matmul over the 2P rows of P pairs
(chosen, then rejected), each row's log-probability of its answer tokens, the DPO sigmoid loss against fixed
reference log-probabilities, and the backward into the hidden states (the head frozen, as under LoRA). The
baseline takes the log-probabilities from the whole fp32 logits and their log-softmax, as TRL's DPOTrainer
does; train/preference.py `token_logps` takes them a chunk of rows at a time and makes each chunk's logits again in the backward.
Each variant runs in a fresh process; its peak resident memory above what it held before the step is the
kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs), as bench_loss measures it. Processes
alternate in ABBA order; the best run of each is judged. Target: chunked peak <= 0.5x the whole-logits one.
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


def child(variant: str, pairs: int, length: int, steps: int) -> dict:
    """Runs in the fresh process: setup, reset the high-water mark, `steps` DPO loss steps."""
    import time

    import torch

    from trainpod.train.preference import dpo_losses, token_logps

    torch.set_num_threads(2)
    generator = torch.Generator().manual_seed(0)
    rows = 2 * pairs
    hidden = torch.randn(rows, length, WIDTH, generator=generator, requires_grad=True)
    weight = 0.02 * torch.randn(VOCAB, WIDTH, generator=generator)  # frozen: LoRA leaves the head alone
    targets = torch.randint(0, VOCAB, (rows, length), generator=generator)
    targets[:, : length // 4] = -100  # the prompt: untrained
    reference = -torch.rand(rows, generator=generator) * length
    hidden.grad = torch.zeros_like(hidden)  # as in training

    def whole() -> torch.Tensor:
        valid = targets != -100
        logps = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
        return (logps.gather(2, targets.where(valid, 0)[..., None]).squeeze(2) * valid).sum(-1)

    def chunked() -> torch.Tensor:
        return token_logps(hidden, weight, targets).sum(-1)

    logps_of = whole if variant == "whole" else chunked
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        policy = logps_of()
        losses, _, _ = dpo_losses(policy[:pairs], policy[pairs:], reference[:pairs], reference[pairs:], 0.1)
        loss = losses.mean()
        loss.backward()
        times.append(time.perf_counter() - start)
    return {"peak_bytes": (_status_kib("VmHWM") - before) * 1024, "step_s": min(times), "loss": loss.item()}


def run_variant(variant: str, pairs: int, length: int, steps: int) -> dict:
    code = (
        f"import sys, json; sys.path.insert(0, {str(REPO / 'bench')!r}); import bench_dpo; "
        f"print(json.dumps(bench_dpo.child({variant!r}, {pairs}, {length}, {steps})))"
    )
    env = os.environ | {"PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(workdir: Path, quick: bool = False) -> str:
    pairs, length = (1, 512) if quick else (2, 1024)
    steps = 2
    rounds = 1 if quick else 2
    whole, chunked = paired(
        rounds,
        lambda: run_variant("whole", pairs, length, steps),
        lambda: run_variant("chunked", pairs, length, steps),
    )
    whole_peak = min(r["peak_bytes"] for r in whole)
    our_peak = min(r["peak_bytes"] for r in chunked)
    whole_s = min(r["step_s"] for r in whole)
    our_s = min(r["step_s"] for r in chunked)
    memory_ratio = our_peak / whole_peak
    same = abs(whole[0]["loss"] - chunked[0]["loss"]) <= 1e-5 * abs(whole[0]["loss"])
    mib = 2**20
    return "\n".join(
        [
            "## DPO log-probabilities",
            "",
            f"A DPO loss step after the decoder (bench/bench_dpo.py): {pairs} pairs, so {2 * pairs} rows of {length:,} "
            f"tokens of width {WIDTH} at vocabulary {VOCAB:,}, fp32 on CPU, 2 threads, the head frozen as under "
            "LoRA: each row's answer log-probability, the DPO sigmoid loss against fixed reference log-probabilities, "
            "the backward into the hidden states. Whole logits and their log-softmax (as TRL's DPOTrainer takes them) "
            "vs train/preference.py's `token_logps` (chunks of rows, each chunk's logits made again in the backward). Each variant in a fresh "
            f"process, peak resident memory above the step's start (VmHWM), {rounds} pairs in ABBA order, best of "
            f"each; step time the best of {steps} steps, noisy on this shared 2-core machine.",
            "",
            "| metric | measured | target | result |",
            "| --- | --- | --- | --- |",
            f"| whole logits: peak memory of the step | {whole_peak / mib:,.0f} MiB | | |",
            f"| chunked: peak memory of the step | {our_peak / mib:,.0f} MiB | | |",
            f"| chunked / whole peak memory | {memory_ratio:.3f}x | <= {MEMORY_TARGET}x | "
            f"{'pass' if memory_ratio <= MEMORY_TARGET else 'FAIL'} |",
            f"| whole logits: step time | {whole_s * 1000:,.0f} ms | | |",
            f"| chunked: step time | {our_s * 1000:,.0f} ms | | |",
            f"| chunked / whole speed | {whole_s / our_s:.3f}x | | |",
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
