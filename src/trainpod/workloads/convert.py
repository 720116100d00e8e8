"""`trainpod run convert`: adapters to MLX or merged into their base, checkpoints to HF models, export
folders pushed to the Hugging Face Hub.

    TRAINPOD_CONFIG=configs/convert/tiny.yaml TRAINPOD_VOLUME=/tmp/vol trainpod run convert

The conversions themselves are trainpod/convert/'s; outputs go to runs/<run>/export/ under the run's
lease (workloads/lifecycle.py), and a run converted again skips what is done.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from trainpod.config.convert import ConvertConfig
from trainpod.context import RunContext


def preflight(ctx: RunContext, config: ConvertConfig) -> None:
    """Every task's inputs, checked before the run's lease is taken and its export/ made: a typo was exit 75
    ('leased by another writer') for as long as a training run held the lease, or left an empty run folder
    under a misspelt name. `run` looks them up again under the lease, where they may have moved on."""
    from trainpod.convert import plan_convert

    plan_convert(_named(ctx, config), ctx.volume)


def check_ahead(config: ConvertConfig, environ: Mapping[str, str]) -> None:
    """What a deploy's `then` can check before the run it converts exists (boot): each hub task's HF_TOKEN."""
    from trainpod.config.convert import HubTask
    from trainpod.convert.hub import check_push_environment

    for number, task in enumerate(config.task, start=1):
        if isinstance(task, HubTask):
            check_push_environment(task, number, environ)


def run(ctx: RunContext, config: ConvertConfig) -> list[Path]:
    from trainpod.convert import run_convert

    return run_convert(_named(ctx, config), ctx.volume, ctx.watch)


def _named(ctx: RunContext, config: ConvertConfig) -> ConvertConfig:
    return config.model_copy(update={"name": ctx.run.name})  # TRAINPOD_RUN or --run, when given


def disk_estimate(config: ConvertConfig) -> int | None:
    return None
