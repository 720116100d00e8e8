"""GPU tier (`pytest -m gpu`): async commits on CUDA snapshot into pinned host buffers, the copy queued
on the training stream, and the checkpoint holds the state at its step even though the next steps
change the tensors before the writer reads them. (tests/test_gpu.py's resume test covers a SIGTERM
with async commits, the default on GPU.)"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from test_gpu import GPU_RUN

from trainpod.checkpoint import CheckpointStore
from trainpod.checkpoint.writer import CheckpointWriter

from support import RUN, run_trainpod

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU machine)"
    ),
]


def test_async_commit_on_cuda_snapshots_the_state_at_its_step_into_pinned_buffers(tmp_path):
    writer = CheckpointWriter(CheckpointStore(tmp_path), pin_memory=True)
    weights = torch.randn(2048, 2048, device="cuda")
    moment = torch.randn(2048, device="cuda")
    expected_weights, expected_moment = weights.cpu(), moment.cpu()
    files = {"model.safetensors": {"w": weights}, "optimizer.pt": {"exp_avg": moment}}
    for step in (1, 2):  # the second commit reuses the first one's pinned buffers
        writer.commit(step, files, {}, background=True)
        # The next optimizer steps, queued on the same stream right behind the snapshot's copies.
        weights.mul_(2.0)
        moment.add_(1.0)
        committed = writer.wait()
        assert all(buffer.is_pinned() for buffer in writer.buffers._buffers.values())
        saved = safetensors.torch.load((committed.path / "model.safetensors").read_bytes())["w"]
        saved_moment = torch.load(committed.path / "optimizer.pt", weights_only=True)["exp_avg"]
        assert torch.equal(saved, expected_weights), (
            f"step {step}: the snapshot must be the state at its step"
        )
        assert torch.equal(saved_moment, expected_moment)
        expected_weights, expected_moment = weights.cpu(), moment.cpu()
    assert CheckpointStore(tmp_path).latest().step == 2


def test_pretrain_on_gpu_commits_in_the_background_by_default(volume):
    result = run_trainpod(*GPU_RUN, "--set", "train.max_steps=20", volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "committed checkpoint step-10 in" in result.stdout
    assert "in the background" in result.stdout, "checkpoint.mode=auto is async on a GPU"
    assert (volume / "runs" / RUN / "checkpoints" / "LATEST").read_text().strip() == "step-20"
