"""Weight decay of a full finetune: on matrices only, not on norms or biases (as HF Trainer finetunes and
pretrain trains), with exact resume in that layout, and exact resume of a checkpoint written before, when
every trained weight was in one decayed group."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import safetensors.torch

from finetune_support import FINETUNE_RUN, finetune_args, latest_step
from support import run_trainpod, signal_when_step_reached, start_trainpod

pytestmark = pytest.mark.slow

DECAYED = (
    "--set",
    "train.weight_decay=0.5",
    "--set",
    "train.max_steps=16",
    "--set",
    "generation_eval.every_evals=0",
)

# The finetune's optimizer as trainpod built it before norms and biases left weight decay: every trained
# weight in one group. In sitecustomize, so every process a start makes (torchrun's ranks too) builds it.
ONE_GROUP_SITECUSTOMIZE = """
import trainpod.workloads.finetune as finetune

def one_group(model, weight_decay):
    return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]

finetune.decay_groups = one_group
"""


def fresh_volume(finetune_base_volume: Path, tmp_path: Path, name: str) -> Path:
    volume = tmp_path / name
    shutil.copytree(finetune_base_volume, volume)
    return volume


def with_one_group_optimizer(tmp_path: Path) -> dict[str, str]:
    folder = tmp_path / "one-group"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(ONE_GROUP_SITECUSTOMIZE)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def finetuned_weights(volume: Path) -> bytes:
    return (volume / "runs" / FINETUNE_RUN / "export" / "hf" / "model.safetensors").read_bytes()


def full(*extra: str) -> tuple[str, ...]:
    return finetune_args(*DECAYED, *extra, method="full")


def trained_after_one_step(volume: Path, weight_decay: float) -> dict:
    args = finetune_args(
        "--set", f"train.weight_decay={weight_decay}", "--set", "train.max_steps=1", method="full"
    )
    result = run_trainpod(*args, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    checkpoint = volume / "runs" / FINETUNE_RUN / "checkpoints" / f"step-{latest_step(volume)}"
    return safetensors.torch.load((checkpoint / "trainable.safetensors").read_bytes())


def test_a_full_finetune_decays_its_matrices_and_not_its_norms(finetune_base_volume, tmp_path):
    """One step from the same weights on the same rows: the gradients are the same, so only the decay
    tells the two runs apart, and it must not reach a norm (HF Trainer, llm-foundry and pretrain leave
    norms and biases undecayed; a decayed RMSNorm weight shrinks the layer's output scale each step)."""
    plain = trained_after_one_step(fresh_volume(finetune_base_volume, tmp_path, "plain"), 0.0)
    decayed = trained_after_one_step(fresh_volume(finetune_base_volume, tmp_path, "decayed"), 0.5)
    norms = [name for name, tensor in plain.items() if tensor.dim() < 2]
    matrices = [name for name, tensor in plain.items() if tensor.dim() >= 2]
    assert norms and matrices
    decayed_norms = [name for name in norms if not plain[name].equal(decayed[name])]
    assert not decayed_norms, f"train.weight_decay reached the norms: {decayed_norms[:3]}"
    assert all(not plain[name].equal(decayed[name]) for name in matrices), "the matrices decay"


def test_a_full_finetune_with_weight_decay_stopped_by_sigterm_resumes_byte_identically(
    finetune_base_volume, tmp_path
):
    reference = fresh_volume(finetune_base_volume, tmp_path, "reference")
    result = run_trainpod(*full(), volume=reference)
    assert result.returncode == 0, result.stdout + result.stderr

    volume = fresh_volume(finetune_base_volume, tmp_path, "stopped")
    proc = start_trainpod(*full(), volume=volume)
    out = signal_when_step_reached(proc, volume, 7, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143, out
    result = run_trainpod(*full(), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from step-" in result.stdout
    assert finetuned_weights(volume) == finetuned_weights(reference)


@pytest.mark.parametrize("ranks", [(), ("--nproc-per-node", "2", "--set", "train.parallel=fsdp")])
def test_a_checkpoint_of_a_one_group_optimizer_resumes_exactly_keeping_its_weight_decay(
    finetune_base_volume, tmp_path, ranks
):
    """A full finetune stopped before the update that split the optimizer's groups resumes with it: its
    checkpoint's one group (every weight decayed) fits the two groups now built, and the run ends with the
    weights it would have ended with uninterrupted, and says that it keeps the decay on norms and biases."""
    one_group = with_one_group_optimizer(tmp_path)
    reference = fresh_volume(finetune_base_volume, tmp_path, "one-group-reference")
    result = run_trainpod(*full(*ranks), volume=reference, env=one_group)
    assert result.returncode == 0, result.stdout + result.stderr

    volume = fresh_volume(finetune_base_volume, tmp_path, "one-group-stopped")
    proc = start_trainpod(*full(*ranks), volume=volume, env=one_group)
    out = signal_when_step_reached(proc, volume, 7, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143, out
    result = run_trainpod(*full(*ranks), volume=volume)  # this trainpod: two groups
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "resumed from step-" in output
    assert "written with weight decay on every trained weight" in output
    assert finetuned_weights(volume) == finetuned_weights(reference)


def test_a_weight_decay_and_beta2_edited_before_a_resume_are_the_ones_the_resumed_run_trains_with(
    finetune_base_volume, tmp_path
):
    """The resume loaded the checkpoint's optimizer groups whole, so an edited train.weight_decay, beta1,
    beta2 or eps (a lower beta2 against loss spikes) was dropped while the log said 'the config changed
    since step-N was written; continuing with the new one'."""
    from trainpod.checkpoint.tree import load_state_file

    volume = fresh_volume(finetune_base_volume, tmp_path, "edited")
    proc = start_trainpod(*full(), volume=volume)
    out = signal_when_step_reached(proc, volume, 7, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143, out
    edited = ("--set", "train.weight_decay=0.01", "--set", "train.beta2=0.95", "--set", "train.eps=1e-6")
    result = run_trainpod(*full(*edited), volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "continuing with the new one" in output
    groups = load_state_file(volume / "runs" / FINETUNE_RUN / "checkpoints/step-16", "optimizer")[
        "param_groups"
    ]
    assert [(g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in groups] == [
        (0.01, (0.9, 0.95), 1e-6),
        (0.0, (0.9, 0.95), 1e-6),
    ], "the resumed run's optimizer must train with the edited settings"
