"""Process-group setup from torchrun's environment, and the few collectives the trainer needs."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# How long a collective may wait for its slowest rank before the process group aborts the run (NCCL's
# watchdog, gloo's timeout). Work of rank 0 alone (the final export, a synchronous commit, a download) may
# take far longer: the other ranks wait for it outside any collective (`main_alone`).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# While rank 0 works alone it beats every HEARTBEAT_S through the process group's store; a waiting rank
# that hears no beat for SILENCE_LIMIT_S takes rank 0 for dead (a crash that took its process, or its
# machine, along) and ends.
HEARTBEAT_S = 5.0
SILENCE_LIMIT_S = 120.0
POLL_S = 0.5  # how soon a waiting rank follows rank 0 (a stop leaves it 5 s), in store requests per rank


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
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT, device_id=device_id)
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


_phases = itertools.count(1)  # every rank enters the same `main_alone` phases in the same order
_store: dist.Store | None = None


@contextlib.contextmanager
def main_alone(ctx: DistContext, what: str) -> Iterator[None]:
    """Around work that rank 0 does while the other ranks wait for it (the final export, a synchronous
    commit, a download or cache build), however long it takes: every rank enters, and leaves once rank 0
    has left. Collectives of every rank may run inside.

    The others wait on a key of the process group's store, not in a collective, whose timeout
    (COLLECTIVE_TIMEOUT) would abort the run after 10 minutes of an export of a 70B model, at every
    restart again; rank 0 beats meanwhile, and a waiting rank that hears no beat for SILENCE_LIMIT_S
    ends. When rank 0 raises, the others wait on until it has exited (its exit code is the run's)."""
    if not ctx.distributed:
        yield
        return
    store = _phase_store()
    key = f"phase-{next(_phases)}"
    if ctx.is_main:
        with _beating(store, key):
            yield
        store.set(f"{key}/done", b"1")
        return
    yield
    _wait_for_main(store, key, what)


def _phase_store() -> dist.Store:
    """A client of the store the ranks met at (rank 0's, or torchrun's agent's), with keys of this attempt
    alone: torchrun's agent keeps its store through restarts."""
    global _store
    if _store is None:
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=COLLECTIVE_TIMEOUT,
            wait_for_workers=False,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        _store = dist.PrefixStore(f"trainpod/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{attempt}/", client)
    return _store


@contextlib.contextmanager
def _beating(store: dist.Store, key: str) -> Iterator[None]:
    stopped = threading.Event()

    def beat() -> None:
        while not stopped.is_set():
            try:
                store.add(f"{key}/beats", 1)
            except RuntimeError as exc:  # the store is gone: the others' wait fails on it as well
                log.warning("rank 0's heartbeat stopped: %s", exc)
                return
            stopped.wait(HEARTBEAT_S)

    thread = threading.Thread(target=beat, name="rank-0-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stopped.set()
        thread.join()


def _wait_for_main(store: dist.Store, key: str, what: str) -> None:
    # Polled with `check`, not `wait`: each timed-out wait logs two c10d warnings, thousands in a long export.
    beats, heard, read = -1, time.monotonic(), 0.0
    while not store.check([f"{key}/done"]):
        time.sleep(POLL_S)
        now = time.monotonic()
        if now - read < HEARTBEAT_S:
            continue
        now_beats, read = store.add(f"{key}/beats", 0), now
        if now_beats != beats:
            beats, heard = now_beats, now
        elif now - heard > SILENCE_LIMIT_S:
            raise RuntimeError(
                f"rank 0 gave no sign of life for {SILENCE_LIMIT_S:.0f} s during {what}: it died (see its log "
                "above); this rank ends too"
            )


def shutdown(ctx: DistContext) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
