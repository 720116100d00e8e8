"""Learning-rate schedule as a pure function of the step: nothing to checkpoint but the step itself."""

from __future__ import annotations

import math


def cosine_with_warmup(
    step: int, max_steps: int, peak_lr: float, warmup_steps: int, min_lr_ratio: float
) -> float:
    """The learning rate of `step` (0-based) of `max_steps`: a linear warmup from peak/warmup up to the
    peak at the last warmup step (the first step without warmup), then a cosine decay that reaches
    peak*min_lr_ratio at the last step, max_steps - 1, the final learning rate the config promises."""
    if warmup_steps and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    peak_step = max(warmup_steps - 1, 0)
    decay_steps = max_steps - 1 - peak_step
    progress = min(1.0, (step - peak_step) / decay_steps) if decay_steps > 0 else 0.0  # one step: the peak
    min_lr = peak_lr * min_lr_ratio
    return min_lr + 0.5 * (peak_lr - min_lr) * (1 + math.cos(math.pi * progress))
