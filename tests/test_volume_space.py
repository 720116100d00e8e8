"""`trainpod du` and `trainpod rm` on a mounted volume and through the S3 API (moto's server on 127.0.0.1, as
in test_remote_s3.py): the volume is built with the kit's own checkpoint store and small files where only the
layout matters, and the verbs run as a user runs them, `python -m trainpod ...` subprocesses."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
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


def test_du_says_which_run_pins_a_vlm_cache_key(tmp_path):
    root = tmp_path / "vol"
    make_volume(root)
    write(root / "runs/vlm/vlm_data.json", json.dumps({"settings_key": "s", "key": "v1"}).encode())
    write(root / "cache/vlm/v1/manifest.json", 2_000)
    write(root / "cache/vlm/v2/manifest.json", 1_000)
    out = trainpod("du", "--volume", str(root)).stdout
    assert "cache/vlm/v1: pinned by vlm (not done)" in out and "cache/vlm/v2: pinned by no run" in out, out


def test_du_names_the_unfinished_run_whose_base_model_is_another_runs_export(tmp_path):
    root = tmp_path / "vol"
    make_volume(root)
    write(root / "runs/base/export/hf/model.safetensors", 1_000)
    write(root / "runs/r/config.yaml", b"name: r\nbase_model:\n  path: runs/base/export/hf\n")
    out = trainpod("du", "--volume", str(root)).stdout
    base = next(line for line in out.splitlines() if "runs/base:" in line)
    assert base.endswith("named by the config of r (not done)"), out
    assert "runs/r:" in out and "named by" not in next(line for line in out.splitlines() if "runs/r:" in line)


def test_du_of_a_volume_that_is_not_there_is_exit_2_naming_it(tmp_path):
    done = trainpod("du", "--volume", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and "nowhere does not exist" in done.stdout + done.stderr, done.stdout


# ---------------------------------------------------------------------------------------------- rm
def listing(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def s3_listing(raw, name: str) -> dict[str, int]:
    pages = raw.get_paginator("list_objects_v2").paginate(Bucket=name)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def live_lease(host: str = "another-pod") -> bytes:
    """A lease record of a writer on another machine, renewed a moment ago."""
    now = time.time()
    owner = {"id": "x", "host": host, "pod_id": "pod123", "pid": 7, "pid_start": 1}
    return json.dumps({"owner": owner, "heartbeat_unix": now, "expires_unix": now + 90}).encode()


@pytest.fixture(params=["mounted", "s3"])
def volume(request, tmp_path):
    """The volume of make_volume, mounted here or in a bucket; `.put` adds a file, `.files()` lists it all."""
    root = tmp_path / "vol"
    written = make_volume(root)
    if request.param == "mounted":
        return Volume(
            root,
            ["--volume", str(root)],
            {},
            lambda rel, data: write(root / rel, data),
            lambda: listing(root),
            written,
            lambda rel: (root / rel).read_bytes(),
        )
    name, raw, env = request.getfixturevalue("bucket")
    upload(raw, name, root)
    return Volume(
        root,
        [],
        env,
        lambda rel, data: raw.put_object(Bucket=name, Key=rel, Body=data),
        lambda: s3_listing(raw, name),
        written,
        lambda rel: raw.get_object(Bucket=name, Key=rel)["Body"].read(),
    )


@dataclass
class Volume:
    root: Path
    flags: list[str]
    env: dict
    put: Callable[[str, bytes], object]
    files: Callable[[], dict[str, int]]
    written: dict[str, int]
    read: Callable[[str], bytes]

    def rm(self, *entries: str) -> subprocess.CompletedProcess:
        return trainpod("rm", *entries, *self.flags, env=self.env)


# Entries and flags, files put on the volume first (bytes, or a function making them when the test runs: a lease
# made at collection had expired by the time a long run reached the test), exit code, what the message says.
REFUSALS = {
    "not an entry": (
        ["runs", "/", "..", "runs/r/status.json", "datasets/../runs/r", "--yes"],
        {},
        2,
        "it takes",
    ),
    "a live run": (["runs/r", "--yes"], {"runs/r/LEASE": live_lease}, 75, "`trainpod stop r`"),
    "a checkpoint of a live run": (
        ["runs/r/checkpoints/step-10", "--yes"],
        {"runs/r/LEASE": live_lease},
        75,
        "host another-pod",
    ),
    "a tokenizer being made": (
        ["tokenizers/tok", "--yes"],
        {"tokenizers/.tok.LEASE": live_lease},
        75,
        "pod123",
    ),
    "the checkpoint LATEST names": (
        ["runs/r/checkpoints/step-20", "--yes"],
        {},
        2,
        "checkpoints/LATEST names it",
    ),
    "a cache key a run pins": (
        ["cache/sft/k1", "--yes"],
        {},
        2,
        "run(s) r, not DONE, pin it in sft_data.json",
    ),
    "a vlm cache key a run pins": (
        ["cache/vlm/v1", "--yes"],
        {
            "runs/vlm/vlm_data.json": json.dumps({"settings_key": "s", "key": "v1"}).encode(),
            "runs/vlm/status.json": b'{"state": "stopped"}',
            "cache/vlm/v1/manifest.json": b"{}",
        },
        2,
        "run(s) vlm, not DONE, pin it in vlm_data.json",
    ),
    "a dataset a run names": (
        ["datasets/my-data", "--yes"],
        {},
        2,
        "run(s) r, not DONE, name it in config.yaml",
    ),
    "a cache folder while a run is live": (
        ["cache/hf", "--yes"],
        {"runs/r/LEASE": live_lease},
        75,
        "run(s) r hold a live lease",
    ),
    "a run whose export another run trains on": (
        ["runs/base", "--yes"],
        {
            "runs/base/export/hf/model.safetensors": b"weights",
            "runs/r/config.yaml": b"name: r\nbase_model:\n  path: /workspace/runs/base/export/hf\n",
        },
        2,
        "run(s) r, not DONE, name it in config.yaml",
    ),
    "nothing there": (["datasets/nope", "--yes"], {}, 2, "datasets/nope: nothing there"),
    "one refused among others": (
        ["cache/sft/k2", "runs/r/checkpoints/step-20", "--yes"],
        {},
        2,
        "LATEST names it",
    ),
    "no --yes and no terminal": (["cache/sft/k2"], {}, 2, "add --yes"),
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_rm_refuses_before_deleting_anything(volume, refusal):
    entries, extra, code, said = REFUSALS[refusal]
    for rel, data in extra.items():
        volume.put(rel, data() if callable(data) else data)
    before = volume.files()
    done = volume.rm(*entries)
    assert done.returncode == code and said in done.stdout, (done.returncode, done.stdout, done.stderr)
    assert volume.files() == before, "rm deleted something though it refused"


def test_rm_of_an_older_checkpoint_a_finished_runs_cache_key_and_an_unpinned_one_frees_their_bytes(volume):
    before = volume.files()
    done = volume.rm("runs/r/checkpoints/step-10", "cache/sft/k2", "runs/r", "cache/sft/k1", "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    after = volume.files()
    # Recorded stopped first, as `trainpod stop` does: a supervisor still watching the run, its DONE gone, would
    # take it for an interrupted one and start a pod that trains it anew.
    assert json.loads(volume.read("runs/.r.STOPPED"))["by"] == "trainpod rm"
    after.pop("runs/.r.STOPPED")
    gone = [k for k in before if k not in after]
    assert all(k.startswith(("runs/r/", "cache/sft/k1/", "cache/sft/k2/")) for k in gone), gone
    assert not [k for k in after if k.startswith(("runs/r/", "cache/sft/"))], after
    assert sum(before.values()) - sum(after.values()) == sum(
        volume.written[e] for e in ("runs/r", "cache/sft/k1", "cache/sft/k2")
    )
    assert "datasets/my-data" in trainpod("du", *volume.flags, env=volume.env).stdout


def test_rm_of_an_older_checkpoint_leaves_the_run_resuming_from_latest(tmp_path):
    root = tmp_path / "vol"
    make_volume(root)
    done = trainpod("rm", "runs/r/checkpoints/step-10", "--yes", "--volume", str(root))
    assert done.returncode == 0, done.stdout + done.stderr
    store = CheckpointStore(root / "runs/r/checkpoints")
    assert [c.step for c in store.committed()] == [20] and store.latest().step == 20
    assert not list((root / "runs/r/checkpoints").glob("step-10*")), "nothing of step-10 is left"


def test_rm_of_a_done_run_and_its_dataset_and_tokenizer_together(tmp_path):
    root = tmp_path / "vol"
    make_volume(root)
    write(root / "runs/r/DONE", b"")
    done = trainpod("rm", "datasets/my-data", "tokenizers/tok", "--yes", "--volume", str(root))
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (root / "datasets/my-data").exists() and not (root / "tokenizers/tok").exists()
    assert (root / "runs/r/checkpoints/LATEST").exists()


class Killed(Exception):
    """Stands for a kill: nothing after it runs."""


def test_a_mounted_rm_killed_after_its_rename_leaves_nothing_a_reader_takes_and_the_same_rm_finishes_it(
    tmp_path, monkeypatch
):
    from trainpod import cli
    from trainpod.remote import remove

    root = tmp_path / "vol"
    make_volume(root)
    monkeypatch.setattr(remove, "delete_tree", lambda folder: (_ for _ in ()).throw(Killed()))
    for entry in ("runs/r/checkpoints/step-10", "runs/r", "datasets/other"):
        if entry == "datasets/other":
            write(root / "datasets/other/train.bin", 1000)
            write(
                root / "datasets/other/manifest.json", b'{"format": "trainpod-datagen/1", "complete": true}'
            )
        with pytest.raises(Killed):
            cli.main(["rm", entry, "--yes", "--volume", str(root)])
    leftovers = sorted(p.relative_to(root).as_posix() for p in root.glob("*/*.tmp-deleting-*"))
    assert [p.split(".tmp-")[0] for p in leftovers] == ["datasets/other", "runs/r"], leftovers
    listed = trainpod("ls", "--volume", str(root)).stdout + trainpod("status", "--volume", str(root)).stdout
    assert "runs/r" not in listed and "datasets/other" not in listed and " r:" not in listed, listed
    monkeypatch.undo()
    du = trainpod("du", "--volume", str(root)).stdout
    assert "left by an interrupted write or rm" in du, du
    for entry in ("runs/r", "datasets/other"):
        done = trainpod("rm", entry, "--yes", "--volume", str(root))
        assert done.returncode == 0, done.stdout + done.stderr
    assert not list(root.glob("*/*.tmp-deleting-*")), listing(root)


def test_a_checkpoint_whose_rm_was_killed_after_its_rename_is_swept_by_the_store(tmp_path, monkeypatch):
    from trainpod import cli
    from trainpod.remote import remove

    root = tmp_path / "vol"
    make_volume(root)
    monkeypatch.setattr(remove, "delete_tree", lambda folder: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        cli.main(["rm", "runs/r/checkpoints/step-10", "--yes", "--volume", str(root)])
    store = CheckpointStore(root / "runs/r/checkpoints")
    assert [c.step for c in store.committed()] == [20]
    store.remove_leftovers()
    assert sorted(p.name for p in (root / "runs/r/checkpoints").iterdir()) == ["LATEST", "step-20"]


def test_an_s3_rm_killed_after_its_first_delete_leaves_nothing_complete_and_the_same_rm_finishes_it(
    bucket, tmp_path, monkeypatch
):
    from trainpod import cli
    from trainpod.remote.s3 import VolumeS3

    name, raw, env = bucket
    root = tmp_path / "vol"
    make_volume(root)
    write(root / "runs/r/DONE", b"")
    write(root / "datasets/other/train.bin", 1000)
    write(root / "datasets/other/manifest.json", b'{"format": "trainpod-datagen/1", "complete": true}')
    upload(raw, name, root)
    raw.put_object(Bucket=name, Key="runs/r/", Body=b"")  # RunPod lists folders as objects too
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    real_remove = VolumeS3.remove

    def first_then_killed(self, key):
        real_remove(self, key)
        raise Killed()

    monkeypatch.setattr(VolumeS3, "remove", first_then_killed)
    expected_first = {
        "runs/r/checkpoints/step-10": "runs/r/checkpoints/step-10/manifest.json",
        "datasets/other": "datasets/other/manifest.json",
        "runs/r": "runs/r/DONE",
    }
    for entry, first in expected_first.items():
        before = s3_listing(raw, name)
        with pytest.raises(Killed):
            cli.main(["rm", entry, "--yes"])
        assert set(before) - set(s3_listing(raw, name)) == {first}, entry
    store_view = s3_listing(raw, name)
    assert "runs/r/checkpoints/step-10/model.safetensors" in store_view
    monkeypatch.undo()
    ls = trainpod("ls", env=env).stdout
    assert "datasets/other: 1 file(s), no manifest.json" in ls and "runs/r: done" not in ls, ls
    for entry in ("runs/r/checkpoints/step-10", "datasets/other", "runs/r"):
        done = trainpod("rm", entry, "--yes", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    left = s3_listing(raw, name)
    assert not [k for k in left if k.startswith(("runs/r", "datasets/other"))], left


def put_cache(raw, name: str, files: int) -> None:
    """cache/hf: an HF cache of `files` small files in two folders, with the folder objects RunPod lists."""
    for i in range(files):
        raw.put_object(Bucket=name, Key=f"cache/hf/blobs/{i:05d}", Body=b"x")
    for folder in ("cache/hf/", "cache/hf/blobs/"):
        raw.put_object(Bucket=name, Key=folder, Body=b"")


def test_an_s3_rm_of_thousands_of_files_deletes_them_a_thousand_to_a_request(bucket, faulty_s3):
    """One DeleteObject a file took minutes for an HF cache from a laptop; DeleteObjects takes 1000 keys."""
    name, raw, env = bucket
    put_cache(raw, name, 1001)
    done = trainpod("rm", "cache/hf", "--yes", env=env | {"TRAINPOD_S3_ENDPOINT_URL": faulty_s3.url})
    assert done.returncode == 0, done.stdout + done.stderr
    assert not [key for key in s3_listing(raw, name) if key.startswith("cache/hf")]
    batches = [path for method, path in faulty_s3.requests if method == "POST" and path.endswith("?delete")]
    singles = [path for method, path in faulty_s3.requests if method == "DELETE"]
    assert len(batches) == 2, batches
    assert sorted(singles) == [f"/{name}/cache/hf/", f"/{name}/cache/hf/blobs/"]  # deepest first, alone


def test_an_s3_gateway_that_refuses_batched_deletes_gets_one_request_an_object(bucket, faulty_s3):
    """RunPod does not document DeleteObjects: a gateway answering NotImplemented still gets the entry deleted,
    with one batch tried and no more."""
    name, raw, env = bucket
    put_cache(raw, name, 30)
    faulty_s3.refuse_batch_delete = True
    done = trainpod("rm", "cache/hf", "--yes", env=env | {"TRAINPOD_S3_ENDPOINT_URL": faulty_s3.url})
    assert done.returncode == 0, done.stdout + done.stderr
    assert not [key for key in s3_listing(raw, name) if key.startswith("cache/hf")]
    batches = [path for method, path in faulty_s3.requests if method == "POST" and path.endswith("?delete")]
    singles = [path for method, path in faulty_s3.requests if method == "DELETE"]
    assert len(batches) == 1 and len(singles) == 30 + 2, (batches, len(singles))


def test_an_s3_rm_of_a_run_takes_latests_checkpoint_manifest_before_the_older_ones_and_latest():
    from trainpod.remote.remove import removal_rank

    files = [
        "checkpoints/step-10/manifest.json",
        "checkpoints/step-10/model.safetensors",
        "checkpoints/step-20/manifest.json",
        "checkpoints/LATEST",
        "DONE",
        "export/merged/manifest.json",
        "status.json",
    ]
    order = sorted(files, key=lambda rel: (removal_rank(rel, "step-20"), rel))
    assert order[:5] == [
        "DONE",
        "checkpoints/step-20/manifest.json",
        "checkpoints/step-10/manifest.json",
        "export/merged/manifest.json",
        "checkpoints/LATEST",
    ], order


class Terminal(io.StringIO):
    """stdin as a terminal the user types `answer` on."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("answer", ["n", "y"])
def test_rm_on_a_terminal_shows_what_would_go_and_deletes_only_when_told_yes(
    tmp_path, monkeypatch, capsys, answer
):
    from trainpod import cli

    root = tmp_path / "vol"
    written = make_volume(root)
    monkeypatch.setattr(sys, "stdin", Terminal(answer + "\n"))
    assert cli.main(["rm", "cache/sft/k2", "--volume", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"{size_text(written['cache/sft/k2'])}  cache/sft/k2" in out, out
    assert (root / "cache/sft/k2").exists() == (answer == "n"), out


def test_a_full_volumes_message_points_at_du_and_rm(tmp_path):
    from trainpod.diskspace import volume_full

    message = str(volume_full(tmp_path, "checkpoint step-10", 1 << 30))
    assert "`trainpod du` shows what takes it" in message and "`trainpod rm` deletes" in message, message
    assert "grow the network volume" in message and "\n" not in message, message
