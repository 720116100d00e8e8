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

    def background_commits(self, device_type: str) -> bool:
        """Whether periodic commits are written in the background on this device."""
        return self.mode == "async" or (self.mode == "auto" and device_type == "cuda")
