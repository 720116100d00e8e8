"""The kit's own API telling the command workload that it refused the program's input (docs/design.md, "Your
own trainer").

    TRAINPOD_REFUSAL_FILE=/tmp/trainpod-program-x/refusal.txt python train.py   # set by the command workload

A Checkpointer, `trainpod checkpoint commit` or the HF callback that refuses what the program asked of it (a
step older than LATEST, a state that would not load back, keep_last below 2) ends the program with exit 2. The
kit does not read a program's own exit codes (a program may exit 2 for anything), so that exit was a failed
start, retried at every start into the same refusal until the crash-loop limit, each start paying for the
program's setup. The refusal is written here, a file on the container's disk that the kit clears before each
start of the program: a program that fails after one is exit 2 for the run too, not restarted.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from trainpod import atomic
from trainpod.errors import ExitCode, TrainpodError
from trainpod.log import redact

REFUSAL_FILE_ENV = "TRAINPOD_REFUSAL_FILE"


def record(error: TrainpodError) -> None:
    """Say to the kit running this program (if one does) that `error`, bad input, ends it."""
    path = os.environ.get(REFUSAL_FILE_ENV)
    if not path or error.exit_code != ExitCode.BAD_INPUT:
        return
    with contextlib.suppress(OSError):  # the program's exit 2 and its line are said either way
        atomic.write_text(Path(path), redact(str(error)))


def clear() -> None:
    """A commit the API made after a refusal: the program got past it (a shell's `commit ... || true`), so a later
    failure of this start is its own, counted and tried again, not the refusal's exit 2."""
    path = os.environ.get(REFUSAL_FILE_ENV)
    if path:
        with contextlib.suppress(OSError):
            atomic.remove(Path(path))


def read(path: Path) -> str | None:
    """The refusal recorded at `path` since it was cleared, or None."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip() or None
    except OSError:
        return None
