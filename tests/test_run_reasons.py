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
