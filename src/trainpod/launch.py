"""One process per GPU on this machine, with the two guarantees the pod contract needs.

torchrun's agent turns a worker's exit code into its own failure code, but the supervisor acts on
the exact code (143 preempted, 75 retry, 2 bad input, 3 budget). This launcher starts the ranks
with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), forwards SIGTERM
and SIGINT to every rank, and returns the ranks' own code. Several nodes still use torchrun.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

# If one rank fails, the others are blocked in a collective: give them this long to notice, then kill.
_PEER_GRACE_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(nproc: int, argv: list[str]) -> int:
    port = str(_free_port())
    procs = []
    for rank in range(nproc):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "trainpod", *argv], env=env))

    def forward(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    return _wait(procs)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _wait(procs: list[subprocess.Popen]) -> int:
    first_failure: int | None = None
    failed_at = 0.0
    while any(p.poll() is None for p in procs):
        for proc in procs:
            code = proc.poll()
            if code not in (None, 0) and first_failure is None:
                first_failure, failed_at = _exit_code(code), time.monotonic()
        if first_failure is not None and time.monotonic() - failed_at > _PEER_GRACE_S:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        time.sleep(0.05)
    codes = [_exit_code(p.returncode) for p in procs]
    if first_failure is None:
        first_failure = next((c for c in codes if c != 0), 0)
    return first_failure
