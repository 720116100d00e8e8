"""The optimizers a training workload can ask for, built in one place for pretrain and finetune.

`adamw` is torch's (fused kernels on CUDA); the bitsandbytes ones keep their states in 8 bit
(a quarter of fp32's 8 bytes per parameter) or page them to host memory when the GPU runs short.
"""

from __future__ import annotations

from typing import Any

import torch

OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only, not on norms or biases (as GPT-2 and Llama were trained)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_optimizer(
    name: str,
    groups: list[dict[str, Any]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    device: torch.device,
) -> torch.optim.Optimizer:
    """The optimizer `name` (one of OPTIMIZERS) over the parameter groups, each with its weight decay."""
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=device.type == "cuda")
    import bitsandbytes as bnb

    optimizer_class = {
        "adamw_8bit": bnb.optim.AdamW8bit,
        "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
        "paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
    }[name]
    return optimizer_class(groups, lr=lr, betas=betas, eps=eps)
