"""Exact resume of finetuning: QLoRA and LoRA runs interrupted like a spot pod, then resumed, end
with an adapter byte-identical to an uninterrupted run's (adapter, optimizer, schedule, RNG and the
data position all restored)."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import pytest

from finetune_support import FINETUNE_RUN, adapter_bytes, finetune_args, latest_step
from support import REPO, run_trainpod, signal_when_step_reached, start_trainpod, trainpod_cmd

pytestmark = pytest.mark.slow


def fresh_volume(finetune_base_volume: Path, tmp_path: Path) -> Path:
    volume = tmp_path / "volume"
    shutil.copytree(finetune_base_volume, volume)
    return volume


@pytest.fixture(scope="module")
def uninterrupted(finetune_base_volume: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    adapters = {}
    for method in ("qlora", "lora"):
        volume = tmp_path_factory.mktemp(f"uninterrupted-{method}")
        shutil.copytree(finetune_base_volume, volume, dirs_exist_ok=True)
        result = run_trainpod(*finetune_args(method=method), volume=volume)
        assert result.returncode == 0, result.stdout + result.stderr
        adapters[method] = adapter_bytes(volume)
    return adapters


def finish(volume: Path, method: str) -> str:
    result = run_trainpod(*finetune_args(method=method), volume=volume)
    assert result.returncode == 0, f"the resumed run failed:\n{result.stdout}\n{result.stderr}"
    assert "resumed from step-" in result.stdout + result.stderr
    return result.stdout + result.stderr


@pytest.mark.parametrize(("method", "stop_at"), [("qlora", 7), ("qlora", 23), ("lora", 12)])
def test_sigterm_then_resume_gives_the_same_adapter(
    finetune_base_volume, tmp_path, uninterrupted, method, stop_at
):
    volume = fresh_volume(finetune_base_volume, tmp_path)
    proc = start_trainpod(*finetune_args(method=method), volume=volume)
    out = signal_when_step_reached(proc, volume, stop_at, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143, out
    assert latest_step(volume) >= stop_at, "SIGTERM must commit the step it finished"
    finish(volume, method)
    assert adapter_bytes(volume) == uninterrupted[method]


@pytest.mark.parametrize(("method", "kill_at"), [("qlora", 13), ("lora", 17)])
def test_sigkill_between_checkpoints_then_resume_gives_the_same_adapter(
    finetune_base_volume, tmp_path, uninterrupted, method, kill_at
):
    volume = fresh_volume(finetune_base_volume, tmp_path)
    proc = start_trainpod(*finetune_args(method=method), volume=volume)
    signal_when_step_reached(proc, volume, kill_at, signal.SIGKILL, run=FINETUNE_RUN)
    assert proc.returncode == -signal.SIGKILL
    assert latest_step(volume) == (kill_at // 10) * 10
    finish(volume, method)
    assert adapter_bytes(volume) == uninterrupted[method]


@pytest.mark.parametrize("phase", ["writing", "before-latest"])
def test_sigkill_during_a_commit_then_resume_gives_the_same_adapter(
    finetune_base_volume, tmp_path, uninterrupted, phase
):
    volume = fresh_volume(finetune_base_volume, tmp_path)
    driver = [
        sys.executable,
        str(REPO / "tests/crash_driver.py"),
        phase,
        "20",
        "--",
        *trainpod_cmd(*finetune_args(), volume=volume)[3:],
    ]
    proc = start_trainpod(volume=volume, cmd=driver)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, out
    assert latest_step(volume) == 10
    finish(volume, "qlora")
    assert adapter_bytes(volume) == uninterrupted["qlora"]


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_not_replaced_by_fresh_adapters(
    finetune_base_volume, tmp_path
):
    volume = fresh_volume(finetune_base_volume, tmp_path)
    proc = start_trainpod(*finetune_args(), volume=volume)
    signal_when_step_reached(proc, volume, 12, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143
    committed = latest_step(volume)
    result = run_trainpod(*finetune_args("--set", "lora.r=4"), volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "does not fit this model" in output
    assert "other shapes" in output
    assert latest_step(volume) == committed, "the refused start must leave the checkpoints as they were"


def _hub_cache_snapshot(volume: Path, repo: str, commit: str, weights_seed: int) -> Path:
    """A hub download as huggingface_hub lays it out in cache/hf: snapshots/<commit>/, refs/main."""
    import torch
    from safetensors.torch import load_file, save_file

    cached = volume / "cache/hf" / f"models--{repo.replace('/', '--')}"
    snapshot = cached / "snapshots" / commit
    shutil.copytree(volume / "models/base", snapshot)
    weights = load_file(snapshot / "model.safetensors")
    generator = torch.Generator().manual_seed(weights_seed)
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in weights.items()},
              snapshot / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    return cached


def test_a_resumed_run_trains_on_the_hub_commit_it_started_on_when_main_moved_meanwhile(
    finetune_base_volume, tmp_path
):
    """base_model.revision unset means main: a resume after the model's owner pushed to main downloaded the
    new commit and went on training the adapter on another base than its first steps (and convert merged
    it into that one), with nothing said."""
    volume = fresh_volume(finetune_base_volume, tmp_path)
    first, pushed = "a" * 40, "b" * 40
    cached = _hub_cache_snapshot(volume, "acme/tiny", first, weights_seed=1)
    _hub_cache_snapshot(volume, "acme/tiny", pushed, weights_seed=2)
    (cached / "refs").mkdir()
    (cached / "refs/main").write_text(first)
    offline = {"HF_HUB_OFFLINE": "1"}  # the cache stands in for the hub: main is what refs/main names
    args = finetune_args("--set", "base_model.path=acme/tiny")
    proc = start_trainpod(*args, volume=volume, env=offline)
    signal_when_step_reached(proc, volume, 12, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143
    (cached / "refs/main").write_text(pushed)  # the owner pushes to main while the pod is down
    result = run_trainpod(*args, volume=volume, env=offline)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(
        (volume / "runs" / FINETUNE_RUN / "export/adapter/training_summary.json").read_text()
    )
    assert Path(summary["base_model_folder"]).name == first, "the resumed run must train on the same base"
    assert summary["base_model_revision"] == first, "and convert must merge into that commit"


def test_the_adapter_of_a_hub_base_names_the_hub_id_and_commit_that_peft_loads_it_with_elsewhere(
    finetune_base_volume, tmp_path
):
    """adapter_config.json named the base by the folder the pod downloaded it into (its volume's cache/hf
    path), which AutoPeftModelForCausalLM, vLLM or mlx-lm on any other machine cannot open; the trainers
    users compare with write the hub id they were given."""
    from peft import PeftConfig

    volume = fresh_volume(finetune_base_volume, tmp_path)
    commit = "c" * 40
    cached = _hub_cache_snapshot(volume, "acme/tiny", commit, weights_seed=1)
    (cached / "refs").mkdir()
    (cached / "refs/main").write_text(commit)
    args = finetune_args("--set", "base_model.path=acme/tiny", "--set", "train.max_steps=2", method="lora")
    result = run_trainpod(*args, volume=volume, env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout + result.stderr

    config = PeftConfig.from_pretrained(volume / "runs" / FINETUNE_RUN / "export/adapter")
    assert (config.base_model_name_or_path, config.revision) == ("acme/tiny", commit)


def test_the_adapter_of_a_base_in_a_folder_names_that_folder(finetune_base_volume, tmp_path):
    from peft import PeftConfig

    volume = fresh_volume(finetune_base_volume, tmp_path)
    result = run_trainpod(*finetune_args("--set", "train.max_steps=2", method="lora"), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr

    config = PeftConfig.from_pretrained(volume / "runs" / FINETUNE_RUN / "export/adapter")
    assert Path(config.base_model_name_or_path) == volume / "models/base"
    assert config.revision is None


def test_the_adapter_folder_is_the_same_bytes_whatever_the_processes_hash_seed(
    finetune_base_volume, tmp_path
):
    """A resumed run exports from another process than the one that started, with another string hash
    seed: adapter_config.json listed target_modules (a set, for all-linear) in that seed's order, so the
    same training exported another adapter_config.json (and another sha256 of it in the export's manifest)."""

    def export(seed: str) -> dict[str, bytes]:
        volume = tmp_path / f"seed-{seed}"
        shutil.copytree(finetune_base_volume, volume)
        args = finetune_args("--set", "train.max_steps=2", method="lora")
        result = run_trainpod(*args, volume=volume, env={"PYTHONHASHSEED": seed})
        assert result.returncode == 0, result.stdout + result.stderr
        folder = volume / "runs" / FINETUNE_RUN / "export/adapter"
        timed = {"training_summary.json", "manifest.json"}  # the run's elapsed seconds, and their hash
        return {
            path.name: path.read_bytes().replace(str(volume).encode(), b"VOLUME")  # the base model's folder
            for path in folder.iterdir()
            if path.name not in timed
        }

    first, second = export("1"), export("2")
    assert "adapter_config.json" in first
    assert first == second
