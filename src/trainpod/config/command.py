"""The `command` workload's config: your own program, run under the kit's lifecycle.

TRAINPOD_WORKLOAD=command TRAINPOD_CONFIG=configs/my-trainer.yaml trainpod boot
trainpod run command --config examples/nanogpt/command.yaml
"""

from __future__ import annotations

from pydantic import Field, model_validator

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
)


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

    @model_validator(mode="after")
    def _env_names(self) -> CommandConfig:
        import re

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
