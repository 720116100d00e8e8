"""Learning-rate schedule as a pure function of the step: nothing to checkpoint but the step itself."""

from __future__ import annotations

import math


def cosine_with_warmup(
    step: int, max_steps: int, peak_lr: float, warmup_steps: int, min_lr_ratio: float
) -> float:
    """Linear warmup from peak/warmup to peak over `warmup_steps`, then cosine decay to peak*min_lr_ratio."""
    if warmup_steps and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    min_lr = peak_lr * min_lr_ratio
    return min_lr + 0.5 * (peak_lr - min_lr) * (1 + math.cos(math.pi * progress))
