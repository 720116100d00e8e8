"""A stop during a run's setup: a real `trainpod run finetune` process gets a real SIGTERM while it loads
its base model (a `trainpod run pretrain` while it reads the checkpoint it resumes from), before any step, and must end at once, exit 143, with the run's lease released and nothing
committed; the next start trains to the same result as an uninterrupted run.

A spot pod gets SIGKILL 5 s after the SIGTERM. The stop was answered only at the first step boundary, so a
load of minutes (a 32B model quantized to 4-bit on load, a large model read from the network volume) met
the SIGKILL with the lease held, and the next start on another host waited out its TTL (90 s). The driver
below holds the load in from_pretrained until the SIGTERM has come, then lets it go on, as a long one would.

.venv/bin/pytest -q tests/test_setup_stop.py
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
from transformers import PreTrainedModel
from trainpod import preemption

signalled = threading.Event()
preemption.call_at_first_signal(signalled.set)
real_from_pretrained = PreTrainedModel.from_pretrained.__func__


def one_endless_c_call():
    # Like one large tensor read or quantized in one C call: it releases the GIL and runs on through
    # signals, so the signal's Python handler never gets its turn. A mutex locked twice never returns.
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_init(mutex, None)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


@classmethod
def from_pretrained(cls, *args, **kwargs):
    Path(os.environ["STOP_MARKER"]).touch()
    if os.environ.get("STUCK_IN_C"):
        one_endless_c_call()
    while not signalled.is_set():  # the test's SIGTERM comes while the base model loads
        signalled.wait(0.01)
    return real_from_pretrained(cls, *args, **kwargs)


PreTrainedModel.from_pretrained = from_pretrained
sys.argv = ["trainpod", *sys.argv[1:]]
runpy.run_module("trainpod", run_name="__main__")
"""

ARGS = finetune_args("--set", "train.max_steps=3", method="lora")


@pytest.fixture(scope="module")
def uninterrupted_adapter(tmp_path_factory: pytest.TempPathFactory, finetune_base_volume: Path) -> bytes:
    volume = tmp_path_factory.mktemp("uninterrupted") / "volume"
    shutil.copytree(finetune_base_volume, volume)
    result = run_trainpod(*ARGS, volume=volume)
    assert result.returncode == ExitCode.DONE, result.stdout + result.stderr
    return adapter_bytes(volume)


@pytest.mark.parametrize("stuck_in_c", [False, True], ids=["between-two-calls", "in-one-long-call"])
def test_a_sigterm_while_the_base_model_loads_ends_the_start_with_the_lease_released_and_the_next_trains_the_same(
    finetune_base_volume: Path, tmp_path: Path, uninterrupted_adapter: bytes, stuck_in_c: bool
) -> None:
    """In one long C call the signal's handler cannot run, so a thread releases the lease and exits 143."""
    volume = tmp_path / "volume"
    shutil.copytree(finetune_base_volume, volume)
    env = {"STUCK_IN_C": "1"} if stuck_in_c else {}
    code, out = sigterm_once_marked(DRIVER, ARGS, volume, tmp_path / "loading", env, "base model's load")
    run = volume / "runs" / FINETUNE_RUN
    assert code == ExitCode.PREEMPTED, f"a stop while the base model loads must exit 143:\n{out}"
    assert not (run / "LEASE").exists(), (
        f"the stopped start kept the run's lease: a new pod on another host would wait out its TTL:\n{out}"
    )
    assert not (run / "DONE").exists(), out
    assert not (run / "checkpoints" / "LATEST").exists(), (
        f"a start stopped in its setup committed a step:\n{out}"
    )
    assert json.loads((run / "status.json").read_text())["state"] == "preempted", out
    assert "Traceback" not in out, out

    resumed = run_trainpod(*ARGS, volume=volume)
    assert resumed.returncode == ExitCode.DONE, resumed.stdout + resumed.stderr
    assert "no checkpoint found; starting from step 0" in resumed.stdout + resumed.stderr
    assert adapter_bytes(volume) == uninterrupted_adapter, "the next start did not train to the same adapter"


RESUME_DRIVER = """
import os, runpy, sys, threading
from pathlib import Path
from trainpod import preemption
from trainpod.train.trainer import Trainer

signalled = threading.Event()
preemption.call_at_first_signal(signalled.set)
real_load_committed = Trainer._load_committed


def load_committed(self, path):
    Path(os.environ["STOP_MARKER"]).touch()
    while not signalled.is_set():  # the test's SIGTERM comes while the checkpoint is read
        signalled.wait(0.01)
    return real_load_committed(self, path)


Trainer._load_committed = load_committed
sys.argv = ["trainpod", *sys.argv[1:]]
runpy.run_module("trainpod", run_name="__main__")
"""

PRETRAIN = (
    "run",
    "pretrain",
    "--config",
    str(TINY_PRETRAIN),
    *("--set", "train.max_steps=4", "--set", "train.warmup_steps=1", "--set", "train.eval_every=0"),
    *("--set", "checkpoint.every_steps=2"),
)


def test_a_sigterm_while_a_pretrain_reads_its_checkpoint_ends_the_start_with_the_lease_released(
    volume: Path, tmp_path: Path
) -> None:
    finished = run_trainpod(*PRETRAIN, volume=volume)
    assert finished.returncode == ExitCode.DONE, finished.stdout + finished.stderr
    uninterrupted = exported_weights(volume)
    run = volume / "runs" / RUN
    # As a stop after step 2 leaves it: step 2 committed, no later step, no export and no DONE.
    (run / "DONE").unlink()
    shutil.rmtree(run / "export" / "hf")
    shutil.rmtree(run / "checkpoints" / "step-4")
    (run / "checkpoints" / "LATEST").write_text("step-2\n")

    code, out = sigterm_once_marked(
        RESUME_DRIVER, PRETRAIN, volume, tmp_path / "reading", {}, "checkpoint's read"
    )
    assert code == ExitCode.PREEMPTED, f"a stop while the checkpoint is read must exit 143:\n{out}"
    assert not (run / "LEASE").exists(), f"the stopped start kept the run's lease:\n{out}"
    assert not (run / "DONE").exists() and not (run / "export" / "hf").exists(), out
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-2", (
        f"the stopped start trained on:\n{out}"
    )
    assert json.loads((run / "status.json").read_text())["state"] == "preempted", out
    assert "Traceback" not in out, out

    resumed = run_trainpod(*PRETRAIN, volume=volume)
    assert resumed.returncode == ExitCode.DONE, resumed.stdout + resumed.stderr
    assert "resumed from step-2" in resumed.stdout
    assert exported_weights(volume) == uninterrupted, "the resumed run did not train to the same weights"


VERIFY_DRIVER = """
import os, runpy, sys, time
from pathlib import Path
from trainpod.checkpoint.store import CheckpointStore

real_verify = CheckpointStore.verify


def verify(self, path):
    Path(os.environ["STOP_MARKER"]).touch()
    for _ in range(12000):  # sha256 over every piece of a large checkpoint on a network volume: minutes
        time.sleep(0.01)
    return real_verify(self, path)


CheckpointStore.verify = verify
sys.argv = ["trainpod", *sys.argv[1:]]
runpy.run_module("trainpod", run_name="__main__")
"""


def test_a_sigterm_while_a_pretrain_verifies_its_checkpoint_ends_the_start_with_the_lease_released(
    volume: Path, tmp_path: Path
) -> None:
    """The checkpoint to resume from is verified first, every byte hashed (minutes for tens of GB read from the
    network volume), outside the setup a stop ends at once: the start verified on into the SIGKILL with the
    run's lease held, and the next start on another host waited out its TTL."""
    finished = run_trainpod(*PRETRAIN, volume=volume)
    assert finished.returncode == ExitCode.DONE, finished.stdout + finished.stderr
    run = volume / "runs" / RUN
    (run / "DONE").unlink()  # as a stop after step 4's commit leaves it: no DONE yet
    shutil.rmtree(run / "export" / "hf")

    code, out = sigterm_once_marked(
        VERIFY_DRIVER, PRETRAIN, volume, tmp_path / "verifying", {}, "checkpoint's verification"
    )
    assert code == ExitCode.PREEMPTED, f"a stop while the checkpoint is verified must exit 143:\n{out}"
    assert not (run / "LEASE").exists(), f"the stopped start kept the run's lease:\n{out}"
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-4", out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["LATEST", "step-2", "step-4"], out
    assert json.loads((run / "status.json").read_text())["state"] == "preempted", out
    assert "Traceback" not in out, out
