"""A full volume: one line saying what is needed and free, exit 5, nothing committed lost, nothing
published half-written, and a rerun after space is freed finishes byte-identically.

    .venv/bin/pytest -q tests/test_disk_full.py      (as root: the volume's folders are small tmpfs mounts)

A real small file system, not a fake: a tmpfs of a few MiB is mounted over the folder the workload
writes to, and grown (`remount,size=`) the way a network volume is grown. Without root (or where the
kernel refuses the mount) the tests are skipped, with the reason, never passed.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainpod.config import load_config
from trainpod.config.pretrain import PretrainConfig
from trainpod.convert import run_convert
from trainpod.diskspace import is_disk_full
from trainpod.errors import VolumeFull
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume
from trainpod.workloads.pretrain import disk_estimate

from convert_support import convert_config, make_adapter, make_base
from support import (
    RUN,
    TINY_DATAGEN,
    TINY_PRETRAIN,
    child_env,
    exported_weights,
    run_trainpod,
    small_filesystem,
    status_step,
)

pytestmark = pytest.mark.slow
PRETRAIN = ("run", "pretrain", "--config", str(TINY_PRETRAIN), "--set", "train.max_steps=30")


def grow(folder: Path, size: str) -> None:
    """What growing the network volume does: the same files, more room."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp-" in p.name)


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if " ERROR " in line]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, tiny_dataset_volume: Path) -> Path:
    """A volume with the pretrain run finished on a roomy disk; copy it before writing."""
    volume = tmp_path_factory.mktemp("roomy")
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, volume / folder)
    result = run_trainpod(*PRETRAIN, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    return volume


@pytest.fixture(scope="module")
def uninterrupted(finished: Path) -> bytes:
    return exported_weights(finished)


def test_pretrain_on_a_full_volume_exits_5_keeps_its_checkpoint_and_finishes_identically_after(
    volume, uninterrupted
):
    # A checkpoint of the tiny model is about 1.7 MiB: the first fits in 3 MiB, the second does not.
    with small_filesystem(volume / "runs", "3m") as runs:
        result = run_trainpod(*PRETRAIN, volume=volume)
        output = result.stdout + result.stderr
        assert result.returncode == 5, output
        assert "Traceback" not in output, output
        (error,) = error_lines(output)
        assert "no space left on the volume" in error and "checkpoint step-20" in error, error
        assert "it needs about 1.7 MiB and" in error and "is free" in error, error
        assert "grow the network volume" in error and "step-10, is intact" in error, error
        assert "only 1 checkpoint(s) of about" in output, "the headroom warning comes before the failure"
        checkpoints = runs / RUN / "checkpoints"
        assert leftovers(checkpoints) == [], "the half-written checkpoint is removed at once"
        assert (checkpoints / "LATEST").read_text().strip() == "step-10"
        status = json.loads((runs / RUN / "status.json").read_text())
        assert status["state"] == "stopped" and status["reason"].startswith("disk full (exit 5)"), status
        grow(runs, "64m")
        again = run_trainpod(*PRETRAIN, volume=volume)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "resumed from step-10" in again.stdout
        assert exported_weights(volume) == uninterrupted, "the run after freeing space must end identically"


def test_a_background_commit_that_fills_the_volume_is_exit_5_naming_its_own_step(volume):
    # Its error surfaces at the next step's poll: the message named that step (step-21), never written.
    with small_filesystem(volume / "runs", "3m") as runs:
        result = run_trainpod(*PRETRAIN, "--set", "checkpoint.mode=async", volume=volume)
        output = result.stdout + result.stderr
        assert result.returncode == 5, output
        (error,) = error_lines(output)
        assert "for checkpoint step-20 " in error and "step-10, is intact" in error, error
        assert leftovers(runs / RUN / "checkpoints") == [], "the half-written checkpoint is removed at once"


def test_two_ranks_on_a_volume_without_room_for_one_checkpoint_exit_5_before_a_step(volume):
    # Rank 0 measures the headroom. It alone raised VolumeFull; rank 1, in its next collective, crashed on
    # the closed connection, and the launcher reported rank 1's 1 (a failed start, retried on a full volume).
    with small_filesystem(volume / "runs", "1m"):
        result = run_trainpod(*PRETRAIN, "--nproc-per-node", "2", volume=volume)
        output = result.stdout + result.stderr
        assert result.returncode == 5, output
        assert "Traceback" not in output, output
        assert "for the first checkpoint: it needs about 1.7 MiB" in output, output


def test_a_spot_restart_is_not_refused_for_the_checkpoints_it_already_holds(tmp_path, tiny_dataset_volume):
    # boot compares pretrain's disk_estimate (the kept checkpoints, the one in flight and the export) with
    # the free bytes: a resumed run's own checkpoints were counted as still to come, and the first restart
    # after they accumulated exited 5 (FAILED, pod stopped) on a volume with room to finish the run.
    inputs = sum(p.stat().st_size for p in tiny_dataset_volume.rglob("*") if p.is_file())
    needed = disk_estimate(load_config(PretrainConfig, TINY_PRETRAIN))
    # Room for the estimate and 4 MiB more: three checkpoints of 1.7 MiB later, less than the estimate is free.
    with small_filesystem(tmp_path / "volume", str(inputs + needed + 4 * 2**20)) as volume:
        for folder in ("datasets", "tokenizers"):
            shutil.copytree(tiny_dataset_volume / folder, volume / folder)
        env = child_env(
            {
                "TRAINPOD_VOLUME": str(volume),
                "TRAINPOD_WORKLOAD": "pretrain",
                "TRAINPOD_CONFIG": str(TINY_PRETRAIN),
                "TRAINPOD_SET": "train.log_every=1",
            }
        )
        boot = [sys.executable, "-m", "trainpod", "boot"]
        first = subprocess.Popen(boot, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while first.poll() is None and status_step(volume) < 35:
            time.sleep(0.05)
        first.send_signal(signal.SIGTERM)
        out = first.communicate(timeout=120)[0]
        assert first.returncode == 143, out
        assert shutil.disk_usage(volume).free < needed, "the run's checkpoints now hold part of the estimate"
        again = subprocess.run(boot, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "resumed from step-" in again.stdout + again.stderr


def test_datagen_on_a_full_volume_exits_5_publishes_nothing_half_written_and_resumes(
    tmp_path, tiny_dataset_volume
):
    volume = tmp_path / "volume"
    with small_filesystem(volume / "datasets", "256k") as datasets:
        result = run_trainpod("run", "datagen", "--config", str(TINY_DATAGEN), volume=volume)
        output = result.stdout + result.stderr
        assert result.returncode == 5, output
        assert "Traceback" not in output, output
        (error,) = error_lines(output)
        assert "no space left on the volume" in error and "are free" in error and "grow the network" in error
        folder = datasets / "tiny-stories"
        assert leftovers(folder) == [] and not (folder / "manifest.json").exists()
        grow(datasets, "64m")
        again = run_trainpod("run", "datagen", "--config", str(TINY_DATAGEN), volume=volume)
        assert again.returncode == 0, again.stdout + again.stderr
        reference = tiny_dataset_volume / "datasets" / "tiny-stories"
        shards = sorted(p.name for p in reference.glob("*.bin"))
        assert shards and shards == sorted(p.name for p in folder.glob("*.bin"))
        for name in shards:
            assert (folder / name).read_bytes() == (reference / name).read_bytes(), name


def test_convert_on_a_full_volume_exits_5_publishes_nothing_and_converts_after(tmp_path, finished):
    volume = tmp_path / "volume"
    shutil.copytree(finished, volume)
    config = tmp_path / "export.yaml"
    config.write_text(f"name: {RUN}\ntask:\n  - kind: export\n    step: 20\n")
    # The export of the tiny model is about 0.6 MiB of weights plus the tokenizer: 256 KiB cannot hold it.
    with small_filesystem(volume / "runs" / RUN / "export", "256k") as export:
        result = run_trainpod("run", "convert", "--config", str(config), volume=volume)
        output = result.stdout + result.stderr
        assert result.returncode == 5, output
        assert "Traceback" not in output, output
        (error,) = error_lines(output)
        assert "no space left on the volume" in error and "grow the network" in error
        assert "for the exported model (float32): it needs about" in error, "checked before it writes"
        assert leftovers(export) == [] and not (export / "hf-step-20").exists()
        grow(export, "64m")
        again = run_trainpod("run", "convert", "--config", str(config), volume=volume)
        assert again.returncode == 0, again.stdout + again.stderr
        assert (export / "hf-step-20" / "manifest.json").is_file() and leftovers(export) == []


def test_a_merge_without_room_for_its_weights_is_exit_5_naming_the_sizes_and_keeps_the_older_output(tmp_path):
    """A merge (a 7B base: about 15 GB) on a volume without room for it ran to ENOSPC, minutes in, and said
    only what was free; it is refused before it writes, naming what it needs, and the older output stays."""
    volume = Volume(tmp_path / "volume")
    base = make_base(tmp_path / "base")  # 78,144 weights: 305.2 KiB in float32, half in bfloat16
    adapter = str(make_adapter(base, tmp_path / "adapter"))
    with small_filesystem(volume.run("ft").export, "256k") as export:
        task = {"kind": "merge", "output": "merged"}
        bf16, fp32 = (convert_config(task | {"dtype": d}, adapter=adapter) for d in ("bfloat16", "float32"))
        [merged] = run_convert(bf16, volume, PreemptionWatch())
        before = {p.name: p.read_bytes() for p in merged.iterdir()}
        with pytest.raises(
            VolumeFull, match=r"the merged model.*needs about 305\.2 KiB and [\d.]+ KiB is free; free space"
        ):
            run_convert(fp32, volume, PreemptionWatch())
        assert leftovers(export) == [], "a refused merge leaves no temp folder"
        assert {p.name: p.read_bytes() for p in merged.iterdir()} == before, "the older output stays whole"


def hub_copying(hub_repo: Path):
    """A stand-in for huggingface_hub's snapshot_download (the hub cannot be reached here): it copies
    `hub_repo`'s files into the cache as the download writes them."""

    def snapshot_download(repo_id, cache_dir, **kwargs):
        snapshot = Path(cache_dir) / "snapshot"
        snapshot.mkdir(parents=True)
        for path in hub_repo.iterdir():
            shutil.copy(path, snapshot / path.name)
        return str(snapshot)

    return snapshot_download


def test_a_hub_base_that_fills_the_volume_is_exit_5_not_a_download_retried_at_every_start(
    tmp_path, monkeypatch
):
    """A merge's hub base downloads into the volume's cache/hf; a full volume there was exit 75 ('could not
    fetch ... the next start tries again'), so the supervisor started the pod again and again, each start
    downloading gigabytes into the same full volume."""
    import huggingface_hub

    volume = Volume(tmp_path / "volume")
    hub_repo = make_base(tmp_path / "hub-repo")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub_copying(hub_repo))
    summary = {"base_model": "org/tiny-base", "base_model_folder": "/gone/with/the/pod"}
    adapter = str(make_adapter(hub_repo, tmp_path / "adapter", summary=summary))
    full = pytest.raises(VolumeFull, match=r"for the base model org/tiny-base: .* free; free space")
    with small_filesystem(volume.cache(), "128k"), full:
        run_convert(convert_config({"kind": "merge"}, adapter=adapter), volume, PreemptionWatch())


def test_a_finetune_base_that_fills_the_volume_is_exit_5_not_a_download_retried_at_every_start(
    tmp_path, monkeypatch
):
    """The finetune's hub base downloads into cache/hf as the merge's does (above): a full volume there was exit
    75, a download of gigabytes repeated at every start into the same full volume."""
    import huggingface_hub

    from trainpod.config.finetune import BaseModelConfig
    from trainpod.train.base_model import resolve_base_model

    volume = Volume(tmp_path / "volume")
    hub_repo = make_base(tmp_path / "hub-repo")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub_copying(hub_repo))
    full = pytest.raises(VolumeFull, match=r"for the base model org/tiny-base: .* free; free space")
    with small_filesystem(volume.cache(), "128k"), full:
        resolve_base_model(BaseModelConfig(path="org/tiny-base"), volume)


def test_a_status_write_on_a_full_volume_is_raised_on_the_training_thread(tmp_path):
    """Other failed writes of status.json are logged and training goes on (test_progress); a full volume ends the
    run with exit 5 instead, as the next commit could not land either."""
    from trainpod.train.reporting import StatusWriter

    with small_filesystem(tmp_path / "volume", "64k") as volume:
        writer = StatusWriter(volume / "status.json")
        writer.put({"padding": "x" * 200_000})
        with pytest.raises(OSError) as raised:
            writer.close()
    assert is_disk_full(raised.value)
