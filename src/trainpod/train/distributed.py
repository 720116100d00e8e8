"""Process-group setup from torchrun's environment, and the few collectives the trainer needs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# How long a collective may wait for its slowest rank before the process group aborts the run (NCCL's
# watchdog, gloo's timeout): a hung rank ends the run, and the pod's restart, in minutes.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# How long the other ranks wait for work of rank 0 alone (`wait_for_main`): the final export of a 70B model
# to a network volume, a synchronous commit of one, a base model's download, an SFT data build or a
# generation eval may each take far longer than COLLECTIVE_TIMEOUT, and an abort there came back at every
# restart. A rank 0 that dies instead ends the wait at once (its connections close).
SOLO_WORK_TIMEOUT = timedelta(hours=4)
_solo_work_group: dist.ProcessGroup | None = None


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
    global _solo_work_group
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT, device_id=device_id)
        # Every rank makes it here, together: a group made later would be made while rank 0 is away.
        _solo_work_group = dist.new_group(backend="gloo", timeout=SOLO_WORK_TIMEOUT)
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


def all_reduce_sum_tensor(ctx: DistContext, value: torch.Tensor) -> torch.Tensor:
    """`value` summed over the ranks, in place (a vector of sums: one collective for all of them)."""
    if ctx.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


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


def wait_for_main(ctx: DistContext) -> None:
    """Every rank, after work that rank 0 does alone (docs/design.md, "Checkpoints", work of rank 0 alone): the others
    wait here, however long rank 0 takes, up to SOLO_WORK_TIMEOUT, in a barrier of a gloo group of
    their own, since a wait in a collective of the training group aborts after COLLECTIVE_TIMEOUT. A barrier,
    not a wait on a store key: every rank leaves it together, so rank 0 (which hosts the store without
    torchrun) cannot exit while another rank still reads from it. Only on the path where rank 0 has not
    raised: a rank 0 that raises and exits closes its connections, and the others' barrier fails at once."""
    if not ctx.distributed:
        return
    dist.barrier(group=_solo_work_group)  # None (a group made by someone else): the default group's


def shutdown(ctx: DistContext) -> None:
    global _solo_work_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _solo_work_group = None
