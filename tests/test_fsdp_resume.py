"""FSDP2 (train.parallel=fsdp) on two CPU ranks over gloo: sharded checkpoints through
torch.distributed.checkpoint inside the commit protocol, exact resume on the same rank count, and
resume on another rank count (2 -> 1, 1 -> 2) from the committed step with the same data position.

FSDP2 itself runs here (fully_shard on CPU with gloo); only NCCL and bf16 gathers wait for the GPU
tier (tests/test_gpu_training_paths.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load as load_safetensors

from trainpod.checkpoint import CheckpointStore

from support import (
    RUN,
    TINY_PRETRAIN,
    child_env,
    exported_weights,
    run_trainpod,
    signal_when_step_reached,
    start_trainpod,
    status_step,
    trainpod_cmd,
)

pytestmark = pytest.mark.slow
PRETRAIN = ("run", "pretrain", "--config", str(TINY_PRETRAIN), "--set", "train.log_every=1")
SHORT = ("--set", "train.max_steps=24")  # checkpoints every 10 steps (tiny.yaml), 2 micro-batches a step
TWO_FSDP = ("--nproc-per-node", "2", "--set", "train.parallel=fsdp")
ONE_RANK_SAME_BATCH = ("--set", "train.grad_accum_steps=4")  # 1 rank x 4 reads what 2 ranks x 2 read


def fresh_volume(tmp_path: Path, dataset: Path, name: str) -> Path:
    volume = tmp_path / name
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(dataset / folder, volume / folder)
    return volume


def checkpoints(volume: Path) -> Path:
    return volume / "runs" / RUN / "checkpoints"


def data_position(volume: Path, step: int) -> dict:
    state = json.loads((checkpoints(volume) / f"step-{step}" / "trainer_state.json").read_text())
    return {k: state["data"][k] for k in ("epoch", "shard_index", "position")} | {
        "tokens_seen": state["progress"]["tokens_seen"]
    }


def assert_weights_close(a: bytes, b: bytes, atol: float) -> None:
    import torch

    left, right = load_safetensors(a), load_safetensors(b)
    assert left.keys() == right.keys()
    for name in left:
        torch.testing.assert_close(left[name], right[name], rtol=0, atol=atol, msg=name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_dataset_volume: Path) -> Path:
    """An uninterrupted two-rank FSDP run."""
    volume = fresh_volume(tmp_path_factory.mktemp("fsdp"), tiny_dataset_volume, "reference")
    result = run_trainpod(*PRETRAIN, *SHORT, *TWO_FSDP, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 rank(s) (fsdp)" in result.stdout
    return volume


def test_every_rank_writes_its_shards_and_the_manifest_hashes_each_of_them(reference):
    store = CheckpointStore(checkpoints(reference))
    latest = store.latest()
    assert latest is not None and latest.step == 24
    files = latest.manifest["files"]
    assert {"model/.metadata", "model/__0_0.distcp", "model/__1_0.distcp"} <= set(files)
    assert "model.safetensors" not in files, "no rank gathers the full weights for a checkpoint"
    assert all(entry["sha256_pieces"] for entry in files.values())

    shard = latest.path / "model" / "__1_0.distcp"  # a flipped bit in rank 1's shard is caught
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    manifest, reason = store.verify(latest.path)
    assert manifest is None and "model/__1_0.distcp does not match its sha256" in reason


def test_the_export_gathers_the_shards_into_a_model_transformers_loads(reference):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reference / "runs" / RUN / "export" / "hf")
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "ties kept"


def test_sigterm_under_fsdp_with_background_commits_resumes_byte_identically(
    reference, tmp_path, tiny_dataset_volume
):
    volume = fresh_volume(tmp_path, tiny_dataset_volume, "async")
    args = (
        *PRETRAIN,
        *SHORT,
        *TWO_FSDP,
        "--set",
        "checkpoint.mode=async",
        "--set",
        "checkpoint.every_steps=3",
    )
    proc = start_trainpod(*args, volume=volume)
    out = signal_when_step_reached(proc, volume, 14, signal.SIGTERM)
    assert proc.returncode == 143, out
    result = run_trainpod(*args, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from step-" in result.stdout
    assert exported_weights(volume) == exported_weights(reference)
    assert not list(checkpoints(volume).glob("*.tmp-*"))


def test_sigkill_of_every_rank_loses_only_the_uncommitted_steps_and_resumes_byte_identically(
    reference, tmp_path, tiny_dataset_volume
):
    volume = fresh_volume(tmp_path, tiny_dataset_volume, "killed")
    args = (*PRETRAIN, *SHORT, *TWO_FSDP)
    proc = subprocess.Popen(
        trainpod_cmd(*args, volume=volume),
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # the launcher and both ranks: a pod's hard kill takes them all
    )
    try:
        while status_step(volume) < 15 and proc.poll() is None:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (checkpoints(volume) / "LATEST").read_text().strip() == "step-10"
    result = run_trainpod(*args, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from step-10" in result.stdout
    assert exported_weights(volume) == exported_weights(reference)


def test_a_two_rank_fsdp_run_resumes_on_one_rank_at_the_same_data_position(
    reference, tmp_path, tiny_dataset_volume
):
    volume = fresh_volume(tmp_path, tiny_dataset_volume, "two-to-one")
    proc = start_trainpod(*PRETRAIN, *SHORT, *TWO_FSDP, volume=volume)
    out = signal_when_step_reached(proc, volume, 13, signal.SIGTERM)
    assert proc.returncode == 143, out
    stopped = int((checkpoints(volume) / "LATEST").read_text().strip().split("-")[1])

    result = run_trainpod(*PRETRAIN, *SHORT, "--set", "train.parallel=fsdp", volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resumed from step-{stopped}" in result.stdout
    assert "train.grad_accum_steps becomes 4" in result.stdout
    assert data_position(volume, 24) == data_position(reference, 24)
    # The same tokens, weights and optimizer state each step; only the order of float sums differs.
    assert_weights_close(exported_weights(volume), exported_weights(reference), atol=1e-5)


def test_a_one_rank_run_resumes_on_two_fsdp_ranks_at_the_same_data_position(
    reference, tmp_path, tiny_dataset_volume
):
    volume = fresh_volume(tmp_path, tiny_dataset_volume, "one-to-two")
    proc = start_trainpod(*PRETRAIN, *SHORT, *ONE_RANK_SAME_BATCH, volume=volume)
    out = signal_when_step_reached(proc, volume, 13, signal.SIGTERM)
    assert proc.returncode == 143, out
    assert (
        checkpoints(volume) / (checkpoints(volume) / "LATEST").read_text().strip() / "model.safetensors"
    ).is_file()

    result = run_trainpod(*PRETRAIN, *SHORT, *ONE_RANK_SAME_BATCH, *TWO_FSDP, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "train.grad_accum_steps becomes 2" in result.stdout
    assert data_position(volume, 24) == data_position(reference, 24)
    assert_weights_close(exported_weights(volume), exported_weights(reference), atol=1e-5)


def test_a_rank_count_that_cannot_share_the_steps_micro_batches_is_refused_with_exit_2(
    tmp_path, tiny_dataset_volume
):
    volume = fresh_volume(tmp_path, tiny_dataset_volume, "indivisible")
    proc = start_trainpod(*PRETRAIN, *SHORT, "--set", "train.grad_accum_steps=3", volume=volume)
    out = signal_when_step_reached(proc, volume, 3, signal.SIGTERM)
    assert proc.returncode == 143, out
    before = sorted(p.name for p in checkpoints(volume).iterdir())

    result = run_trainpod(*PRETRAIN, *SHORT, *TWO_FSDP, volume=volume)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "2 ranks cannot share them evenly. Resume on 1, 3 GPU(s)" in result.stdout + result.stderr
    assert sorted(p.name for p in checkpoints(volume).iterdir()) == before, "nothing on the volume changed"


# ------------------------------------------------------------------------------ full finetuning
FULL = ("--set", "train.max_steps=16", "--set", "generation_eval.every_evals=0")


def finetune_volume(tmp_path: Path, base: Path, name: str) -> Path:
    volume = tmp_path / name
    shutil.copytree(base, volume)
    return volume


def full_finetune(*extra: str) -> tuple[str, ...]:
    from finetune_support import finetune_args

    return finetune_args(*FULL, *extra, method="full")


def finetuned_weights(volume: Path) -> bytes:
    from finetune_support import FINETUNE_RUN

    return (volume / "runs" / FINETUNE_RUN / "export" / "hf" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def full_reference(tmp_path_factory: pytest.TempPathFactory, finetune_base_volume: Path) -> Path:
    volume = finetune_volume(tmp_path_factory.mktemp("full"), finetune_base_volume, "reference")
    result = run_trainpod(*full_finetune(*TWO_FSDP), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 rank(s) (fsdp)" in result.stdout
    return volume


def test_a_full_finetune_under_fsdp_stopped_by_sigterm_resumes_byte_identically(
    full_reference, tmp_path, finetune_base_volume
):
    from finetune_support import FINETUNE_RUN

    volume = finetune_volume(tmp_path, finetune_base_volume, "stopped")
    proc = start_trainpod(*full_finetune(*TWO_FSDP), volume=volume)
    out = signal_when_step_reached(proc, volume, 7, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143, out
    result = run_trainpod(*full_finetune(*TWO_FSDP), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from step-" in result.stdout
    assert finetuned_weights(volume) == finetuned_weights(full_reference)


def test_a_full_finetune_under_fsdp_resumes_on_one_rank_with_the_same_rows(
    full_reference, tmp_path, finetune_base_volume
):
    from finetune_support import FINETUNE_RUN

    volume = finetune_volume(tmp_path, finetune_base_volume, "two-to-one")
    proc = start_trainpod(*full_finetune(*TWO_FSDP), volume=volume)
    out = signal_when_step_reached(proc, volume, 7, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143, out
    result = run_trainpod(*full_finetune(), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "train.grad_accum_steps becomes 4" in result.stdout
    state = json.loads(
        (volume / "runs" / FINETUNE_RUN / "checkpoints/step-16/trainer_state.json").read_text()
    )
    reference = json.loads(
        (full_reference / "runs" / FINETUNE_RUN / "checkpoints/step-16/trainer_state.json").read_text()
    )
    assert (state["data"]["epoch"], state["data"]["step"] * 1) == (
        reference["data"]["epoch"],
        reference["data"]["step"] * 2,
    ), "the same rows: one rank's micro batches are the two ranks' together"
    assert_weights_close(finetuned_weights(volume), finetuned_weights(full_reference), atol=1e-5)


def test_fsdp_for_a_lora_finetune_is_refused_with_exit_2(tmp_path, finetune_base_volume):
    from finetune_support import finetune_args

    volume = finetune_volume(tmp_path, finetune_base_volume, "lora")
    result = run_trainpod(*finetune_args(*FULL, "--set", "train.parallel=fsdp", method="lora"), volume=volume)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "train.parallel=fsdp shards full finetuning" in result.stdout + result.stderr
