"""The checkpoint protocol (docs/design.md, "Checkpoints"): a kill at any instant loses no committed checkpoint.

Commit sequence:
  1. write every file into `step-<N>.tmp-<id>/`, hashing while writing, fsync each file;
  2. write `manifest.json` (sizes, sha256, step, metadata) last, fsync the directory;
  3. rename the directory to `step-<N>/`, fsync `checkpoints/`;
  4. replace `LATEST` atomically; this is the commit point;
  5. only then delete checkpoints that retention no longer keeps (renamed to `*.tmp-*` first, so a
     kill mid-delete leaves something that the next start removes, never a half checkpoint).

On start, leftover `*.tmp-*` are removed, LATEST is verified against its manifest, and on any
mismatch the next older valid checkpoint is used. Steps are ordered by number, never by mtime.

A pending checkpoint can be abandoned (checkpoint/writer.py does, when a background commit cannot
finish before SIGKILL): its writes stop at the next 32 MiB piece with `CommitAbandoned`, and its temp
folder is left for the next start to remove.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import logging
import math
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from trainpod import atomic
from trainpod.errors import TemporaryError

if TYPE_CHECKING:
    from trainpod.checkpoint.lease import Lease

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "LATEST"
# A checkpoint being deleted (retention, `trainpod rm`) is first renamed <name><DELETING><id>: no reader takes it.
DELETING = ".tmp-deleting-"
RANK_RNG_FOLDER = "rng"  # beside the checkpoints: the other ranks' RNG states (checkpoint/rank_rng.py)
FORMAT = "trainpod-checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CommitAbandoned(Exception):
    """Raised inside a pending checkpoint's writes once it was abandoned; nothing of it is published."""


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def step_of(name: str | None) -> int | None:
    """The step a checkpoint folder's name (or LATEST's text) holds, else None."""
    match = _STEP_DIR.match((name or "").strip())
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class CommittedCheckpoint:
    step: int
    path: Path
    manifest: dict[str, Any]

    @property
    def eval_loss(self) -> float | None:
        return self.manifest.get("eval_loss")

    @property
    def score(self) -> float | None:
        """What best-k retention ranks by, lower is better: the configured metric's value (`score`, e.g.
        a CER) where the manifest has one, else the eval loss (manifests written before `score` existed)."""
        score = self.manifest.get("score")
        return score["value"] if score else self.eval_loss

    @property
    def ranked_by(self) -> str:
        """The metric `score` is a value of: eval_loss where the manifest names none."""
        score = self.manifest.get("score")
        return score["metric"] if score else "eval_loss"

    @property
    def metadata(self) -> dict[str, Any]:
        return self.manifest.get("metadata", {})

    @property
    def nbytes(self) -> int:
        """The size of its files, from the manifest: the next checkpoint of the run will be as large."""
        return sum(entry["bytes"] for entry in self.manifest.get("files", {}).values())


PIECE_BYTES = 32 << 20
SMALL_WRITE_BYTES = 64 << 10  # HashingFile copies writes below this rather than look them up


def _piece_digest(piece: bytes | memoryview) -> str:
    return hashlib.sha256(piece).hexdigest()


def _segments_digest(segments: list[memoryview]) -> str:
    """The sha256 of the concatenated segments, without concatenating them (no copy)."""
    digest = hashlib.sha256()
    for segment in segments:
        digest.update(segment)
    return digest.hexdigest()


class HashingFile:
    """A write-only file that records the sha256 of every 32 MiB piece of what passes through it.

    One sha256 stream (about 1.6 GB/s with SHA-NI) is as slow as a fast disk, so hashing the file
    as a whole would nearly double the commit time. Pieces are hashed by a thread pool (hashlib
    releases the GIL) while this thread writes, and the disk flushes behind the writes
    (atomic.WriteBehind): the commit costs about the write alone, and verification at start runs on
    every core as well. Each piece is an ordinary sha256.

    The hashers read the caller's memory after `write` returns, so `write` copies what a streaming
    writer hands it (torch.save reuses its buffers); `write_stable` does not, for memory that stays
    unchanged until the file is closed (a snapshot's tensors): no copy of the state in host memory,
    which at 4b would be 8 GB of weights more for the length of a commit.
    """

    def __init__(
        self,
        raw: BinaryIO,
        hashers: ThreadPoolExecutor,
        flush: atomic.WriteBehind,
        abandoned: threading.Event,
        stable_memory: Sequence[tuple[int, int]] = (),
    ):
        self._raw = raw
        # Sorted by start, for a bisect per write (torch.save writes ~6 times per tensor).
        self._stable_memory = sorted(stable_memory)
        self._stable_starts = [first for first, _ in self._stable_memory]
        self._abandoned = abandoned
        self._hashers = hashers
        self._flush = flush
        self._digests: list[Future] = []
        self._piece: list[memoryview] = []  # the segments of the piece being filled
        self._piece_bytes = 0
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if not isinstance(data, bytes) and not self._in_stable_memory(data):
            data = bytes(data)  # the caller may reuse its buffer before the hashers read it
        return self.write_stable(data)

    def _in_stable_memory(self, data: bytearray | memoryview) -> bool:
        """Whether `data` lies inside memory its owner keeps unchanged until the file is closed
        (torch.save hands each tensor's storage over in one piece: no copy of it is needed).

        A write below SMALL_WRITE_BYTES (torch.save's record headers and padding) is copied without
        looking: the copy costs less than the lookup, which runs on the writer thread holding the GIL
        while training waits for it."""
        nbytes = memoryview(data).nbytes
        if not self._stable_memory or nbytes < SMALL_WRITE_BYTES:
            return False
        start = np.frombuffer(data, dtype=np.uint8).ctypes.data
        at = bisect.bisect_right(self._stable_starts, start) - 1
        return at >= 0 and start + nbytes <= self._stable_memory[at][1]

    def write_stable(self, data: bytes | memoryview) -> int:
        """`write` without a copy: `data` must stay unchanged until the file is closed."""
        view = memoryview(data).cast("B")
        # Hand the pieces to the hashers first, so they digest while this thread copies to the disk.
        offset = 0
        while offset < len(view):
            taken = min(PIECE_BYTES - self._piece_bytes, len(view) - offset)
            self._piece.append(view[offset : offset + taken])
            self._piece_bytes += taken
            offset += taken
            if self._piece_bytes == PIECE_BYTES:
                self._hash_piece()
        for start in range(0, len(view), PIECE_BYTES):
            if self._abandoned.is_set():  # checked per piece: an abandoned commit stops within ~0.1 s
                for digest in self._digests:  # and its queued hashing too, which would delay the exit
                    digest.cancel()
                raise CommitAbandoned(f"{self._raw.name} was abandoned while being written")
            piece = view[start : start + PIECE_BYTES]
            self._raw.write(piece)
            self._flush.nudge(len(piece))
        self.size += len(view)
        return len(view)

    def _hash_piece(self) -> None:
        self._digests.append(self._hashers.submit(_segments_digest, self._piece))
        self._piece, self._piece_bytes = [], 0

    def flush(self) -> None:
        self._raw.flush()

    def piece_digests(self) -> list[str]:
        if self._piece or not self._digests:  # the last, partial piece; an empty file has one empty piece
            self._hash_piece()
        return [future.result() for future in self._digests]


class PendingCheckpoint:
    """A checkpoint being written into its temp directory; nothing here is visible until commit."""

    def __init__(self, tmp_dir: Path, hashers: ThreadPoolExecutor, abandoned: threading.Event | None = None):
        self.dir = tmp_dir
        self.files: dict[str, dict[str, Any]] = {}
        self.hashers = hashers
        self.abandoned = abandoned or threading.Event()

    def abandon(self) -> None:
        """Stop every write into this checkpoint at its next piece; it will never be published."""
        self.abandoned.set()

    def write_bytes(self, name: str, data: bytes) -> None:
        with self.open(name) as f:
            f.write(data)

    def open(self, name: str, stable_memory: Sequence[tuple[int, int]] = ()) -> _PendingFile:
        """A file object for streaming writers (e.g. `torch.save(obj, pending.open("x.pt"))`).
        `stable_memory`: address ranges [first, last) that stay unchanged until the file is closed
        (the tensors being saved); what is written from inside them is not copied for the hashers."""
        self._check_name(name)
        return _PendingFile(self, name, stable_memory)

    def adopt(self, name: str, source: Path) -> None:
        """Take a finished file into the checkpoint: renamed when on the same filesystem (no copy),
        else copied; then fsynced and hashed like a file written through `open`.

        For checkpoints another program wrote (`trainpod checkpoint commit`, the HF callback): the
        source is gone afterwards, so a kill mid-commit leaves only this temp folder, removed at start.
        """
        self._check_name(name)
        target = self.dir / name
        try:
            os.rename(source, target)
        except OSError:  # another filesystem (EXDEV): copy, hashing while writing
            with open(source, "rb") as src, self.open(name) as dst:
                shutil.copyfileobj(src, dst, PIECE_BYTES)
            os.unlink(source)
            return
        with open(target, "rb") as f:
            os.fsync(f.fileno())  # the writer may never have synced it
        size = target.stat().st_size
        starts = range(0, size, PIECE_BYTES) if size else [0]
        digests = self.hashers.map(lambda start: _piece_digest(_read_piece(target, start)), starts)
        self.files[name] = {"bytes": size, "sha256_pieces": list(digests)}

    def _check_name(self, name: str) -> None:
        parts = name.split("/")
        if name in (MANIFEST, LATEST) or name in self.files or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"checkpoint file name {name!r} is reserved, not relative or already written")
        if len(parts) > 1:  # nested files (e.g. an HF checkpoint's sub-folders) keep their layout
            (self.dir / name).parent.mkdir(parents=True, exist_ok=True)


class _PendingFile:
    def __init__(self, pending: PendingCheckpoint, name: str, stable_memory: Sequence[tuple[int, int]] = ()):
        self._pending = pending
        self._name = name
        self._raw = open(pending.dir / name, "wb")  # noqa: SIM115 - closed in __exit__
        self._flush = atomic.WriteBehind(self._raw.fileno())
        self._hashing = HashingFile(self._raw, pending.hashers, self._flush, pending.abandoned, stable_memory)

    def __enter__(self) -> HashingFile:
        return self._hashing

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            if exc_type is None:
                self._raw.flush()
                self._flush.finish()
                self._pending.files[self._name] = {
                    "bytes": self._hashing.size,
                    "sha256_pieces": self._hashing.piece_digests(),
                }
        finally:
            self._flush.close()
            self._raw.close()


class CheckpointStore:
    def __init__(self, root: Path, keep_last: int = 2, keep_best: int = 0, verify: str = "sha256"):
        if keep_last < 1:
            raise ValueError("keep_last must be at least 1: the newest committed checkpoint is always kept")
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.verify_mode = verify
        # The run's lease this process commits under, where it holds one: a commit is published only while it
        # is not lost (a writer that took the run over owns LATEST and retention from then on).
        self.lease: Lease | None = None
        self.last_commit_seconds: float | None = None
        self._hashers = ThreadPoolExecutor(
            max_workers=os.cpu_count() or 2, thread_name_prefix="checkpoint-sha256"
        )

    # ----------------------------------------------------------------------------- reading
    def _step_dirs(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found, reverse=True)

    def _latest_name(self) -> str | None:
        try:
            name = (self.root / LATEST).read_text(encoding="utf-8").strip()
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        return name if _STEP_DIR.match(name) else None

    def verify(self, path: Path, files: Collection[str] | None = None) -> tuple[dict[str, Any] | None, str]:
        """(manifest, "") when every file matches its manifest entry, else (None, reason). `files`: those alone
        (a reader of part of the checkpoint, the weights of an export), each of which the manifest must list."""
        try:
            manifest = atomic.read_json(path / MANIFEST)
        except FileNotFoundError:
            return None, "manifest.json is missing"
        except (ValueError, UnicodeDecodeError):
            return None, "manifest.json is not valid JSON"
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            return None, f"manifest.json is not a {FORMAT} manifest"
        match = _STEP_DIR.match(path.name)
        if not match or manifest.get("step") != int(match.group(1)):
            return None, f"manifest step {manifest.get('step')!r} does not match the folder name"
        listed = manifest.get("files", {})
        unlisted = sorted(set(files or ()) - set(listed))
        if unlisted:
            return None, f"{unlisted[0]} is not in manifest.json"
        for name, expected in listed.items():
            if files is not None and name not in files:
                continue
            file = path / name
            try:
                size = file.stat().st_size
                if size != expected["bytes"]:
                    return None, f"{name} has {size} bytes, the manifest says {expected['bytes']}"
                if self.verify_mode == "sha256" and self._file_digests(file) != expected["sha256_pieces"]:
                    return None, f"{name} does not match its sha256 (bit rot or a torn write)"
            except FileNotFoundError:  # also while it is read: another rank restoring moved the folder aside
                return None, f"{name} is missing"
        return manifest, ""

    def latest(self, clean: bool = True) -> CommittedCheckpoint | None:
        """The newest valid committed checkpoint, cleaning up what a kill may have left behind.

        `clean=False` for a reader beside a live writer: nothing is removed, moved or rewritten (the temp
        folder of the writer's commit in flight, or its folder renamed just before LATEST, are not leftovers).
        """
        if clean:
            self.root.mkdir(parents=True, exist_ok=True)
            self.remove_leftovers()
        latest_name = self._latest_name()
        step_dirs = self._step_dirs()
        latest_step = int(_STEP_DIR.match(latest_name).group(1)) if latest_name else None
        if latest_step is not None and step_dirs and latest_step not in {step for step, _ in step_dirs}:
            # Its folder deleted (by hand: retention never deletes LATEST's): LATEST no longer says which are
            # committed, as when it is missing. Read as the commit point, it made every newer checkpoint (each
            # whole: its manifest precedes its rename) look like a kill's leftover, and they were deleted.
            log.warning(
                "checkpoints/LATEST names %s, whose folder is gone; looking for the newest valid checkpoint",
                latest_name,
            )
            latest_name = latest_step = None
        elif latest_step is None and step_dirs:
            log.warning(
                "checkpoints/LATEST is missing or unreadable; looking for the newest valid checkpoint"
            )
        for step, path in step_dirs:
            if latest_step is not None and step > latest_step:
                if not clean:
                    continue
                # Renamed into place but never committed by LATEST: a kill between steps 3 and 4.
                log.warning(
                    "removing %s: written after the committed LATEST (%s) by an interrupted commit",
                    path.name,
                    latest_name,
                )
                self._delete(path)
                continue
            manifest, reason = self.verify(path)
            if manifest is not None:
                if path.name != latest_name and clean:
                    atomic.write_text(self.root / LATEST, path.name + "\n")
                    log.warning("resuming from %s instead; LATEST now points to it", path.name)
                return CommittedCheckpoint(step, path, manifest)
            log.warning("checkpoint %s is invalid (%s); trying the next older one", path.name, reason)
            if clean:
                self._quarantine(path)
        if latest_name and not step_dirs:
            log.warning("LATEST names %s but no checkpoint folder exists; starting from scratch", latest_name)
        return None

    def committed(self) -> list[CommittedCheckpoint]:
        """Every committed checkpoint, newest first, read from manifests (not re-hashed)."""
        out = []
        for step, path in self._step_dirs():
            try:
                out.append(CommittedCheckpoint(step, path, atomic.read_json(path / MANIFEST)))
            except (FileNotFoundError, ValueError):
                continue
        return out

    # ----------------------------------------------------------------------------- writing
    def begin(self, step: int, abandoned: threading.Event | None = None) -> PendingCheckpoint:
        """A new pending checkpoint; setting `abandoned` stops its writes and forbids its publication."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{step_dir_name(step)}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        return PendingCheckpoint(tmp, self._hashers, abandoned)

    @contextlib.contextmanager
    def writing(
        self, step: int, abandoned: threading.Event | None = None, pending: PendingCheckpoint | None = None
    ) -> Iterator[PendingCheckpoint]:
        """`begin(step)` (or `pending`, begun already); when writing or committing fails, the temp folder
        goes at once (a full volume gets its space back; a kill instead leaves it for the next start's
        `remove_leftovers`)."""
        pending = pending or self.begin(step, abandoned)
        try:
            yield pending
        except BaseException:
            shutil.rmtree(pending.dir, ignore_errors=True)
            raise

    def commit(
        self,
        pending: PendingCheckpoint,
        step: int,
        metadata: dict[str, Any],
        eval_loss: float | None = None,
        started: float | None = None,
        score: tuple[str, float] | None = None,
    ) -> CommittedCheckpoint:
        """Publish `pending` as `step-<step>` and make it LATEST; then apply retention.

        `score` (metric name, value; lower is better) ranks the checkpoint for best-k retention in
        place of `eval_loss`, e.g. ("eval_cer", 0.12)."""
        committed = self.publish(pending, step, metadata, eval_loss, started, score)
        self.apply_retention()
        return committed

    def publish(
        self,
        pending: PendingCheckpoint,
        step: int,
        metadata: dict[str, Any],
        eval_loss: float | None = None,
        started: float | None = None,
        score: tuple[str, float] | None = None,
    ) -> CommittedCheckpoint:
        """Steps 2-4 of the protocol: the manifest, the rename and LATEST (the commit point)."""
        started = time.monotonic() if started is None else started
        if pending.abandoned.is_set():
            raise CommitAbandoned(f"{pending.dir.name} was abandoned before its manifest")
        manifest = {
            "format": FORMAT,
            "step": step,
            "files": pending.files,
            "eval_loss": eval_loss,
            **({"score": {"metric": score[0], "value": score[1]}} if score else {}),
            "created_unix": time.time(),
            "metadata": metadata,
        }
        with open(pending.dir / MANIFEST, "wb") as f:  # last: its presence means every file is whole
            f.write(atomic.json_bytes(manifest))
            f.flush()
            os.fsync(f.fileno())
        # Every folder between a file and the checkpoint's own, deepest first: a file at a/b/x is reachable
        # after a power loss only when a/ (holding b/'s entry) is durable too, not just a/b/.
        subs = {parent for name in pending.files for parent in Path(name).parents if parent != Path(".")}
        for sub in sorted(subs, key=lambda sub: -len(sub.parts)):
            atomic.fsync_dir(pending.dir / sub)
        target = self.root / step_dir_name(step)
        if self.lease is not None and self.lease.lost.is_set():  # lost while the files were written: minutes
            raise TemporaryError(
                f"another writer took over this run's lease while step-{step} was written; it is not published "
                f"(LATEST names {self._latest_name() or 'none'} as before) and this writer stops: the one that "
                "holds the lease goes on"
            )
        if target.exists():
            # Same step written again (e.g. a resumed run preempted before its first new step):
            # the committed one stays; the duplicate is discarded.
            self._delete(pending.dir)
        else:
            atomic.fsync_dir(pending.dir)
            os.rename(pending.dir, target)
            atomic.fsync_dir(self.root)
        atomic.write_text(self.root / LATEST, target.name + "\n")
        self.last_commit_seconds = time.monotonic() - started
        return CommittedCheckpoint(step, target, atomic.read_json(target / MANIFEST))

    def record_eval(self, step: int, eval_loss: float, score: tuple[str, float] | None = None) -> None:
        """Put the eval of `step` into its committed checkpoint's manifest, where best-k retention reads it,
        then apply retention: for an eval that ran after the commit (a stop interrupted it, and the resumed
        run ran it first), without which that checkpoint never competed for best-k. The manifest is
        replaced atomically (its files are unchanged: the checkpoint stays valid at every instant)."""
        path = self.root / step_dir_name(step)
        manifest = atomic.read_json(path / MANIFEST)
        manifest["eval_loss"] = eval_loss
        if score:
            manifest["score"] = {"metric": score[0], "value": score[1]}
        atomic.write_json(path / MANIFEST, manifest)
        self.apply_retention()

    def ranked(self, checkpoints: list[CommittedCheckpoint] | None = None) -> list[CommittedCheckpoint]:
        """The committed checkpoints an eval scored, best first (lower score; the newer of two equal ones), as
        best-k retention keeps them and `export.weights: best` picks one."""
        checkpoints = self.committed() if checkpoints is None else checkpoints
        # Ranked by the metric the newest manifest with a score names (eval_loss where none has one, as before
        # scores) alone: under a generation metric measured every k-th eval (eval_cer), the checkpoints of the
        # evals between hold an eval loss, which is no CER to beat.
        metric = next((c.ranked_by for c in checkpoints if c.manifest.get("score")), "eval_loss")
        # A NaN (a diverged eval) compares neither lower nor higher and broke the sort: it ranked as the best.
        ranked = (c for c in checkpoints if _finite(c.score) and c.ranked_by == metric)
        return sorted(ranked, key=lambda c: (c.score, -c.step))

    def apply_retention(self) -> list[int]:
        """Delete checkpoints beyond the last k and best k (by `score`); never the one LATEST names."""
        checkpoints = self.committed()
        keep = {c.step for c in checkpoints[: self.keep_last]}
        keep |= {c.step for c in self.ranked(checkpoints)[: self.keep_best]}
        latest_name = self._latest_name()
        deleted = []
        for c in checkpoints:
            if c.step not in keep and c.path.name != latest_name:
                self._delete(c.path)
                deleted.append(c.step)
        return deleted

    def _file_digests(self, path: Path) -> list[str]:
        """Per-piece sha256 of a file, pieces read and hashed in parallel."""
        size = path.stat().st_size
        starts = range(0, size, PIECE_BYTES) if size else [0]
        return list(self._hashers.map(lambda start: _piece_digest(_read_piece(path, start)), starts))

    # ----------------------------------------------------------------------------- cleanup
    def remove_leftovers(self) -> list[str]:
        removed = []
        for path in self.root.glob("*.tmp-*"):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(path.name)
        if removed:
            log.info(
                "removed %d leftover temp item(s) from an interrupted write: %s",
                len(removed),
                ", ".join(sorted(removed)),
            )
        return removed

    def _delete(self, path: Path) -> None:
        doomed = path.with_name(f"{path.name}{DELETING}{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, doomed)
        except FileNotFoundError:  # retention of an abandoned background commit got there first
            return
        atomic.fsync_dir(self.root)
        shutil.rmtree(doomed, ignore_errors=True)

    def _quarantine(self, path: Path) -> None:
        """Keep an invalid checkpoint for inspection, out of the way of the step it would collide with."""
        aside = path.with_name(f"{path.name}.invalid-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:  # another rank restoring at the same time moved it aside first
            return
        log.warning("moved the invalid checkpoint to %s (delete it when you no longer need it)", aside.name)


def _finite(score: float | None) -> bool:
    return score is not None and math.isfinite(score)


def _read_piece(path: Path, start: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(PIECE_BYTES)
