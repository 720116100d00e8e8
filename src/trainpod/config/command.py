"""The `command` workload's config: your own program, run under the kit's lifecycle.

TRAINPOD_WORKLOAD=command TRAINPOD_CONFIG=configs/my-trainer.yaml trainpod boot
trainpod run command --config examples/nanogpt/command.yaml
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from pydantic import Field, field_validator, model_validator

from trainpod.config.checkpoint import CheckpointConfig
from trainpod.config.deploy import ENV_NAME_PATTERN, NAME_PATTERN
from trainpod.config.loader import Section
from trainpod.log import is_secret_name

# What the kit tells the program beyond the pod's own variables (README, "Bring your own trainer").
PROGRAM_ENV = (
    "TRAINPOD_RUN_DIR",
    "TRAINPOD_CHECKPOINT_DIR",
    "TRAINPOD_PREEMPTION_WINDOW_S",
    "TRAINPOD_LEASE_HELD",
    "TRAINPOD_KEEP_LAST",
    "TRAINPOD_KEEP_BEST",
    "TRAINPOD_PROGRAM_ID",
    "TRAINPOD_REFUSAL_FILE",
)


SCRIPT_RUNNERS = re.compile(r"^(python[0-9.]*|sh|bash|dash|zsh)$")
# Interpreters that, given no argument at all, read their program from standard input as the ones above do (their
# options are not read here: only the bare name is refused). Rscript and R refuse to start without one instead.
_STDIN_WHEN_BARE = re.compile(r"^(node|nodejs|perl|ruby|php|lua|julia)[0-9.]*$")
# The interpreters' one-letter options, which may come clustered in one word (`bash -lc CMD`, `sh -ec CMD`,
# `bash -euo pipefail script.sh`, `python -uc CODE`, `python -um MODULE`): those that mean there is no
# script file (inline code, a module), the shells' -s (commands from stdin), and those that take the next word
# as their value (python's -O takes none: it is the shells' -O that does; python's -W and -X may carry it in
# the same word).
_INLINE = {"python": "cm", "shell": "c"}
_FROM_STDIN = {"python": "", "shell": "s"}
_TAKES_A_VALUE = {"python": "WX", "shell": "oO"}
_LONG_OPTIONS_WITH_A_VALUE = {"--check-hash-based-pycs", "--rcfile", "--init-file"}


class Runs(NamedTuple):
    """What an interpreter's command line runs: `script` (the file at `index`), `code` (-c, -m), `stdin` (its
    program read from standard input), or `other` (no interpreter these rules know)."""

    what: str
    index: int | None = None


def what_it_runs(command: list[str]) -> Runs:
    """Where in `command` the interpreter's script file is named, or what it runs instead."""
    name = Path(command[0]).name
    if not SCRIPT_RUNNERS.match(name):
        return Runs("stdin" if len(command) == 1 and _STDIN_WHEN_BARE.match(name) else "other")
    kind = "python" if name.startswith("python") else "shell"
    index = 1
    while index < len(command):
        word = command[index]
        if word == "-":
            return Runs("stdin")
        if word == "--":
            return Runs("script", index + 1) if index + 1 < len(command) else Runs("stdin")
        if word.startswith("--"):
            index += 2 if word in _LONG_OPTIONS_WITH_A_VALUE else 1
            continue
        if not (word.startswith("-") or (kind == "shell" and word.startswith("+"))):
            return Runs("script", index)
        for position, letter in enumerate(word[1:], start=1):
            if letter in _INLINE[kind]:
                return Runs("code")
            if letter in _FROM_STDIN[kind]:
                return Runs("stdin")
            if letter in _TAKES_A_VALUE[kind]:
                index += 1 if position < len(word) - 1 else 2  # its value: the rest of the word, or the next
                break
        else:
            index += 1
    return Runs("stdin")  # no script named: python and the shells read their program from standard input


class CommandConfig(Section):
    """A program of yours (any language), started, watched, stopped and restarted by the kit."""

    name: str = Field(
        description="Run name: the run lives in runs/<name>/ unless TRAINPOD_RUN says otherwise.",
        pattern=NAME_PATTERN,
    )
    command: list[str] = Field(
        min_length=1,
        description="The program and its arguments, run without a shell, e.g. [python, train.py, --lr, '3e-4']. "
        "A bare name is looked up on PATH (the kit's own Python first); a relative path in workdir.",
    )
    workdir: str | None = Field(
        None,
        description="Where the program runs. Default: the synced repo's checkout at TRAINPOD_GIT_REF (repos/<name>@<ref>/) "
        "when TRAINPOD_GIT_REPO is "
        "set, else the current directory; a relative path is taken inside that default.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="More environment variables for the program, NAME: value (PATH too: the kit's own Python "
        "environment stays first in it; secrets belong in the pod's "
        "environment, which the program inherits, not here: this file is copied to runs/<run>/config.yaml).",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="Times a program that fails (an exit other than 0 and 143) is started again within this "
        "pod start before the start counts as failed (exit 75).",
    )
    status_every_seconds: float = Field(
        10.0, gt=0, description="How often status.json is refreshed (elapsed, cost, last log line)."
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description="keep_last and keep_best (given to the program as TRAINPOD_KEEP_LAST/KEEP_BEST), the "
        "preemption window and the lease; the program decides when to commit.",
    )

    @field_validator("command")
    @classmethod
    def _names_what_to_run(cls, command: list[str]) -> list[str]:
        """An interpreter with no script (`[python]`, `[bash, -l]`) reads its program from standard input, which
        is /dev/null in a pod (no terminal: a read would wait, billed, for good): it did nothing, exited 0 at
        once, and the run was DONE, its pod stopped as finished."""
        if command and what_it_runs(command).what == "stdin":
            name = Path(command[0]).name
            fix = {"python": f"[{name}, train.py], or code, like [{name}, -m, my.module]",
                   "shell": f"[{name}, train.sh], or commands, like [{name}, -c, './train.sh --lr 3e-4']"}  # fmt: skip
            kind = (
                ("python" if name.startswith("python") else "shell") if SCRIPT_RUNNERS.match(name) else None
            )
            raise ValueError(
                f"it gives {name} no script to run, so {name} would read its program from standard input, which is "
                "empty here (/dev/null): it would exit 0 at once and the run be marked DONE having done nothing. "
                f"Name the script, like {fix.get(kind, f'[{name}, <your script>]')}"
            )
        return command

    @model_validator(mode="after")
    def _env_names(self) -> CommandConfig:
        problems = [
            f"env.{name}: not a variable name"
            for name in self.env
            if not re.fullmatch(ENV_NAME_PATTERN, name)
        ]
        problems += [
            f"env.{name}: TRAINPOD_ variables are set by the kit (the program gets them all); remove it"
            for name in self.env
            if name.startswith("TRAINPOD_")
        ]
        problems += [
            f"env.{name}: a secret does not belong in this file, which is copied to runs/<run>/config.yaml "
            "on the volume; remove it and set it in the pod's environment (the deploy config's `secrets:`), "
            "which the program inherits"
            for name in self.env
            if is_secret_name(name)
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return self
