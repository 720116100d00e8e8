"""When and how checkpoints are written, kept and verified (shared by every training workload)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainpod.config.loader import Section


class CheckpointConfig(Section):
    every_steps: int = Field(500, ge=1, description="Commit a checkpoint every this many optimizer steps.")
    every_minutes: float = Field(
        10.0,
        gt=0,
        description="Also commit when this many minutes have passed since the last commit's snapshot: "
        "the most training an interruption can lose, whatever the step time.",
    )
    mode: Literal["auto", "async", "sync"] = Field(
        "auto",
        description="'async': snapshot the state into reused host buffers (pinned on GPU) and write it on a "
        "background thread while training goes on; 'sync': training waits for each write; 'auto': async "
        "on GPU, sync on CPU (where the writer's hashing and copying compete with training for the cores; "
        "see BENCHMARKS.md).",
    )
    keep_last: int = Field(2, ge=2, description="Keep the newest this many checkpoints (at least 2).")
    keep_best: int = Field(
        1,
        ge=0,
        description="Also keep the best this many by eval loss (finetunes: train.early_stopping_metric; 0 keeps none).",
    )
    verify: Literal["sha256", "size"] = Field(
        "sha256", description="How a checkpoint is verified at start: 'sha256' (every byte) or 'size' (fast)."
    )
    lease_ttl_seconds: float = Field(
        90.0, gt=5, description="A run's lease expires this long after its last heartbeat (seconds)."
    )
    preemption_window_seconds: float = Field(
        5.0, gt=0, description="Seconds between SIGTERM and SIGKILL on this platform (RunPod spot: 5)."
    )
    commit_margin: float = Field(
        1.5, ge=1.0, description="On SIGTERM, commit only if the last commit time times this fits the window."
    )

    def best_export_problem(self, weights: str, eval_every: int) -> str | None:
        """What keeps `export.weights` from exporting the best checkpoint (None: nothing): it is the best of the
        checkpoints kept that an eval scored at their own step."""
        if weights != "best":
            return None
        if not eval_every:
            return (
                "export.weights='best' exports the checkpoint of the best eval, and train.eval_every=0 runs none; "
                "set train.eval_every (with a validation split), or export.weights=last"
            )
        if not self.keep_best:
            return (
                "export.weights='best' needs that checkpoint kept: set checkpoint.keep_best to 1 or more (it is 0, "
                "so retention deletes the best once it is not among the last), or export.weights=last"
            )
        if eval_every % self.every_steps:
            return (
                f"export.weights='best' picks among the checkpoints committed at an eval's step, and "
                f"checkpoint.every_steps={self.every_steps} does not divide train.eval_every={eval_every} (most "
                f"evals would have none); set checkpoint.every_steps to a divisor of eval_every (e.g. {eval_every}), "
                "or export.weights=last"
            )
        return None

    def background_commits(self, device_type: str) -> bool:
        """Whether periodic commits are written in the background on this device."""
        return self.mode == "async" or (self.mode == "auto" and device_type == "cuda")
