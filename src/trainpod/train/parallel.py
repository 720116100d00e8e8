"""Which data parallelism a training run uses, DDP or FSDP (`train.parallel: auto | ddp | fsdp`), without
torch: the trainers (train/sharding.py does the sharding) and `trainpod estimate`, which sizes the
memory per GPU as the run will hold it, choose alike.

`auto` is FSDP when there are several ranks and the model has at least FSDP_AUTO_PARAMS parameters
(and the optimizer can step sharded parameters), else DDP. Below that DDP is as fast and simpler: a
replica of a 350M model's weights, gradients and AdamW state is 5.6 GB, 7% of an 80 GB GPU.
"""

from __future__ import annotations

from trainpod.config.pretrain import SHARDABLE_OPTIMIZERS, unshardable_optimizer
from trainpod.errors import InputError

FSDP_AUTO_PARAMS = 1_000_000_000  # 16 bytes per parameter replicated (fp32 weights, grads, AdamW) = 16 GB


def resolve_parallel(requested: str, world_size: int, parameters: int, optimizer: str = "adamw") -> str:
    """ "ddp" or "fsdp" for `train.parallel` (auto, ddp, fsdp) with this many ranks and parameters and
    `train.optimizer`: auto replicates for an optimizer that cannot step sharded parameters, and an
    explicit fsdp with one is an InputError (exit 2) before any step."""
    shardable = optimizer in SHARDABLE_OPTIMIZERS
    if requested == "fsdp" and not shardable:
        raise InputError(unshardable_optimizer(optimizer))
    if requested != "auto":
        return requested
    return "fsdp" if world_size > 1 and parameters >= FSDP_AUTO_PARAMS and shardable else "ddp"
