"""A workload start as the supervisor sees it: exit codes, nothing written on bad input, DONE, lease."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

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
    tree_snapshot,
)

pytestmark = pytest.mark.slow
PRETRAIN = ("run", "pretrain", "--config", str(TINY_PRETRAIN))


def test_finished_run_exports_a_model_transformers_loads_and_generates_with(volume):
    result = run_trainpod(*PRETRAIN, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    run = volume / "runs" / RUN
    done = json.loads((run / "DONE").read_text())
    assert done["step"] == 60 and done["export"].endswith("export/hf")
    model = AutoModelForCausalLM.from_pretrained(run / "export/hf")
    tokenizer = AutoTokenizer.from_pretrained(run / "export/hf")
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 8
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "done" and status["step"] == 60 and status["tokens_per_s"] > 0
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "config.yaml").read_text().startswith("name: tiny-pretrain")
    assert not (run / "LEASE").exists(), "a finished run releases its lease"
    metrics = [json.loads(line) for line in (run / "logs/metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < metrics[0]["loss"], "the tiny model must learn something"
    kept = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert kept == ["step-50", "step-60"], "retention: the last 2, which include the best eval (step 60)"


def test_rerun_after_done_exits_zero_at_once_and_changes_nothing(volume):
    assert run_trainpod(*PRETRAIN, volume=volume).returncode == 0
    before = tree_snapshot(volume)
    result = run_trainpod(*PRETRAIN, volume=volume)
    assert result.returncode == 0
    assert "already DONE" in result.stdout
    assert tree_snapshot(volume) == before


@pytest.mark.parametrize(
    ("config_text", "expected"),
    [
        ("name: x\ndata: {dataset: tiny\ntrain: {max_steps: 3, warmup_steps: 0}\n", "malformed YAML at line"),
        ("name: x\ndata: {dataset: tiny}\ntrain: {max_steps: 3, lr_peak: 1}\n", "train.lr_peak: unknown key"),
        ("name: x\ndata: {dataset: tiny}\ntrain: {max_steps: many}\n", "train.max_steps = 'many'"),
        (
            "name: x\ndata: {dataset: missing-set}\ntrain: {max_steps: 3, warmup_steps: 0}\n",
            "trainpod run datagen",
        ),
    ],
    ids=["malformed-yaml", "unknown-key", "wrong-type", "missing-dataset"],
)
def test_bad_input_exits_2_with_a_clear_message_and_leaves_the_volume_untouched(
    volume, tmp_path, config_text, expected
):
    config = tmp_path / "bad.yaml"
    config.write_text(config_text)
    before = tree_snapshot(volume)
    result = run_trainpod("run", "pretrain", "--config", str(config), volume=volume)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert tree_snapshot(volume) == before


def test_missing_dataset_message_names_the_path(volume):
    result = run_trainpod(*PRETRAIN, "--set", "data.dataset=nope", volume=volume)
    assert result.returncode == 2
    assert f"{volume}/datasets/nope/manifest.json does not exist" in result.stdout


def test_a_missing_dataset_a_shipped_datagen_config_makes_is_named_with_that_config(tmp_path):
    """README: `trainpod run pretrain --config configs/pretrain/125m.yaml` on a volume without its dataset said
    "Make it first with ... (for example configs/datagen/tiny.yaml)", which makes tiny-stories, not fineweb-edu-10b."""
    repo = TINY_PRETRAIN.parents[2]
    result = subprocess.run(
        trainpod_cmd("run", "pretrain", "--config", "configs/pretrain/125m.yaml", volume=tmp_path),
        cwd=repo,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "`TRAINPOD_CONFIG=configs/datagen/fineweb-edu.yaml trainpod run datagen`" in result.stdout, (
        result.stdout
    )
    assert "tiny.yaml" not in result.stdout and not list(tmp_path.iterdir())


def test_a_validation_split_too_small_for_one_eval_batch_exits_2_before_the_first_step(volume):
    """The test split's one val shard holds 17,742 tokens; 36 x 512 + 1 do not fit in it. Before, the
    run trained until its first eval and died there."""
    too_big = [
        arg
        for setting in ("micro_batch_size=36", "seq_len=512", "grad_accum_steps=1")
        for arg in ("--set", f"train.{setting}")
    ]
    result = run_trainpod(*PRETRAIN, *too_big, volume=volume)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the largest holds 17742" in result.stdout and "train.eval_every=0" in result.stdout
    assert not list((volume / "runs" / RUN / "checkpoints").glob("step-*")), "no step ran"


def test_missing_trainpod_config_exits_2(volume):
    result = run_trainpod("run", "pretrain", volume=volume)
    assert result.returncode == 2
    assert "TRAINPOD_CONFIG is not set" in result.stdout


@contextlib.contextmanager
def read_only(path: Path):
    """Make `path` unwritable the way a read-only mounted volume is (root ignores permission bits)."""
    if os.geteuid() == 0:
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True)
            yield
        finally:
            subprocess.run(["umount", str(path)], check=True)
    else:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)


def test_unwritable_volume_exits_2_before_writing_anything(volume):
    before = tree_snapshot(volume)
    with read_only(volume):
        result = run_trainpod(*PRETRAIN, volume=volume)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is not writable" in result.stdout
    assert tree_snapshot(volume) == before


def test_second_writer_on_a_leased_run_is_refused_with_exit_75(volume):
    # Long enough that the first run is still training whatever the machine's load.
    first = start_trainpod(
        *PRETRAIN, "--set", "train.log_every=1", "--set", "train.max_steps=100000", volume=volume
    )
    try:
        while status_step(volume) < 3 and first.poll() is None:
            time.sleep(0.02)
        second = run_trainpod(*PRETRAIN, volume=volume)
        assert second.returncode == 75, second.stdout + second.stderr
        assert "leased by another writer" in second.stdout
    finally:
        signal_when_step_reached(first, volume, 0, signal.SIGTERM)
    assert first.returncode == 143


def test_budget_exhaustion_commits_and_exits_3(volume):
    env = {"TRAINPOD_GPU_HOURLY_USD": "3600", "TRAINPOD_BUDGET_USD": "0.5"}  # $1 a second: spent in 0.5 s
    result = run_trainpod(*PRETRAIN, "--set", "checkpoint.every_steps=1000", volume=volume, env=env)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "TRAINPOD_BUDGET_USD is spent" in result.stdout
    latest = (volume / "runs" / RUN / "checkpoints/LATEST").read_text().strip()
    status = json.loads((volume / "runs" / RUN / "status.json").read_text())
    assert latest == f"step-{status['step']}", "the step the budget ran out on is committed"


def test_a_budget_without_a_price_is_exit_2_before_anything_is_written(volume):
    result = run_trainpod(*PRETRAIN, volume=volume, env={"TRAINPOD_BUDGET_USD": "0.5"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "set it like TRAINPOD_GPU_HOURLY_USD=2.49" in result.stdout, "the fix: the pod's price"
    assert not (volume / "runs" / RUN).exists(), "a run that could never be capped must not start"


def test_what_a_kill_during_the_export_left_is_removed_at_the_next_start(volume):
    """docs/design.md, "Crash-safe writes": a `*.tmp-*` is a kill's leftover, removed at the next start. A kill
    while the final model was written (GBs for a large one) left export/hf.tmp-<id>/ on the volume for good."""
    run = volume / "runs" / RUN
    half_written = run / "export/hf.tmp-0123456789ab"
    half_written.mkdir(parents=True)
    (half_written / "model.safetensors").write_bytes(b"\0" * 4096)
    moved_aside = run / "export/hf.tmp-replaced-01234567"  # atomic.replace_dir killed between its renames
    moved_aside.mkdir()
    (run / "status.json.tmp-0123456789ab").write_text('{"state": ')
    result = run_trainpod(*PRETRAIN, "--set", "train.max_steps=6", volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (run / "export/hf/model.safetensors").is_file()
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*.tmp-*"))
    assert left == [], f"leftovers of the killed start are still on the volume: {left}"


def test_secrets_never_reach_logs_or_the_volume(volume):
    secrets = {
        "HF_TOKEN": "hf_secretvalue0123456789",
        "WANDB_API_KEY": "wandbsecret0123456789",
        "RUNPOD_API_KEY": "fake-runpod-secret-for-tests",
        "TRAINPOD_GIT_TOKEN": "ghp_gitsecret0123456789",
    }
    result = run_trainpod(*PRETRAIN, "--set", "train.max_steps=10", volume=volume, env=secrets)
    assert result.returncode == 0, result.stdout + result.stderr
    for value in secrets.values():
        assert value not in result.stdout + result.stderr
        for path in volume.rglob("*"):
            if path.is_file():
                assert value.encode() not in path.read_bytes(), f"{value} found in {path}"


def test_run_name_from_environment_selects_the_run_folder(volume):
    result = subprocess.run(
        trainpod_cmd(*PRETRAIN, "--set", "train.max_steps=6", volume=volume),
        env=child_env({"TRAINPOD_RUN": "custom-name"}),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (volume / "runs/custom-name/DONE").exists()
    assert exported_weights(volume, "custom-name")
    shutil.rmtree(volume / "runs/custom-name")


def test_time_based_saves_commit_without_waiting_for_the_step_interval(volume):
    every_moment = (
        "--set",
        "checkpoint.every_minutes=0.000001",
        "--set",
        "checkpoint.every_steps=1000",
        "--set",
        "train.max_steps=6",
    )
    result = run_trainpod(*PRETRAIN, *every_moment, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    committed = [line for line in result.stdout.splitlines() if "committed checkpoint" in line]
    assert len(committed) == 6, "a commit after every step once the time interval has passed"


def test_status_shows_step_loss_throughput_and_newest_checkpoint(volume):
    assert run_trainpod(*PRETRAIN, "--set", "train.max_steps=10", volume=volume).returncode == 0
    result = run_trainpod("status", volume=volume)
    assert result.returncode == 0
    line = result.stdout.splitlines()[0]
    assert line.startswith("tiny-pretrain: done | step 10/10 (100%) | loss ")
    assert "tok/s" in line and "checkpoint step-10" in line


def test_a_split_dataset_whose_validation_split_is_empty_exits_2_before_the_first_step(volume):
    # datagen's `mode: split` on a small corpus with a small val_ratio can put no document in val. The
    # run then trained without a single eval (no eval_loss, no best checkpoints) and said nothing.
    manifest_path = volume / "datasets" / "tiny-stories" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for shard in manifest["splits"]["val"]["shards"]:
        (manifest_path.parent / shard["file"]).unlink()
    manifest["splits"]["val"] = {"shards": [], "tokens": 0}
    manifest_path.write_text(json.dumps(manifest))
    result = run_trainpod(*PRETRAIN, volume=volume)
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        "no validation shard holds one eval micro-batch" in result.stdout
        and "train.eval_every=0" in result.stdout
    )
    assert not list((volume / "runs" / RUN / "checkpoints").glob("step-*")), "no step ran"
    no_eval = ["--set", "train.eval_every=0", "--set", "train.max_steps=2", "--set", "train.warmup_steps=0"]
    result = run_trainpod(*PRETRAIN, *no_eval, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
