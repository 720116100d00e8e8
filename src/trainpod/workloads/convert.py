"""`trainpod run convert`: adapters to MLX or merged into their base, checkpoints to HF models.

    TRAINPOD_CONFIG=configs/convert/tiny.yaml TRAINPOD_VOLUME=/tmp/vol trainpod run convert

The conversions themselves are trainpod/convert/'s; outputs go to runs/<run>/export/ under the run's
lease (workloads/lifecycle.py), and a run converted again skips what is done.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainpod.config.convert import ConvertConfig
from trainpod.context import RunContext


def config_type(tree: dict[str, Any]) -> type:
    return ConvertConfig


def preflight(ctx: RunContext, config: ConvertConfig) -> None:
    """run_convert checks every input before it writes anything."""


def run(ctx: RunContext, config: ConvertConfig) -> list[Path]:
    from trainpod.convert import run_convert

    return run_convert(config.model_copy(update={"name": ctx.run.name}), ctx.volume, ctx.watch)


def disk_estimate(config: ConvertConfig) -> int | None:
    return None
