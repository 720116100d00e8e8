"""The RNG states of the ranks other than 0, beside the checkpoints, for `trainpod.Checkpointer`.

    checkpoints/rng/step-<N>.rank-<R>.pt      (rank 0's state is the checkpoint's own rng.pt)

Rank 0 alone commits a checkpoint, and gathering the other ranks' states into it would make `commit`
a collective: README's loop calls it under `commit_fits()`, which each rank answers for itself, and
many loops call it on rank 0 only, so a collective there would hang. Each other rank instead writes its
own state here at the top of its `commit(N)`, and a restore of step N reads it back on that rank.
Ranks that seed their own streams (nanoGPT's `1337 + rank`), draw dropout masks or sample batches
with the global RNG so resume on their own streams; before this, every rank resumed on rank 0's.

A rank with no valid file for the step restores rank 0's state, with a warning: a loop that commits
on rank 0 only, a kill between rank 0's commit and this rank's write, a resume on more ranks.

Crash safety: each file is written to a temp name, fsynced and renamed (trainpod.atomic), and holds
its step, rank and the sha256 of the state, checked when it is read. None of it is part of a
checkpoint (no manifest names it; `trainpod checkpoint verify` does not read it), so a kill at any
instant loses nothing committed. A rank removes its own temp leftovers and its own files newer than
the step it restores (written for a commit that never happened) at its restore; after each commit
rank 0 removes the files of older steps that are no longer committed checkpoints (retention).
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainpod import atomic
from trainpod.checkpoint.store import RANK_RNG_FOLDER, step_dir_name

_FILE = re.compile(r"^step-(\d+)\.rank-(\d+)\.pt(\.tmp-.+)?$")


class RankRng:
    """The per-rank RNG files of one checkpoint store (`checkpoints/rng/`)."""

    def __init__(self, checkpoints: Path):
        self.checkpoints = checkpoints
        self.folder = checkpoints / RANK_RNG_FOLDER

    def path(self, step: int, rank: int) -> Path:
        return self.folder / f"step-{step}.rank-{rank}.pt"

    def write(self, step: int, rank: int, state: dict[str, Any]) -> None:
        """`state` (trainpod.capture_rng) as this rank's for `step`, atomically."""
        target = self.path(step, rank)
        if target.exists() and (self.checkpoints / step_dir_name(step)).is_dir():
            # The step is committed already (a stop right after a resume, before a new step): the store
            # keeps that checkpoint and discards the duplicate, so this rank keeps the state that goes
            # with it too, not one drawn from since.
            return
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic.fsync_dir(self.checkpoints)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        record = io.BytesIO()
        torch.save(
            {
                "step": step,
                "rank": rank,
                "sha256": hashlib.sha256(data).hexdigest(),
                "state": torch.frombuffer(bytearray(data), dtype=torch.uint8),
            },
            record,
        )
        atomic.write_bytes(target, record.getvalue())

    def read(self, step: int, rank: int) -> tuple[dict[str, Any] | None, str]:
        """(this rank's state for `step`, "") when its file is there and whole, else (None, why not)."""
        path = self.path(step, rank)
        if not path.is_file():
            return None, f"{path} is missing"
        try:
            record = torch.load(path, weights_only=True)
            data = record["state"].numpy().tobytes()
            if (record["step"], record["rank"]) != (step, rank):
                return None, f"{path} holds step {record['step']} of rank {record['rank']}"
            if hashlib.sha256(data).hexdigest() != record["sha256"]:
                return None, f"{path} does not match its sha256 (bit rot or a torn write)"
            return torch.load(io.BytesIO(data), weights_only=True), ""
        except Exception as error:  # torn, rotten, not a record: whatever it is, rank 0's state is used
            return None, f"{path} is unreadable ({type(error).__name__}: {error})"

    def remove_stale(self, rank: int, restored_step: int | None) -> None:
        """This rank's files newer than the step it restores (`None`: every one) and its temp leftovers.

        Only its own: the other ranks may be writing theirs meanwhile."""
        stale = [
            path
            for path, step, file_rank, temp in self._files()
            if file_rank == rank and (temp or restored_step is None or step > restored_step)
        ]
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:  # gone for good: one back after a power loss would be taken for a later commit's
            atomic.fsync_dir(self.folder)

    def prune(self, newest: int, committed_steps: Callable[[], set[int]]) -> None:
        """Rank 0, after committing `newest`: the files of older steps that are not committed checkpoints
        (retention deleted them, or their commit never happened). Temp files are left to their own rank,
        which may be writing one now. `committed_steps` reads every checkpoint's manifest, so it is asked
        only when there is an older file to judge: a single process writes none."""
        older = [(path, step) for path, step, _, temp in self._files() if not temp and step < newest]
        if not older:
            return
        committed = committed_steps()
        for path, step in older:
            if step not in committed:
                path.unlink(missing_ok=True)

    def _files(self) -> list[tuple[Path, int, int, bool]]:
        if not self.folder.is_dir():
            return []
        found = []
        for path in self.folder.iterdir():
            match = _FILE.match(path.name)
            if match:
                found.append((path, int(match.group(1)), int(match.group(2)), match.group(3) is not None))
        return found
