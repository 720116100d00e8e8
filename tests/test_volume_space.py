"""`trainpod du` and `trainpod rm` on a mounted volume and through the S3 API (moto's server on 127.0.0.1, as
in test_remote_s3.py): the volume is built with the kit's own checkpoint store and small files where only the
layout matters, and the verbs run as a user runs them, `python -m trainpod ...` subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest

from trainpod.checkpoint.store import CheckpointStore

from support import child_env

DC = "EU-RO-1"


@pytest.fixture
def bucket(s3_server, tmp_path_factory):
    """A fresh network volume (bucket) and the environment that reaches it."""
    name = f"vol{uuid.uuid4().hex[:10]}"
    env = {
        "TRAINPOD_S3_ENDPOINT_URL": s3_server,
        "TRAINPOD_S3_VOLUME": name,
        "TRAINPOD_S3_DATACENTER": DC,
        "AWS_ACCESS_KEY_ID": "user_2f21CfO73Mm2Uq2lEGFiEF24IPw",
        "AWS_SECRET_ACCESS_KEY": "rps_FAKESECRETFORTESTS0123456789",
        "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache")),
    }
    raw = boto3.client(
        "s3",
        endpoint_url=s3_server,
        region_name="us-east-1",
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )
    raw.create_bucket(Bucket=name)
    return name, raw, env


def trainpod(*args: str, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainpod", *args],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
    )


def write(path: Path, nbytes: int | bytes) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(nbytes) if isinstance(nbytes, int) else nbytes)
    return path.stat().st_size


def commit(run: Path, step: int, nbytes: int, keep_last: int = 5) -> None:
    store = CheckpointStore(run / "checkpoints", keep_last=keep_last)
    pending = store.begin(step)
    pending.write_bytes("model.safetensors", os.urandom(nbytes))
    store.commit(pending, step, {"world_size": 1})


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def make_volume(root: Path) -> dict[str, int]:
    """A volume with a run of two checkpoints and an export (done or not), a dataset and a cache key it needs,
    another cache folder and a repo; returns each entry's bytes as written."""
    run = root / "runs/r"
    commit(run, 10, 70_000)
    commit(run, 20, 70_000)
    write(run / "export/hf/model.safetensors", 50_000)
    write(run / "status.json", json.dumps({"state": "running", "step": 20}).encode())
    write(run / "config.yaml", b"name: r\ndata:\n  dataset: my-data\n")
    write(run / "sft_data.json", json.dumps({"settings_key": "s", "key": "k1"}).encode())
    write(root / "datasets/my-data/train.bin", 30_000)
    write(
        root / "datasets/my-data/manifest.json",
        json.dumps({"format": "trainpod-sft/1", "complete": True}).encode(),
    )
    write(root / "tokenizers/tok/tokenizer.json", 9_000)
    write(root / "cache/sft/k1/train.bin", 20_000)
    write(root / "cache/sft/k1/manifest.json", b'{"complete": true}')
    write(root / "cache/sft/k2/train.bin", 15_000)
    write(root / "cache/hf/models--x/blob", 40_000)
    write(root / "repos/code@main/train.py", 1_000)
    write(root / "runs/.r.DEPLOYED", b"{}")
    return {
        "runs/r": folder_bytes(run),
        "checkpoints": folder_bytes(run / "checkpoints/step-10") + folder_bytes(run / "checkpoints/step-20"),
        "datasets/my-data": folder_bytes(root / "datasets/my-data"),
        "tokenizers/tok": 9_000,
        "cache/sft/k1": folder_bytes(root / "cache/sft/k1"),
        "cache/sft/k2": 15_000,
        "cache/hf": 40_000,
        "repos/code@main": 1_000,
        "total": folder_bytes(root),
    }


def upload(raw, name: str, root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            raw.upload_file(str(path), name, path.relative_to(root).as_posix())


def du_sizes(out: str) -> dict[str, str]:
    """`du`'s lines as {entry: its size text}; the total under "total"."""
    sizes = {}
    for line in out.splitlines():
        if line.startswith("total "):
            sizes["total"] = line.removeprefix("total ").split(";")[0]
        elif line.startswith("  "):
            size, entry = line.strip().split("  ", 1)
            sizes[entry.split(":")[0]] = size.strip()
    return sizes


def size_text(nbytes: int) -> str:
    from trainpod.diskspace import size_text as kit_size_text

    return kit_size_text(nbytes)


def check_du(out: str, written: dict[str, int]) -> None:
    sizes = du_sizes(out)
    for entry in ("runs/r", "datasets/my-data", "tokenizers/tok", "cache/sft/k1", "cache/sft/k2", "cache/hf"):
        assert sizes[entry] == size_text(written[entry]), (entry, out)
    assert sizes["repos/code@main"] == size_text(1_000), out
    assert sizes["total"] == size_text(written["total"]), out
    listed = [
        line.strip().split("  ", 1)[1].split(":")[0] for line in out.splitlines() if line.startswith("  ")
    ]
    assert listed[0] == "runs/r" and listed.index("cache/hf") < listed.index("cache/sft/k1"), (
        "largest first: " + out
    )
    run_line = next(line for line in out.splitlines() if "runs/r:" in line)
    assert (
        f"2 checkpoint(s) {size_text(written['checkpoints'])} (step-10, step-20; LATEST step-20)" in run_line
    )
    assert "export 48.8 KiB" in run_line and "not done" in run_line, run_line
    assert "cache/sft/k1: pinned by r (not done)" in out and "cache/sft/k2: pinned by no run" in out, out
    assert "datasets/my-data: named by the config of r (not done)" in out, out


# ---------------------------------------------------------------------------------------------- du
def test_du_of_a_mounted_volume_gives_each_entrys_bytes_largest_first_and_who_needs_it(tmp_path):
    written = make_volume(tmp_path / "vol")
    done = trainpod("du", "--volume", str(tmp_path / "vol"))
    assert done.returncode == 0, done.stdout + done.stderr
    check_du(done.stdout, written)
    assert " free" in done.stdout.splitlines()[-1], done.stdout


def test_du_through_s3_gives_the_same_entries_and_sizes_as_the_mounted_volume(bucket, tmp_path):
    name, raw, env = bucket
    written = make_volume(tmp_path / "vol")
    upload(raw, name, tmp_path / "vol")
    done = trainpod("du", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    check_du(done.stdout, written)
    here = trainpod("du", "--volume", str(tmp_path / "vol"))
    assert here.stdout.splitlines()[1:-1] == done.stdout.splitlines()[1:-1], (here.stdout, done.stdout)


def test_du_says_which_runs_pinning_a_cache_key_are_done(tmp_path):
    make_volume(tmp_path / "vol")
    write(tmp_path / "vol/runs/r/DONE", b"")
    done = trainpod("du", "--volume", str(tmp_path / "vol"))
    assert "cache/sft/k1: pinned by r (done)" in done.stdout, done.stdout
    assert "runs/r: done," in done.stdout, done.stdout


def test_du_of_a_volume_that_is_not_there_is_exit_2_naming_it(tmp_path):
    done = trainpod("du", "--volume", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and "nowhere does not exist" in done.stdout + done.stderr, done.stdout
