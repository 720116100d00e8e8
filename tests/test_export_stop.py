"""A stop during a run's final export: a real `trainpod run pretrain` (or finetune) process gets a real SIGTERM
while it writes export/, after its last step, and must end at once, exit 143, publish nothing, write no DONE
and release the run's lease; the next start loads the last checkpoint and makes the export again.

A spot pod gets SIGKILL 5 s after the SIGTERM. The export ran on after the stop, so an export of a large
model met the SIGKILL with the lease held, and the next start on another host waited out its TTL (90 s).
The driver below holds the export in its save_pretrained until the SIGTERM has come, then lets it go on,
as a long one would.

.venv/bin/pytest -q tests/test_export_stop.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainpod.errors import ExitCode

from finetune_support import FINETUNE_RUN, adapter_bytes, finetune_args
from support import RUN, TINY_PRETRAIN, exported_weights, run_trainpod, sigterm_once_marked

DRIVER = """
import ctypes, os, runpy, sys, threading
from pathlib import Path
from peft import PeftModel
from transformers import PreTrainedModel
from trainpod import preemption

signalled = threading.Event()
preemption.call_at_first_signal(signalled.set)


def one_endless_c_call():
    # Like one shard written by save_pretrained: a C call that releases the GIL and runs on through
    # signals, so the signal's Python handler never gets its turn. A mutex locked twice never returns.
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_init(mutex, None)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


def held_until_the_stop(real_save):
    def save_pretrained(self, *args, **kwargs):
        Path(os.environ["STOP_MARKER"]).touch()
        if os.environ.get("STUCK_IN_C"):
            one_endless_c_call()
        while not signalled.is_set():  # the test's SIGTERM comes while this export is under way
            signalled.wait(0.01)
        return real_save(self, *args, **kwargs)
    return save_pretrained


PreTrainedModel.save_pretrained = held_until_the_stop(PreTrainedModel.save_pretrained)
PeftModel.save_pretrained = held_until_the_stop(PeftModel.save_pretrained)
sys.argv = ["trainpod", *sys.argv[1:]]
runpy.run_module("trainpod", run_name="__main__")
"""

PRETRAIN = (
    "run",
    "pretrain",
    "--config",
    str(TINY_PRETRAIN),
    *("--set", "train.max_steps=4", "--set", "train.warmup_steps=1", "--set", "train.eval_every=0"),
)


def start_export_and_stop_it(
    args: tuple[str, ...], volume: Path, tmp_path: Path, env: dict[str, str]
) -> tuple[int, str]:
    """Start the run, wait until its final export is under way, SIGTERM it; its exit code and output."""
    return sigterm_once_marked(DRIVER, args, volume, tmp_path / "exporting", env, "export")


def assert_stopped_with_nothing_published(code: int, out: str, run: Path, published: str) -> None:
    assert code == ExitCode.PREEMPTED, f"a stop during the export must exit 143:\n{out}"
    assert not (run / "LEASE").exists(), (
        f"the stopped run kept its lease: a new pod on another host would wait out its TTL:\n{out}"
    )
    assert not (run / "DONE").exists(), f"a run whose export was stopped was marked DONE:\n{out}"
    assert not (run / "export" / published).exists(), f"an export stopped midway was published:\n{out}"
    assert json.loads((run / "status.json").read_text())["state"] == "preempted"
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def uninterrupted_pretrain(tmp_path_factory: pytest.TempPathFactory, tiny_dataset_volume: Path) -> bytes:
    volume = tmp_path_factory.mktemp("uninterrupted")
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, volume / folder)
    result = run_trainpod(*PRETRAIN, volume=volume)
    assert result.returncode == ExitCode.DONE, result.stdout + result.stderr
    return exported_weights(volume)


@pytest.mark.parametrize("stuck_in_c", [False, True], ids=["between-two-calls", "in-one-long-write"])
def test_a_sigterm_during_the_final_export_ends_it_with_the_lease_released_and_the_next_start_exports_again(
    volume: Path, tmp_path: Path, uninterrupted_pretrain: bytes, stuck_in_c: bool
) -> None:
    """In one long write (save_pretrained writing a 50 GB shard, made endless) the signal's handler cannot
    run, so a thread releases the lease and exits 143."""
    env = {"STUCK_IN_C": "1"} if stuck_in_c else {}
    code, out = start_export_and_stop_it(PRETRAIN, volume, tmp_path, env)
    run = volume / "runs" / RUN
    assert_stopped_with_nothing_published(code, out, run, "hf")
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-4", out

    resumed = run_trainpod(*PRETRAIN, volume=volume)
    assert resumed.returncode == ExitCode.DONE, resumed.stdout + resumed.stderr
    assert "resumed from step-4" in resumed.stdout
    assert (run / "DONE").is_file() and (run / "export" / "hf" / "manifest.json").is_file()
    assert not list((run / "export").glob("*.tmp-*")), (
        "the next start must remove what the stopped export left"
    )
    assert exported_weights(volume) == uninterrupted_pretrain, "the export made again is not the last step's"


def test_a_sigterm_during_a_finetunes_adapter_export_ends_it_and_the_next_start_exports_again(
    finetune_base_volume: Path, tmp_path: Path
) -> None:
    volume = tmp_path / "volume"
    shutil.copytree(finetune_base_volume, volume)
    args = finetune_args(method="lora")
    code, out = start_export_and_stop_it(args, volume, tmp_path, {})
    run = volume / "runs" / FINETUNE_RUN
    assert_stopped_with_nothing_published(code, out, run, "adapter")

    resumed = run_trainpod(*args, volume=volume)
    assert resumed.returncode == ExitCode.DONE, resumed.stdout + resumed.stderr
    assert "resumed from step-" in resumed.stdout
    assert adapter_bytes(volume) and (run / "export" / "adapter" / "manifest.json").is_file()
    assert not list((run / "export").glob("*.tmp-*"))
    # The start that made the export again trained no step; the summaries still name the run's final loss.
    last_logged = json.loads((run / "logs" / "metrics.jsonl").read_text().splitlines()[-1])
    summary = json.loads((run / "export" / "adapter" / "training_summary.json").read_text())["results"]
    assert summary["loss"] == json.loads((run / "DONE").read_text())["loss"] == last_logged["loss"], (
        "the export made again must name the loss of the last step, as an uninterrupted run's does"
    )
    assert f"loss {last_logged['loss']:.4f}" in resumed.stderr + resumed.stdout, "and so must the DONE line"
