"""`trainpod push LOCAL_PATH datasets/NAME`: data onto the network volume through RunPod's S3 API.

    trainpod run datagen --config configs/datagen/tiny.yaml --volume ./local   # made on a laptop
    trainpod push ./local/datasets/tiny-stories datasets/tiny-stories --s3-volume VOL --datacenter EU-RO-1

A folder is uploaded with its layout (temp leftovers `*.tmp-*` aside), a file into the folder.
Published like datagen publishes: every data file first, each appearing whole or not at all (an S3
object exists only once its upload completes), and the markers pretrain and finetune look for
(`manifest.json`, `metadata.json`) last, so a dataset is seen only once all of it is there. Run
again after an interruption, it keeps the files already there and the parts already uploaded. It
never replaces anything: a file on the volume that differs from the local one stops the push
before anything is sent.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path, PurePosixPath

from trainpod.data.datagen import MANIFEST_FORMAT as DATAGEN_FORMAT
from trainpod.data.datagen import load_dataset_manifest
from trainpod.errors import InputError
from trainpod.remote.s3 import RemoteObject, VolumeS3, expected_etag, file_md5, md5_form, part_size

log = logging.getLogger("trainpod.push")

MARKERS = ("manifest.json", "metadata.json")  # what datagen (tokens, SFT, generators) writes last
KIT_FOLDERS = ("runs", "cache")  # written by the workloads only


def check_destination(dest: str) -> str:
    path = PurePosixPath(dest.strip("/"))
    if dest.startswith("/") or ".." in path.parts or len(path.parts) < 2 or path.parts[0] in KIT_FOLDERS:
        raise InputError(
            f"push destination {dest!r}: give a folder on the volume such as datasets/NAME (or tokenizers/NAME, "
            f"models/NAME); not absolute, no '..', not under {' or '.join(KIT_FOLDERS)}/ (the workloads' own)"
        )
    return str(path)


def local_files(source: Path) -> dict[str, Path]:
    """The files to upload, by their path under the destination."""
    if source.is_file():
        return {source.name: source}
    if not source.is_dir():
        raise InputError(f"push: {source} does not exist; give a file or a folder")
    files = {
        str(p.relative_to(source)): p
        for p in sorted(source.rglob("*"))
        if p.is_file() and ".tmp-" not in str(p.relative_to(source))
    }
    if not files:
        raise InputError(f"push: {source} holds no files")
    if _is_datagen(source / "manifest.json"):
        load_dataset_manifest(
            source
        )  # an unfinished dataset is refused here, with the command that finishes it
    return files


def _is_datagen(manifest: Path) -> bool:
    try:
        return manifest.is_file() and f'"{DATAGEN_FORMAT}"' in manifest.read_text(errors="replace")
    except OSError:
        return False


def upload_order(names: list[str]) -> list[str]:
    """Data files first, the top-level markers last (manifest.json after metadata.json's data too)."""
    return sorted(names, key=lambda name: (name in MARKERS, name))


def push(s3: VolumeS3, source: Path, dest: str, echo=print) -> int:
    """Upload `source` to `dest` on the volume; returns the number of files sent (0: all were there)."""
    dest = check_destination(dest)
    files = local_files(source)
    remote = s3.list_files(dest + "/")
    already = _already_there(s3, files, remote, dest, echo)
    sent = 0
    for name in upload_order(list(files)):
        if name in already:
            continue
        key = f"{dest}/{name}"
        size = files[name].stat().st_size
        kept = s3.upload_file(
            files[name], key, on_part=lambda done, total, key=key: _progress(echo, key, done, total)
        )
        resumed = f", {kept} part(s) kept from an interrupted push" if kept else ""
        echo(f"uploaded {key} ({size:,} bytes, verified{resumed})")
        sent += 1
    echo(
        f"{dest}: {len(files)} file(s) on volume {s3.bucket}, {sent} sent, {len(already)} were there already"
    )
    _hint_tokenizer(s3, source, echo)
    return sent


def _hint_tokenizer(s3: VolumeS3, source: Path, echo) -> None:
    """A token dataset is read with its tokenizer (tokenizers/<name>/ on the volume): say so when it is missing."""
    if not _is_datagen(source / "manifest.json"):
        return
    name = json.loads((source / "manifest.json").read_text()).get("tokenizer", {}).get("name")
    if name and s3.head(f"tokenizers/{name}/tokenizer.json") is None:
        local = source.parent.parent / "tokenizers" / name
        echo(
            f"pretrain reads this dataset with tokenizers/{name}/, not on the volume yet: "
            f"trainpod push {local if local.is_dir() else '<its folder>'} tokenizers/{name}"
        )


def _already_there(s3: VolumeS3, files: dict[str, Path], remote: dict, dest: str, echo=print) -> set[str]:
    """Local files the volume holds already (same size and checksum); InputError when it holds anything else."""
    conflicts, same = [], set()
    for name, obj in sorted(remote.items()):
        local = files.get(name)
        if local is None:
            conflicts.append(f"{name} (not in the local folder)")
        elif obj.size != local.stat().st_size or not _same_bytes(s3, f"{dest}/{name}", obj, local, echo):
            conflicts.append(f"{name} (other content)")
        else:
            same.add(name)
    if conflicts:
        shown = ", ".join(conflicts[:5]) + (f" and {len(conflicts) - 5} more" if len(conflicts) > 5 else "")
        raise InputError(
            f"{dest}/ on volume {s3.bucket} already holds other data: {shown}; nothing was uploaded and nothing "
            "is replaced. Push to another name, or delete that folder on the volume first"
        )
    return same


def _same_bytes(s3: VolumeS3, key: str, obj: RemoteObject, local: Path, echo) -> bool:
    """Whether the object of `local`'s size holds its bytes: its ETag when that is the MD5 form trainpod's
    upload gives, else the file's MD5 trainpod recorded in its metadata (a gateway's ETag may be an opaque
    token, and another part size gives another MD5-of-MD5s). Neither: taken as there, and said so."""
    if obj.etag == expected_etag(local, part_size(obj.size, s3.part_bytes)):
        return True
    head = s3.head(key)
    if head is not None and head.md5 is not None:
        return head.md5 == file_md5(local)
    if md5_form(obj.etag):  # S3 proper's checksum, and it differs: other bytes
        return False
    echo(f"kept s3://{s3.bucket}/{key}: same size, and the volume has no checksum of it to compare "
         "(not uploaded by trainpod push); delete it on the volume to have it sent again")  # fmt: skip
    return True


def _progress(echo, key: str, done: int, total: int) -> None:
    echo(f"  {key}: part {done}/{total}")  # 64 MiB each: a line every second or so on a fast link
