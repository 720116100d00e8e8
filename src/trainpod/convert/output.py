"""Conversion outputs: written into a temp folder, hashed into manifest.json, fsynced, renamed into place.

An output whose manifest.json records the same key (a hash of every input's sha256 and of the task's
settings) is finished: running the same conversion again rewrites nothing. Input hashes are reused
from the previous manifest while a file's size and mtime are unchanged, so a rerun does not read a
14 GB base model again to find out that nothing changed.

Hashing is most of a conversion's work besides the writing (sha256 runs at about 1 GB/s per core,
as fast as the disk), so none of it waits for anything else: the inputs that need hashing are hashed
by a thread pool while the output is written (hashlib releases the GIL), and files written through
`Staging.write_file` are hashed from memory while the same bytes go to the disk, never read back.
When the inputs turn out unchanged after all (same contents, new mtime), the finished output stays
and the staged one is dropped, so the result is as if the key had been known first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import trainpod
from trainpod import atomic
from trainpod.convert.tensorfile import TensorFile

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "trainpod-convert/1"
PIECE_BYTES = 32 << 20  # the checkpoint store's piece size: one manifest scheme across the kit


def hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="convert-sha256")


def _digest(piece: bytes | memoryview) -> str:
    return hashlib.sha256(piece).hexdigest()


def _file_piece_digest(job: tuple[Path, int]) -> str:
    """sha256 of one piece of a file, hashed from the page cache through a mapping (a read() would copy it)."""
    path, start = job
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return _digest(b"")  # an empty file cannot be mapped
        with (
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
            memoryview(mapped) as view,
            view[start : start + PIECE_BYTES] as piece,
        ):
            return _digest(piece)


def _submit_file(path: Path, hashers: ThreadPoolExecutor) -> list[Future]:
    """Per-32 MiB-piece sha256 of a file on disk, each piece its own job so that all cores hash at once."""
    starts = range(0, max(path.stat().st_size, 1), PIECE_BYTES)
    return [hashers.submit(_file_piece_digest, (path, start)) for start in starts]


class Staging:
    """The temp folder an output is written into (the writer creates it, as `folder.mkdir(parents=True)`).

    Files written through `write_file`/`write_tensors` are hashed from memory on their way to the disk
    and fsynced; any other file put into the folder (by save_pretrained, say) is hashed from the disk
    when the manifest is made.
    """

    def __init__(self, folder: Path, hashers: ThreadPoolExecutor):
        self.folder = folder
        self._hashers = hashers
        self._digests: dict[str, list[Future]] = {}

    def write_file(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """Write `data` (not changed until this returns) to folder/name."""
        with _StreamedFile(self.folder / name, memoryview(data).cast("B"), self._hashers) as streamed:
            streamed.ready(len(streamed.data))
        self._digests[name] = streamed.digests

    def write_tensors(self, name: str, file: TensorFile, fill: Callable[[str, torch.Tensor], None]) -> None:
        """Write a safetensors file laid out by tensorfile.layout, calling `fill(tensor name, slot)` for each
        tensor in file order; every finished 32 MiB piece is hashed and written while later ones are filled."""
        threads = torch.get_num_threads()
        # The fill runs on this thread while the hashers and the writer take the other cores; torch's own
        # thread pool would spin-wait against them (measured: a LoRA merge 2-3x slower on 2 cores).
        torch.set_num_threads(1)
        try:
            self._write_tensors(name, file, fill)
        finally:
            torch.set_num_threads(threads)

    def _write_tensors(self, name: str, file: TensorFile, fill: Callable[[str, torch.Tensor], None]) -> None:
        with _StreamedFile(self.folder / name, file.bytes(), self._hashers) as streamed:
            for tensor_name, slot in file.slots.items():
                fill(tensor_name, slot)
                streamed.ready(file.end(tensor_name))
            streamed.ready(len(streamed.data))
        self._digests[name] = streamed.digests

    def file_digests(self) -> dict[str, dict[str, Any]]:
        files = sorted(p for p in self.folder.rglob("*") if p.is_file())
        pending = {}
        for path in files:
            name = str(path.relative_to(self.folder))
            pending[name] = self._digests.get(name) or _submit_file(path, self._hashers)
        return {
            name: {
                "bytes": (self.folder / name).stat().st_size,
                "sha256_pieces": [f.result() for f in futures],
            }
            for name, futures in pending.items()
        }


def _write_all(file: Any, data: memoryview) -> None:
    while data:
        data = data[file.write(data) :]  # an unbuffered write may take fewer bytes than offered


class _StreamedFile:
    """A file written from one memory buffer as its bytes become final: each finished piece is handed to
    the hashers and to a writer thread at once, so filling, hashing and writing overlap."""

    def __init__(self, path: Path, data: memoryview, hashers: ThreadPoolExecutor):
        self.data = data
        self.digests: list[Future] = []
        self._hashers = hashers
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in __exit__
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="convert-write")
        self._writes: list[Future] = []
        self._handed = 0

    def ready(self, upto: int) -> None:
        """Bytes [0, upto) of the buffer are final; hand on every whole piece among them (all at the end)."""
        end = upto if upto == len(self.data) else upto - upto % PIECE_BYTES
        for start in range(self._handed, end, PIECE_BYTES):
            piece = self.data[start : min(start + PIECE_BYTES, end)]
            self.digests.append(self._hashers.submit(_digest, piece))
            self._writes.append(self._writer.submit(_write_all, self._file, piece))
        self._handed = max(self._handed, end)
        if not self.digests and upto == len(self.data):  # an empty file has one piece, as _submit_file says
            self.digests.append(self._hashers.submit(_digest, b""))

    def __enter__(self) -> _StreamedFile:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            for write in self._writes:
                write.result()  # re-raises a failed write (a full disk, say)
            if exc_type is None:
                os.fsync(self._file.fileno())  # the disk flushes while the hashers finish, not after them
                for digest in self.digests:
                    digest.result()  # the caller may reuse the buffer once the file is closed
        finally:
            self._writer.shutdown()
            self._file.close()


class InputHashes:
    """Every input's {path, bytes, mtime_ns, sha256_pieces}: unchanged files' hashes reused from the previous
    manifest, the others hashed in the background from construction on."""

    def __init__(self, files: dict[str, Path], previous: dict[str, Any] | None, hashers: ThreadPoolExecutor):
        known = (previous or {}).get("inputs", {})
        self._described: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, list[Future]] = {}
        for label, path in files.items():
            stat = path.stat()
            entry = {"path": str(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
            old = known.get(label, {})
            if all(old.get(k) == entry[k] for k in entry) and old.get("sha256_pieces"):
                entry["sha256_pieces"] = old["sha256_pieces"]
            else:
                self._pending[label] = _submit_file(path, hashers)
            self._described[label] = entry

    @property
    def all_known(self) -> bool:
        return not self._pending

    def described(self) -> dict[str, dict[str, Any]]:
        """Waits for the hashes still running."""
        for label, futures in self._pending.items():
            self._described[label]["sha256_pieces"] = [f.result() for f in futures]
        self._pending = {}
        return self._described


def read_manifest(target: Path) -> dict[str, Any] | None:
    try:
        manifest = atomic.read_json(target / MANIFEST)
    except (FileNotFoundError, NotADirectoryError, ValueError, UnicodeDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def output_key(inputs: dict[str, dict[str, Any]], settings: dict[str, Any]) -> str:
    """What an output depends on: the inputs' contents (not their paths or times) and the settings."""
    contents = {label: entry["sha256_pieces"] for label, entry in inputs.items()}
    canonical = json.dumps({"inputs": contents, "settings": settings}, sort_keys=True, separators=(",", ":"))
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


def remove_leftovers(target: Path) -> None:
    """Temp folders of this output left by a kill mid-write (never anything else's)."""
    for path in target.parent.glob(f"{target.name}.tmp-*"):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        log.info("removed %s, left by an interrupted conversion", path.name)


def produce(
    target: Path, files: dict[str, Path], settings: dict[str, Any], write: Callable[[Staging], None]
) -> bool:
    """Make `target` from `files` with `write`, unless it is finished already. True when it was written.

    `write(staging)` creates staging.folder and fills it; manifest.json is added and the folder renamed
    into place. A reader sees the old output (if any) or the complete new one; a kill leaves only a
    `.tmp-` folder, removed by the next run.
    """
    remove_leftovers(target)
    previous = read_manifest(target)
    with hash_pool() as hashers:
        inputs = InputHashes(files, previous, hashers)
        if inputs.all_known and is_finished(target, previous, output_key(inputs.described(), settings)):
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Staging(atomic.temp_name(target), hashers)
        try:
            write(staging)
            described = inputs.described()
            key = output_key(described, settings)
            if is_finished(target, previous, key):  # touched but unchanged inputs: keep what is there
                shutil.rmtree(staging.folder)
                return False
            manifest = {
                "format": FORMAT,
                "key": key,
                "settings": settings,
                "inputs": described,
                "files": staging.file_digests(),
                "created_unix": time.time(),
                "versions": _versions(),
            }
            (staging.folder / MANIFEST).write_bytes(atomic.json_bytes(manifest))  # fsynced by publish_dir
            atomic.replace_dir(staging.folder, target)
        except BaseException:
            shutil.rmtree(staging.folder, ignore_errors=True)
            raise
    return True


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
