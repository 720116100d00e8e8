"""Training batches read sequentially from token shards, with an O(1) position to checkpoint.

Like llm.c's DataLoader: every rank reads its own B*T+1 window at `position + rank*B*T` of the
current shard, then the position advances by world*B*T. The shard order is a permutation drawn
from (seed, epoch), so the whole position is four integers, restored without replaying batches.

An optimizer step reads world x accumulation windows in a row, and moves to the next shard only
between steps (when the whole step no longer fits). So a step's tokens depend only on the product:
2 ranks x 1 micro-batch read exactly what 1 rank x 2 micro-batches read. That is what lets a run
resume on another GPU count (`rescaled_accumulation`) with the same data and the same global batch.
A shard too short for one whole step is skipped (alike for any split of that product): datagen's last
shard of a split holds what was left over, often less than one step of a large run, and a run that
reached it would otherwise fail at the end of its epoch, and again at every resume.

On CUDA the batches are written straight into pinned (page-locked) host memory and moved with
`to_device`, a non-blocking copy: it runs on the GPU's copy engine while the host goes on queueing
work, where a copy from pageable memory makes the host wait for it every micro-batch. On CPU
nothing changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from trainpod.errors import InputError

log = logging.getLogger(__name__)

ShardOpener = Callable[[Path], np.ndarray]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; from pinned memory on CUDA without blocking the host (pinning it first if
    the producer did not); on CPU the tensor itself."""
    if device.type != "cuda":
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class TokenBatches:
    def __init__(
        self,
        shards: list[Path],
        open_shard: ShardOpener,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        pin_memory: bool = False,
        grad_accum_steps: int = 1,
    ):
        """`pin_memory`: return batches in page-locked memory, for non-blocking copies to a GPU."""
        if not shards:
            raise InputError("the dataset has no shards for this split; rerun datagen with more documents")
        self.shards = list(shards)
        self._open = open_shard
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.pin_memory = pin_memory
        self.grad_accum_steps = grad_accum_steps
        self._micro = 0  # micro-batch index within the current optimizer step
        self.epoch = 0
        self.shard_index = 0  # index into this epoch's order
        self.position = 0  # token offset of the global window in the current shard
        self._order = self._epoch_order(0)
        self._cache: tuple[int, np.ndarray] | None = None
        self._lengths = [len(open_shard(path)) for path in self.shards]  # from the headers: no tokens read
        self._check_some_shard_holds_a_step()

    @property
    def _global_window(self) -> int:
        return self.world_size * self.batch_size * self.seq_len

    @property
    def _step_window(self) -> int:
        return self._global_window * self.grad_accum_steps

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch == 0:
            return list(range(len(self.shards)))  # epoch 0 in dataset order, like llm.c
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shards)).tolist()

    def _holds_a_step(self, shard: int, position: int = 0) -> bool:
        return position + self._step_window + 1 <= self._lengths[shard]

    def _check_some_shard_holds_a_step(self) -> None:
        short = [i for i in range(len(self.shards)) if not self._holds_a_step(i)]
        if len(short) == len(self.shards):
            raise InputError(
                f"no shard of {self.shards[0].parent} holds one optimizer step ({self.world_size} rank(s) x "
                f"{self.grad_accum_steps} accumulation x {self.batch_size} x {self.seq_len} + 1 = "
                f"{self._step_window + 1} tokens; the largest holds {max(self._lengths)}); lower "
                "train.micro_batch_size, train.grad_accum_steps or train.seq_len, or make bigger shards "
                "(datagen shard_tokens)"
            )
        if short and self.rank == 0:
            skipped = sum(self._lengths[i] for i in short)
            log.info(
                "%d of %d shard(s) hold less than one step (%d tokens) and are skipped: %d tokens, %.2f%% of them",
                len(short),
                len(self.shards),
                self._step_window + 1,
                skipped,
                100 * skipped / max(sum(self._lengths), 1),
            )

    def _tokens(self, shard: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != shard:
            self._cache = (shard, self._open(self.shards[shard]))
        return self._cache[1]

    def _seek_a_step(self) -> None:
        """Stay in the current shard while a whole step fits from the position, else move on to the next
        shard that holds one. Bounded: a resume can rescale the accumulation past every shard's size."""
        for _ in range(2 * len(self.shards) + 1):
            if self._holds_a_step(self._order[self.shard_index], self.position):
                return
            self._advance_shard()
        self._check_some_shard_holds_a_step()  # raises: no shard holds a step at this accumulation

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._micro == 0:
            self._seek_a_step()
        tokens = self._tokens(self._order[self.shard_index])
        self._micro = (self._micro + 1) % self.grad_accum_steps
        start = self.position + self.rank * self.batch_size * self.seq_len
        size = self.batch_size * self.seq_len + 1
        window = torch.empty(size, dtype=torch.int64, pin_memory=self.pin_memory)
        window.numpy()[:] = tokens[start : start + size]  # one copy, widening uint16/uint32 to int64
        self.position += self._global_window
        inputs = window[:-1].view(self.batch_size, self.seq_len)
        targets = window[1:].view(self.batch_size, self.seq_len)
        return inputs, targets

    def _advance_shard(self) -> None:
        self.position = 0
        self.shard_index += 1
        if self.shard_index == len(self.shards):
            self.epoch += 1
            self.shard_index = 0
            self._order = self._epoch_order(self.epoch)

    def state_dict(self) -> dict[str, int]:
        """The position between two optimizer steps (taken only there: a commit follows a whole step)."""
        return {
            "epoch": self.epoch,
            "shard_index": self.shard_index,
            "position": self.position,
            "world_size": self.world_size,
            "grad_accum_steps": self.grad_accum_steps,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the saved position. Written by another rank count, the state fits when this run's
        ranks x accumulation read as many windows per step (see `rescaled_accumulation`)."""
        layout = (state["batch_size"], state["seq_len"])
        if layout != (self.batch_size, self.seq_len):
            raise InputError(
                f"the checkpoint's data position was taken with (micro batch, seq_len) = {layout}, this run "
                f"has {(self.batch_size, self.seq_len)}; resume with the same settings, or start a new run name"
            )
        saved_windows = state["world_size"] * state.get("grad_accum_steps", self.grad_accum_steps)
        if saved_windows != self.world_size * self.grad_accum_steps:
            raise InputError(
                f"the checkpoint's steps read {saved_windows} micro-batches ({state['world_size']} rank(s)), "
                f"this run reads {self.world_size * self.grad_accum_steps}; resume on a rank count that "
                f"divides {saved_windows}, or start a new run name"
            )
        self._micro = 0
        self.epoch = state["epoch"]
        self.shard_index = state["shard_index"]
        self.position = state["position"]
        self._order = self._epoch_order(self.epoch)


def rescaled_accumulation(saved: dict[str, int], world_size: int, configured: int) -> int:
    """The accumulation steps that keep a checkpoint's global batch on `world_size` ranks: its ranks x
    accumulation over `world_size` (a spot run may come back on another GPU count). InputError when
    the rank count does not divide it.

    On the rank count that wrote it, that is the checkpoint's own accumulation, not `configured`: a
    run rescaled once (8 GPUs -> 4, accumulation 1 -> 2) commits its rescaled value, and the next
    resume on the same 4 GPUs must keep it (the config's 1 would read half the step's windows)."""
    saved_world = saved["world_size"]
    windows = saved_world * saved.get("grad_accum_steps", configured)
    if windows % world_size:
        fits = ", ".join(str(n) for n in range(1, windows + 1) if windows % n == 0)
        raise InputError(
            f"the checkpoint was written by {saved_world} rank(s) reading {windows} micro-batches per step; "
            f"{world_size} ranks cannot share them evenly. Resume on {fits} GPU(s), or start a new run name"
        )
    return windows // world_size


def accumulation_note(saved: dict[str, int], world_size: int, configured: int, accumulation: int) -> str:
    """The warning for a resume whose accumulation steps are not the config's (`rescaled_accumulation`): another
    rank count, or train.grad_accum_steps edited since the run began, which a resume does not follow (its
    steps keep the global batch they began with; the warning said the rank count had changed, and the
    trainer that the config's other changes are taken)."""
    saved_world = saved["world_size"]
    if saved_world != world_size:
        return (
            f"the checkpoint was written by {saved_world} rank(s); on {world_size}, train.grad_accum_steps "
            f"becomes {accumulation} so that every step still trains on the same rows"
        )
    return (
        f"train.grad_accum_steps={configured} is not what this run trains with: its checkpoints take "
        f"{accumulation} micro-batches a step on {world_size} rank(s), kept so that every step trains on the same "
        "rows; to train with another batch, start a new run name"
    )


def eval_batches(
    shards: list[Path],
    open_shard: ShardOpener,
    batch_size: int,
    seq_len: int,
    count: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `count` validation windows of one micro-batch each, the same at every evaluation and on any
    rank count (they are read as one rank reads them; the caller shares them out across its ranks), so a run
    resumed on another GPU count evaluates the same tokens. InputError when no validation shard holds one."""
    window = batch_size * seq_len + 1
    largest = max((len(open_shard(path)) for path in shards), default=0)
    if largest < window:
        raise InputError(
            f"no validation shard holds one eval micro-batch ({batch_size} x {seq_len} + 1 = {window} tokens; "
            f"the largest holds {largest}); lower train.micro_batch_size or train.seq_len, give the validation "
            "split more tokens (datagen val_ratio), or set train.eval_every=0 to train without evals"
        )
    batches = TokenBatches(shards, open_shard, batch_size, seq_len, seed=0)
    out = []
    for _ in range(count):
        batch = batches.next_batch()
        if batches.epoch > 0:  # a small validation split wrapped; stop rather than repeat windows
            break
        out.append(batch)
    return out
