"""The optimizers a training workload can ask for, built in one place for pretrain and finetune.

`adamw` is torch's (fused kernels on CUDA); the bitsandbytes ones keep their states in 8 bit
(a quarter of fp32's 8 bytes per parameter) or page them to host memory when the GPU runs short.
"""

from __future__ import annotations

from typing import Any

import torch

OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only, not on norms or biases (as GPT-2 and Llama were trained, and as HF
    Trainer finetunes). A group with no parameters is left out: LoRA's adapters are all matrices, so a
    LoRA's optimizer keeps the one group its checkpoints have always had."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def in_groups_of(
    optimizer: torch.optim.Optimizer, state: dict[str, Any], params: list[torch.Tensor]
) -> dict[str, Any]:
    """`state` (an `optimizer.state_dict()`) laid out in `optimizer`'s parameter groups, where it was written
    with every parameter in one group (a full finetune before its norms and biases left weight decay), its
    indices following `params` (the trained parameters in the model's order). Each group takes that one
    group's settings, its weight_decay included, so the run goes on exactly as it started. Any other state
    is returned as it is (load_optimizer_state says what does not fit)."""
    groups = optimizer.param_groups
    written = state["param_groups"]
    if len(written) != 1 or len(groups) == 1 or len(written[0]["params"]) != len(params):
        return state
    index_now = {id(p): i for i, p in enumerate(p for group in groups for p in group["params"])}
    indices = iter(range(len(index_now)))
    return {
        "state": {index_now[id(params[i])]: per_param for i, per_param in state["state"].items()},
        "param_groups": [
            {**written[0], "params": [next(indices) for _ in group["params"]]} for group in groups
        ],
    }


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
