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
from trainpod.remote.s3 import VolumeS3, etag_agrees, expected_etag, part_size

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
    already = _already_there(s3, files, remote, dest)
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


def _already_there(s3: VolumeS3, files: dict[str, Path], remote: dict, dest: str) -> set[str]:
    """Local files the volume holds already (same size and checksum); InputError when it holds anything else."""
    conflicts, same = [], set()
    for name, obj in sorted(remote.items()):
        local = files.get(name)
        if local is None:
            conflicts.append(f"{name} (not in the local folder)")
        elif obj.size != local.stat().st_size or not etag_agrees(
            obj.etag, expected_etag(local, part_size(obj.size, s3.part_bytes))
        ):
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


def _progress(echo, key: str, done: int, total: int) -> None:
    echo(f"  {key}: part {done}/{total}")  # 64 MiB each: a line every second or so on a fast link
