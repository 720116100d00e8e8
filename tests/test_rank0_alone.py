"""Work that rank 0 does alone while the other ranks wait for it, run longer than the process group's
timeout: the run still finishes (docs/design.md, "Checkpoints", work of rank 0 alone; distributed.wait_for_main).

The final export of a 30-70B model, a synchronous commit of one, the checkpoint's verification at resume or
a large SFT data build takes rank 0 minutes to tens of minutes on a network volume, longer than the process
group's timeout (10 minutes). The other ranks waited for it in a collective, which aborted the run when the
timeout passed, and every restart crashed the same way. Two gloo ranks on CPU (`--nproc-per-node 2`); a
hook (sitecustomize, imported into both ranks) shortens the training group's timeout to TIMEOUT_S and makes
one piece of rank 0's solo work take SLOW_S.

.venv/bin/pytest -q tests/test_rank0_alone.py
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainpod.errors import ExitCode
from trainpod.launch import _free_port

from finetune_support import FINETUNE_RUN, finetune_args
from support import RUN, TINY_PRETRAIN, child_env, run_trainpod, signal_when_step_reached, start_trainpod

pytestmark = pytest.mark.slow

TIMEOUT_S = 4  # the training group's timeout; the tiny run's own collectives take far less
SLOW_S = 10  # rank 0's slowed work: well past that timeout

HOOK = """
import os, time
from datetime import timedelta

import torch.distributed as dist

real_init = dist.init_process_group


def init_with_short_timeout(*args, **kwargs):
    kwargs["timeout"] = timedelta(seconds=float(os.environ["TIMEOUT_S"]))
    return real_init(*args, **kwargs)


dist.init_process_group = init_with_short_timeout
slow, rank = os.environ["SLOW"], os.environ.get("RANK")


def slowed(real, when=lambda *args: True):
    def slow(*args, **kwargs):
        if when(*args):
            time.sleep(float(os.environ["SLOW_S"]))
        return real(*args, **kwargs)

    return slow


if slow == "export" and rank == "0":
    import trainpod.train.export as export

    export.write_export_manifest = slowed(export.write_export_manifest)

if slow == "commit" and rank == "0":
    from trainpod.checkpoint.writer import CheckpointWriter

    CheckpointWriter.commit = slowed(CheckpointWriter.commit, when=lambda self, step, *rest: step == 2)

if slow == "verify" and rank == "0":
    from trainpod.checkpoint.store import CheckpointStore

    CheckpointStore.verify = slowed(CheckpointStore.verify)

if slow == "sft" and rank == "0":
    import trainpod.workloads.finetune as finetune

    finetune.prepare_sft = slowed(finetune.prepare_sft)
"""

PRETRAIN = (
    "run",
    "pretrain",
    "--config",
    str(TINY_PRETRAIN),
    *("--set", "train.warmup_steps=1", "--set", "train.eval_every=0"),
    *("--set", "checkpoint.every_steps=2", "--set", "checkpoint.mode=sync"),
)


def run_slowed(tmp_path: Path, volume: Path, args: tuple[str, ...], slow: str):
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
        "SLOW": slow,
        "SLOW_S": str(SLOW_S),
        "TIMEOUT_S": str(TIMEOUT_S),
    }
    return run_trainpod(*args, "--nproc-per-node", "2", volume=volume, env=env)


def finished(result: subprocess.CompletedProcess, what: str) -> str:
    """The run's output, once it is known to have finished (exit 0) while rank 0 did `what` alone."""
    out = result.stdout + result.stderr
    assert result.returncode == ExitCode.DONE, (
        f"rank 1 must wait for rank 0's {what} however long it takes, not abort in a collective:\n{out}"
    )
    return out


def pretrain_volume(tmp_path: Path, dataset: Path) -> Path:
    volume = tmp_path / "volume"
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(dataset / folder, volume / folder)
    return volume


def test_a_final_export_that_outlasts_the_process_group_timeout_finishes_the_two_rank_run(
    tmp_path: Path, tiny_dataset_volume: Path
) -> None:
    volume = pretrain_volume(tmp_path, tiny_dataset_volume)
    result = run_slowed(tmp_path, volume, (*PRETRAIN, "--set", "train.max_steps=4"), "export")
    out = finished(result, "export")
    assert (volume / "runs" / RUN / "DONE").exists(), out
    assert (volume / "runs" / RUN / "export" / "hf" / "model.safetensors").exists(), out


def test_a_synchronous_commit_that_outlasts_the_process_group_timeout_lets_the_two_rank_run_go_on(
    tmp_path: Path, tiny_dataset_volume: Path
) -> None:
    volume = pretrain_volume(tmp_path, tiny_dataset_volume)
    result = run_slowed(tmp_path, volume, (*PRETRAIN, "--set", "train.max_steps=4"), "commit")
    out = finished(result, "commit")
    checkpoints = sorted(p.name for p in (volume / "runs" / RUN / "checkpoints").glob("step-*"))
    assert checkpoints == ["step-2", "step-4"], out


def test_a_checkpoint_verification_that_outlasts_the_process_group_timeout_lets_the_two_rank_run_resume(
    tmp_path: Path, tiny_dataset_volume: Path
) -> None:
    """At resume rank 0 finds the newest valid checkpoint, reading every byte (verify_mode sha256): minutes
    for a large model on a network volume, while the other ranks wait for the step it found."""
    volume = pretrain_volume(tmp_path, tiny_dataset_volume)
    args = (*PRETRAIN, "--set", "train.max_steps=40")
    first = start_trainpod(*args, "--nproc-per-node", "2", volume=volume)
    first_out = signal_when_step_reached(first, volume, 2, signal.SIGTERM)  # a spot stop: commits, exits 143
    assert first.returncode == ExitCode.PREEMPTED, first_out
    result = run_slowed(tmp_path, volume, args, "verify")
    out = finished(result, "verification")
    assert "resumed from step-" in out, out
    assert (volume / "runs" / RUN / "DONE").exists(), out


def test_an_sft_data_build_on_rank_0_that_outlasts_the_process_group_timeout_lets_the_finetune_start(
    tmp_path: Path, finetune_base_volume: Path
) -> None:
    """Rank 0 tokenizes the SFT data (minutes for a large dataset) while the other ranks wait to read it."""
    volume = tmp_path / "volume"
    shutil.copytree(finetune_base_volume, volume)
    args = finetune_args("--set", "train.max_steps=2", "--set", "train.eval_every=0", method="lora")
    result = run_slowed(tmp_path, volume, args, "sft")
    out = finished(result, "SFT data build")
    assert (volume / "runs" / FINETUNE_RUN / "export" / "adapter").is_dir(), out


# Two ranks, without torchrun (rank 0 hosts the store): rank 0 works argv[1] s alone while rank 1 waits in
# `wait_for_main`, then (argv[2]) "leave": both leave and exit at once, with no collective after (the end
# of a run); "die": rank 0 dies instead of arriving.
PHASE = """
import os, sys, time
from datetime import timedelta

import torch.distributed as dist

real_init = dist.init_process_group
dist.init_process_group = lambda *a, **k: real_init(*a, **(k | {"timeout": timedelta(seconds=2)}))

from trainpod.train import distributed as D

ctx = D.init_distributed()
if ctx.is_main:
    time.sleep(float(sys.argv[1]))
    if sys.argv[2] == "die":
        os._exit(9)
D.wait_for_main(ctx)
print(f"rank {ctx.rank} left", flush=True)
os._exit(0)
"""


def run_phase(tmp_path: Path, work_s: float, then: str) -> list[tuple[str, int, float]]:
    """Each rank's output, exit code and seconds to exit."""
    script = tmp_path / "phase.py"
    script.write_text(PHASE)
    port = str(_free_port())
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(work_s), then],
            env=child_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"})
            | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    out = []
    for proc in procs:
        text = proc.communicate(timeout=120)[0]
        out.append((text, proc.returncode, time.monotonic() - started))
    return out


def test_ranks_wait_for_rank_0_past_the_groups_timeout_and_leave_together(tmp_path: Path) -> None:
    """Rank 0 leaves and exits at once, as at the end of a run: rank 1 must not fail on rank 0's store,
    gone with it (as a wait that polled a store key did)."""
    (out0, code0, _), (out1, code1, _) = run_phase(tmp_path, work_s=6, then="leave")
    assert (code0, code1) == (0, 0), f"rank 0:\n{out0}\nrank 1:\n{out1}"
    assert "rank 1 left" in out1, out1


def test_a_waiting_rank_ends_at_once_when_rank_0_dies(tmp_path: Path) -> None:
    """Rank 0 dies during its solo work: rank 1 ends with it, not after SOLO_WORK_TIMEOUT (4 hours; the
    test's own limit is 120 s)."""
    (_, code0, _), (out1, code1, seconds) = run_phase(tmp_path, work_s=3, then="die")
    assert code0 == 9
    assert code1 != 0 and "rank 1 left" not in out1, out1
    assert seconds < 60, f"rank 1 took {seconds:.0f} s to notice rank 0's death:\n{out1}"
