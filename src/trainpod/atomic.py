"""Crash-safe writes: a reader sees either the old file or the complete new one, never a torn one.

The pattern is write to a temp name in the same directory, fsync the file, rename over the target,
fsync the directory (so the rename itself survives a power loss; on a FUSE network volume the
fsync is what makes the server persist it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any


def temp_name(target: Path) -> Path:
    """A sibling of `target` that no other writer picks, recognisable as leftover by `.tmp-`."""
    return target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:12]}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete `path` durably (its folder fsynced) when it exists; nothing is written when it does not."""
    if path.exists():
        path.unlink()
        fsync_dir(path.parent)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriteBehind:
    """Keeps the disk busy with what a large file has written so far, so its final fsync waits for the
    last part only: a write + fsync of N bytes costs the write, then the whole flush; with the flush
    started behind the writes (one fdatasync at a time, on a thread of its own) the two overlap.

        with open(path, "wb", buffering=0) as f, WriteBehind(f.fileno()) as flush:
            for part in parts:
                f.write(part)
                flush.nudge(len(part))  # from one thread at a time
            flush.finish()              # raises the first write-back error; the file is durable after it
    """

    def __init__(self, fd: int, every_bytes: int = 32 << 20):
        self._fd = fd
        self._every_bytes = every_bytes  # a flush per small write would only queue round trips to the disk
        self._unflushed = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="write-behind")
        self._flushing: Future | None = None

    def nudge(self, nbytes: int) -> None:
        """`nbytes` more were written: once `every_bytes` have come since the last flush began, start
        flushing everything written so far, unless that flush is still running."""
        self._unflushed += nbytes
        if self._unflushed < self._every_bytes:
            return
        if self._flushing is not None:
            if not self._flushing.done():
                return
            # A failed flush must fail the file: Linux may report a write-back error to one fsync only.
            self._flushing.result()
        self._unflushed = 0
        self._flushing = self._thread.submit(os.fdatasync, self._fd)

    def finish(self) -> None:
        if self._flushing is not None:
            self._flushing.result()
        os.fsync(self._fd)

    def __enter__(self) -> WriteBehind:
        return self

    def close(self) -> None:
        self._thread.shutdown()  # waits for a flush still running, so the fd outlives it

    def __exit__(self, *_: Any) -> None:
        self.close()


def write_parts(target: Path, parts: Iterable[bytes | memoryview]) -> None:
    """Atomically replace `target` with the concatenation of `parts` (written without joining them)."""
    target = Path(target)
    tmp = temp_name(target)
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def write_bytes(target: Path, data: bytes) -> None:
    """Atomically replace `target` with `data`."""
    write_parts(target, [data])


def write_text(target: Path, text: str) -> None:
    write_bytes(target, text.encode("utf-8"))


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def write_json(target: Path, obj: Any) -> None:
    write_bytes(target, json_bytes(obj))


def file_sha256(path: Path) -> str:
    """The file's sha256, read 1 MiB at a time (hashlib.file_digest needs Python 3.11)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def publish_dir(tmp_dir: Path, target: Path) -> None:
    """Move a fully written and fsynced `tmp_dir` to `target` (which must not exist) durably."""
    _sync_tree(tmp_dir)
    os.rename(tmp_dir, target)
    fsync_dir(target.parent)


def _sync_tree(tmp_dir: Path) -> None:
    for path in sorted(tmp_dir.rglob("*")):
        if path.is_file():
            fsync_file(path)
    for path in sorted([p for p in tmp_dir.rglob("*") if p.is_dir()] + [tmp_dir], reverse=True):
        fsync_dir(path)


def replace_dir(tmp_dir: Path, target: Path) -> None:
    """Publish the finished `tmp_dir` as `target`; an older `target` is moved aside first, then deleted.

    The new folder is synced before the older one is touched: a sync that fails (an I/O error on a network
    volume) leaves the older output in place, where moving it aside first left no output and, at the next
    start, the older one deleted as a leftover. A kill between the two renames leaves the old folder under a
    .tmp-replaced- name and no `target`; whoever made it writes it again (exports and conversions are made
    from committed inputs).
    """
    if not target.exists():
        publish_dir(tmp_dir, target)
        return
    _sync_tree(tmp_dir)
    old = target.with_name(f"{target.name}.tmp-replaced-{uuid.uuid4().hex[:8]}")
    os.rename(target, old)
    try:
        os.rename(tmp_dir, target)
    except BaseException:
        os.rename(old, target)  # the older output back under its name, not left to be deleted
        raise
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
