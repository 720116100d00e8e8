"""GPU tier (`pytest -m gpu`, run where a CUDA GPU is lent; `make test` deselects it).

bf16 autocast, SDPA or flash-attn 2, fused AdamW, and resume on GPU: the data order is the same and
the loss after resuming matches the uninterrupted run within a bf16 tolerance (GPU kernels are not
bitwise deterministic, so exactness is asserted on CPU only).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from support import RUN, TINY_PRETRAIN, run_trainpod, signal_when_step_reached, start_trainpod

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU machine)"
    ),
]
GPU_RUN = (
    "run",
    "pretrain",
    "--config",
    str(TINY_PRETRAIN),
    "--set",
    "train.log_every=1",
    "--set",
    "model.hidden_size=256",
    "--set",
    "model.num_heads=4",
    "--set",
    "model.intermediate_size=688",
)


def metrics(volume: Path) -> dict[int, dict]:
    lines = (volume / "runs" / RUN / "logs/metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def test_bf16_run_uses_gpu_paths_and_exports(volume):
    result = run_trainpod(*GPU_RUN, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "precision torch.bfloat16" in result.stdout
    assert "device cuda" in result.stdout
    assert metrics(volume)[60]["loss"] < metrics(volume)[1]["loss"]
    assert metrics(volume)[60]["mfu"] is None or metrics(volume)[60]["mfu"] > 0


def test_resume_on_gpu_keeps_data_order_and_loss(volume, tmp_path, tiny_dataset_volume):
    import shutil

    reference = tmp_path / "reference"
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, reference / folder)
    assert run_trainpod(*GPU_RUN, volume=reference).returncode == 0
    proc = start_trainpod(*GPU_RUN, volume=volume)
    signal_when_step_reached(proc, volume, 25, signal.SIGTERM)
    assert proc.returncode == 143
    assert run_trainpod(*GPU_RUN, volume=volume).returncode == 0
    ours, theirs = metrics(volume), metrics(reference)
    for step in range(26, 61):
        assert ours[step]["loss"] == pytest.approx(theirs[step]["loss"], rel=2e-2), f"step {step}"


FSDP_ONE_GPU = ("--set", "train.parallel=fsdp", "--set", "checkpoint.every_steps=10")


def test_fsdp2_on_one_gpu_trains_in_bf16_commits_shards_in_the_background_and_resumes(
    volume, tmp_path, tiny_dataset_volume
):
    """FSDP2 with a group of one (train/sharding.py): bf16 gathers with fp32 reduction, DCP commits
    written behind training (async on GPU), a SIGTERM and a resume that follows the unsharded loss."""
    import shutil

    reference = tmp_path / "reference"
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, reference / folder)
    assert run_trainpod(*GPU_RUN, volume=reference).returncode == 0
    proc = start_trainpod(*GPU_RUN, *FSDP_ONE_GPU, volume=volume)
    out = signal_when_step_reached(proc, volume, 25, signal.SIGTERM)
    assert proc.returncode == 143, out
    assert "1 rank(s) (fsdp)" in out and "in the background" in out
    latest = (volume / "runs" / RUN / "checkpoints" / "LATEST").read_text().strip()
    assert (volume / "runs" / RUN / "checkpoints" / latest / "model" / ".metadata").is_file()
    result = run_trainpod(*GPU_RUN, *FSDP_ONE_GPU, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    ours, theirs = metrics(volume), metrics(reference)
    for step in range(30, 61):  # bf16 gathers vs autocast: the same math, other rounding
        assert ours[step]["loss"] == pytest.approx(theirs[step]["loss"], rel=3e-2), f"step {step}"
