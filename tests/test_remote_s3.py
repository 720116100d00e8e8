"""push, pull, ls and status through the S3 API, against a real S3 server on 127.0.0.1 (moto's server
mode, standing in for RunPod's S3-compatible API, which cannot be reached here); boto3 is never mocked.
The trainpod side runs as a user runs it: `python -m trainpod ...` subprocesses with the S3 settings
in their environment, and the push interruption in-process (an exception from the progress line)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest

from trainpod.checkpoint.store import CheckpointStore
from trainpod.data.datagen import load_dataset_manifest
from trainpod.errors import InputError, TemporaryError
from trainpod.log import redact
from trainpod.remote.push import push
from trainpod.remote.s3 import S3Target, VolumeS3

from fake_runpod import FakeRunPodServer, api_env
from support import REPO, child_env

KEY_ID = "user_2f21CfO73Mm2Uq2lEGFiEF24IPw"
SECRET = "rps_FAKESECRETFORTESTS0123456789"
DC = "EU-RO-1"
PART = 5 << 20  # S3's smallest part, so a few MiB make a multipart upload


@pytest.fixture
def bucket(s3_server, monkeypatch, tmp_path_factory):
    """A fresh network volume (bucket) and this process's environment pointed at it."""
    name = f"vol{uuid.uuid4().hex[:10]}"
    env = {
        "TRAINPOD_S3_ENDPOINT_URL": s3_server,
        "TRAINPOD_S3_VOLUME": name,
        "TRAINPOD_S3_DATACENTER": DC,
        "TRAINPOD_S3_PART_MB": "5",
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache")),  # where push records its parts
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    raw = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    raw.create_bucket(Bucket=name)
    return name, raw, env


def trainpod(env: dict, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainpod", *args],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def objects(raw, bucket: str, prefix: str = "") -> dict[str, bytes]:
    listed = raw.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: raw.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def volume_s3(name: str) -> VolumeS3:
    return VolumeS3(S3Target(name, DC, os.environ["TRAINPOD_S3_ENDPOINT_URL"]), part_bytes=PART)


# ---------------------------------------------------------------------------------------------- push
def test_a_pushed_datagen_dataset_reads_on_the_volume_exactly_like_one_datagen_made_there(
    bucket, tiny_dataset_volume, tmp_path
):
    name, raw, env = bucket
    local = tiny_dataset_volume / "datasets/tiny-stories"
    result = trainpod(env, "push", str(local), "datasets/tiny-stories")
    assert result.returncode == 0, result.stdout + result.stderr
    tokenizer = tiny_dataset_volume / "tokenizers/tiny-stories-1k"
    assert f"trainpod push {tokenizer} tokenizers/tiny-stories-1k" in result.stdout, "the tokenizer goes too"
    mirror = tmp_path / "volume/datasets/tiny-stories"  # what a pod sees at /workspace
    for key, data in objects(raw, name, "datasets/tiny-stories/").items():
        (mirror / key.removeprefix("datasets/tiny-stories/")).parent.mkdir(parents=True, exist_ok=True)
        (mirror / key.removeprefix("datasets/tiny-stories/")).write_bytes(data)
    assert load_dataset_manifest(mirror)["complete"], "pretrain reads it through load_dataset_manifest"
    for path in local.rglob("*"):
        if path.is_file():
            assert (mirror / path.relative_to(local)).read_bytes() == path.read_bytes(), path.name
    again = trainpod(env, "push", str(local), "datasets/tiny-stories")
    assert again.returncode == 0 and " 0 sent" in again.stdout, "pushing again sends nothing"


def test_an_interrupted_push_keeps_its_parts_and_publishes_the_marker_only_once_complete(bucket, tmp_path):
    name, raw, _ = bucket
    local = tmp_path / "generated"
    local.mkdir()
    (local / "train.bin").write_bytes(os.urandom(4 * PART + 12345))  # 5 parts
    (local / "metadata.json").write_text(json.dumps({"counts": {"train": 1}}))

    def interrupt_after_two_parts(line: str) -> None:
        if "part 2/5" in line:
            raise KeyboardInterrupt  # Ctrl-C, or a laptop closing its lid

    with pytest.raises(KeyboardInterrupt):
        push(volume_s3(name), local, "datasets/generated", echo=interrupt_after_two_parts)
    assert objects(raw, name) == {}, "nothing is published by an interrupted push, the marker least of all"
    uploads = raw.list_multipart_uploads(Bucket=name).get("Uploads", [])
    assert len(uploads) == 1
    kept = raw.list_parts(Bucket=name, Key=uploads[0]["Key"], UploadId=uploads[0]["UploadId"])["Parts"]
    assert len(kept) >= 2

    lines: list[str] = []
    push(volume_s3(name), local, "datasets/generated", echo=lines.append)
    assert any(f"{len(kept)} part(s) kept from an interrupted push" in line for line in lines), lines
    published = objects(raw, name)
    assert published["datasets/generated/train.bin"] == (local / "train.bin").read_bytes()
    assert published["datasets/generated/metadata.json"] == (local / "metadata.json").read_bytes()
    assert lines.index(next(x for x in lines if "metadata.json" in x)) > lines.index(
        next(x for x in lines if "uploaded datasets/generated/train.bin" in x)
    ), "the marker goes last"
    assert raw.list_multipart_uploads(Bucket=name).get("Uploads", []) == []


def test_push_refuses_to_replace_other_data_on_the_volume(bucket, tmp_path):
    name, raw, env = bucket
    raw.put_object(Bucket=name, Key="datasets/sft/train.jsonl", Body=b'{"other": 1}\n')
    local = tmp_path / "sft"
    local.mkdir()
    (local / "train.jsonl").write_text('{"mine": 1}\n')
    result = trainpod(env, "push", str(local), "datasets/sft")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "already holds other data: train.jsonl (other content)" in result.stdout
    assert objects(raw, name)["datasets/sft/train.jsonl"] == b'{"other": 1}\n', "nothing replaced"


def test_push_refuses_an_unfinished_datagen_dataset_and_a_destination_under_runs(
    bucket, tiny_dataset_volume, tmp_path
):
    _, _, env = bucket
    unfinished = tmp_path / "tiny"
    shutil.copytree(tiny_dataset_volume / "datasets/tiny-stories", unfinished)
    next(unfinished.glob("train_*.bin")).unlink()
    result = trainpod(env, "push", str(unfinished), "datasets/tiny")
    assert result.returncode == 2 and "is listed in" in result.stdout, result.stdout
    result = trainpod(env, "push", str(tiny_dataset_volume / "datasets/tiny-stories"), "runs/x")
    assert result.returncode == 2 and "not under runs or cache/" in result.stdout, result.stdout


# ---------------------------------------------------------------------------------------------- pull
def make_run_on_volume(raw, name: str, root: Path) -> Path:
    """A run folder as the workloads leave it: a committed checkpoint (the real store), a conversion
    output with its manifest, an HF export with none, status.json, and leftovers never to be pulled."""
    run = root / "runs/r"
    store = CheckpointStore(run / "checkpoints")
    pending = store.begin(10)
    pending.write_bytes("model.safetensors", os.urandom(3 * (1 << 20) + 7))
    pending.write_bytes("optimizer.pt", os.urandom(1000))
    store.commit(pending, 10, {"world_size": 1})
    merged = run / "export/merged"
    merged.mkdir(parents=True)
    files = {"model.safetensors": os.urandom(6 * (1 << 20) + 3), "config.json": b'{"model_type": "llama"}'}
    for file, data in files.items():
        (merged / file).write_bytes(data)
    manifest = {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}
    (merged / "manifest.json").write_text(json.dumps({"format": "trainpod-convert/2", "files": manifest}))
    (run / "export/hf").mkdir()
    (run / "export/hf/model.safetensors").write_bytes(os.urandom(2000))
    (run / "export/mlx.tmp-0123abcd").mkdir()
    (run / "export/mlx.tmp-0123abcd/half.safetensors").write_bytes(b"half")
    (run / "status.json").write_text(
        json.dumps({"state": "running", "step": 10, "max_steps": 100, "loss": 2.5})
    )
    (run / "LEASE").write_text("{}")
    for path in run.rglob("*"):
        if path.is_file():
            raw.upload_file(str(path), name, str(path.relative_to(root)))
    return run


def test_pull_export_checks_the_manifests_and_leaves_temp_folders_behind(bucket, tmp_path):
    name, raw, env = bucket
    run = make_run_on_volume(raw, name, tmp_path / "pod")
    dest = tmp_path / "laptop"
    result = trainpod(env, "pull", "r", "export", str(dest))
    assert result.returncode == 0, result.stdout + result.stderr
    for rel in (
        "merged/model.safetensors",
        "merged/config.json",
        "merged/manifest.json",
        "hf/model.safetensors",
    ):
        assert (dest / "export" / rel).read_bytes() == (run / "export" / rel).read_bytes(), rel
    assert (
        not list(dest.rglob("*.tmp-*"))
        and not (dest / "LEASE").exists()
        and not (dest / "checkpoints").exists()
    )
    assert "2 checked against their manifest's sha256" in result.stdout


def test_pull_resumes_an_interrupted_download_and_discards_bytes_of_another_version(bucket, tmp_path):
    name, raw, env = bucket
    run = make_run_on_volume(raw, name, tmp_path / "pod")
    dest = tmp_path / "laptop"
    target = dest / "export/merged/model.safetensors"
    target.parent.mkdir(parents=True)
    whole = (run / "export/merged/model.safetensors").read_bytes()
    partial = target.with_name(target.name + ".tmp-pull")
    partial.write_bytes(whole[: 2 << 20])  # an interrupted pull: the first 2 MiB
    stale = dest / "export/hf/model.safetensors.tmp-pull"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x" * 500)  # bytes of an older export of the same name
    result = trainpod(env, "pull", "r", "export", str(dest))
    assert result.returncode == 0, result.stdout + result.stderr
    assert target.read_bytes() == whole
    assert (
        "merged/model.safetensors: continued an interrupted download after 2,097,152 bytes" in result.stdout
    )
    assert (dest / "export/hf/model.safetensors").read_bytes() == (
        run / "export/hf/model.safetensors"
    ).read_bytes()
    assert not partial.exists() and not stale.exists()


def test_pull_brings_empty_files_too(bucket, tmp_path):
    """An empty file on the volume (a log a start just opened, a program's empty marker or __init__.py in its
    export) was never downloaded, so no .tmp-pull existed to check: FileNotFoundError, a traceback and exit 1
    at every pull of the run."""
    name, raw, env = bucket
    run = make_run_on_volume(raw, name, tmp_path / "pod")
    for key in ("runs/r/logs/pretrain.log", "runs/r/export/mine/__init__.py"):
        raw.put_object(Bucket=name, Key=key, Body=b"")
    dest = tmp_path / "laptop"
    result = trainpod(env, "pull", "r", "all", str(dest))
    assert result.returncode == 0, result.stdout + result.stderr
    assert (dest / "logs/pretrain.log").read_bytes() == b"" and (dest / "export/mine/__init__.py").is_file()
    assert (dest / "export/merged/config.json").read_bytes() == (
        run / "export/merged/config.json"
    ).read_bytes()
    assert not list(dest.rglob("*.tmp-pull"))
    again = trainpod(env, "pull", "r", "all", str(dest))
    assert again.returncode == 0 and ", 0 downloaded" in again.stdout, again.stdout + again.stderr


def test_pull_refuses_a_file_that_does_not_match_its_manifest(bucket, tmp_path):
    name, raw, env = bucket
    run = make_run_on_volume(raw, name, tmp_path / "pod")
    size = (run / "export/merged/model.safetensors").stat().st_size
    raw.put_object(Bucket=name, Key="runs/r/export/merged/model.safetensors", Body=b"\0" * size)  # bit rot
    dest = tmp_path / "laptop"
    result = trainpod(env, "pull", "r", "export", str(dest))
    assert result.returncode == 75, result.stdout + result.stderr
    assert "does not match its checksum" in result.stdout
    assert not (dest / "export/merged/model.safetensors").exists()
    assert not (dest / "export/merged/manifest.json").exists(), "no manifest for an output that is not whole"


def test_a_pulled_checkpoint_is_one_the_checkpoint_store_resumes_from(bucket, tmp_path):
    name, raw, env = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    # trainpod.Checkpointer under torchrun: rank 1's RNG states of the newest checkpoint and of an older one
    rank_1_rng = os.urandom(9000)
    raw.put_object(Bucket=name, Key="runs/r/checkpoints/rng/step-10.rank-1.pt", Body=rank_1_rng)
    raw.put_object(Bucket=name, Key="runs/r/checkpoints/rng/step-8.rank-1.pt", Body=b"older")
    dest = tmp_path / "laptop"
    result = trainpod(env, "pull", "r", "checkpoint", str(dest))
    assert result.returncode == 0, result.stdout + result.stderr
    latest = CheckpointStore(dest / "checkpoints").latest()  # verifies every 32 MiB piece's sha256
    assert latest is not None and latest.step == 10
    assert not (dest / "export").exists()
    assert [p.name for p in (dest / "checkpoints/rng").iterdir()] == ["step-10.rank-1.pt"], (
        "a torchrun resumed from the pulled checkpoint needs the other ranks' RNG states of its step"
    )
    assert (dest / "checkpoints/rng/step-10.rank-1.pt").read_bytes() == rank_1_rng


def test_pull_never_moves_a_local_latest_back_over_checkpoints_committed_here(bucket, tmp_path):
    """A run pulled, continued here (step-20 committed), then pulled again: LATEST was set back to the
    volume's step-10, and the next start deleted step-20 as the leftover of an interrupted commit."""
    from trainpod.remote.pull import pull

    name, raw, _ = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    dest = tmp_path / "laptop"
    pull(volume_s3(name), "r", "checkpoint", dest, echo=lambda line: None)
    store = CheckpointStore(dest / "checkpoints")
    assert store.latest().step == 10
    pending = store.begin(20)
    pending.write_bytes("model.safetensors", os.urandom(100))
    store.commit(pending, 20, {})
    said = []
    pull(volume_s3(name), "r", "all", dest, echo=said.append)
    assert (dest / "checkpoints/LATEST").read_text() == "step-20\n"
    assert any("kept" in line and "step-20" in line for line in said), said
    latest = CheckpointStore(dest / "checkpoints").latest()
    assert latest is not None and latest.step == 20 and (dest / "checkpoints/step-10").is_dir()


def test_pull_never_replaces_a_checkpoint_of_the_same_step_committed_here(bucket, tmp_path):
    """A step-10 committed in DEST (a run continued locally) had its files replaced one by one with the
    volume's step-10, and its manifest last: the local checkpoint was gone, torn if the pull was killed."""
    from trainpod.errors import InputError
    from trainpod.remote.pull import pull

    name, raw, _ = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    dest = tmp_path / "laptop"
    store = CheckpointStore(dest / "checkpoints")
    pending = store.begin(10)
    pending.write_bytes("model.safetensors", b"weights trained here")
    store.commit(pending, 10, {})
    before = {p: p.read_bytes() for p in (dest / "checkpoints").rglob("*") if p.is_file()}
    with pytest.raises(InputError, match="holds another checkpoint") as caught:
        pull(volume_s3(name), "r", "checkpoint", dest, echo=lambda line: None)
    assert caught.value.exit_code == 2
    assert {p: p.read_bytes() for p in (dest / "checkpoints").rglob("*") if p.is_file()} == before
    pull(volume_s3(name), "r", "checkpoint", tmp_path / "elsewhere", echo=lambda line: None)
    pull(volume_s3(name), "r", "checkpoint", tmp_path / "elsewhere", echo=lambda line: None)  # same one: fine


def test_a_checkpoint_whose_eval_was_recorded_after_an_earlier_pull_is_pulled_again_not_refused(
    bucket, tmp_path
):
    """A run stopped during the eval of a committed step puts that eval's score into the step's manifest when the
    next start runs it (CheckpointStore.record_eval; its files unchanged). A pull of the run before that, then
    the same pull again: DEST's copy was refused as 'another checkpoint' (exit 2, nothing pulled), the whole run
    to be pulled again into another DEST."""
    from trainpod.remote.pull import pull

    name, raw, _ = bucket
    run = make_run_on_volume(raw, name, tmp_path / "pod")
    dest = tmp_path / "laptop"
    pull(volume_s3(name), "r", "all", dest, echo=lambda line: None)
    CheckpointStore(run / "checkpoints").record_eval(10, 2.25)  # the resumed run's eval of step 10
    raw.upload_file(
        str(run / "checkpoints/step-10/manifest.json"), name, "runs/r/checkpoints/step-10/manifest.json"
    )
    lines: list[str] = []
    assert pull(volume_s3(name), "r", "all", dest, echo=lines.append) == 0, lines
    latest = CheckpointStore(dest / "checkpoints").latest()  # verifies every piece's sha256
    assert latest is not None and latest.step == 10 and latest.manifest["eval_loss"] == 2.25


def remake_output_on_the_volume(raw, name: str, files: dict[str, bytes]) -> None:
    """export/merged made again by a conversion (another step, another dtype): the folder replaced whole."""
    for listed in raw.list_objects_v2(Bucket=name, Prefix="runs/r/export/merged/").get("Contents", []):
        raw.delete_object(Bucket=name, Key=listed["Key"])
    for file, data in files.items():
        raw.put_object(Bucket=name, Key=f"runs/r/export/merged/{file}", Body=data)
    manifest = {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}
    body = json.dumps({"format": "trainpod-convert/2", "files": manifest}).encode()
    raw.put_object(Bucket=name, Key="runs/r/export/merged/manifest.json", Body=body)


def test_pulling_an_output_remade_on_the_volume_never_leaves_the_old_manifest_over_a_mix_or_its_old_files(
    bucket, tmp_path, monkeypatch
):
    """A second pull of export/merged after it was made again replaced its files one by one under the first
    pull's manifest.json: interrupted, the folder held both outputs' files with the old manifest vouching for
    them; finished, the old model.safetensors stayed beside the new shards and their index, and transformers
    loads model.safetensors first, so the old weights."""
    from trainpod.remote.pull import pull

    name, raw, _ = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    dest = tmp_path / "laptop"
    merged = dest / "export/merged"
    pull(volume_s3(name), "r", "export", dest, echo=lambda line: None)
    first_manifest = (merged / "manifest.json").read_bytes()
    assert (merged / "model.safetensors").is_file()
    remade = {
        "config.json": b'{"model_type": "llama", "torch_dtype": "float32"}',
        "model-00001-of-00002.safetensors": os.urandom(3 * (1 << 20)),
        "model-00002-of-00002.safetensors": os.urandom(3 * (1 << 20)),
        "model.safetensors.index.json": b'{"weight_map": {}}',
    }
    remake_output_on_the_volume(raw, name, remade)
    (merged / "notes.txt").write_text("mine")  # the user's own file in the folder

    s3 = volume_s3(name)
    real_download, downloads = s3.download, []

    def interrupted_at_the_second_file(key, partial, size, on_bytes=None):
        downloads.append(key)
        if len(downloads) == 2:
            raise KeyboardInterrupt  # Ctrl-C, a laptop's lid closed
        return real_download(key, partial, size, on_bytes)

    monkeypatch.setattr(s3, "download", interrupted_at_the_second_file)
    with pytest.raises(KeyboardInterrupt):
        pull(s3, "r", "export", dest, echo=lambda line: None)
    assert (
        not (merged / "manifest.json").is_file() or (merged / "manifest.json").read_bytes() != first_manifest
    ), "the first output's manifest vouches for a folder holding files of the second"

    said: list[str] = []
    pull(volume_s3(name), "r", "export", dest, echo=said.append)
    assert sorted(p.name for p in merged.iterdir()) == sorted([*remade, "manifest.json", "notes.txt"])
    for file, data in remade.items():
        assert (merged / file).read_bytes() == data, file
    assert any("removed 1 file(s) of the earlier export/merged" in line for line in said), said

    # A program's own manifest.json, of a format pull does not read, changed on the volume: replaced too.
    raw.put_object(Bucket=name, Key="runs/r/export/mine/manifest.json", Body=b'{"version": 1}')
    pull(volume_s3(name), "r", "export", dest, echo=said.append)
    raw.put_object(Bucket=name, Key="runs/r/export/mine/manifest.json", Body=b'{"version": 2}')
    pull(volume_s3(name), "r", "export", dest, echo=said.append)
    assert sorted(p.name for p in (dest / "export/mine").iterdir()) == ["manifest.json"]
    assert (dest / "export/mine/manifest.json").read_bytes() == b'{"version": 2}'


def test_an_interrupted_download_of_a_file_the_remade_output_dropped_is_removed_from_dest(bucket, tmp_path):
    """A pull of a remade export/merged interrupted in its model.safetensors, then the output made again as
    float32 shards: the old model.safetensors went, but its .tmp-pull (gigabytes) stayed in DEST for good, a
    download no pull would finish."""
    from trainpod.remote.pull import pull

    name, raw, _ = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    dest = tmp_path / "laptop"
    pull(volume_s3(name), "r", "export", dest, echo=lambda line: None)
    remake_output_on_the_volume(raw, name, {"model.safetensors": os.urandom(4 << 20), "config.json": b"{}"})
    s3 = volume_s3(name)
    s3._client = CutAt(s3._client, "runs/r/export/merged/model.safetensors")
    with pytest.raises(KeyboardInterrupt):
        pull(s3, "r", "export", dest, echo=lambda line: None)
    merged = dest / "export/merged"
    assert (merged / "model.safetensors.tmp-pull").is_file()
    float32 = {
        "model-00001-of-00001.safetensors": os.urandom(5000),
        "config.json": b'{"torch_dtype": "float32"}',
    }
    remake_output_on_the_volume(raw, name, float32)
    lines: list[str] = []
    pull(volume_s3(name), "r", "export", dest, echo=lines.append)
    assert not list(dest.rglob("*.tmp-pull")), (
        "an interrupted download of a file the volume no longer has was left"
    )
    assert sorted(p.name for p in merged.iterdir()) == sorted([*float32, "manifest.json"])
    assert any("model.safetensors" in line and "no longer on the volume" in line for line in lines), lines


class RemadeWhileRead:
    """The volume while a conversion makes export/merged again (the same file names, other weights: another step)
    as pull reads it: at the GET of its manifest the old output is gone, and the new one lands right after."""

    def __init__(self, client, raw, bucket: str, files: dict[str, bytes]):
        self._client, self._raw, self._bucket, self.files = client, raw, bucket, files

    def get_object(self, **kwargs):
        if kwargs["Key"] != "runs/r/export/merged/manifest.json" or self.files is None:
            return self._client.get_object(**kwargs)
        for gone in objects(self._raw, self._bucket, "runs/r/export/merged/"):
            self._raw.delete_object(Bucket=self._bucket, Key=gone)
        try:
            return self._client.get_object(**kwargs)
        finally:
            remake_output_on_the_volume(self._raw, self._bucket, self.files)
            self.files = None

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_an_output_whose_manifest_goes_while_it_is_listed_is_pulled_as_the_new_one_checked_by_its_manifest(
    bucket, tmp_path
):
    """A manifest gone between the listing and its read was written into DEST as {}, a manifest claiming nothing,
    and the output's files were pulled as whichever version each GET found, checked by nothing."""
    from trainpod.remote.pull import pull

    name, raw, _ = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    remade = {"model.safetensors": os.urandom(5 * (1 << 20) + 1), "config.json": b'{"model_type": "llama"} '}
    s3 = volume_s3(name)
    s3._client = RemadeWhileRead(s3._client, raw, name, remade)
    dest, lines = tmp_path / "laptop", []
    pull(s3, "r", "export", dest, echo=lines.append)
    merged = dest / "export/merged"
    assert (merged / "manifest.json").read_bytes() == objects(
        raw, name, "runs/r/export/merged/manifest.json"
    )["runs/r/export/merged/manifest.json"], "the pulled output is not vouched for by the volume's manifest"
    for file, data in remade.items():
        assert (merged / file).read_bytes() == data, file
    assert "2 checked against their manifest's sha256" in lines[-1], lines


def commit_on_the_volume(raw, name: str, step: int, root: Path, retention: bool = True) -> None:
    """What a run training on the volume does at a commit: step-<N> whole, then LATEST naming it, then
    retention (keep_last 1) deleting the older checkpoints (unless `retention` is False)."""
    store = CheckpointStore(root / "checkpoints")
    pending = store.begin(step)
    pending.write_bytes("model.safetensors", os.urandom(5000))
    store.commit(pending, step, {"world_size": 1})
    folder = root / "checkpoints" / f"step-{step}"
    for path in folder.rglob("*"):
        if path.is_file():
            raw.upload_file(str(path), name, f"runs/r/checkpoints/{path.relative_to(root / 'checkpoints')}")
    raw.put_object(Bucket=name, Key="runs/r/checkpoints/LATEST", Body=f"step-{step}\n".encode())
    if not retention:
        return
    for listed in raw.list_objects_v2(Bucket=name, Prefix="runs/r/checkpoints/step-").get("Contents", []):
        if not listed["Key"].startswith(f"runs/r/checkpoints/step-{step}/"):
            raw.delete_object(Bucket=name, Key=listed["Key"])


@pytest.mark.parametrize("what", ["checkpoint", "all"])
def test_a_checkpoint_committed_while_the_run_is_listed_is_pulled_not_taken_for_none(
    bucket, tmp_path, monkeypatch, what
):
    """The listing came first, LATEST was read after it: a commit in between (a large run's listing is
    pages of seconds) gave LATEST naming a checkpoint the listing lacked, so `pull checkpoint` said 'no
    committed checkpoint yet' with exit 2, and `pull all` pointed the local LATEST at a step it never pulled."""
    from trainpod.remote.pull import pull

    name, raw, _ = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    s3 = volume_s3(name)
    real_listing = s3.list_files
    listings = []

    def listing_then_a_commit(prefix: str):
        listed = real_listing(prefix)
        listings.append(prefix)
        if len(listings) == 1:
            commit_on_the_volume(raw, name, 20, tmp_path / "pod2")
        return listed

    monkeypatch.setattr(s3, "list_files", listing_then_a_commit)
    dest = tmp_path / "laptop"
    pull(s3, "r", what, dest, echo=lambda line: None)
    latest = CheckpointStore(dest / "checkpoints").latest()  # verifies every piece's sha256
    assert latest is not None and latest.step == 20
    assert (dest / "checkpoints/LATEST").read_text() == "step-20\n"


class RetentionDuringPull:
    """The volume of a run still training, as pull reads it: at the GET of `at` (a checkpoint's file or its
    manifest) the run has committed a newer checkpoint and its retention deleted `doomed` (a checkpoint's
    folder, renamed away at once: every file of it gone together)."""

    def __init__(self, client, raw, bucket: str, at: str, doomed: str):
        self._client, self._raw, self._bucket, self.at, self.doomed = client, raw, bucket, at, doomed

    def get_object(self, **kwargs):
        if kwargs["Key"] == self.at:
            for gone in objects(self._raw, self._bucket, self.doomed):
                self._raw.delete_object(Bucket=self._bucket, Key=gone)
        return self._client.get_object(**kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.parametrize("deleted_at", ["manifest.json", "optimizer.pt"])
def test_pull_all_skips_a_checkpoint_the_runs_retention_deletes_midway_and_pulls_the_rest(
    bucket, tmp_path, deleted_at
):
    """A checkpoint deleted by the run's keep_last while `pull RUN all` read it ended the pull with exit 75
    and a vague 'disappeared' (its manifest gone: the same, after its files were read as unlisted ones), at
    every try again where the run commits more often than the pull takes."""
    from trainpod.remote.pull import pull

    name, raw, _ = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")  # step-10
    commit_on_the_volume(raw, name, 20, tmp_path / "pod/runs/r", retention=False)  # step-20, LATEST
    s3 = volume_s3(name)
    doomed = "runs/r/checkpoints/step-10/"
    s3._client = RetentionDuringPull(s3._client, raw, name, at=doomed + deleted_at, doomed=doomed)
    dest, lines = tmp_path / "laptop", []
    pull(s3, "r", "all", dest, echo=lines.append)
    said = "\n".join(lines)
    assert "checkpoints/step-10" in said and "retention" in said and "pull again" in said, said
    assert not (dest / "checkpoints/step-10").exists(), "half a deleted checkpoint was left in DEST"
    assert not list(dest.rglob("*.tmp-pull"))
    latest = CheckpointStore(dest / "checkpoints").latest()  # verifies every piece's sha256
    assert latest is not None and latest.step == 20
    assert (dest / "export/merged/manifest.json").is_file(), "the rest of the run is pulled"


def test_pull_of_a_checkpoint_the_runs_retention_deletes_midway_is_exit_75_naming_it(bucket, tmp_path):
    from trainpod.remote.pull import pull

    name, raw, env = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    s3 = volume_s3(name)
    doomed = "runs/r/checkpoints/step-10/"
    s3._client = RetentionDuringPull(s3._client, raw, name, at=doomed + "model.safetensors", doomed=doomed)
    dest = tmp_path / "laptop"
    with pytest.raises(TemporaryError) as refused:
        pull(s3, "r", "checkpoint", dest, echo=lambda line: None)
    assert "checkpoints/step-10" in str(refused.value) and "retention" in str(refused.value), refused.value
    assert "pull again" in str(refused.value)
    assert not (dest / "checkpoints/step-10").exists()
    assert not (dest / "checkpoints/LATEST").exists(), "LATEST named a checkpoint that was not pulled"


def test_pull_into_a_disk_without_room_is_exit_5_saying_what_it_needs_not_a_traceback(bucket, tmp_path):
    """A pull onto a laptop's full disk ended in a traceback (OSError: No space left on device, exit 1) after
    downloading what fitted, with no word of how much it needed."""
    from support import small_filesystem

    name, raw, env = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")  # about 9 MiB: a checkpoint and an export
    with small_filesystem(tmp_path / "laptop", "4m") as disk:
        result = trainpod(env, "pull", "r", "all", str(disk / "r"))
        output = result.stdout + result.stderr
        assert result.returncode == 5, output
        assert "Traceback" not in output
        assert "MiB" in output and "free" in output and str(disk / "r") in output, output
        assert not list(disk.rglob("*.tmp-pull")), "bytes were downloaded that could never fit"


class CutAt:
    """The connection drops (Ctrl-C, a laptop's lid closed) at pull's GET of `key`."""

    def __init__(self, client, key: str):
        self._client, self.key = client, key

    def get_object(self, **kwargs):
        answer = self._client.get_object(**kwargs)
        if kwargs["Key"] == self.key:
            return {**answer, "Body": DroppedBody(answer["Body"].read()[:1000])}
        return answer

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_what_an_interrupted_pull_got_of_a_checkpoint_the_volume_has_since_deleted_is_removed(
    bucket, tmp_path
):
    """A pull interrupted in a checkpoint that the run's retention deleted before the next pull left that half
    folder (gigabytes of a checkpoint: its files and .tmp-pull) in DEST for good, no manifest to make it one."""
    from trainpod.remote.pull import pull

    name, raw, _ = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    s3 = volume_s3(name)
    s3._client = CutAt(s3._client, "runs/r/checkpoints/step-10/optimizer.pt")
    dest = tmp_path / "laptop"
    with pytest.raises(KeyboardInterrupt):
        pull(s3, "r", "checkpoint", dest, echo=lambda line: None)
    assert (dest / "checkpoints/step-10/optimizer.pt.tmp-pull").is_file()
    commit_on_the_volume(raw, name, 20, tmp_path / "pod/runs/r")  # keep_last 1: step-10 deleted
    lines: list[str] = []
    pull(volume_s3(name), "r", "checkpoint", dest, echo=lines.append)
    assert not (dest / "checkpoints/step-10").exists(), "an interrupted pull's half checkpoint was left"
    assert any("step-10" in line for line in lines), lines
    latest = CheckpointStore(dest / "checkpoints").latest()
    assert latest is not None and latest.step == 20


class DiskFilledMeanwhile:
    """Something else on the laptop fills its disk at pull's GET of runs/r/export/hf/'s file, after the checkpoint's."""

    def __init__(self, client, disk: Path):
        self._client, self.disk = client, disk

    def get_object(self, **kwargs):
        if "/export/hf/" in kwargs["Key"] and not (self.disk / "filler").exists():
            with open(self.disk / "filler", "wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * (1 << 16))
        return self._client.get_object(**kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_pull_onto_a_disk_that_fills_midway_is_exit_5_keeping_what_was_pulled(bucket, tmp_path):
    from trainpod.errors import VolumeFull
    from trainpod.remote.pull import pull

    from support import small_filesystem

    name, raw, _ = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    with small_filesystem(tmp_path / "laptop", "16m") as disk:
        s3 = volume_s3(name)
        s3._client = DiskFilledMeanwhile(s3._client, disk)
        with pytest.raises(VolumeFull) as full:
            pull(s3, "r", "all", disk / "r", echo=lambda line: None)
        assert "free" in str(full.value) and str(disk / "r") in str(full.value), full.value
        assert (disk / "r/checkpoints/step-10/model.safetensors").is_file(), "what was pulled is kept"


def test_pull_of_an_unknown_run_exits_2(bucket, tmp_path):
    _, _, env = bucket
    result = trainpod(env, "pull", "nope", "export", str(tmp_path / "x"))
    assert result.returncode == 2 and "no run 'nope' on volume" in result.stdout, result.stdout


# ---------------------------------------------------------------------------------------------- ls and status
def test_status_and_ls_read_the_volume_through_s3_from_a_laptop(bucket, tmp_path, tiny_dataset_volume):
    name, raw, env = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    assert (
        trainpod(
            env, "push", str(tiny_dataset_volume / "datasets/tiny-stories"), "datasets/tiny-stories"
        ).returncode
        == 0
    )
    raw.put_object(Bucket=name, Key="datasets/half/train_000000.bin", Body=b"123")
    raw.put_object(Bucket=name, Key="runs/r/loss.png", Body=b"\x89PNG")
    pushed = {
        "repo_id": "me/r",
        "revision": "main",
        "source": "merged",
        "commit": "c0ffee" * 7,
        "url": "https://hf.co/me/r",
    }
    raw.put_object(Bucket=name, Key="runs/r/hub/me--r@main.json", Body=json.dumps(pushed).encode())
    status = trainpod(env, "status", "r")
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"volume {name} ({DC}) through S3" in status.stdout
    assert "r: running | step 10/100 (10%) | loss 2.5000" in status.stdout
    # Not the path of the temporary copy status read, which is gone when it ends.
    assert "loss curve  runs/r/loss.png on the volume" in status.stdout, status.stdout
    assert "on the hub  me/r@main: merged, commit c0ffeec0ffee (https://hf.co/me/r)" in status.stdout
    listing = trainpod(env, "ls")
    assert listing.returncode == 0, listing.stdout + listing.stderr
    assert "datasets/tiny-stories: tokens," in listing.stdout
    assert "datasets/half: 1 file(s), no manifest.json" in listing.stdout
    assert "runs/r: running | step 10/100 | checkpoint step-10 | export hf, merged" in listing.stdout


def test_ls_reads_a_local_volume_the_same_way(tmp_path, tiny_dataset_volume):
    result = trainpod({}, "ls", "--volume", str(tiny_dataset_volume))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "datasets/tiny-stories: tokens," in result.stdout and "tokenizers/tiny-stories-1k" in result.stdout


def test_ls_finds_the_volume_of_a_deploy_config_by_name_through_runpods_api(bucket, tmp_path):
    name, raw, env = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    config = REPO / "configs/deploy/pretrain-spot.yaml"  # volume "trainpod" in EU-RO-1
    with FakeRunPodServer() as fake:
        fake.volumes["x"] = {"id": name, "name": "trainpod", "size": 100, "dataCenterId": DC}
        fake.volumes["y"] = {"id": "other", "name": "trainpod", "size": 100, "dataCenterId": "US-KS-2"}
        laptop = {k: v for k, v in env.items() if k not in ("TRAINPOD_S3_VOLUME", "TRAINPOD_S3_DATACENTER")}
        result = trainpod(laptop | api_env(fake), "ls", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"volume {name} ({DC}) through S3" in result.stdout and "runs/r: running" in result.stdout
    assert not fake.violations


def test_a_wrong_volume_id_exits_2_naming_it(bucket):
    _, _, env = bucket
    result = trainpod(env, "ls", "--s3-volume", "no-such-volume")
    assert result.returncode == 2 and "no network volume no-such-volume in EU-RO-1" in result.stdout, (
        result.stdout
    )


def test_a_part_size_that_is_not_a_number_exits_2_naming_it(bucket, tmp_path):
    """Was a ValueError traceback (exit 1)."""
    _, _, env = bucket
    (tmp_path / "data.jsonl").write_text("{}\n")
    result = trainpod({**env, "TRAINPOD_S3_PART_MB": "64MB"}, "push", str(tmp_path), "datasets/x")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "TRAINPOD_S3_PART_MB='64MB' is not a whole number" in result.stdout, result.stdout


def test_a_part_size_of_a_digit_that_is_no_number_is_exit_2_naming_it():
    """'³' is a digit to str.isdigit but no number to int(): a ValueError traceback (exit 1)."""
    from trainpod.errors import InputError
    from trainpod.remote.s3 import S3Target, VolumeS3

    target = S3Target("vol", DC, "http://127.0.0.1:9")
    with pytest.raises(InputError, match="TRAINPOD_S3_PART_MB='³' is not a whole number"):
        VolumeS3(target, environ={"TRAINPOD_S3_PART_MB": "³"})


def test_a_download_continued_past_the_end_of_a_file_that_shrank_since_its_listing_reads_it_whole(
    bucket, tmp_path
):
    """A log a run rewrote shorter between the listing and the GET: the ranged GET from the bytes an interrupted
    pull kept asks past its end, and S3's InvalidRange was exit 2 ("S3 answered InvalidRange"), a pull that
    failed the same way again and again. Those bytes are of another version: dropped, the file is read whole."""
    name, raw, _ = bucket
    key = "runs/r/logs/train.log"
    raw.put_object(Bucket=name, Key=key, Body=b"new and short\n")
    partial = tmp_path / "train.log.tmp-pull"
    partial.write_bytes(b"old and much longer " * 10)  # kept from a pull of the older, longer version
    kept, etag = volume_s3(name).download(key, partial, 400)  # 400: the size the listing said
    assert partial.read_bytes() == b"new and short\n" and kept == 0
    assert etag == raw.head_object(Bucket=name, Key=key)["ETag"].strip('"')


def test_a_connection_dropped_mid_download_is_exit_75_and_keeps_the_bytes_received(tmp_path, monkeypatch):
    """The body is read after the call that error translation wraps: a dropped connection was botocore's
    IncompleteReadError, a traceback and exit 1, instead of 75 (run the same pull again)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from trainpod.errors import ExitCode, TemporaryError

    class Dropping(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.write(b"x" * 1000)
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

        def log_message(self, *_):
            pass

    server = HTTPServer(("127.0.0.1", 0), Dropping)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    s3 = VolumeS3(S3Target("vol", DC, f"http://127.0.0.1:{server.server_port}"), max_attempts=1)
    partial = tmp_path / "model.safetensors.tmp-pull"
    try:
        with pytest.raises(TemporaryError, match="while receiving it") as caught:
            s3.download("runs/r/export/hf/model.safetensors", partial, 100000)
    finally:
        server.shutdown()
    assert caught.value.exit_code == ExitCode.TEMPORARY
    assert partial.read_bytes() == b"x" * 1000, "what arrived stays for the next pull to continue"


# ---------------------------------------------------------------------------------------------- secrets
def test_the_s3_key_and_secret_never_reach_the_output_or_the_volume(bucket, tmp_path):
    name, raw, env = bucket
    make_run_on_volume(raw, name, tmp_path / "pod")
    local = tmp_path / "data"
    local.mkdir()
    (local / "train.jsonl").write_text("{}\n")
    outputs = [
        trainpod(env, "push", str(local), "datasets/d"),
        trainpod(env, "pull", "r", "all", str(tmp_path / "laptop")),
        trainpod(env, "status"),
        trainpod(env, "ls", "--s3-volume", "no-such-volume"),
    ]
    for result in outputs:
        assert KEY_ID not in result.stdout + result.stderr and SECRET not in result.stdout + result.stderr
    for key, data in objects(raw, name).items():
        assert KEY_ID.encode() not in data and SECRET.encode() not in data, key
    for path in (tmp_path / "laptop").rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes()


def test_a_key_from_an_aws_profile_file_is_masked_in_log_lines(bucket, tmp_path, monkeypatch):
    name, _, _ = bucket
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    credentials = tmp_path / "credentials"
    credentials.write_text(
        "[runpod]\naws_access_key_id = user_fromprofile123\naws_secret_access_key = rps_fromprofile456\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "runpod")
    volume_s3(name).list_files("runs/")
    assert redact("signed with user_fromprofile123 / rps_fromprofile456") == "signed with *** / ***"


def test_half_a_key_or_a_missing_profile_is_exit_2_saying_what_to_export_not_a_traceback(
    bucket, tmp_path, monkeypatch
):
    """botocore raised PartialCredentialsError (AWS_ACCESS_KEY_ID exported, its secret forgotten) and
    ProfileNotFound (AWS_PROFILE naming no profile) out of the client's making: a traceback and exit 1."""
    _, _, env = bucket
    (tmp_path / "data.jsonl").write_text("{}\n")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    half = {k: v for k, v in env.items() if k != "AWS_SECRET_ACCESS_KEY"}
    result = trainpod(half, "push", str(tmp_path), "datasets/x")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "missing: AWS_SECRET_ACCESS_KEY" in result.stdout, result.stdout
    assert "export both AWS_ACCESS_KEY_ID" in result.stdout
    assert KEY_ID not in result.stdout + result.stderr

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    nothing = {k: v for k, v in half.items() if k != "AWS_ACCESS_KEY_ID"}
    for verb in (["ls"], ["pull", "r", "export", str(tmp_path / "laptop")]):
        result = trainpod({**nothing, "AWS_PROFILE": "no-such-profile"}, *verb)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        assert "profile (no-such-profile) could not be found" in result.stdout, result.stdout


def test_without_boto3_the_s3_verbs_say_which_extra_to_install():
    blocked = (
        "import sys; sys.modules['boto3'] = None; from trainpod.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", blocked, "ls", "--s3-volume", "v", "--datacenter", DC],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "pip install 'trainpod[remote]'" in result.stdout, (
        result.stdout + result.stderr
    )


def test_a_push_killed_mid_upload_is_finished_by_the_next_one_with_the_parts_already_sent(bucket, tmp_path):
    name, raw, env = bucket
    local = tmp_path / "big"
    local.mkdir()
    (local / "train.bin").write_bytes(os.urandom(20 * PART))  # 20 parts: seconds against moto on 2 cores
    (local / "metadata.json").write_text("{}")
    child = subprocess.Popen(
        [sys.executable, "-m", "trainpod", "push", str(local), "datasets/big"],
        env=child_env(env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    parts: list = []
    while child.poll() is None and len(parts) < 3:
        time.sleep(0.05)
        uploads = raw.list_multipart_uploads(Bucket=name).get("Uploads", [])
        if uploads:
            parts = raw.list_parts(Bucket=name, Key=uploads[0]["Key"], UploadId=uploads[0]["UploadId"]).get(
                "Parts", []
            )
    child.kill()  # SIGKILL: no handler runs
    child.wait()
    assert len(parts) >= 3, "the push finished before it could be killed; make the file larger"
    assert "datasets/big/metadata.json" not in objects(raw, name), "a killed push publishes no marker"
    result = trainpod(env, "push", str(local), "datasets/big")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "part(s) kept from an interrupted push" in result.stdout
    assert (
        objects(raw, name, "datasets/big/train.bin")["datasets/big/train.bin"]
        == (local / "train.bin").read_bytes()
    )


class OpaqueEtagGateway:
    """A stand-in for an S3-compatible gateway whose part ETags are opaque tokens, not MD5s (RunPod's may
    be: its S3 API is not S3 proper). Wraps the real client against moto: part ETags are handed out as
    tokens, and a completion must name them, as such a gateway would require (InvalidPart otherwise)."""

    def __init__(self, client):
        self._client, self._real, self._tokens = client, {}, {}
        self.parts_sent: list[int] = []
        self.cut_after: dict[str, int] = {}  # key: the bytes of its next GET before the connection drops

    def upload_part(self, **kwargs):
        answer = self._client.upload_part(**kwargs)
        self.parts_sent.append(kwargs["PartNumber"])
        token = f'"part-{kwargs["PartNumber"]}-{uuid.uuid4().hex[:8]}"'
        self._real[token] = answer["ETag"]
        self._tokens[(kwargs["UploadId"], kwargs["PartNumber"])] = token
        return {**answer, "ETag": token}

    def list_parts(self, **kwargs):
        answer = self._client.list_parts(**kwargs)
        tokens = [{**p, "ETag": self._tokens[(kwargs["UploadId"], p["PartNumber"])]} for p in answer["Parts"]]
        return {**answer, "Parts": tokens}

    def complete_multipart_upload(self, **kwargs):
        parts = kwargs["MultipartUpload"]["Parts"]
        unknown = [p["ETag"] for p in parts if p["ETag"] not in self._real]
        assert not unknown, f"InvalidPart: the completion names ETags this gateway never gave: {unknown}"
        real = [{**p, "ETag": self._real[p["ETag"]]} for p in parts]
        return self._client.complete_multipart_upload(**{**kwargs, "MultipartUpload": {"Parts": real}})

    # An object's ETag: an opaque token too, one per version of it (as a gateway's), never its MD5.
    def list_objects_v2(self, **kwargs):
        answer = self._client.list_objects_v2(**kwargs)
        opaque = [{**o, "ETag": self._opaque(o["ETag"])} for o in answer.get("Contents", [])]
        return {**answer, "Contents": opaque} if "Contents" in answer else answer

    def head_object(self, **kwargs):
        answer = self._client.head_object(**kwargs)
        return {**answer, "ETag": self._opaque(answer["ETag"])}

    def get_object(self, **kwargs):
        answer = self._client.get_object(**kwargs)
        if kwargs["Key"] in self.cut_after:
            received = answer["Body"].read()[: self.cut_after.pop(kwargs["Key"])]
            answer = {**answer, "Body": DroppedBody(received)}
        return {**answer, "ETag": self._opaque(answer["ETag"])}

    @staticmethod
    def _opaque(real: str) -> str:
        return f'"obj-{hashlib.sha256(real.encode()).hexdigest()[:16]}"'

    def __getattr__(self, name):
        return getattr(self._client, name)


class DroppedBody:
    """A response body whose connection drops after `received` (a laptop closing its lid mid-pull)."""

    def __init__(self, received: bytes):
        self.received = received

    def iter_chunks(self, size: int):
        yield self.received
        raise KeyboardInterrupt


def test_a_multipart_upload_is_completed_with_the_etags_the_server_gave_its_parts(bucket, tmp_path):
    name, raw, _ = bucket
    local = tmp_path / "weights.bin"
    local.write_bytes(os.urandom(2 * PART + 123))
    s3 = volume_s3(name)
    s3._client = OpaqueEtagGateway(s3._client)
    s3.upload_file(local, "datasets/w/weights.bin")
    assert objects(raw, name, "datasets/w/")["datasets/w/weights.bin"] == local.read_bytes()


def interrupted_upload(s3: VolumeS3, local: Path, key: str, after_parts: int) -> None:
    def interrupt(done: int, total: int) -> None:
        if done >= after_parts:
            raise KeyboardInterrupt  # Ctrl-C, or a laptop closing its lid

    with pytest.raises(KeyboardInterrupt):
        s3.upload_file(local, key, on_part=interrupt)


def test_a_resumed_upload_keeps_its_parts_on_a_gateway_whose_part_etags_are_not_md5s(
    bucket, tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    name, raw, _ = bucket
    local = tmp_path / "train.bin"
    local.write_bytes(os.urandom(6 * PART + 99))  # 7 parts
    gateway = OpaqueEtagGateway(volume_s3(name)._client)  # one gateway: it remembers the tokens it gave
    s3 = volume_s3(name)
    s3._client = gateway
    interrupted_upload(s3, local, "datasets/d/train.bin", after_parts=3)
    s3 = volume_s3(name)
    s3._client = gateway
    sent: list[int] = []
    kept = s3.upload_file(local, "datasets/d/train.bin", on_part=lambda done, total: sent.append(done))
    assert kept >= 3, f"{kept} part(s) kept: a resumed upload sent every part again"
    assert len(sent) == 7 - kept
    assert objects(raw, name, "datasets/d/")["datasets/d/train.bin"] == local.read_bytes()
    assert not list((tmp_path / "cache").rglob("*.json")), (
        "the record of the parts goes once the upload is done"
    )


def test_a_part_changed_since_the_interrupted_upload_is_sent_again_on_a_gateway_without_md5_etags(
    bucket, tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    name, raw, _ = bucket
    local = tmp_path / "train.bin"
    local.write_bytes(os.urandom(4 * PART + 7))
    gateway = OpaqueEtagGateway(volume_s3(name)._client)
    s3 = volume_s3(name)
    s3._client = gateway
    interrupted_upload(s3, local, "datasets/d/train.bin", after_parts=3)
    with open(local, "r+b") as f:  # same size, other bytes in the first part
        f.write(b"\0" * 1000)
    s3 = volume_s3(name)
    s3._client = gateway
    gateway.parts_sent.clear()
    s3.upload_file(local, "datasets/d/train.bin")
    assert 1 in gateway.parts_sent, "a part whose local bytes changed was kept from the interrupted upload"
    assert objects(raw, name, "datasets/d/")["datasets/d/train.bin"] == local.read_bytes()


def test_push_onto_a_gateway_without_md5_etags_never_takes_other_bytes_of_the_same_size_for_its_own(
    bucket, tmp_path, monkeypatch
):
    """Token shards of one size, another dataset's under the same name: a size alone proved 'already there',
    and the volume kept the other data while push said every file was there."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    name, raw, _ = bucket
    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    for folder, seed in ((theirs, b"a"), (mine, b"b")):
        folder.mkdir()
        (folder / "train.bin").write_bytes(seed * (2 * PART + 5))  # multipart, same size
        (folder / "small.bin").write_bytes(seed * 100)  # one request, same size
    gateway = OpaqueEtagGateway(volume_s3(name)._client)
    s3 = volume_s3(name)
    s3._client = gateway
    push(s3, theirs, "datasets/d", echo=lambda line: None)
    with pytest.raises(InputError, match="other content"):
        push(s3, mine, "datasets/d", echo=lambda line: None)
    assert objects(raw, name, "datasets/d/")["datasets/d/small.bin"] == b"a" * 100, "nothing replaced"
    lines: list[str] = []
    assert push(s3, theirs, "datasets/d", echo=lines.append) == 0, "its own files are recognised as there"


def test_a_push_interrupted_with_ctrl_c_ends_with_one_line_and_130_not_a_traceback(
    bucket, faulty_s3, tmp_path
):
    import signal

    name, raw, env = bucket
    local = tmp_path / "big"
    local.mkdir()
    (local / "train.bin").write_bytes(os.urandom(20 * PART))
    # Through a proxy that holds the parts after the first: on a busy machine the push finished before it was seen
    faulty_s3.hold_parts()
    child = subprocess.Popen(
        [sys.executable, "-m", "trainpod", "push", str(local), "datasets/big"],
        env=child_env(env | {"TRAINPOD_S3_ENDPOINT_URL": faulty_s3.url}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    parts: list = []
    try:
        deadline = time.monotonic() + 120
        while child.poll() is None and not parts and time.monotonic() < deadline:
            time.sleep(0.05)
            uploads = raw.list_multipart_uploads(Bucket=name).get("Uploads", [])
            if uploads:
                parts = raw.list_parts(
                    Bucket=name, Key=uploads[0]["Key"], UploadId=uploads[0]["UploadId"]
                ).get("Parts", [])
        child.send_signal(signal.SIGINT)  # Ctrl-C
        time.sleep(0.5)  # the signal lands while the next parts wait at the proxy
    finally:
        faulty_s3.release_parts()
    out, err = child.communicate(timeout=120)
    assert parts, "the push finished before it could be interrupted; make the file larger"
    assert child.returncode == 130, out + err
    assert "Traceback" not in out + err
    assert "run the same command again" in out + err


def machine(name: str, cache: Path) -> VolumeS3:
    """The volume as one machine reaches it: its own cache folder, where push records the uploads it made."""
    environ = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    return VolumeS3(S3Target(name, DC, os.environ["TRAINPOD_S3_ENDPOINT_URL"]), environ, part_bytes=PART)


def test_a_second_machine_pushing_the_same_file_leaves_the_first_ones_upload_in_progress_alone(
    bucket, tmp_path
):
    """The second push aborted every upload of the key it had no record of, the first machine's live one too:
    its next part was refused (NoSuchUpload, exit 2) and the parts it had sent were lost."""
    name, raw, _ = bucket
    local = tmp_path / "train.bin"
    local.write_bytes(os.urandom(5 * PART + 17))  # 6 parts
    first, second = machine(name, tmp_path / "laptop"), machine(name, tmp_path / "workstation")
    pushed_meanwhile: list[int] = []

    def second_push_after_two_parts(done: int, total: int) -> None:
        if done == 2:
            pushed_meanwhile.append(second.upload_file(local, "datasets/d/train.bin"))

    first.upload_file(local, "datasets/d/train.bin", on_part=second_push_after_two_parts)
    assert pushed_meanwhile == [0], "the second machine resumed an upload it never started"
    assert objects(raw, name, "datasets/d/")["datasets/d/train.bin"] == local.read_bytes()
    assert raw.list_multipart_uploads(Bucket=name).get("Uploads", []) == []


def test_an_upload_another_machine_left_unfinished_is_aborted_once_it_has_been_idle_long_enough(
    bucket, tmp_path, monkeypatch
):
    """Its parts are billed storage on the volume that nothing else removes; one with a part sent lately is
    another machine's live upload (the test above), one idle past ABANDONED_UPLOAD_S was given up."""
    import trainpod.remote.s3 as s3_module

    name, raw, _ = bucket
    local = tmp_path / "train.bin"
    local.write_bytes(os.urandom(3 * PART + 5))
    interrupted_upload(machine(name, tmp_path / "laptop"), local, "datasets/d/train.bin", after_parts=2)
    given_up = raw.list_multipart_uploads(Bucket=name)["Uploads"][0]["UploadId"]
    monkeypatch.setattr(s3_module, "ABANDONED_UPLOAD_S", -60)  # idle for a day: no waiting in a test
    assert machine(name, tmp_path / "workstation").upload_file(local, "datasets/d/train.bin") == 0
    left = [u["UploadId"] for u in raw.list_multipart_uploads(Bucket=name).get("Uploads", [])]
    assert given_up not in left and left == []
    assert objects(raw, name, "datasets/d/")["datasets/d/train.bin"] == local.read_bytes()


class AbortedUploadAsS3Answers:
    """S3 proper's answer to a part of an upload aborted meanwhile: 404 NoSuchUpload (moto's server answers 500,
    an internal KeyError, so this one answer is S3's, through the real client on moto otherwise)."""

    def __init__(self, client):
        self._client, self.aborted = client, set()

    def upload_part(self, **kwargs):
        from botocore.exceptions import ClientError

        if kwargs["UploadId"] in self.aborted:
            error = {"Code": "NoSuchUpload", "Message": "The specified upload does not exist."}
            raise ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": 404}}, "UploadPart")
        return self._client.upload_part(**kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_an_upload_aborted_meanwhile_is_exit_75_and_the_same_push_again_finishes_it(bucket, tmp_path):
    """An upload aborted while it was sent (another machine's push found it idle for a day: a laptop that slept
    mid-push; the gateway's own cleanup) had its next part refused with NoSuchUpload, which read as exit 2, a
    setting to fix, where the same push again starts it anew and finishes."""
    name, raw, _ = bucket
    local = tmp_path / "train.bin"
    local.write_bytes(os.urandom(5 * PART + 17))  # 6 parts
    key = "datasets/d/train.bin"
    s3 = volume_s3(name)
    s3._client = gateway = AbortedUploadAsS3Answers(s3._client)

    def aborted_after_the_first_part(done: int, total: int) -> None:
        if done == 1:
            for upload in raw.list_multipart_uploads(Bucket=name).get("Uploads", []):
                raw.abort_multipart_upload(Bucket=name, Key=key, UploadId=upload["UploadId"])
                gateway.aborted.add(upload["UploadId"])

    with pytest.raises(TemporaryError) as aborted:
        s3.upload_file(local, key, on_part=aborted_after_the_first_part)
    assert aborted.value.exit_code == 75 and "push again" in str(aborted.value), aborted.value
    volume_s3(name).upload_file(local, key)
    assert objects(raw, name, key)[key] == local.read_bytes()


class OtherUploadEndsAfterTheListing:
    """A gateway listing unfinished uploads without their dates, through which another machine's upload of the key
    ends (that machine completed or aborted it) right after the listing: moto answers its parts' listing and its
    abort with NoSuchUpload, as S3 does."""

    def __init__(self, client, raw, bucket: str):
        self._client, self._raw, self._bucket = client, raw, bucket

    def list_multipart_uploads(self, **kwargs):
        answer = self._client.list_multipart_uploads(**kwargs)
        for upload in answer.get("Uploads", []):
            self._raw.abort_multipart_upload(
                Bucket=self._bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )
        undated = [{k: v for k, v in u.items() if k != "Initiated"} for u in answer.get("Uploads", [])]
        return {**answer, "Uploads": undated}

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_another_machines_upload_ended_right_after_the_listing_is_passed_over_not_exit_2(bucket, tmp_path):
    """Another machine's upload of the key, listed, then ended by that machine before this push looked at its
    parts: NoSuchUpload ended this push with exit 2 'S3 answered NoSuchUpload', a config error, for an upload that
    was simply no more."""
    name, raw, _ = bucket
    local = tmp_path / "train.bin"
    local.write_bytes(os.urandom(2 * PART + 17))
    key = "datasets/d/train.bin"
    raw.create_multipart_upload(Bucket=name, Key=key)  # the laptop's, ended right after the listing
    workstation = machine(name, tmp_path / "workstation")
    workstation._client = OtherUploadEndsAfterTheListing(workstation._client, raw, name)
    workstation.upload_file(local, key)
    assert objects(raw, name, key)[key] == local.read_bytes()


class AnotherPushMeanwhile:
    """One machine's client, through which another machine's push of the same key (other bytes) completes
    right after this one's upload completes, before its check of what landed: the last writer wins."""

    def __init__(self, client, other_push):
        self._client, self.other_push = client, other_push

    def complete_multipart_upload(self, **kwargs):
        answer = self._client.complete_multipart_upload(**kwargs)
        self.other_push()
        return answer

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.parametrize("their_size", ["same size", "other size"])
def test_a_push_overwritten_by_another_machines_push_says_so_not_corrupted_on_the_way(
    bucket, tmp_path, their_size
):
    """Two machines pushing different bytes to one key: the one completing first found the other's object and
    was told its bytes were 'corrupted on the way' (or that the sizes differ), with 'run the same push again',
    which then refused the key as other content."""
    name, raw, _ = bucket
    mine, theirs = tmp_path / "mine.bin", tmp_path / "theirs.bin"
    mine.write_bytes(os.urandom(2 * PART + 17))
    theirs.write_bytes(os.urandom(2 * PART + (17 if their_size == "same size" else 99)))
    key = "datasets/d/train.bin"
    laptop, workstation = machine(name, tmp_path / "laptop"), machine(name, tmp_path / "workstation")
    laptop._client = AnotherPushMeanwhile(laptop._client, lambda: workstation.upload_file(theirs, key))
    with pytest.raises(InputError) as refused:
        laptop.upload_file(mine, key)
    said = str(refused.value)
    assert "another" in said and "meanwhile" in said and "corrupted" not in said, said
    assert hashlib.md5(theirs.read_bytes()).hexdigest() in said, "the message names the bytes now there"
    assert objects(raw, name, key)[key] == theirs.read_bytes()


class AnotherPutMeanwhile:
    """One machine's client, through which another machine's push of the same small key (other bytes, one request)
    lands right after this one's, before its check of what landed: the last writer wins."""

    def __init__(self, client, other_push):
        self._client, self.other_push = client, other_push

    def put_object(self, **kwargs):
        answer = self._client.put_object(**kwargs)
        self.other_push()
        return answer

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_a_single_request_push_overwritten_by_another_machines_push_says_so_not_verified(bucket, tmp_path):
    """A file of one part (a manifest.json, a tokenizer, a small shard) was checked by its PutObject's ETag alone,
    never by what the key held after it, so the push another machine's bytes replaced said 'uploaded ...
    verified' while the volume held theirs (the multipart path checked the key)."""
    name, raw, _ = bucket
    mine, theirs = tmp_path / "mine.json", tmp_path / "theirs.json"
    mine.write_bytes(b'{"tokenizer": "mine"}')
    theirs.write_bytes(b'{"tokenizer": "theirs"}')
    key = "datasets/d/manifest.json"
    laptop, workstation = machine(name, tmp_path / "laptop"), machine(name, tmp_path / "workstation")
    laptop._client = AnotherPutMeanwhile(laptop._client, lambda: workstation.upload_file(theirs, key))
    with pytest.raises(InputError) as refused:
        laptop.upload_file(mine, key)
    said = str(refused.value)
    assert "another" in said and "meanwhile" in said, said
    assert hashlib.md5(theirs.read_bytes()).hexdigest() in said, "the message names the bytes now there"
    assert objects(raw, name, key)[key] == theirs.read_bytes()


class UndatedUploads:
    """A gateway that lists unfinished uploads without their Initiated date (S3 gives it; an S3-compatible
    gateway need not), through the real client on moto."""

    def __init__(self, client):
        self._client = client

    def list_multipart_uploads(self, **kwargs):
        answer = self._client.list_multipart_uploads(**kwargs)
        undated = [{k: v for k, v in u.items() if k != "Initiated"} for u in answer.get("Uploads", [])]
        return {**answer, "Uploads": undated}

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_another_machines_upload_just_begun_is_left_alone_by_a_gateway_that_gives_no_upload_date(
    bucket, tmp_path
):
    """An upload with no parts yet, listed without its Initiated date, was taken for one idle since long ago and
    aborted: the other machine's first part was refused (NoSuchUpload, exit 2)."""
    name, raw, _ = bucket
    local = tmp_path / "train.bin"
    local.write_bytes(os.urandom(2 * PART + 17))
    key = "datasets/d/train.bin"
    theirs = raw.create_multipart_upload(Bucket=name, Key=key)["UploadId"]  # the laptop's, a part to come
    workstation = machine(name, tmp_path / "workstation")
    workstation._client = UndatedUploads(workstation._client)
    workstation.upload_file(local, key)
    assert theirs in [u["UploadId"] for u in raw.list_multipart_uploads(Bucket=name).get("Uploads", [])], (
        "another machine's upload of unknown age was aborted"
    )
    raw.upload_part(Bucket=name, Key=key, UploadId=theirs, PartNumber=1, Body=b"x" * PART)


def test_pull_through_a_gateway_without_md5_etags_never_keeps_bytes_of_an_older_version_of_the_same_size(
    bucket, tmp_path
):
    """A file no manifest covers (a command program's export, status.json) was checked by its size alone where
    the volume's ETag is no MD5: a pull after the program wrote it again at the same size kept the copy of
    the first pull, and one continuing an interrupted download appended the new version's bytes to the old
    one's, both with 'already there' or no word at all."""
    from trainpod.remote.pull import pull

    name, raw, _ = bucket
    export = "runs/r/export/mine"
    first = {"model.bin": b"a" * 300_000, "tokens.bin": b"c" * 200_000}
    for file, data in first.items():
        raw.put_object(Bucket=name, Key=f"{export}/{file}", Body=data)
    s3 = volume_s3(name)
    s3._client = gateway = OpaqueEtagGateway(s3._client)
    gateway.cut_after[f"{export}/tokens.bin"] = 50_000
    dest = tmp_path / "laptop"
    with pytest.raises(KeyboardInterrupt):
        pull(s3, "r", "export", dest, echo=lambda line: None)
    assert (dest / "export/mine/model.bin").read_bytes() == first["model.bin"]
    assert (dest / "export/mine/tokens.bin.tmp-pull").stat().st_size == 50_000

    second = {"model.bin": b"b" * 300_000, "tokens.bin": b"d" * 200_000}  # written again, same sizes
    for file, data in second.items():
        raw.put_object(Bucket=name, Key=f"{export}/{file}", Body=data)
    pull(s3, "r", "export", dest, echo=lambda line: None)
    for file, data in second.items():
        assert (dest / "export/mine" / file).read_bytes() == data, f"{file} holds bytes of the older version"
    lines: list[str] = []
    pull(s3, "r", "export", dest, echo=lines.append)
    assert ", 0 downloaded" in lines[-1], "a file pulled at the volume's version is kept"


class RunStillLogging:
    """The volume of a run still training, as pull reads it: the run appends to its log and rewrites
    status.json between pull's listing and its GET of each (through the real client, on moto)."""

    def __init__(self, client, raw, bucket: str, grown: dict[str, bytes]):
        self._client, self._raw, self._bucket, self.grown = client, raw, bucket, dict(grown)

    def get_object(self, **kwargs):
        if kwargs["Key"] in self.grown:
            self._raw.put_object(Bucket=self._bucket, Key=kwargs["Key"], Body=self.grown.pop(kwargs["Key"]))
        return self._client.get_object(**kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.parametrize("gateway", ["s3", "opaque etags"])
def test_pull_all_of_a_running_run_takes_its_log_and_status_as_they_are_when_read(bucket, tmp_path, gateway):
    """A log appended to (or status.json rewritten) after the listing came with more bytes than listed, or
    other ones, and was refused as 'does not match its checksum ... being rewritten or damaged' (exit 75),
    at every pull again: the run logs every few steps, and the checkpoints before them take minutes."""
    from trainpod.remote.pull import pull

    name, raw, _ = bucket
    run = make_run_on_volume(raw, name, tmp_path / "pod")
    log_key, status_key = "runs/r/logs/pretrain.log", "runs/r/status.json"
    raw.put_object(Bucket=name, Key=log_key, Body=b"step 10 loss 2.50\n")
    grown = {
        log_key: b"step 10 loss 2.50\nstep 20 loss 2.41\n",
        status_key: json.dumps({"state": "running", "step": 20, "max_steps": 100, "loss": 2.41}).encode(),
    }
    s3 = volume_s3(name)
    if gateway == "opaque etags":
        s3._client = OpaqueEtagGateway(s3._client)
    s3._client = RunStillLogging(s3._client, raw, name, grown)
    dest = tmp_path / "laptop"
    pull(s3, "r", "all", dest, echo=lambda line: None)
    assert (dest / "logs/pretrain.log").read_bytes() == b"step 10 loss 2.50\nstep 20 loss 2.41\n"
    assert json.loads((dest / "status.json").read_text())["step"] == 20
    assert (dest / "checkpoints/step-10/model.safetensors").read_bytes() == (
        run / "checkpoints/step-10/model.safetensors"
    ).read_bytes()
    assert not list(dest.rglob("*.tmp-pull"))


def test_a_data_center_without_s3_names_the_endpoint_variable_that_reaches_a_new_one():
    """The refusal named the data centers the kit knows to serve S3 alone; one RunPod opened since is reached by
    TRAINPOD_S3_ENDPOINT_URL, which the message now names (and which lifts the refusal)."""
    from trainpod.errors import InputError
    from trainpod.remote.s3 import ENDPOINT_ENV, target_from

    with pytest.raises(InputError, match=f"reachable through a pod only .*{ENDPOINT_ENV}"):
        target_from("vol", "XX-NEW-1", environ={})
    assert (
        target_from("vol", "XX-NEW-1", environ={ENDPOINT_ENV: "https://s3.example.com"}).datacenter
        == "XX-NEW-1"
    )
