"""Weights & Biases, when the pod has WANDB_API_KEY (or WANDB_MODE=offline for a local record).

The W&B run id travels in every checkpoint, so a run resumed after an interruption logs into the
same W&B run and its curves continue instead of starting a second run at step 0. TensorBoard is
always written (reporting.py); W&B is the optional second view.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import secrets
import string
from typing import Any

from trainpod.errors import InputError
from trainpod.volume import RunDir

log = logging.getLogger(__name__)


def wandb_wanted() -> bool:
    return bool(os.environ.get("WANDB_API_KEY")) or os.environ.get("WANDB_MODE") == "offline"


def check_wandb_installed() -> None:
    """Before anything is written: tracking asked for (the environment) needs wandb importable."""
    if wandb_wanted() and importlib.util.find_spec("wandb") is None:
        asked = "WANDB_API_KEY is set" if os.environ.get("WANDB_API_KEY") else "WANDB_MODE=offline"
        raise InputError(
            f"{asked}, which asks for W&B tracking, but wandb is not installed: pip install "
            "'trainpod[tracking]' (the trainpod image has it), or unset it to train without W&B"
        )


def new_run_id() -> str:
    """Eight lowercase letters and digits, the shape of W&B's own run ids."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbTracker:
    def __init__(
        self, run: RunDir, project: str, entity: str | None, run_id: str | None, config: dict[str, Any]
    ):
        import wandb

        self.run_id = run_id or new_run_id()
        # resume="allow": the same id continues the existing W&B run, or creates it on the first start.
        # The key is read from the environment by wandb itself; it never passes through our code.
        self._run = wandb.init(
            project=project,
            entity=entity,
            id=self.run_id,
            name=run.name,
            resume="allow",
            dir=str(run.root),
            config=config,
        )
        log.info("W&B run %s (%s)", self.run_id, "resumed" if run_id else "new")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = {
            (f"train/{k}" if k != "eval_loss" else "eval/loss"): v
            for k, v in metrics.items()
            if k != "step" and isinstance(v, int | float) and math.isfinite(v)
        }
        self._run.log(values, step=step)

    def finish(self) -> None:
        self._run.finish()
