"""Why a run stopped or failed is on the volume: the traceback of a crash in runs/<run>/logs/, the
reason in status.json, and `trainpod status` prints it.

    .venv/bin/pytest -q tests/test_run_reasons.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainpod import boot as booting

from support import RUN, TINY_PRETRAIN, run_trainpod

pytestmark = pytest.mark.slow
PRETRAIN = ("run", "pretrain", "--config", str(TINY_PRETRAIN), "--set", "train.max_steps=10")


def status_of(volume: Path) -> dict:
    return json.loads((volume / "runs" / RUN / "status.json").read_text())


def test_a_crash_writes_its_traceback_to_the_run_log_and_its_summary_to_status(volume):
    # A real unexpected error: the metrics log's path is taken by a folder, so opening it fails.
    (volume / "runs" / RUN / "logs" / "metrics.jsonl").mkdir(parents=True)
    result = run_trainpod(*PRETRAIN, volume=volume)
    assert result.returncode == 1, result.stdout + result.stderr
    log = (volume / "runs" / RUN / "logs" / "pretrain.log").read_text()
    assert "Traceback (most recent call last)" in log and "IsADirectoryError" in log, log
    status = status_of(volume)
    assert status["state"] == "failed"
    assert status["reason"].startswith("crash: IsADirectoryError"), status
    shown = run_trainpod("status", RUN, volume=volume)
    assert "failed" in shown.stdout and "reason: crash: IsADirectoryError" in shown.stdout, shown.stdout


def test_a_spent_budget_is_the_reason_status_gives_for_stopped(volume):
    env = {"TRAINPOD_GPU_HOURLY_USD": "3600", "TRAINPOD_BUDGET_USD": "0.5"}  # $1 a second: spent in 0.5 s
    result = run_trainpod(*PRETRAIN, "--set", "train.max_steps=1000", volume=volume, env=env)
    assert result.returncode == 3, result.stdout + result.stderr
    status = status_of(volume)
    assert status["state"] == "stopped" and status["reason"].startswith("budget spent (exit 3)"), status
    shown = run_trainpod("status", RUN, volume=volume)
    assert "reason: budget spent (exit 3): TRAINPOD_BUDGET_USD is spent" in shown.stdout, shown.stdout


def test_a_resumed_run_drops_the_old_reason(volume):
    (volume / "runs" / RUN / "logs" / "metrics.jsonl").mkdir(parents=True)
    assert run_trainpod(*PRETRAIN, volume=volume).returncode == 1
    (volume / "runs" / RUN / "logs" / "metrics.jsonl").rmdir()
    assert run_trainpod(*PRETRAIN, volume=volume).returncode == 0
    assert status_of(volume)["state"] == "done" and "reason" not in status_of(volume)


def test_a_crash_in_boot_reaches_the_run_log_when_the_run_folder_exists(volume, monkeypatch, capsys):
    (volume / "runs" / RUN).mkdir(parents=True)

    def crash(*args, **kwargs):  # fault injection: boot's own steps have no input that crashes them
        raise RuntimeError("the launcher broke")

    monkeypatch.setattr(booting, "_launch", crash)
    environ = {
        "TRAINPOD_WORKLOAD": "pretrain",
        "TRAINPOD_CONFIG": str(TINY_PRETRAIN),
        "TRAINPOD_VOLUME": str(volume),
    }
    assert booting.boot(environ) == 1
    log = (volume / "runs" / RUN / "logs" / "boot.log").read_text()
    assert "Traceback (most recent call last)" in log and "RuntimeError: the launcher broke" in log, log


def test_the_gpu_running_out_of_memory_is_exit_2_naming_the_fields_that_lower_the_peak(
    volume, monkeypatch, capsys
):
    """A CUDA out-of-memory in a stock trainer was a crash (exit 1): the pod was started again up to
    TRAINPOD_MAX_FAILED_STARTS times, each start loading the model and replaying the same batches into the same
    peak, before FAILED. It is now bad config (exit 2: the pod stops) naming what lowers the peak.
    The error is injected (no GPU here): torch's own OutOfMemoryError, with the text the CUDA allocator gives it."""
    import torch

    from trainpod.volume import Volume
    from trainpod.workloads import pretrain
    from trainpod.workloads.lifecycle import RunRequest, execute

    real_step = pretrain.Pretrainer.train_step

    def step_out_of_memory_at_3(self, model, step):
        if step == 3:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                "1.06 GiB is free. Of the allocated memory 75.1 GiB is allocated by PyTorch, ..."
            )
        return real_step(self, model, step)

    monkeypatch.setattr(pretrain.Pretrainer, "train_step", step_out_of_memory_at_3)
    request = RunRequest("pretrain", str(TINY_PRETRAIN), ["train.max_steps=10"], volume=Volume(volume))
    assert execute(request) == 2
    said = capsys.readouterr().out
    assert (
        "the GPU ran out of memory in the pretrain (CUDA out of memory. Tried to allocate 2.00 GiB.)" in said
    )
    assert "lower train.micro_batch_size (now 4)" in said and "shorten train.seq_len (now 128)" in said, said
    assert "set train.gradient_checkpointing: true" in said and "79.19" not in said, said
    status = status_of(volume)
    assert status["state"] == "stopped", status
    assert status["reason"].startswith("bad config or input (exit 2): the GPU ran out of memory"), status


def test_a_finetune_out_of_gpu_memory_is_told_its_own_fields():
    from trainpod.config import load_config
    from trainpod.config.finetune import FinetuneConfig
    from trainpod.config.finetune_vlm import VlmFinetuneConfig
    from trainpod.workloads.lifecycle import _memory_fixes

    configs = Path(__file__).parents[1] / "configs/finetune"
    full = load_config(FinetuneConfig, configs / "qwen2.5-7b-qlora-24gb.yaml", ["method=full"])
    fixes = "; ".join(_memory_fixes(full))
    assert f"shorten data.sft.cutoff_len (now {full.data.sft.cutoff_len})" in fixes, fixes
    assert "finetune with method: lora or qlora" in fixes and "gradient_checkpointing" not in fixes, fixes
    vlm = load_config(VlmFinetuneConfig, configs / "qwen3-vl-2b-qlora-ocr.yaml", ["train.micro_batch_size=1"])
    fixes = "; ".join(_memory_fixes(vlm))
    assert (
        f"shorten data.cutoff_len (now {vlm.data.cutoff_len})" in fixes and "micro_batch_size" not in fixes
    ), fixes
