"""Work that rank 0 does alone while the other ranks wait for it (two gloo ranks on CPU,
`--nproc-per-node 2`), run longer than the process group's timeout: the run still finishes.

The final export of a 30-70B model, or a synchronous commit of one, takes rank 0 minutes to tens of minutes
on a network volume, longer than the process group's timeout (10 minutes). The other ranks waited for it in
a collective, which aborted the run when the timeout passed, and every restart crashed the same way. Here a
hook (sitecustomize, imported into both ranks) shortens the timeout to TIMEOUT_S and makes one piece of
rank 0's solo work take SLOW_S.

.venv/bin/pytest -q tests/test_rank0_alone.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainpod.errors import ExitCode
from trainpod.launch import _free_port

from finetune_support import FINETUNE_RUN, finetune_args
from support import RUN, TINY_PRETRAIN, child_env, run_trainpod

pytestmark = pytest.mark.slow

TIMEOUT_S = 4  # the process group's timeout; the tiny run's own collectives take far less
SLOW_S = 10  # rank 0's slowed work: well past the timeout

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

if slow == "export" and rank == "0":
    import trainpod.train.export as export

    real_manifest = export.write_export_manifest

    def slow_manifest(tmp):
        time.sleep(float(os.environ["SLOW_S"]))
        real_manifest(tmp)

    export.write_export_manifest = slow_manifest

if slow == "commit" and rank == "0":
    from trainpod.checkpoint.writer import CheckpointWriter

    real_commit = CheckpointWriter.commit

    def slow_commit(self, step, *args, **kwargs):
        if step == 2:
            time.sleep(float(os.environ["SLOW_S"]))
        return real_commit(self, step, *args, **kwargs)

    CheckpointWriter.commit = slow_commit

if slow == "sft" and rank == "0":
    import trainpod.workloads.finetune as finetune

    real_prepare = finetune.prepare_sft

    def slow_prepare(*args, **kwargs):
        time.sleep(float(os.environ["SLOW_S"]))
        return real_prepare(*args, **kwargs)

    finetune.prepare_sft = slow_prepare
"""

PRETRAIN = (
    "run",
    "pretrain",
    "--config",
    str(TINY_PRETRAIN),
    *("--set", "train.max_steps=4", "--set", "train.warmup_steps=1", "--set", "train.eval_every=0"),
    *("--set", "checkpoint.every_steps=2", "--set", "checkpoint.mode=sync"),
)


def run_slowed(tmp_path: Path, volume: Path, args: tuple[str, ...], slow: str):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
        "SLOW": slow,
        "SLOW_S": str(SLOW_S),
        "TIMEOUT_S": str(TIMEOUT_S),
    }
    return run_trainpod(*args, "--nproc-per-node", "2", volume=volume, env=env)


def run_pretrain_slowed(tmp_path: Path, dataset: Path, slow: str):
    volume = tmp_path / "volume"
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(dataset / folder, volume / folder)
    return volume / "runs" / RUN, run_slowed(tmp_path, volume, PRETRAIN, slow)


def test_a_final_export_that_outlasts_the_process_group_timeout_finishes_the_two_rank_run(
    tmp_path: Path, tiny_dataset_volume: Path
) -> None:
    run, result = run_pretrain_slowed(tmp_path, tiny_dataset_volume, "export")
    out = result.stdout + result.stderr
    assert result.returncode == ExitCode.DONE, (
        f"rank 1 must wait for rank 0's export however long it takes, not abort in a collective:\n{out}"
    )
    assert (run / "DONE").exists(), out
    assert (run / "export" / "hf" / "model.safetensors").exists(), out


def test_a_synchronous_commit_that_outlasts_the_process_group_timeout_lets_the_two_rank_run_go_on(
    tmp_path: Path, tiny_dataset_volume: Path
) -> None:
    run, result = run_pretrain_slowed(tmp_path, tiny_dataset_volume, "commit")
    out = result.stdout + result.stderr
    assert result.returncode == ExitCode.DONE, (
        f"rank 1 must wait for rank 0's commit however long it takes, not abort in a collective:\n{out}"
    )
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-2", "step-4"], out


def test_an_sft_data_build_on_rank_0_that_outlasts_the_process_group_timeout_lets_the_finetune_start(
    tmp_path: Path, finetune_base_volume: Path
) -> None:
    """Rank 0 tokenizes the SFT data (minutes for a large dataset) while the other ranks wait to read it."""
    volume = tmp_path / "volume"
    shutil.copytree(finetune_base_volume, volume)
    args = finetune_args("--set", "train.max_steps=2", "--set", "train.eval_every=0", method="lora")
    result = run_slowed(tmp_path, volume, args, "sft")
    out = result.stdout + result.stderr
    assert result.returncode == ExitCode.DONE, (
        f"rank 1 must wait for rank 0's SFT data build however long it takes, not abort in a collective:\n{out}"
    )
    assert (volume / "runs" / FINETUNE_RUN / "export" / "adapter").is_dir(), out


# Two ranks in `main_alone` with short beats: rank 0 works argv[3] s alone (beating every argv[1] s) while
# rank 1 waits; argv[2] is the silence after which rank 1 takes rank 0 for dead; argv[4] "die": rank 0 then
# dies instead of leaving.
PHASE = """
import os, sys, time
from trainpod.train import distributed as D

heartbeat_s, D.SILENCE_LIMIT_S, work_s = (float(a) for a in sys.argv[1:4])
D.HEARTBEAT_S = heartbeat_s if os.environ["RANK"] == "0" else 0.2  # how often rank 1 reads the beats
ctx = D.init_distributed()
try:
    with D.main_alone(ctx, "the test's work"):
        if ctx.is_main:
            time.sleep(work_s)
            if sys.argv[4] == "die":
                os._exit(9)
    print(f"rank {ctx.rank} left", flush=True)
    D.barrier(ctx)
finally:
    D.shutdown(ctx)
"""


def run_phase(
    tmp_path: Path, heartbeat_s: float, silence_s: float, work_s: float, then: str = "leave"
) -> list[tuple[str, int]]:
    """Each rank's output and exit code."""
    script = tmp_path / "phase.py"
    script.write_text(PHASE)
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(heartbeat_s), str(silence_s), str(work_s), then],
            env=child_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"})
            | {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    return [(p.communicate(timeout=120)[0], p.returncode) for p in procs]


def test_ranks_wait_for_a_beating_rank_0_longer_than_the_silence_limit(tmp_path: Path) -> None:
    (out0, code0), (out1, code1) = run_phase(tmp_path, heartbeat_s=0.2, silence_s=1.5, work_s=4)
    assert (code0, code1) == (0, 0), f"rank 0:\n{out0}\nrank 1:\n{out1}"
    assert "rank 1 left" in out1, out1
    assert "[c10d]" not in out1, f"waiting must not fill the run's log with c10d warnings:\n{out1}"


def test_a_waiting_rank_ends_when_rank_0_falls_silent(tmp_path: Path) -> None:
    """Rank 0 beats once and then no more (as when torchrun's agent keeps the store after rank 0 died):
    rank 1 must end on its own, not wait for ever."""
    (out0, _), (out1, code1) = run_phase(tmp_path, heartbeat_s=1000, silence_s=1.5, work_s=8)
    assert code1 != 0, f"rank 1 waited out a silent rank 0:\n{out1}"
    assert "rank 0 gave no sign of life for 2 s during the test's work" in out1, out1
    assert "rank 1 left" not in out1, out1


def test_a_waiting_rank_ends_at_once_when_rank_0_dies_with_the_store(tmp_path: Path) -> None:
    """Under the kit's launcher rank 0 holds the store: its death ends the wait, long before the silence
    limit (1000 s here; the test would time out waiting for it)."""
    (_, code0), (out1, code1) = run_phase(tmp_path, heartbeat_s=0.2, silence_s=1000, work_s=2, then="die")
    assert code0 == 9
    assert code1 != 0 and "rank 1 left" not in out1, out1
