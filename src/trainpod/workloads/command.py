"""The `command` workload: your own training program under the same lifecycle as the stock workloads.

    TRAINPOD_WORKLOAD=command TRAINPOD_CONFIG=examples/nanogpt/command.yaml trainpod boot
    trainpod run command --config examples/nanogpt/command.yaml

The kit holds the run's lease, starts the program in the config's workdir with TRAINPOD_RUN_DIR,
TRAINPOD_CHECKPOINT_DIR and TRAINPOD_PREEMPTION_WINDOW_S in its environment, copies its output to
the console and runs/<run>/logs/program.log, and keeps status.json alive (elapsed, cost, newest
checkpoint, last log line). The program commits its own checkpoints (trainpod.Checkpointer, the HF
callback, or `trainpod checkpoint commit`). How it ends:

| the program | the kit exits |
| --- | --- |
| exits 0 | 0, DONE written |
| exits 143, or anything once the kit was asked to stop (SIGTERM), forwarded to it yet or not | 143 (the supervisor starts it again) |
| is over TRAINPOD_BUDGET_USD: SIGTERM, the window, then SIGKILL | 3 |
| loses the run's lease to another writer: SIGKILL at once, so no commit of its lands | 75 |
| exits with anything else (1, 2, 3, killed, ...), after `max_restarts` tries | 75: a failed start, counted; FAILED after TRAINPOD_MAX_FAILED_STARTS in a row |
| fails after the kit's own API refused its input (a Checkpointer's, `trainpod checkpoint commit`'s or the HF callback's exit 2: a step older than LATEST, a state that would not load back; trainpod/refusal.py) | 2 at once: every start would be refused the same way |
| fails with less free on the volume than the run's newest checkpoint takes, or before its first commit with its last output lines saying the disk is full (its Checkpointer's exit 5, an ENOSPC traceback naming no file off the volume) | 5 at once: the next commit cannot land |

A program's own exit 2 or 3 is not taken as "bad input" or "budget": the kit cannot know what a
program means by them, and a failed start is bounded by the crash-loop limit anyway. Its own API's
refusals it knows: they are written to TRAINPOD_REFUSAL_FILE, on the container's disk.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainpod import atomic, cost, refusal
from trainpod.checkpoint import CheckpointStore
from trainpod.config.command import CommandConfig, what_it_runs
from trainpod.context import RunContext
from trainpod.diskspace import free_bytes, full_path_named, is_disk_full, says_disk_full, volume_full
from trainpod.errors import BudgetExhausted, InputError, Preempted, TemporaryError
from trainpod.gitsync import own_checkout
from trainpod.program import Program
from trainpod.volume import Volume

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often the kit looks at the program, its signals and the budget
FORWARD_DELAY_S = 0.1  # the window the program is told is this much shorter: the kit forwards SIGTERM
OUTPUT_WAIT_S = 2.0  # for the program's last output once it and its group have exited
OUTPUT_WAIT_MIN_S = 0.2  # ... even when the window is spent: its pipes are at their end by then


class ProgramFailed(TemporaryError):
    """The program exited with a failure; a later start may not (a crash loop is bounded by finish.py)."""


def disk_estimate(config: CommandConfig) -> int | None:
    return None  # the program decides what it writes


def preflight(ctx: RunContext, config: CommandConfig) -> None:
    """Exit 2, with nothing written, when the workdir or the program does not exist."""
    workdir = resolve_workdir(config, ctx.volume)
    resolve_program(config, workdir, program_path(config))


def run(ctx: RunContext, config: CommandConfig) -> dict[str, Any]:
    workdir = resolve_workdir(config, ctx.volume)
    argv = [resolve_program(config, workdir, program_path(config)), *config.command[1:]]
    status = CommandStatus(ctx, config)
    restarts = 0
    with tempfile.TemporaryDirectory(prefix="trainpod-program-") as scratch:  # the container's disk
        refusal_file = Path(scratch) / "refusal.txt"
        env = program_env(ctx, config) | {refusal.REFUSAL_FILE_ENV: str(refusal_file)}
        while True:
            refusal_file.unlink(missing_ok=True)  # a refusal said in an earlier try is that try's
            program = Program(argv, workdir, env, ctx.run.logs / "program.log")
            code, stopped_by = _supervise(program, ctx, config, status)
            status.write("exited", program)
            _raise_if_stopped(code, stopped_by, status)
            if code == 0:
                newest = status.latest()
                return {
                    "exit_code": 0,
                    "restarts": restarts,
                    "checkpoint": newest,
                    "step": newest,  # the DONE line's step, as status.json's (None: the program committed none)
                    "elapsed_s": status.elapsed(),
                }
            _raise_if_no_checkpoint_fits(status, argv[0], code, program.last_lines)
            _raise_if_refused(argv[0], code, refusal_file)
            if restarts >= config.max_restarts:
                raise ProgramFailed(
                    f"{argv[0]} exited with {code} (after {restarts} restart(s), max_restarts={config.max_restarts}); "
                    f"its output is in {ctx.run.logs / 'program.log'}"
                )
            restarts += 1
            log.warning(
                "%s exited with %d; starting it again (%d/%d)", argv[0], code, restarts, config.max_restarts
            )


def _raise_if_refused(program: str, code: int, refusal_file: Path) -> None:
    """A program that failed after the kit's own API refused its input (trainpod/refusal.py) fails the same way
    at every start: exit 2, the line saying what to change, not a counted retry. Under torchrun the refused
    rank's exit 2 reaches the kit as torchrun's 1: any failure after a refusal is the refusal's."""
    said = refusal.read(refusal_file)
    if said is not None:
        raise InputError(
            f"{program} exited with {code} after the kit's checkpoint API refused it; every start would end the "
            f"same way, so it is not started again: {said}"
        )


def _raise_if_no_checkpoint_fits(
    status: CommandStatus, program: str, code: int, last_lines: Iterable[str]
) -> None:
    """A program that failed with less free on the volume than the run's newest checkpoint takes (its
    Checkpointer's exit 5, or a write of its own on a full volume) fails the same way at every start: exit 5,
    the volume's fix, not a counted retry; before the first commit, one whose last lines say the disk is full,
    unless the file they name is off the volume (the container disk: a counted failure, that disk wiped at a restart).
    Its own exit codes alone say nothing (the table above)."""
    committed = status.store.committed()
    if committed and free_bytes(status.store.root) < committed[0].nbytes:
        raise volume_full(
            status.store.root,
            f"the next checkpoint of {program}, which exited with {code}",
            committed[0].nbytes,
        )
    said = next((line for line in reversed(last_lines) if says_disk_full(line)), None)
    if committed or said is None:
        return
    elsewhere = full_path_named(said)
    if elsewhere is not None and not _on_the_volume(elsewhere, status.ctx.volume.root):
        # Not the volume (freeing it would not help, and exit 5 stops the pod): the container disk, /tmp or
        # /dev/shm. A counted failure, restarted; the line says which disk and how to grow it.
        log.warning(
            "%s's last lines say a disk outside the volume is full (%s): the container's own disk, not the "
            "volume; raise pod.container_disk_gb in the deploy config (that disk is wiped at every restart) or "
            "have the program write there less (TMPDIR, caches on the volume)",
            program,
            said,
        )
        return
    # No checkpoint yet to size the next one by: the first commit's own failure says it (its Checkpointer's
    # exit 5, an ENOSPC traceback), and it fails the same way at every start.
    raise volume_full(
        status.store.root, f"the first checkpoint of {program}, which exited with {code} ({said})"
    )


def _on_the_volume(path: Path, volume_root: Path) -> bool:
    """Whether `path` (which may be gone by now) is on the volume, through whatever links lead there."""
    return path.resolve().is_relative_to(volume_root.resolve())


def _raise_if_stopped(code: int, stopped_by: str | None, status: CommandStatus) -> None:
    """A stop the kit made, or the program's own 143, as the exit-code table in the docstring says."""
    if stopped_by == "budget":
        raise BudgetExhausted(
            f"TRAINPOD_BUDGET_USD is spent (${status.cost_usd():.2f}); the program was stopped (exit {code}). "
            "Raise the budget and start again to continue from its newest checkpoint."
        )
    if stopped_by == "lease":
        raise TemporaryError("another writer took over this run's lease; the program was stopped")
    if stopped_by or code == 143:
        raise Preempted(
            f"stopped by {stopped_by or 'the program (exit 143)'}; newest checkpoint: {status.latest()}"
        )


def _supervise(
    program: Program, ctx: RunContext, config: CommandConfig, status: CommandStatus
) -> tuple[int, str | None]:
    """Run the program to its end: (its exit code, what stopped it: a signal's name, budget, lease, or None)."""
    _start(program)
    log.info("started %s (pid %d) in %s", " ".join(program.argv), program.proc.pid, program.workdir)
    stopped_by, killed, next_status = None, False, 0.0
    while (code := program.poll()) is None:
        if stopped_by is None:
            stopped_by = _stop_to_make(ctx, status, program)
            if stopped_by == "lease":
                # The run is another writer's now: a SIGTERM asks the program for its last commit, which
                # would land in that writer's run (LATEST moved under it). As the stock trainers abandon theirs.
                log.warning(
                    "another writer took over this run's lease: SIGKILL to the program's process group"
                )
                program.signal_group(signal.SIGKILL)
                killed = True
            elif stopped_by:
                ctx.watch.request(stopped_by)  # starts the window's clock for a budget stop
                # The program first; the rest of its process group once it exits (_end_group). SIGTERM to
                # the whole group at once killed its DataLoader workers, and its final commit with them.
                log.warning("stopping the program (%s): SIGTERM to it, then to its process group", stopped_by)
                program.signal(signal.SIGTERM)
        elif not killed and ctx.watch.seconds_left() <= 0:
            log.warning("the program is still running at the end of the stop window: SIGKILL")
            program.signal_group(signal.SIGKILL)
            killed = True
        if time.monotonic() >= next_status:
            status.write("running", program)
            next_status = time.monotonic() + config.status_every_seconds
        time.sleep(POLL_S)
    log.info("the program exited with %d", code)
    if stopped_by is None and ctx.watch.requested:
        # The stop came after the last look and before the program's exit was seen: nothing was forwarded yet,
        # but the exit is the stop's (a SIGTERM to every process of the pod reaches the program too, and
        # torchrun answers one with exit 1), not a failure to count or a reason to start the program again.
        stopped_by = ctx.watch.signal_name or "signal"
    # Its group first, its last output after: what it left in its group holds the output pipes open, and
    # waiting for them before (2 s a pipe) spent 4 s of a stop's 5 s window before that group got its
    # SIGTERM, and the kit's own exit (status.json, the lease) came after the platform's SIGKILL.
    _end_group(program, ctx, killed)
    program.sweep()
    program.wait_for_output(min(OUTPUT_WAIT_S, max(_window_left(ctx), OUTPUT_WAIT_MIN_S)))
    return code, stopped_by


def _start(program: Program) -> None:
    """Start the program; a file the system cannot run is bad input (exit 2), not a crash that every start
    of the pod repeats until the crash-loop limit."""
    try:
        program.start()
    except OSError as exc:
        if exc.errno not in (errno.ENOEXEC, errno.ENOENT, errno.EACCES):
            raise
        raise InputError(
            f"command[0]: {program.argv[0]} cannot be run ({exc.strerror}). A script needs a first line naming "
            "its interpreter, like #!/bin/sh or #!/usr/bin/env python3, with Unix line ends (a '\\r' after it "
            "names an interpreter that does not exist); or run it through one: command: [sh, train.sh]"
        ) from None


def _end_group(program: Program, ctx: RunContext, killed: bool) -> None:
    """What the program left running in its group (a shell wrapper's child, a background process) is
    stopped like the program: SIGTERM, then SIGKILL when the window ends. Nothing keeps writing to the run
    once the kit has released its lease (what left the group gets its SIGKILL from Program.sweep)."""
    if killed or not program.group_alive():
        return
    deadline = time.monotonic() + _window_left(ctx)
    log.warning("the program left processes in its group: SIGTERM to its process group")
    program.signal_group(signal.SIGTERM)
    while program.group_alive() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    program.signal_group(signal.SIGKILL)


def _window_left(ctx: RunContext) -> float:
    """Seconds of the stop window left (a whole window when no stop was asked for)."""
    return max(ctx.watch.seconds_left() if ctx.watch.requested else ctx.watch.window_seconds, 0.0)


def _stop_to_make(ctx: RunContext, status: CommandStatus, program: Program) -> str | None:
    """The stop to make of the program still running at the loop's look: none for a budget spent once it had
    finished since (exit 0). Its own finish, racing the budget (the 50 ms between the look and the budget's),
    ended in 3 and no DONE, the run FAILED with its work done; a look again before the SIGTERM leaves
    microseconds of that race. A failure in that race stays the budget's 3 (not a start again, stopped at once),
    and so does an exit after the SIGTERM: a program answering SIGTERM with a commit and exit 0 has steps left,
    and DONE would end its run for good where a raised budget resumes it."""
    reason = _stop_reason(ctx, status)
    if reason == "budget" and program.poll() == 0:
        log.info("the program finished (exit 0) as the budget ran out: its work is done")
        return None
    return reason


def _stop_reason(ctx: RunContext, status: CommandStatus) -> str | None:
    if ctx.watch.requested:
        return ctx.watch.signal_name or "signal"
    if ctx.lease_lost():
        return "lease"
    budget = ctx.budget_usd
    spent = status.cost_usd()
    if budget is not None and spent is not None and spent >= budget:
        return "budget"
    return None


# ------------------------------------------------------------------------ where and what it runs
def default_workdir(volume: Volume, environ: dict[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    return own_checkout(volume.root / "repos", environ) or Path.cwd()


def resolve_workdir(config: CommandConfig, volume: Volume) -> Path:
    base = default_workdir(volume)
    workdir = base / config.workdir if config.workdir else base
    if not workdir.is_dir():
        raise InputError(
            f"workdir {workdir} does not exist (workdir={config.workdir!r}, relative to {base}); "
            "set workdir to a folder of your synced repo, or TRAINPOD_GIT_REPO to the repo holding it"
        )
    return workdir


def program_path(config: CommandConfig) -> str:
    """PATH with the kit's own Python environment first: `python` and `trainpod` are the kit's. The rest is the
    config's env.PATH where it sets one (it was dropped for the pod's, so a tool it named was not found)."""
    rest = config.env.get("PATH") or os.environ.get("PATH", os.defpath)
    return os.pathsep.join([str(Path(sys.executable).parent), rest])


def resolve_program(config: CommandConfig, workdir: Path, path: str) -> str:
    name = config.command[0]
    if "/" in name:
        found = workdir / name
        if found.is_file() and os.access(found, os.X_OK):
            _check_interpreter_line(found, name)
            return str(found)
        problem = "is not executable (chmod +x it)" if found.is_file() else "does not exist"
        raise InputError(f"command[0]={name!r}: {found} {problem}; fix command or workdir")
    found = shutil.which(name, path=path)
    if found is None:
        raise InputError(
            f"command[0]={name!r} is not on PATH ({path}); install it in the image, or give a path "
            "relative to workdir like ./train.sh"
        )
    _check_script_argument(config.command, workdir)
    return found


def _check_script_argument(command: list[str], workdir: Path) -> None:
    """`python train.py` or `bash train.sh` whose script is not in workdir: the interpreter's own exit 2
    counted as a failed start at every restart until the run was FAILED, its real reason in program.log."""
    index = what_it_runs(command).index  # of the script: set for a script alone
    if index is None:
        return
    word = command[index]
    script = Path(word) if os.path.isabs(word) else workdir / word
    if not script.is_file():
        raise InputError(
            f"command[{index}]={word!r}: {script} does not exist, so {command[0]} has no script to run; fix "
            "command or workdir (relative paths start at workdir)"
        )


def _check_interpreter_line(path: Path, name: str) -> None:
    """A script the system can run: its first line names an interpreter that exists (a program started
    without a shell is exec'd, and exec refuses a script without one)."""
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith(b"\x7fELF"):
        return
    line = head[2:].split(b"\n", 1)[0] if head.startswith(b"#!") else None
    interpreter = line.split()[0].decode(errors="replace") if line and line.split() else None
    if line is None or interpreter is None:
        problem = "has no first line naming its interpreter; add one like #!/bin/sh or #!/usr/bin/env python3"
    elif line.endswith(b"\r"):
        problem = "has Windows line ends (its first line ends in '\\r'); save it with Unix line ends (LF)"
    elif not os.access(interpreter, os.X_OK):
        problem = f"names the interpreter {interpreter}, which does not exist here; fix its first line"
    else:
        return
    raise InputError(f"command[0]={name!r}: {path} {problem}, or run it through one: command: [sh, {name}]")


def program_env(ctx: RunContext, config: CommandConfig) -> dict[str, str]:
    window = max(ctx.watch.window_seconds - FORWARD_DELAY_S, 0.0)
    return {
        **os.environ,
        **config.env,
        "PATH": program_path(config),
        "PYTHONUNBUFFERED": "1",  # lines reach the log and status.json as they are printed
        "TRAINPOD_RUN": ctx.run.name,
        "TRAINPOD_RUN_DIR": str(ctx.run.root.absolute()),
        "TRAINPOD_CHECKPOINT_DIR": str(ctx.run.checkpoints.absolute()),
        "TRAINPOD_PREEMPTION_WINDOW_S": f"{window:g}",
        "TRAINPOD_LEASE_HELD": "1",
        "TRAINPOD_KEEP_LAST": str(config.checkpoint.keep_last),
        "TRAINPOD_KEEP_BEST": str(config.checkpoint.keep_best),
    }


# ------------------------------------------------------------------------ status.json
class CommandStatus:
    """status.json for `trainpod status` and the supervisor: elapsed and cost across starts.

    It is advisory: a write that fails (a network volume's I/O error) is said once and tried again at the next
    refresh. Raised, it ended the kit, and the program with it (PR_SET_PDEATHSIG) without its stop window. A
    full volume is still exit 5 at once: the program's next commit could not land either."""

    def __init__(self, ctx: RunContext, config: CommandConfig):
        self.ctx = ctx
        self.store = CheckpointStore(ctx.run.checkpoints, config.checkpoint.keep_last)
        self.hourly_usd = cost.hourly_usd()
        self.started = time.monotonic()
        self.failing = False  # the last write failed: said once until one works again
        try:
            self.elapsed_before = float(atomic.read_json(ctx.run.status).get("elapsed_s") or 0.0)
        except (OSError, ValueError, AttributeError):  # none yet, or unreadable: this start counts from 0
            self.elapsed_before = 0.0

    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    def cost_usd(self) -> float | None:
        return None if self.hourly_usd is None else self.elapsed() / 3600 * self.hourly_usd

    def latest(self) -> int | None:
        committed = self.store.committed()
        return committed[0].step if committed else None

    def write(self, state: str, program: Program) -> None:
        try:
            self._write(state, program)
        except OSError as exc:
            if is_disk_full(exc):
                raise
            if not self.failing:
                log.warning("could not write %s (%s); the program goes on, and so do the tries",
                            self.ctx.run.status, exc)  # fmt: skip
            self.failing = True
            return
        self.failing = False

    def _write(self, state: str, program: Program) -> None:
        committed = self.store.committed()
        newest = committed[0] if committed else None
        atomic.write_json(
            self.ctx.run.status,
            {
                "run": self.ctx.run.name,
                "workload": "command",
                "state": state,
                "step": newest.step if newest else None,
                "max_steps": None,
                "elapsed_s": self.elapsed(),
                "cost_usd": self.cost_usd(),
                "latest_checkpoint": {
                    "step": newest.step,
                    "committed_unix": newest.manifest.get("created_unix"),
                }
                if newest
                else None,
                "last_log_line": program.last_line,
                "program_pid": program.proc.pid if program.proc else None,
                "updated_unix": time.time(),
                "pid": os.getpid(),
            },
        )
