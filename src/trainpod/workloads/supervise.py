"""`trainpod boot` with TRAINPOD_WORKLOAD=supervise: the spot supervisor in a pod with the run's volume.

    TRAINPOD_WORKLOAD=supervise TRAINPOD_CONFIG=configs/deploy/pretrain-spot.yaml TRAINPOD_RUN=... trainpod boot

The recommended place for it: a cheap on-demand CPU pod mounting the same network volume sees DONE,
FAILED and status.json directly (runpod/supervise.py). Its config is the run's deploy config.
"""

from __future__ import annotations

from trainpod.config.deploy import DeployConfig
from trainpod.context import RunContext


def preflight(ctx: RunContext, config: DeployConfig) -> None:
    """The deploy config was validated when it loaded; the API key is checked at the first request."""


def run(ctx: RunContext, config: DeployConfig) -> int:
    from trainpod.runpod.supervise import supervise

    config.run = ctx.run.name
    return supervise(config, ctx.volume, stop_requested=lambda: ctx.watch.requested)


def disk_estimate(config: DeployConfig) -> int | None:
    return None
