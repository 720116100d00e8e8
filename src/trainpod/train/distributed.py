"""Process-group setup from torchrun's environment, and the few collectives the trainer needs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(always_group: bool = False) -> DistContext:
    """One process per GPU under torchrun (NCCL), or CPU processes over gloo; plain single process
    otherwise, unless `always_group` (FSDP on one GPU) asks for a group of one."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(minutes=10), device_id=device_id)
    elif always_group and not dist.is_initialized():  # no torchrun: a group of this process alone
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    return DistContext(rank, local_rank, world_size, device)


def all_reduce_max(ctx: DistContext, values: list[float]) -> list[float]:
    if not ctx.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def all_reduce_sum(ctx: DistContext, value: float) -> float:
    if not ctx.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.item()


def all_reduce_mean(ctx: DistContext, value: torch.Tensor) -> torch.Tensor:
    if ctx.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.AVG if ctx.device.type == "cuda" else dist.ReduceOp.SUM)
        if ctx.device.type != "cuda":  # gloo has no AVG
            value /= ctx.world_size
    return value


def broadcast_from_main(ctx: DistContext, value: float) -> float:
    if not ctx.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.broadcast(tensor, src=0)
    return tensor.item()


def broadcast_object(ctx: DistContext, obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a path, a decision)."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_main(ctx: DistContext, obj: Any) -> list[Any] | None:
    if not ctx.distributed:
        return [obj]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def shutdown(ctx: DistContext) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
