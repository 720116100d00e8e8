"""A resume that cannot work is one line naming the checkpoint, what does not fit and the fix, exit 2.

    .venv/bin/pytest -q tests/test_resume_errors.py

RunPod counts an exit 1 as a failed start and retries it; exit 2 stops the pod at once (DESIGN.md).
Each test starts from a run interrupted after its last commit (DONE removed from a finished run).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from trainpod.train import state as checkpoint_state

from support import RUN, TINY_PRETRAIN, run_trainpod

pytestmark = pytest.mark.slow
PRETRAIN = ("run", "pretrain", "--config", str(TINY_PRETRAIN), "--set", "train.max_steps=10")


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory, tiny_dataset_volume: Path) -> Path:
    volume = tmp_path_factory.mktemp("interrupted")
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, volume / folder)
    result = run_trainpod(*PRETRAIN, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    (volume / "runs" / RUN / "DONE").unlink()  # as if killed right after the step-10 commit
    return volume


@pytest.fixture
def volume(tmp_path: Path, interrupted: Path) -> Path:
    copy = tmp_path / "volume"
    shutil.copytree(interrupted, copy)
    return copy


def checkpoint(volume: Path) -> Path:
    return volume / "runs" / RUN / "checkpoints" / "step-10"


def assert_one_line_exit_2(result, *expected: str) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1, output
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def test_resume_after_a_model_shape_change_names_the_tensor_both_shapes_and_the_fix(volume):
    result = run_trainpod(*PRETRAIN, "--set", "model.hidden_size=128", volume=volume)
    assert_one_line_exit_2(
        result, str(checkpoint(volume)), "model.embed_tokens.weight", "[832, 64]", "[832, 128]",
        "start a new run name", "restore",
    )  # fmt: skip
    assert json.loads((volume / "runs" / RUN / "status.json").read_text())["state"] == "stopped"


def test_resume_from_a_committed_checkpoint_missing_a_file_names_the_file(volume):
    manifest_path = checkpoint(volume) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["files"]["rng.safetensors"]  # a checkpoint whose manifest never listed it (another version)
    manifest_path.write_text(json.dumps(manifest))
    (checkpoint(volume) / "rng.safetensors").unlink()
    result = run_trainpod(*PRETRAIN, volume=volume)
    assert_one_line_exit_2(result, str(checkpoint(volume)), "rng.safetensors", "start a new run name")


def test_resume_from_a_checkpoint_of_another_workload_names_what_is_missing(volume):
    state_path = checkpoint(volume) / "trainer_state.json"
    state = json.loads(state_path.read_text())
    del state["aliased_weights"]
    manifest_path = checkpoint(volume) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["files"]["trainer_state.json"]  # edited here, so no longer covered by its hash
    manifest_path.write_text(json.dumps(manifest))
    state_path.write_text(json.dumps(state))
    result = run_trainpod(*PRETRAIN, volume=volume)
    assert_one_line_exit_2(result, str(checkpoint(volume)), "aliased_weights")


def test_resume_when_the_tokenizer_is_gone_says_where_it_was_looked_for(volume):
    shutil.rmtree(volume / "tokenizers")
    # By name: the dataset manifest also records the session fixture's tokenizer, which still exists.
    result = run_trainpod(*PRETRAIN, "--set", "data.tokenizer=tiny-stories-1k", volume=volume)
    assert_one_line_exit_2(result, "tokenizer not found", "tokenizers/tiny-stories-1k")


def adamw_with_state(shape: tuple[int, ...]) -> torch.optim.AdamW:
    param = torch.nn.Parameter(torch.zeros(shape))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(shape)
    optimizer.step()
    return optimizer


def test_optimizer_state_of_other_shapes_is_refused_not_loaded():
    saved = adamw_with_state((4, 4)).state_dict()
    with pytest.raises(ValueError, match=r"exp_avg is \[4, 4\] in the checkpoint and \[8, 4\] here"):
        checkpoint_state.load_optimizer_state(adamw_with_state((8, 4)), saved)


def test_optimizer_state_with_other_parameter_groups_is_refused():
    saved = adamw_with_state((4, 4)).state_dict()
    two = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="parameter group"):
        checkpoint_state.load_optimizer_state(two, saved)
