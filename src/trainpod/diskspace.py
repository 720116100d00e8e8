"""A full volume: one line and exit 5 (errors.VolumeFull), never a traceback; and an early warning.

    with volume_full_as_exit_5(volume.root): run_datagen(...)       # ENOSPC anywhere -> VolumeFull
    warn_headroom(checkpoints_dir, next_checkpoint_bytes)            # fewer than 2 checkpoints fit

ENOSPC reaches the caller in more than one shape: an OSError from a write or fsync, another
exception raised while handling one (torch.save wraps it in a RuntimeError "unexpected pos"), or a
native library's own error carrying only the OS's text (safetensors: "I/O error: No space left on
device (os error 28)"), so the whole chain of causes is searched, for the errno or the OS's message.
EDQUOT (a quota, as on some network file systems) is the same.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from trainpod.errors import TrainpodError, VolumeFull

log = logging.getLogger(__name__)

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_MESSAGES = tuple(os.strerror(code) for code in DISK_FULL_ERRNOS)  # "No space left on device"
VOLUME_FULL_PREFIX = "no space left on the volume"  # how volume_full's line begins
WARN_BELOW_CHECKPOINTS = 2  # warn while a commit still works, before the one that does not
FIX = (
    "free space on it (`trainpod du` shows what takes it; `trainpod rm` deletes old runs, checkpoints, datasets, "
    "cache/ keys, never what a live or unfinished run needs) or grow the network volume, then start again"
)


def is_disk_full(exc: BaseException | None) -> bool:
    """True when `exc` or any exception it was raised from or during is ENOSPC/EDQUOT."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        if any(message in str(exc) for message in DISK_FULL_MESSAGES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def says_disk_full(line: str) -> bool:
    """Whether a line of a program's output reports a full disk: the OS's message (an ENOSPC traceback's last
    line) or the kit's own (volume_full's, printed by a Checkpointer or `trainpod checkpoint commit`)."""
    said = line.lower()
    return any(message.lower() in said for message in (*DISK_FULL_MESSAGES, VOLUME_FULL_PREFIX))


# A quoted absolute path after the OS's message: Python's OSError names the file it could not open or
# create (`[Errno 28] No space left on device: '/tmp/x'`); a failed write() names none.
_PATH_NAMED = re.compile(r"""['"](/[^'"]+)['"]""")


def full_path_named(line: str) -> Path | None:
    """The file a disk-full line of a program's output names, where it names one after the OS's message."""
    for message in DISK_FULL_MESSAGES:
        at = line.lower().find(message.lower())
        if at >= 0:
            named = _PATH_NAMED.findall(line[at:])
            return Path(named[-1]) if named else None
    return None


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def size_text(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} bytes"


def volume_full(where: Path, what: str, needed: int | None = None) -> VolumeFull:
    """The one-line error: what could not be written, how much it needs and how much is free, the fix."""
    need = f"it needs about {size_text(needed)} and " if needed is not None else ""
    return VolumeFull(
        f"{VOLUME_FULL_PREFIX} at {where} for {what}: {need}{size_text(free_bytes(where))} "
        f"{'is' if needed is not None else 'are'} free; {FIX}"
    )


@contextlib.contextmanager
def volume_full_as_exit_5(where: Path, what: str = "the workload's output") -> Iterator[None]:
    """Turn ENOSPC raised inside the block into VolumeFull (exit 5); other errors pass unchanged."""
    try:
        yield
    except TrainpodError:  # already one line with its own exit code
        raise
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        raise volume_full(where, what) from exc


def check_room(where: Path, needed: int, what: str) -> None:
    """VolumeFull (exit 5) before `what` is written when the volume at `where` has less than `needed` free: a
    write that fills it runs to ENOSPC first (a 7B model's merge: about 15 GB, minutes) and gains nothing."""
    if free_bytes(where) < needed:
        raise volume_full(where, what, needed)


def checkpoints_that_fit(where: Path, checkpoint_bytes: int) -> int:
    return free_bytes(where) // max(checkpoint_bytes, 1)


def check_headroom(where: Path, checkpoint_bytes: int, first: bool = False) -> None:
    """Before training (`first`): VolumeFull when not one more checkpoint fits, so no GPU hour is spent on
    steps that cannot be committed. Always: a warning while fewer than two fit."""
    fit = checkpoints_that_fit(where, checkpoint_bytes)
    if first and fit < 1:
        raise volume_full(where, "the first checkpoint", checkpoint_bytes)
    if fit < WARN_BELOW_CHECKPOINTS:
        log.warning(
            "only %d checkpoint(s) of about %s fit in the %s free at %s: %s",
            fit,
            size_text(checkpoint_bytes),
            size_text(free_bytes(where)),
            where,
            FIX.replace(", then start again", " before the volume fills up"),
        )
