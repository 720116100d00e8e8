"""A user's program as a child process the kit can stop: its own process group, dead with its parent,
its output on the console and in a log file (secrets masked), its last line kept for status.json.

Dead with its parent, all of it: PR_SET_PDEATHSIG reaches the program alone, so a watchdog process
outside the program's group waits on a pipe from the kit, and when the kit dies (SIGKILL, the OOM
killer: no container's PID 1 takes everything with it on a laptop or a bare VM) it kills the program's
group and every process that carries the program's TRAINPOD_PROGRAM_ID in its environment (torchrun
starts each worker in a session of its own, out of the group's reach). The kit has it do the same
once the program has ended (`sweep`), for what no signal to the group reached.

The `command` workload (workloads/command.py) runs one with the run's lifecycle around it.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import BinaryIO, TextIO

from trainpod.log import redact

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded before any fork
PROGRAM_ID_ENV = "TRAINPOD_PROGRAM_ID"  # in the program's environment, inherited by all it starts
STAND_DOWN = b"done"
LAST_LINES_KEPT = 20  # torchrun's summary of a failed worker, after the worker's own last line, is about 15
# Run by the kit's own Python, so nothing here is imported: it reads the program's pid, then the pipe's
# end: with STAND_DOWN before it (nothing was started) it leaves, without (the kit died, or swept once the
# program had ended) it kills.
_WATCHDOG = f"""
import os, signal, sys, time
received = b""
while chunk := os.read(0, 64):
    received += chunk
words = received.split()
if {STAND_DOWN!r} in words:
    sys.exit(0)
group = int(words[0]) if words else None
marker = b"\\0{PROGRAM_ID_ENV}=" + sys.argv[1].encode() + b"\\0"
for _ in range(40):  # until nothing is left to kill: a process may start another while this looks
    if group is not None:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
    hit = False  # a process found by its environment (a zombie has none: it does not count)
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{{entry}}/environ", "rb") as f:
                found = marker in b"\\0" + f.read()
            if found:
                os.kill(int(entry), signal.SIGKILL)
                hit = True
        except (OSError, ValueError):
            pass
    if not hit:
        break
    time.sleep(0.05)
"""


def _in_own_group_dying_with_parent(parent: int) -> None:
    """Runs in the child between fork and exec (no allocation-heavy work: other threads may hold locks)."""
    os.setpgid(0, 0)  # SIGTERM goes to the program's whole group; the terminal's Ctrl-C does not
    if _LIBC is not None:
        # A SIGKILLed kit must not leave the program writing checkpoints with no lease held for it.
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(137)


def exit_code(returncode: int) -> int:
    """A shell's view of the code: killed by signal N is 128 + N (SIGTERM: 143)."""
    return 128 - returncode if returncode < 0 else returncode


class Program:
    def __init__(self, argv: list[str], workdir: Path, env: dict[str, str], log_path: Path):
        self.argv = argv
        self.workdir = workdir
        self.env = env
        self.log_path = log_path
        # The output's last lines: a failure's reason (a traceback's last line) may come before a launcher's own.
        self.last_lines: collections.deque[str] = collections.deque(maxlen=LAST_LINES_KEPT)
        self.proc: subprocess.Popen | None = None
        self._pumps: list[threading.Thread] = []
        self._log_lock = threading.Lock()
        self._log_failing = False  # the last write of log_path failed: said once until one works again
        self._watchdog: subprocess.Popen | None = None
        self._watchdog_pipe: int | None = None

    @property
    def last_line(self) -> str:
        """The output's last non-blank line (status.json's last_log_line), "" before any."""
        return self.last_lines[-1] if self.last_lines else ""

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        parent = os.getpid()
        program_id = uuid.uuid4().hex
        self._start_watchdog(program_id)  # first: a kit killed while the program starts leaves nothing behind
        try:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.workdir,
                env={**self.env, PROGRAM_ID_ENV: program_id},
                stdin=subprocess.DEVNULL,  # a pod has no terminal; in a shell, a read would stop its group
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=lambda: _in_own_group_dying_with_parent(parent),  # noqa: PLW1509
            )
        except BaseException:
            self.stand_down()  # nothing started: nothing to kill
            raise
        with contextlib.suppress(OSError):  # a watchdog gone (killed by hand) must not end the kit's start
            os.write(self._watchdog_pipe, f"{self.proc.pid}\n".encode())  # the program's group
        # Like every line after it: masked (a token given on the command line, `--hub-token $HF_TOKEN` expanded,
        # a git URL with credentials, is on the volume otherwise), and a failed write is said while the program's
        # output is still read
        self._append_to_log(redact(f"--- started {self.argv} in {self.workdir} (pid {self.proc.pid})\n"))
        for pipe, console in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr)):
            pump = threading.Thread(target=self._pump, args=(pipe, console), daemon=True)
            pump.start()
            self._pumps.append(pump)

    def _start_watchdog(self, program_id: str) -> None:
        read_end, self._watchdog_pipe = os.pipe()  # not inherited: the program never holds the write end
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, program_id],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # out of reach of the kit's group: a Ctrl-C, a kill of that group
            )
        finally:
            os.close(read_end)

    def sweep(self) -> None:
        """Once the program has exited and its group had its window: SIGKILL, through the watchdog, whatever
        carrying the program's id is left in sessions of its own (torchrun's workers once torchrun itself
        was killed), which no signal to the group reaches. Nothing writes to the run after the kit's lease."""
        self._end_watchdog(b"")  # the pipe's end without a word: what the kit's death looks like

    def stand_down(self) -> None:
        """Tell the watchdog that nothing was started, so nothing is left to kill."""
        self._end_watchdog(STAND_DOWN)

    def _end_watchdog(self, last_words: bytes) -> None:
        """Close the pipe after `last_words` and wait for the watchdog to act on them (once)."""
        if self._watchdog_pipe is None:
            return
        if last_words:
            with contextlib.suppress(OSError):
                os.write(self._watchdog_pipe, last_words)
        os.close(self._watchdog_pipe)
        self._watchdog_pipe = None
        self._watchdog.wait()

    def signal(self, signum: int) -> None:
        """The program itself, not its group: its helpers (torch DataLoader workers) die at a SIGTERM
        that does not come from their parent, and the program's next batch raises instead of committing."""
        with contextlib.suppress(ProcessLookupError):  # it exited already
            os.kill(self.proc.pid, signum)

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # the program's group is gone already
            os.killpg(self.proc.pid, signum)

    def group_alive(self) -> bool:
        """Whether anything of the program's process group is left (after the program itself exited)."""
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # the group id was reused by someone else's processes
            return False
        return True

    def poll(self) -> int | None:
        """The program's exit code once it has exited, at once: its output pipes may stay open while what
        it left in its group (DataLoader workers, a wrapper's child) runs on; `wait_for_output` after."""
        code = self.proc.poll()
        return None if code is None else exit_code(code)

    def wait_for_output(self, timeout: float) -> None:
        """Let the pumps copy the rest of the output, for at most `timeout` seconds in all (a process that
        left the group may hold the pipes open for good)."""
        deadline = time.monotonic() + max(timeout, 0.0)
        for pump in self._pumps:
            pump.join(timeout=max(deadline - time.monotonic(), 0.0))

    def _pump(self, pipe: BinaryIO, console: TextIO) -> None:
        """Copy the program's output line by line ('\\r' ends a progress bar's line too), masked: a secret is
        masked in a whole line, never in pieces of one. Each chunk is looked at once: the unfinished line was
        copied and searched whole at every chunk, so a program writing a line of some MB without its end (a
        JSON dump, a row of dots) was read slower and slower and blocked at its next write, for minutes."""
        pending = bytearray()  # the unfinished line
        for chunk in iter(lambda: os.read(pipe.fileno(), 65536), b""):
            end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1  # after its last line end; 0: none
            if not end:
                pending += chunk
                continue
            pending += chunk[:end]
            self._emit(bytes(pending), console)
            pending = bytearray(chunk[end:])
        self._emit(bytes(pending), console)

    def _emit(self, data: bytes, console: TextIO) -> None:
        if not data:
            return
        text = redact(data.decode("utf-8", errors="replace"))
        # Neither copy may end the pump: a program whose output is no longer read blocks at its next print once
        # the pipe (64 kB) is full, and runs on, billed, with nothing to end it.
        with contextlib.suppress(OSError):  # a console whose reader is gone (`trainpod run ... | head`)
            console.write(text)
            console.flush()
        self._append_to_log(text)
        shown = [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()]
        self.last_lines.extend(line[:300] for line in shown)

    def _append_to_log(self, text: str) -> None:
        """The output into log_path; a write that fails (a network volume's I/O error, a full volume) is said
        once, and the next lines are tried again."""
        with self._log_lock:
            try:
                with open(self.log_path, "a", encoding="utf-8") as file:
                    file.write(text)
            except OSError as exc:
                if not self._log_failing:
                    log.warning(
                        "could not write %s (%s); the program's output goes on to the console",
                        self.log_path,
                        exc,
                    )
                self._log_failing = True
                return
            self._log_failing = False
