"""Conversion outputs: written into a temp folder, listed with their sha256 in manifest.json, renamed into place.

An output whose manifest.json records the same key is finished: running the same conversion again
rewrites nothing. The key is a hash of the task's settings and of every input's path, size and
mtime (the identity datagen's manifests record for their sources too): the inputs are not read to
decide, so a rerun does not read a 14 GB base model to find out that nothing changed. An input
written again, even with the same bytes, makes the output be converted again (the safe direction).
An input that changes while it is being converted fails the conversion (exit 75) instead of
publishing an output made from two versions of it.

Every output file's sha256 is that of the whole file, as `sha256sum` and the Hugging Face hub (the
LFS oid of an uploaded file) compute it. Files written through `Staging.write_tensors` are hashed
from memory while the same bytes go to the disk, never read back: the caller fills each tensor
into a reusable chunk buffer (memory already mapped: a fresh buffer per file costs a page fault
per 4 KiB, as long as the copy itself), and each full chunk goes to a writer thread and a hashing
thread at once (both release the GIL), so filling, writing and hashing overlap.

The writer sends the chunks' whole 4 KiB blocks to the disk with O_DIRECT, where the filesystem
allows it, and only the partial blocks at their ends through the page cache. An output is read by
another process or machine later, never by this one now, and a buffered write spends as much CPU as
the hashing to put each page in the cache (measured on 2 cores: 0.1-1.3 s of kernel time per
450 MB, swinging with the host, against 0.02 s for the same bytes written direct). Where O_DIRECT is
refused (some FUSE mounts, tmpfs), every byte goes through the page cache, flushed behind the writes.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

import trainpod
from trainpod import atomic
from trainpod.errors import InputError, TemporaryError
from trainpod.preemption import WorkAbandoned
from trainpod.tensorfile import TensorLayout

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "trainpod-convert/2"  # 1 hashed inputs' contents in 32 MiB pieces; its outputs are converted again
FORMAT_FAMILY = "trainpod-convert/"  # every version's outputs are this module's to replace
CHUNK_BYTES = 32 << 20  # large enough that a chunk's write and hash dwarf the hand-over between threads
CHUNK_BUFFERS = 3  # one being filled, one being written and hashed, one spare against uneven speeds
# O_DIRECT wants buffer addresses, file offsets and lengths in multiples of the device's logical block
# size (512 B or 4 KiB); 4 KiB serves both.
DIRECT_ALIGN = 4096


class Staging:
    """The temp folder an output is written into (the writer creates it, as `folder.mkdir(parents=True)`).

    Files written through `write_file`/`write_tensors` are hashed on their way to the disk and fsynced;
    any other file put into the folder (by save_pretrained, say) is hashed from the disk when the
    manifest is made.
    """

    def __init__(self, folder: Path):
        self.folder = folder
        self._digests: dict[str, str] = {}
        self._chunks = _ChunkBuffers()

    def write_file(self, name: str, data: bytes) -> None:
        with open(self.folder / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._digests[name] = hashlib.sha256(data).hexdigest()

    def write_tensors(self, name: str, file: TensorLayout, fill: Callable[[str, torch.Tensor], None]) -> None:
        """Write a safetensors file laid out by tensorfile.layout, calling `fill(tensor name, slot)` for each
        tensor in file order; `fill` must set every element of the slot."""
        threads = torch.get_num_threads()
        # The fill runs on this thread while the writer and the hasher take the other cores; torch's own
        # thread pool would spin-wait against them (measured: a LoRA merge 2-3x slower on 2 cores).
        torch.set_num_threads(1)
        try:
            with _StreamedFile(self.folder / name, self._chunks) as streamed:
                streamed.reserve(len(file.header)).copy_(
                    torch.frombuffer(bytearray(file.header), dtype=torch.uint8)
                )
                for entry in file.tensors:
                    fill(entry.name, streamed.reserve(entry.nbytes).view(entry.dtype).view(entry.shape))
            self._digests[name] = streamed.sha256
        finally:
            torch.set_num_threads(threads)

    def file_digests(self) -> dict[str, dict[str, Any]]:
        files = sorted(p for p in self.folder.rglob("*") if p.is_file())
        names = [str(path.relative_to(self.folder)) for path in files]
        unhashed = [name for name in names if name not in self._digests]
        hashers = ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
        try:
            self._digests.update(
                zip(
                    unhashed,
                    hashers.map(atomic.file_sha256, [self.folder / n for n in unhashed]),
                    strict=True,
                )
            )
        finally:
            # All done, or abandoned by a stop: then the files not begun are dropped and the ones being
            # hashed (gigabytes each after save_pretrained) not waited for, or the 5 s window runs out.
            hashers.shutdown(wait=False, cancel_futures=True)
        return {
            name: {"bytes": (self.folder / name).stat().st_size, "sha256": self._digests[name]}
            for name in names
        }


class _ChunkBuffers:
    """Chunk-sized uint8 buffers kept across the files of one output, so their pages are mapped once."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer starting at a DIRECT_ALIGN-aligned address with room for `nbytes` after up to
        DIRECT_ALIGN bytes of lead-in; a tensor larger than a chunk gets a buffer of its size."""
        buffer = self.free.pop() if self.free else None
        if buffer is None or len(buffer) < nbytes + DIRECT_ALIGN:
            size = max(nbytes, CHUNK_BYTES) + DIRECT_ALIGN
            raw = torch.empty(size + DIRECT_ALIGN, dtype=torch.uint8)
            lead = -raw.data_ptr() % DIRECT_ALIGN
            buffer = raw[lead : lead + size]
        return buffer


class _StreamedFile:
    """A file written chunk by chunk from reused buffers: the caller fills a chunk through `reserve`,
    and each full chunk is handed to a writer thread and a hashing thread while the next one is filled.

    A chunk's bytes start in their buffer at the same offset modulo DIRECT_ALIGN as in the file, so its
    whole blocks can be written with O_DIRECT straight from the buffer. The partial blocks at the ends
    of the chunks go through the page cache, flushed behind the writes (atomic.WriteBehind), and so does
    everything where the filesystem refuses O_DIRECT; the fsync at the end makes all of it durable.
    """

    def __init__(self, path: Path, buffers: _ChunkBuffers):
        self.sha256 = ""
        self._buffers = buffers
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in __exit__
        self._direct = _open_direct(path)
        self._digest = hashlib.sha256()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="convert-write")
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="convert-sha256")
        self._flush = atomic.WriteBehind(self._file.fileno())
        self._in_flight: collections.deque[tuple[torch.Tensor, Future, Future]] = collections.deque()
        self._buffer: torch.Tensor | None = None
        self._position = 0  # where in the file the current buffer's bytes go
        self._lead = 0  # where in the current buffer its bytes start
        self._used = 0

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` of the file, as a uint8 tensor for the caller to fill before the next call.

        A chunk ends before a tensor that does not fit, so every tensor is contiguous in one buffer, at
        an address with the alignment of its offset in the file (tensorfile.layout aligns those)."""
        if self._buffer is None or self._lead + self._used + nbytes > len(self._buffer):
            self._hand_on()
            self._buffer = self._take(nbytes)
            self._lead = self._position % DIRECT_ALIGN
        start = self._lead + self._used
        self._used += nbytes
        return self._buffer[start : start + nbytes]

    def _hand_on(self) -> None:
        if self._buffer is not None and self._used:
            chunk = memoryview(self._buffer.numpy())[self._lead : self._lead + self._used]
            written = self._writer.submit(self._write, self._position, chunk)
            hashed = self._hasher.submit(self._digest.update, chunk)  # one thread: in file order
            self._in_flight.append((self._buffer, written, hashed))
            self._position += self._used
        elif self._buffer is not None:
            self._buffers.free.append(self._buffer)
        self._buffer, self._used = None, 0

    def _write(self, offset: int, chunk: memoryview) -> None:
        """On the writer thread, in file order: the whole blocks direct, the partial ones at the ends buffered."""
        end = offset + len(chunk)
        direct_start = min(-(-offset // DIRECT_ALIGN) * DIRECT_ALIGN, end)
        direct_end = max(direct_start, end // DIRECT_ALIGN * DIRECT_ALIGN)
        self._write_buffered(offset, chunk[: direct_start - offset])
        self._write_direct(direct_start, chunk[direct_start - offset : direct_end - offset])
        self._write_buffered(direct_end, chunk[direct_end - offset :])

    def _write_buffered(self, offset: int, data: memoryview) -> None:
        _pwrite_all(self._file.fileno(), data, offset)
        self._flush.nudge(len(data))

    def _write_direct(self, offset: int, data: memoryview) -> None:
        if self._direct is None:
            self._write_buffered(offset, data)
            return
        try:
            _pwrite_all(self._direct, data, offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise  # a full disk, an I/O error: the file fails
            # The filesystem took the O_DIRECT open but not the write: the page cache from here on.
            # (A write refused with EINVAL has written nothing; a partial one is written again, whole.)
            log.info("%s: direct writes refused (%s); writing through the page cache", self._file.name, exc)
            os.close(self._direct)
            self._direct = None
            self._write_buffered(offset, data)

    def _take(self, nbytes: int) -> torch.Tensor:
        if len(self._in_flight) >= CHUNK_BUFFERS:
            self._release_oldest()
        return self._buffers.take(nbytes)

    def _release_oldest(self) -> None:
        buffer, written, hashed = self._in_flight.popleft()
        written.result()  # re-raises a failed write (a full disk, say)
        hashed.result()
        self._buffers.free.append(buffer)

    def __enter__(self) -> _StreamedFile:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            if exc_type is None:
                self._hand_on()
                # After the last write, on the writer thread: the disk flushes while the last chunks are hashed.
                synced = self._writer.submit(self._flush.finish)
                while self._in_flight:
                    self._release_oldest()
                synced.result()
                self.sha256 = self._digest.hexdigest()
            # else the file is abandoned (its folder is removed): the threads finish what they hold, and
            # the caller's exception is the one reported, not a second one from a write that followed it.
        finally:
            self._writer.shutdown()
            self._hasher.shutdown()
            self._flush.close()
            if self._direct is not None:
                os.close(self._direct)
            self._file.close()


def _open_direct(path: Path) -> int | None:
    """A second descriptor of `path` for O_DIRECT writes; None where the platform or filesystem has none."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return None


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)  # may take fewer bytes than offered
        data, offset = data[written:], offset + written


def describe_inputs(files: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """{label: {path, bytes, mtime_ns}}: what identifies each input without reading it."""
    described = {}
    for label, path in files.items():
        stat = path.stat()
        described[label] = {"path": str(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return described


def describe_present_inputs(files: dict[str, Path], target: Path) -> dict[str, dict[str, Any]]:
    """describe_inputs, with an input gone since it was looked up (another run's retention deleting the
    checkpoint an export planned while earlier tasks were made) as exit 75, not a traceback."""
    try:
        return describe_inputs(files)
    except FileNotFoundError as exc:
        raise TemporaryError(
            f"{exc.filename} was removed after {target.name} was planned from it; the next start converts what "
            "is there then, or says it is gone"
        ) from None


def read_manifest(target: Path) -> dict[str, Any] | None:
    try:
        manifest = atomic.read_json(target / MANIFEST)
    except (FileNotFoundError, NotADirectoryError, ValueError, UnicodeDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def output_key(inputs: dict[str, dict[str, Any]], settings: dict[str, Any]) -> str:
    """What an output depends on: its inputs (path, size, mtime) and the settings."""
    canonical = json.dumps({"inputs": inputs, "settings": settings}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def is_finished(target: Path, manifest: dict[str, Any] | None, key: str) -> bool:
    if manifest is None or manifest.get("key") != key:
        return False
    for name, entry in manifest.get("files", {}).items():
        try:
            if (target / name).stat().st_size != entry["bytes"]:
                return False
        except FileNotFoundError:
            return False
    return True


def made_by_a_conversion(target: Path) -> bool:
    """Whether the existing folder `target` is a conversion's output (of any format version), which a
    conversion may replace; anything else there is another workload's export or the user's own folder."""
    try:
        manifest = atomic.read_json(target / MANIFEST)
    except (FileNotFoundError, NotADirectoryError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith(FORMAT_FAMILY)


def remove_leftovers(target: Path) -> None:
    """Temp folders of this output left by a kill mid-write (never anything else's)."""
    for path in target.parent.glob(f"{target.name}.tmp-*"):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        log.info("removed %s, left by an interrupted conversion", path.name)


def produce(
    target: Path,
    files: dict[str, Path],
    settings: dict[str, Any],
    write: Callable[[Staging], None],
    abandoning: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> bool:
    """Make `target` from `files` with `write`, unless it is finished already. True when it was written.

    `write(staging)` creates staging.folder and fills it; manifest.json is added and the folder renamed
    into place. A reader sees the old output (if any) or the complete new one; a kill leaves only a
    `.tmp-` folder, removed by the next run. Everything before the rename runs inside `abandoning()`
    (PreemptionWatch.abandoning: a stop ends it there, leaving the temp folder as a kill would).
    """
    held = sorted(label for label, path in files.items() if path.resolve().is_relative_to(target.resolve()))
    if held:
        raise InputError(
            f"the output folder {target} holds this conversion's input {files[held[0]]}, and publishing the "
            "output would delete it; give the task another `output` name"
        )
    remove_leftovers(target)
    inputs = describe_present_inputs(files, target)
    key = output_key(inputs, settings)
    if is_finished(target, read_manifest(target), key):
        return False
    if target.exists() and not made_by_a_conversion(target):
        # Publishing replaces the folder whole: a finetune's adapter/, a pretrain's hf/ or the user's own
        # files there would be deleted without a word.
        raise InputError(
            f"the output folder {target} exists and was not written by a conversion (no conversion "
            f"{MANIFEST} in it), so publishing this output would delete what is there; give the task another "
            "`output` name, or move that folder away first"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Staging(atomic.temp_name(target))
    try:
        with abandoning():
            _fill(staging, files, inputs, key, settings, write, target)
        atomic.replace_dir(staging.folder, target)
    except WorkAbandoned:
        # Left for the next start (remove_leftovers): deleting gigabytes from a network volume could take
        # longer than the seconds left before the SIGKILL, and the run's lease is released after this.
        raise
    except BaseException:
        shutil.rmtree(staging.folder, ignore_errors=True)
        raise
    return True


def _fill(
    staging: Staging,
    files: dict[str, Path],
    inputs: dict[str, dict[str, Any]],
    key: str,
    settings: dict[str, Any],
    write: Callable[[Staging], None],
    target: Path,
) -> None:
    """The output's files and manifest.json into the staging folder, nothing published."""
    try:
        write(staging)
    except FileNotFoundError:
        _refuse_changed_inputs(files, inputs, target)  # an input removed under the write
        raise
    _refuse_changed_inputs(files, inputs, target)
    manifest = {
        "format": FORMAT,
        "key": key,
        "settings": settings,
        "inputs": inputs,
        "files": staging.file_digests(),
        "created_unix": time.time(),
        "versions": _versions(),
    }
    (staging.folder / MANIFEST).write_bytes(atomic.json_bytes(manifest))  # fsynced by publish_dir


def _refuse_changed_inputs(files: dict[str, Path], inputs: dict[str, dict[str, Any]], target: Path) -> None:
    """Exit 75 when an input was changed, replaced or removed since `inputs` described it (another run's
    retention deleting the checkpoint being exported, a finetune publishing its adapter again): the
    output would mix two versions, and the next start converts what is there then, or says it is gone."""
    for label, path in files.items():
        try:
            now = describe_inputs({label: path})[label]
        except FileNotFoundError:
            now = None
        if now != inputs[label]:
            raise TemporaryError(
                f"{path} {'was removed' if now is None else 'changed'} while {target.name} was being made from "
                "it, so the result would mix two versions of it and is not kept; the next start converts it again"
            ) from None


def _versions() -> dict[str, str]:
    import peft
    import safetensors
    import torch
    import transformers

    return {
        "trainpod": trainpod.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "safetensors": safetensors.__version__,
    }
