"""The one error hierarchy of trainpod and the exit codes the supervisor acts on (docs/design.md, "Exit codes").

Every error a user can cause is a `TrainpodError` whose message says what is wrong, where, and
what to do next; the CLI prints the message (never a traceback) and exits with `exit_code`.
"""

from __future__ import annotations

import enum

from trainpod.log import redact


class ExitCode(enum.IntEnum):
    """Process exit codes; the supervisor decides whether to restart a pod from these alone."""

    DONE = 0  # finished, DONE written: stop the pod
    BAD_INPUT = 2  # bad config or input: do not restart
    BUDGET_EXHAUSTED = 3  # checkpoint committed, budget spent: do not restart
    MACHINE_UNFIT = 4  # no usable GPU, driver older than the image's CUDA: replace the pod, same volume
    VOLUME_FULL = 5  # the network volume has no room for the next write: do not restart until it is freed
    TEMPORARY = 75  # network, hub, volume busy: restart with backoff (EX_TEMPFAIL)
    PREEMPTED = 143  # stopped by SIGTERM after committing: restart (128 + SIGTERM)
    INTERRUPTED = 130  # a laptop verb (push, pull, supervise, deploy) ended with Ctrl-C (128 + SIGINT)


def is_whole_number(text: str) -> bool:
    """ASCII digits alone, what int() takes: str.isdigit passes '³' too, and int('³') raised a ValueError, a
    traceback and exit 1 where a setting's reader meant its exit-2 line naming the variable."""
    return text.isascii() and text.isdigit()


class TrainpodError(Exception):
    """Base of every error trainpod reports to a user."""

    exit_code: ExitCode = ExitCode.BAD_INPUT


class ConfigError(TrainpodError):
    """The config (YAML, overrides or environment) is invalid. Holds every problem found."""

    exit_code = ExitCode.BAD_INPUT

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{len(self.problems)} config problem(s){where}:"]
        lines += [f"  - {problem}" for problem in self.problems]
        super().__init__("\n".join(lines))


class InputError(TrainpodError):
    """An input on disk (dataset, tokenizer, volume) is missing or unusable."""

    exit_code = ExitCode.BAD_INPUT


class TemporaryError(TrainpodError):
    """A failure that a later start may not see (network, hub, a volume held by another writer)."""

    exit_code = ExitCode.TEMPORARY


class BudgetExhausted(TrainpodError):
    """The run spent its TRAINPOD_BUDGET_USD; the newest state is committed."""

    exit_code = ExitCode.BUDGET_EXHAUSTED


class Diverged(TrainpodError):
    """The loss or gradient norm became NaN or inf; nothing from that step on was committed.

    A restart replays the same steps from the newest checkpoint into the same NaN, so it is final like
    bad input: the fix is in the config (the learning rate, warmup, clipping) or the data.
    """

    exit_code = ExitCode.BAD_INPUT


class GpuOutOfMemory(TrainpodError):
    """The GPU ran out of memory in a stock trainer. A restart loads the same model and replays the same batches
    into the same peak, so it is final like bad input: the fix is a smaller micro-batch or sequence, gradient
    checkpointing, or a larger GPU (workloads/lifecycle.py names the config's fields)."""

    exit_code = ExitCode.BAD_INPUT


class MachineUnfit(TrainpodError):
    """This machine cannot run the workload (no usable GPU, a driver older than the image's CUDA).

    Starting the same pod again cannot help; a new pod on another machine, same volume, can.
    """

    exit_code = ExitCode.MACHINE_UNFIT


class VolumeFull(TrainpodError):
    """The volume has no room for the next write; nothing committed was lost."""

    exit_code = ExitCode.VOLUME_FULL


class Preempted(TrainpodError):
    """SIGTERM or SIGINT arrived; whatever could be committed in the warning window was committed."""

    exit_code = ExitCode.PREEMPTED


# What `trainpod status` says stopped a run, by exit code (a crash has none of these codes).
STOP_REASONS = {
    ExitCode.PREEMPTED: "preempted",
    ExitCode.BUDGET_EXHAUSTED: "budget spent",
    ExitCode.VOLUME_FULL: "disk full",
    ExitCode.BAD_INPUT: "bad config or input",
    ExitCode.MACHINE_UNFIT: "machine unfit",
    ExitCode.TEMPORARY: "temporary failure",
}
_REASON_CHARS = 400  # status.json keeps a summary; the whole message and traceback are in the run's log


def stop_reason(exc: BaseException) -> str:
    """One line for status.json: what kind of stop, its exit code, and the first line of the message.

    status.json is on the volume: secrets are masked as in a log line (a library's message may hold a
    URL with a token in it)."""
    first_line = redact((str(exc).strip().splitlines() or [""])[0])
    if isinstance(exc, TrainpodError):
        label = STOP_REASONS.get(exc.exit_code, "stopped")
        reason = f"{label} (exit {int(exc.exit_code)}): {first_line}"
    else:
        reason = f"crash: {type(exc).__name__}: {first_line}".rstrip(": ")
    return reason[:_REASON_CHARS]
