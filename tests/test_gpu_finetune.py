"""GPU tier for finetuning (`pytest -m gpu`, run where a CUDA GPU is lent; `make test` deselects it).

QLoRA with bitsandbytes' CUDA NF4 kernels, bf16 compute and the paged 8-bit AdamW, then a resume
on GPU: same data order, and the loss after resuming matches the uninterrupted run within a bf16
tolerance (GPU kernels are not bitwise deterministic; exactness is asserted on CPU).
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch

from finetune_support import FINETUNE_RUN, finetune_args, make_base_model
from support import run_trainpod, signal_when_step_reached, start_trainpod

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU machine)"
    ),
]
GPU_SETTINGS = (
    "--set",
    "quantization.compute_dtype=auto",
    "--set",
    "train.optimizer=paged_adamw_8bit",
    "--set",
    "train.gradient_checkpointing=true",
    "--set",
    "train.cpu_threads=null",
)


def metrics(volume: Path) -> dict[int, dict]:
    lines = (volume / "runs" / FINETUNE_RUN / "logs/metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def test_qlora_on_gpu_uses_bf16_and_cuda_nf4_and_resumes_with_the_same_losses(tmp_path):
    reference, volume = tmp_path / "reference", tmp_path / "volume"
    make_base_model(reference)
    shutil.copytree(reference, volume)
    result = run_trainpod(*finetune_args(*GPU_SETTINGS), volume=reference)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "precision torch.bfloat16" in result.stdout and "device cuda" in result.stdout
    summary = json.loads(
        (reference / "runs" / FINETUNE_RUN / "export/adapter/training_summary.json").read_text()
    )
    assert summary["quantization"]["compute_dtype"] == "bfloat16"

    proc = start_trainpod(*finetune_args(*GPU_SETTINGS), volume=volume)
    signal_when_step_reached(proc, volume, 12, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143
    assert run_trainpod(*finetune_args(*GPU_SETTINGS), volume=volume).returncode == 0
    ours, theirs = metrics(volume), metrics(reference)
    resumed_from = min(step for step in ours if step > 12) - 1
    for step in range(resumed_from + 1, 31):
        assert ours[step]["loss"] == pytest.approx(theirs[step]["loss"], rel=2e-2), f"step {step}"


def test_qlora_dpo_on_gpu_in_bf16_learns_the_preference_and_resumes_with_the_same_losses(tmp_path):
    """objective dpo on CUDA: the 4-bit base with the adapters off as the reference, bf16 autocast, the chunked
    log-probabilities under gradient checkpointing; a SIGTERM and resume give the uninterrupted losses within bf16."""
    from support import CONFIGS

    run = "tiny-dpo"
    dpo = (
        "run",
        "finetune",
        "--config",
        str(CONFIGS / "finetune/tiny-dpo.yaml"),
        "--set",
        "base_model.path=models/base",
    )
    settings = (*dpo, "--set", "method=qlora", *GPU_SETTINGS, "--set", "train.log_every=1")
    reference, volume = tmp_path / "reference", tmp_path / "volume"
    make_base_model(reference)
    shutil.copytree(reference, volume)
    result = run_trainpod(*settings, volume=reference)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "precision torch.bfloat16" in result.stdout and "device cuda" in result.stdout

    def rows(folder: Path) -> dict[int, dict]:
        lines = (folder / "runs" / run / "logs/metrics.jsonl").read_text().splitlines()
        return {row["step"]: row for row in map(json.loads, lines)}

    theirs = rows(reference)
    assert theirs[20]["eval_loss"] < 0.693 and theirs[20]["eval_rewards_accuracy"] > 0.5, theirs[20]
    proc = start_trainpod(*settings, volume=volume)
    signal_when_step_reached(proc, volume, 8, signal.SIGTERM, run=run)
    assert proc.returncode == 143
    assert run_trainpod(*settings, volume=volume).returncode == 0
    ours = rows(volume)
    resumed_from = min(step for step in ours if step > 8) - 1
    for step in range(resumed_from + 1, 21):
        assert ours[step]["loss"] == pytest.approx(theirs[step]["loss"], rel=2e-2), f"step {step}"
