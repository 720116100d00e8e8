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
from pathlib import Path

from abba import paired
from peak_rss import comparison_rows, in_fresh_process, peak_bytes_since, reset_peak

MEMORY_TARGET = 0.5
VOCAB, WIDTH = 32768, 256


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
    before = reset_peak()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        policy = logps_of()
        losses, _, _ = dpo_losses(policy[:pairs], policy[pairs:], reference[:pairs], reference[pairs:], 0.1)
        loss = losses.mean()
        loss.backward()
        times.append(time.perf_counter() - start)
    return {"peak_bytes": peak_bytes_since(before), "step_s": min(times), "loss": loss.item()}


def run(workdir: Path, quick: bool = False) -> str:
    pairs, length = (1, 512) if quick else (2, 1024)
    steps = 2
    rounds = 1 if quick else 2
    whole, chunked = paired(
        rounds,
        lambda: in_fresh_process("bench_dpo", "child", "whole", pairs, length, steps),
        lambda: in_fresh_process("bench_dpo", "child", "chunked", pairs, length, steps),
    )
    table = comparison_rows(("whole logits", "whole"), ("chunked", "chunked"), whole, chunked, MEMORY_TARGET)
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
            *table,
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default="bench-out")
    args = parser.parse_args()
    print(run(Path(args.workdir), args.quick))
