"""Runs `trainpod` and SIGKILLs itself at one exact point of the checkpoint commit protocol.

    python tests/crash_driver.py PHASE STEP -- run pretrain --config ... --volume ...

Phases (each at the first commit of a step >= STEP):
  writing          after the first checkpoint file is written, before the others and the manifest
  before-rename    with every file and the manifest written, before the temp folder is renamed
  before-latest    after the rename, before LATEST is replaced (the commit point)
  during-retention after an old checkpoint was renamed for deletion, before it is removed
Background commits (checkpoint.mode=async), at the first background commit of a step >= STEP:
  background-writing after its first file is written (training goes on meanwhile)
  waiting            the commit is held; SIGKILL when the training loop waits for it
  sigterm-in-flight  SIGTERM after its first file; held until the loop waits for it or abandons it
Sync commits:
  sigterm-writing    SIGTERM (not SIGKILL) after the first file of the commit is written
A real SIGKILL, not an exception: nothing runs after it, exactly like a spot pod's hard kill.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(phase: str, min_step: int) -> None:
    from trainpod import atomic
    from trainpod.checkpoint import store

    def step_of(path: object) -> int:
        match = re.search(r"step-(\d+)", str(path))
        return int(match.group(1)) if match else -1

    from trainpod.checkpoint import writer

    real_rename, real_write_text = os.rename, atomic.write_text
    real_write_bytes = store.PendingCheckpoint.write_bytes
    real_wait = writer.CheckpointWriter.wait
    loop_waits = threading.Event()

    def write_bytes(self, name, data):  # noqa: ANN001
        real_write_bytes(self, name, data)
        if step_of(self.dir) < min_step:
            return
        background = threading.current_thread() is not threading.main_thread()
        if phase == "writing" or (phase == "background-writing" and background):
            _die()
        if phase == "sigterm-writing":
            os.kill(os.getpid(), signal.SIGTERM)
        if phase == "waiting" and background:
            time.sleep(120)  # killed long before: the loop trains on, then waits for this commit
        if phase == "sigterm-in-flight" and background and not loop_waits.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 60
            while not (loop_waits.is_set() or self.abandoned.is_set()) and time.monotonic() < deadline:
                time.sleep(0.01)

    def wait(self):  # noqa: ANN001
        if self.in_flight_step is not None and self.in_flight_step >= min_step:
            loop_waits.set()
            if phase == "waiting":
                _die()
        return real_wait(self)

    def rename(src, dst):  # noqa: ANN001
        if (
            phase == "before-rename"
            and ".tmp-" in str(src)
            and re.search(r"step-\d+$", str(dst))
            and step_of(dst) >= min_step
        ):
            _die()
        real_rename(src, dst)
        if phase == "during-retention" and ".tmp-deleting-" in str(dst):
            _die()

    def write_text(target, text):  # noqa: ANN001
        if phase == "before-latest" and str(target).endswith("LATEST") and step_of(text) >= min_step:
            _die()
        real_write_text(target, text)

    store.PendingCheckpoint.write_bytes = write_bytes
    writer.CheckpointWriter.wait = wait
    os.rename = rename
    atomic.write_text = write_text


if __name__ == "__main__":
    phase, step, sep, *argv = sys.argv[1:]
    assert sep == "--", __doc__
    install(phase, int(step))
    from trainpod.cli import main

    sys.exit(main(argv))
