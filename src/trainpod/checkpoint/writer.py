"""One commit path for checkpoints: snapshot the state, then write it in the foreground or behind training.

    writer = CheckpointWriter(store, pin_memory=torch.cuda.is_available())
    files = {"model.safetensors": weights, "optimizer.safetensors": optimizer.state_dict(), "state.json": {}}
    writer.commit(7, files, metadata={}, background=True)  # returns once the snapshot is taken
    ...
    done = writer.poll()   # at each step boundary: the checkpoint finished since, or None; raises its error
    writer.wait()          # before a stop, at the end (commit() itself waits for the one in flight)

torchtitan's `async_with_pinned_mem`, on the store's protocol: the snapshot copies every tensor
into host buffers allocated once and reused by every commit (pinned on CUDA, so the copy runs at
~25 GB/s and behind the compute on the same stream; plain memory on CPU, where training would
otherwise change the tensors under the writer). A daemon thread then hashes, writes and publishes
the files (checkpoint/store.py) while training goes on. On CPU the trainer lets that thread make the
copies too (`defer_copies`), beside the next forward and backward, and its optimizer step waits for
them (`wait_for_snapshot`): the weights and moments change in the step only. At most one commit is
in flight; the next snapshot waits for it, since it reuses its buffers. A commit that cannot finish
before SIGKILL is abandoned: its writes stop at the next piece and it never becomes LATEST.

A sharded checkpoint (FSDP) is written by every rank at once: rank 0 opens the pending checkpoint
(`begin`), each rank's DCP writes its shards into a folder of it, and rank 0 hands the folder to
`commit` as `ShardFiles`: the writer waits until every shard is written, hashes them into the
manifest, writes the other files and publishes, the same way in the foreground or background.

What a file holds follows its name: `*.safetensors` a flat dict of tensors, or any structure of
tensors and plain values (an optimizer's state: the structure goes into the file's metadata,
checkpoint/tree.py, and nothing is pickled), `*.json` a JSON value, bytes as they are, anything else
(`*.pt`) a structure of tensors and plain values for `torch.save` (loadable with `weights_only=True`).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch.utils.serialization import config as serialization_config

from trainpod import tensorfile
from trainpod.checkpoint import tree
from trainpod.checkpoint.store import (
    CheckpointStore,
    CommitAbandoned,
    CommittedCheckpoint,
    HashingFile,
    PendingCheckpoint,
)

log = logging.getLogger(__name__)


class HostBuffers:
    """Host copies of tensors, one buffer per place in the state, allocated once and reused."""

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.copied_from_device = False  # a device copy was queued: wait for it before reading

    def copy(self, key: tuple, tensor: torch.Tensor, deferred: list | None = None) -> torch.Tensor:
        """`tensor` copied into its buffer; with `deferred`, a CPU tensor's copy is appended there as
        (buffer, source) for the writer thread to make instead."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = self.pin_memory and tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buffer
        if deferred is not None and tensor.device.type == "cpu":
            deferred.append((buffer, tensor.detach()))
            return buffer
        # From the GPU into pinned memory the copy is queued on the current stream and training's next
        # kernels run after it; the writer waits for the event recorded behind it. On CPU it is done here.
        buffer.copy_(tensor.detach(), non_blocking=buffer.is_pinned())
        self.copied_from_device |= tensor.device.type != "cpu"
        return buffer

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def snapshot(value: Any, buffers: HostBuffers | None, key: tuple = (), deferred: list | None = None) -> Any:
    """`value` with every tensor replaced by a host copy (in `buffers`), or, without buffers, by a CPU
    tensor that may be the live one (for a write that finishes before training goes on). With `deferred`,
    the copies of CPU tensors are listed there for the writer thread; the structure is rebuilt now."""
    if isinstance(value, torch.Tensor):
        if buffers is None:
            return value.detach().to("cpu").contiguous()
        return buffers.copy(key, value, deferred)
    if isinstance(value, dict):
        return {k: snapshot(v, buffers, (*key, k), deferred) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v, buffers, (*key, i), deferred) for i, v in enumerate(value))
    return value  # numbers, strings, None: immutable, safe to share


@dataclass
class _TensorTree:
    """A structure bound for a safetensors file: its JSON (tree.flatten) and its tensors, snapshotted."""

    structure: str
    tensors: dict[str, torch.Tensor]


def _frozen(name: str, value: Any, buffers: HostBuffers | None, deferred: list | None = None) -> Any:
    if name.endswith(".json"):
        return json.dumps(value, indent=2).encode()  # serialized now: later changes to `value` do not leak in
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if name.endswith(".safetensors") and not tree.is_flat(value):
        # Flattened now, on the training thread: the structure's plain values (an optimizer's lr, a
        # step count) are captured at the snapshot, and the writer thread has only tensors to write.
        structure, tensors = tree.flatten(value)
        return _TensorTree(structure, snapshot(tensors, buffers, (name,), deferred))
    return snapshot(value, buffers, (name,), deferred)


def _write_file(pending: PendingCheckpoint, name: str, value: Any) -> None:
    if isinstance(value, bytes):
        pending.write_bytes(name, value)
    elif isinstance(value, _TensorTree):
        with pending.open(name) as f:
            write_safetensors(f, value.tensors, {tree.METADATA_KEY: value.structure})
    elif name.endswith(".safetensors"):
        with pending.open(name) as f:
            write_safetensors(f, value)
    else:
        # No zip CRC32: each piece's sha256 in the manifest already guards the file, and the CRC pass
        # costs about a third of torch.save's time (11 of 21 ms for 31 MB here). torch.load does not
        # check it. (A process-wide setting: a torch.save on another thread meanwhile skips it too.)
        memory = tensor_memory(value)
        with pending.open(name, memory) as f, serialization_config.patch("save.compute_crc32", False):
            torch.save(value, f)


def tensor_memory(value: Any) -> list[tuple[int, int]]:
    """The address ranges of every CPU tensor's storage in `value`: a snapshot's tensors stay unchanged
    until their file is written, so torch.save's writes from them need no copy (31 MB here)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            return []
        storage = value.untyped_storage()
        return [(storage.data_ptr(), storage.data_ptr() + storage.nbytes())]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [span for item in value for span in tensor_memory(item)]
    return []


def write_safetensors(
    f: HashingFile, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """`tensors` (and `metadata`) in the safetensors format, written from their own memory (no copy).

    safetensors' `save` returns the whole file as one bytes object: a second copy of the weights in
    host memory for the length of the commit (8 GB at 4b) and 22 ms per 16 MB on this CPU, made holding
    the GIL, which stalls training on the other thread. The header comes from `tensorfile.layout` (as
    for merges); the tensors must stay unchanged until the file is closed: a snapshot's buffers, or live
    ones in a foreground commit. A dtype the layout does not name goes through safetensors' own `save`.
    """
    try:
        file = tensorfile.layout(
            {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}, metadata or {}
        )
    except ValueError:
        f.write_stable(safetensors.torch.save(tensors, metadata))
        return
    f.write_stable(file.header)
    for entry in file.tensors:
        f.write_stable(tensors[entry.name].detach().contiguous().reshape(-1).view(torch.uint8).numpy())


@dataclass
class ShardFiles:
    """Files other processes write into a pending checkpoint (every rank's DCP shards, in `folder`):
    complete when `written` resolves (None: written already, by a foreground `dcp.save`)."""

    pending: PendingCheckpoint
    folder: Path
    written: Future | None = None

    def adopt_into_manifest(self) -> None:
        if self.written is not None:
            self.written.result()  # raises what went wrong on any rank
        prefix = self.folder.relative_to(self.pending.dir)
        for path in sorted(self.folder.iterdir()):
            self.pending.adopt(f"{prefix}/{path.name}", path)


@dataclass
class _Commit:
    """One snapshot on its way to the volume."""

    step: int
    files: dict[str, Any]
    metadata: dict[str, Any]
    eval_loss: float | None
    copied: torch.cuda.Event | None = None  # set when tensors were copied from a GPU without waiting
    started: float = field(default_factory=time.monotonic)
    background: bool = False
    result: CommittedCheckpoint | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: threading.Event = field(default_factory=threading.Event)
    score: tuple[str, float] | None = None  # (metric, value) that ranks it for best-k retention
    shards: ShardFiles | None = None
    deferred_copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (buffer, source)
    snapshot_taken: threading.Event = field(default_factory=threading.Event)


class CheckpointWriter:
    """Snapshots named state and commits it through `store`, in the foreground or on a background thread."""

    def __init__(self, store: CheckpointStore, pin_memory: bool = False):
        self.store = store
        self.buffers = HostBuffers(pin_memory)
        self.last_commit_seconds: float | None = None  # snapshot + write of the newest finished commit
        # The step of the commit whose error was raised last: a background commit's surfaces at a later step.
        self.failed_step: int | None = None
        self._in_flight: _Commit | None = None
        # A background commit that finished while `commit` or `begin` waited for it: no caller saw it, so the
        # next `poll`, `wait` or `abandon` hands it out (the trainer records the newest commit from those).
        self._unreported: CommittedCheckpoint | None = None
        self._commit_point = threading.Lock()  # an abandon and a publish never interleave
        # One thread for every background commit, started at the first: starting a thread per commit made
        # the training thread wait, 1-10 ms on 2 busy cores, until the new thread had run. A daemon, so
        # that a write hung on a dead volume never holds up the process's exit.
        self._jobs: queue.SimpleQueue[_Commit] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------- commit
    def commit(
        self,
        step: int,
        files: dict[str, Any],
        metadata: dict[str, Any],
        eval_loss: float | None = None,
        background: bool = False,
        score: tuple[str, float] | None = None,
        shards: ShardFiles | None = None,
        defer_copies: bool = False,
    ) -> CommittedCheckpoint | None:
        """Snapshot `files` and commit them as `step-<step>`; with `background`, return once the snapshot
        is taken (the result comes from `poll` or `wait`), else return the committed checkpoint.
        `shards`: files of a pending checkpoint from `begin` that other processes write.

        `defer_copies` (with `background`): return before the CPU tensors are copied; the writer thread
        copies them while training goes on. The caller promises that they stay unchanged until
        `wait_for_snapshot` returns, which it calls before changing them (the trainer: before each
        optimizer step). This hides the copy itself (~10 ms per 46 MB on a CPU) from training."""
        self._wait_unreported()  # one in flight at most, and its buffers are the ones the snapshot reuses
        started = time.monotonic()
        buffers = self.buffers if background else None
        deferred: list | None = [] if background and defer_copies else None
        frozen = {name: _frozen(name, value, buffers, deferred) for name, value in files.items()}
        copied = None
        if background and self.buffers.copied_from_device:
            copied = torch.cuda.Event()
            copied.record()
        job = _Commit(
            step,
            frozen,
            metadata,
            eval_loss,
            copied,
            started,
            background,
            # Shards written by other processes stop with the pending checkpoint they write into.
            abandoned=shards.pending.abandoned if shards else threading.Event(),
            score=score,
            shards=shards,
            deferred_copies=deferred or [],
        )
        if not job.deferred_copies:
            job.snapshot_taken.set()
        if not background:
            self._write(job)
            committed = self._finish(job)
            self._unreported = None  # this newer one is the one reported
            return committed
        self._in_flight = job
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="checkpoint-writer", daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return None

    def _serve(self) -> None:
        while True:
            self._write(self._jobs.get())

    def _write(self, job: _Commit) -> None:
        try:
            if job.copied is not None:
                job.copied.synchronize()
            try:
                self._copy_deferred(job)
            finally:
                job.snapshot_taken.set()  # also on an error: an optimizer step waiting must not hang
            pending_shards = job.shards.pending if job.shards else None
            with self.store.writing(job.step, job.abandoned, pending_shards) as pending:
                if job.shards is not None:
                    job.shards.adopt_into_manifest()
                for name, value in job.files.items():
                    _write_file(pending, name, value)
                with self._commit_point:
                    job.result = self.store.publish(
                        pending, job.step, job.metadata, job.eval_loss, score=job.score
                    )
            job.files = {}  # the bytes it serialized can go; the tensors are the reused buffers
            if not job.abandoned.is_set():
                self.store.apply_retention()
            seconds = time.monotonic() - job.started  # from the snapshot's start
            self.last_commit_seconds = seconds
            how = " in the background" if job.background else ""
            log.info("committed checkpoint step-%d in %.2f s%s", job.step, seconds, how)
        except BaseException as exc:  # handed to the training thread by poll() or wait()
            job.error = exc
        finally:
            job.done.set()

    @staticmethod
    def _copy_deferred(job: _Commit) -> None:
        """The copies `defer_copies` left to this thread (torch's copy releases the GIL: training goes on)."""
        for buffer, source in job.deferred_copies:
            buffer.copy_(source)
        job.deferred_copies = []

    def _finish(self, job: _Commit) -> CommittedCheckpoint | None:
        if self._in_flight is job:
            self._in_flight = None
        if isinstance(job.error, CommitAbandoned):
            return None
        if job.error is not None:
            self.failed_step = job.step
            raise job.error
        return job.result

    def begin(self, step: int) -> PendingCheckpoint:
        """A pending checkpoint for files that other processes write (`ShardFiles`), after the commit in
        flight: one at a time, as for `commit`."""
        self._wait_unreported()
        return self.store.begin(step)

    def _wait_unreported(self) -> None:
        """`wait`, its checkpoint kept for the next `poll`: dropped, a commit that finished while the next
        snapshot waited for it (a commit slower than the interval between commits) was never recorded."""
        committed = self.wait()
        if committed is not None:
            self._unreported = committed

    def _newest(self, committed: CommittedCheckpoint | None) -> CommittedCheckpoint | None:
        """`committed`, else the unreported one; either way none is unreported any longer."""
        unreported, self._unreported = self._unreported, None
        return committed or unreported

    # ------------------------------------------------------------------------- in flight
    @property
    def in_flight_step(self) -> int | None:
        return self._in_flight.step if self._in_flight else None

    def in_flight_seconds(self) -> float:
        """How long the commit in flight has been going (0 when none is)."""
        return time.monotonic() - self._in_flight.started if self._in_flight else 0.0

    def wait_for_snapshot(self) -> None:
        """Return once the commit in flight holds its own copy of the state (at once when none is, or
        when its copies were not deferred): call it before changing tensors given to `defer_copies`."""
        job = self._in_flight
        if job is not None:
            job.snapshot_taken.wait()

    def poll(self) -> CommittedCheckpoint | None:
        """The checkpoint a background commit finished since the last call, or None; raises its error."""
        job = self._in_flight
        if job is None or not job.done.is_set():
            return self._newest(None)
        return self._newest(self._finish(job))

    def wait(self) -> CommittedCheckpoint | None:
        """Wait for the commit in flight: the checkpoint it committed (else one that finished unreported while
        `commit` waited for it), or None (none, or abandoned)."""
        job = self._in_flight
        if job is None:
            return self._newest(None)
        job.done.wait()
        return self._newest(self._finish(job))

    def abandon(self) -> CommittedCheckpoint | None:
        """Give up the commit in flight: it stops writing at its next piece, is never published, and its
        temp folder is removed at the next start. Returns the checkpoint when it had been published
        already (it stays committed: LATEST only moves forward), else one that finished unreported, or None."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return self._newest(None)
        with self._commit_point:
            job.abandoned.set()
            return self._newest(job.result)

    def close(self) -> None:
        """Wait for the commit in flight, logging (not raising) its error: for exits on another error."""
        try:
            self.wait()
        except Exception as exc:
            log.error("the checkpoint being written in the background failed: %s", exc)
