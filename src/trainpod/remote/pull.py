"""`trainpod pull RUN [export|checkpoint|all] [DEST]`: a run's results off the network volume via S3.

    trainpod pull tiny-pretrain export ./tiny-pretrain --s3-volume VOL --datacenter EU-RO-1
    trainpod pull tiny-pretrain checkpoint        # the newest committed checkpoint, resumable locally

DEST (default `./RUN`) mirrors the run folder: `export/...`, `checkpoints/step-N/...`. Each file is
downloaded into `<name>.tmp-pull` (an interrupted pull continues it with a ranged GET), checked,
then renamed into place; files already there and intact are kept. The checks are the manifests':
a checkpoint's per-piece sha256 (32 MiB pieces, checkpoint/store.py), a conversion output's and a
dataset's, a training export's (export/hf, export/adapter) whole-file sha256; a file no manifest
covers (an export made before exports had one, a command program's) is checked by size and, where the
volume gives a plain MD5 ETag, by MD5, else by the volume's ETag being the one it had when pulled
(PulledVersions): a copy or an interrupted download of an older version is downloaded again whole.
Such a file a run still training appends to or rewrites (its log, status.json) is taken as one GET
read it, checked by that version's ETag, even where it changed since the listing.
Manifests are written after the files they cover, and checkpoints/LATEST last, as the workloads write
them. An output the volume made again since an earlier pull into DEST (a conversion
run again into the same `output`) loses its old manifest before its first file is replaced, and the
files only the old one listed once the new one is whole (and the `.tmp-pull` of an interrupted download of
a file the volume no longer has); one whose manifest went between the listing and its
read (being made again) has the run listed again. A checkpoint the run's retention deletes
while it is pulled is skipped, what DEST got of it removed (exit 75 where it was the newest: a newer
one is there to pull). A DEST without room for what is still to come is exit 5 before any download.
Temp and quarantined folders (`*.tmp-*`, `*.invalid-*`) and LEASE are never pulled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainpod import atomic
from trainpod.checkpoint.store import LATEST, PIECE_BYTES, RANK_RNG_FOLDER, step_dir_name, step_of
from trainpod.diskspace import free_bytes, is_disk_full, size_text
from trainpod.errors import InputError, TemporaryError, VolumeFull
from trainpod.remote.s3 import RemoteObject, VolumeS3, cache_folder

log = logging.getLogger("trainpod.pull")

WHAT = ("export", "checkpoint", "all")
PARTIAL = ".tmp-pull"
MANIFEST = "manifest.json"
LISTING_ATTEMPTS = 3  # listings of a run whose LATEST names a checkpoint not listed (committed meanwhile)


@dataclass(frozen=True)
class Expected:
    size: int
    sha256: str | None = None
    pieces: tuple[str, ...] | None = None
    md5: str | None = None

    @property
    def by_size_alone(self) -> bool:
        return self.pieces is None and self.sha256 is None and self.md5 is None

    def matches(self, path: Path) -> bool:
        if path.stat().st_size != self.size:
            return False
        if self.pieces is not None:
            return tuple(_piece_digests(path)) == self.pieces
        if self.sha256 is not None:
            return _digest(path, "sha256") == self.sha256
        return self.md5 is None or _digest(path, "md5") == self.md5


class PulledVersions:
    """The volume's ETag of each file pulled into DEST that only its size checks (no manifest covers it, and
    its ETag is no plain MD5), and of each such file's interrupted download: an object written again gets
    another ETag on any gateway, so a file of the same size there, or the bytes of a download begun, are
    the volume's only while its ETag is the one recorded. In the user's cache folder, one JSON per DEST and
    run; a file pulled before it was recorded (or with the cache cleared) is downloaded again once."""

    def __init__(self, environ: Mapping[str, str], bucket: str, prefix: str, dest: Path):
        name = hashlib.sha256(f"{bucket}/{prefix}\0{dest.resolve()}".encode()).hexdigest()[:32]
        self.path = cache_folder(environ) / "pulls" / f"{name}.json"
        try:
            etags = atomic.read_json(self.path)
        except (OSError, ValueError):
            etags = {}
        self.etags: dict[str, str] = etags if isinstance(etags, dict) else {}

    def current(self, path: str, etag: str) -> bool:
        return self.etags.get(path) == etag

    def note(self, path: str, etag: str | None) -> None:
        if self.etags.get(path) == etag:
            return
        if etag is None:
            self.etags.pop(path, None)
        else:
            self.etags[path] = etag
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_json(self.path, self.etags)
        except OSError as exc:  # a read-only cache folder: such files are downloaded again at the next pull
            log.debug("could not record the pulled versions in %s: %s", self.path, exc)


def _digest(path: Path, algorithm: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()


def _piece_digests(path: Path) -> list[str]:
    """sha256 of each 32 MiB piece, as checkpoint/store.py records them (one piece for an empty file)."""
    digests = []
    with open(path, "rb") as f:
        while piece := f.read(PIECE_BYTES):
            digests.append(hashlib.sha256(piece).hexdigest())
    return digests or [hashlib.sha256(b"").hexdigest()]


def manifest_expectations(manifest_path: str, manifest: dict) -> dict[str, Expected]:
    """What a manifest says its folder's files are, by their path beside the manifest's."""
    folder = posixpath.dirname(manifest_path)
    fmt = str(manifest.get("format", ""))
    entries: dict[str, Expected] = {}
    if fmt.startswith("trainpod-checkpoint/"):
        for name, e in manifest.get("files", {}).items():
            entries[name] = Expected(int(e["bytes"]), pieces=tuple(e["sha256_pieces"]))
    elif fmt.startswith(("trainpod-convert/", "trainpod-export/")):
        for name, e in manifest.get("files", {}).items():
            entries[name] = Expected(int(e["bytes"]), sha256=e["sha256"])
    elif fmt.startswith("trainpod-datagen/"):
        for split in manifest.get("splits", {}).values():
            for shard in split.get("shards", []):
                entries[shard["file"]] = Expected(int(shard["bytes"]), sha256=shard["sha256"])
    return {posixpath.join(folder, name): e for name, e in entries.items()}


def _pulled(path: str) -> bool:
    parts = path.split("/")
    return path != "LEASE" and not any(".tmp-" in p or ".invalid-" in p for p in parts)


def select(objects: dict[str, RemoteObject], what: str, latest: str | None) -> list[str]:
    if what == "export":
        chosen = [p for p in objects if p.startswith("export/")]
    elif what == "checkpoint":
        # With the other ranks' RNG states of a Checkpointer commit (checkpoint/rank_rng.py): a torchrun
        # resumed from the pulled checkpoint has each rank on its own stream.
        ranks_rng = f"checkpoints/{RANK_RNG_FOLDER}/{latest}.rank-"
        chosen = [p for p in objects if latest and p.startswith((f"checkpoints/{latest}/", ranks_rng))]
    else:
        chosen = list(objects)
    return [p for p in chosen if _pulled(p) and p != f"checkpoints/{LATEST}"]


def pull(s3: VolumeS3, run: str, what: str, dest: Path, echo=print) -> int:
    """Download `what` of `run` into `dest`; returns the number of files downloaded (0: all were there)."""
    prefix = f"runs/{run}/"
    objects, latest, chosen, read = _listing_and_manifests(s3, prefix, run, what)
    # A checkpoint whose manifest went since the listing was deleted by the run's retention (keep_last): skipped.
    vanished = {_checkpoint_of(p) for p, raw in read.items() if raw is None} - {None}
    manifests = {p: raw for p, raw in read.items() if raw is not None}
    chosen = [p for p in chosen if _checkpoint_of(p) not in vanished]
    expected = {}
    for path, raw in manifests.items():
        expected.update(manifest_expectations(path, _parsed(raw)))
    missing = sorted(p for p in expected if p not in objects)
    if missing:
        raise TemporaryError(
            f"{prefix}{missing[0]} is listed in its manifest but not on the volume ({len(missing)} such); the run "
            "may be replacing it right now: run the same pull again later"
        )
    _refuse_other_checkpoints(manifests, dest, prefix)
    files = [p for p in chosen if p not in manifests]
    sizes = {p: objects[p].size for p in files}
    if free_bytes(dest) < _bytes_to_come(sizes, dest):
        raise _no_room(dest, prefix, sizes)
    remade = _unvouch_remade_outputs(manifests, dest)
    versions = PulledVersions(os.environ, s3.bucket, prefix, dest)
    downloaded = 0
    try:
        for p in files:
            if _checkpoint_of(p) in vanished:
                continue
            try:
                downloaded += _fetch(s3, prefix, p, objects[p], expected, dest, versions)
            except _Vanished:
                if _checkpoint_of(p) is None:
                    raise
                vanished.add(_checkpoint_of(p))
        for path, raw in manifests.items():  # after the files they describe, as the workloads write them
            if _checkpoint_of(path) not in vanished:
                (dest / path).parent.mkdir(parents=True, exist_ok=True)
                atomic.write_bytes(dest / path, raw)
    except OSError as exc:
        if not is_disk_full(exc):  # else the disk filled meanwhile: something else wrote to it
            raise
        raise _no_room(dest, prefix, sizes) from None
    _remove_files_the_remade_outputs_dropped(remade, manifests, set(files), dest, echo)
    _remove_partials_of_files_gone(objects, dest, what, versions, echo)
    _drop_vanished_checkpoints(vanished, latest, dest, prefix, echo)
    if what != "export":
        _remove_interrupted_pulls_of_deleted_checkpoints(objects, dest, prefix, echo)
    if what != "export" and latest:
        _point_latest(dest / "checkpoints", latest, echo)
    files = [p for p in files if _checkpoint_of(p) not in vanished]
    checked = sum(1 for p in files if p in expected)
    echo(
        f"pulled {run} {what} into {dest}: {len(files)} file(s), {downloaded} downloaded, "
        f"{len(files) - downloaded} already there; {checked} checked against their manifest's sha256"
    )
    return downloaded


def _listing_and_manifests(
    s3: VolumeS3, prefix: str, run: str, what: str
) -> tuple[dict[str, RemoteObject], str | None, list[str], dict[str, bytes | None]]:
    """The run's files, LATEST's checkpoint, the files `what` chooses and their manifests as read (None: gone
    since the listing). An output's manifest gone since the listing (the output made again, replaced whole: a
    conversion run again into the same `output`) has the run listed again: taken as gone, the output's files
    were pulled as whichever version each GET found, checked by nothing, and an empty manifest written for them."""
    for _ in range(LISTING_ATTEMPTS):
        objects, latest = _listing(s3, prefix, run, what)
        chosen = select(objects, what, latest)
        if not chosen:
            hint = (
                "no committed checkpoint yet"
                if what == "checkpoint"
                else f"nothing under {prefix}{what}/ yet"
            )
            raise InputError(f"pull {run} {what}: {hint}; `trainpod status {run}` shows how far the run is")
        read = {p: s3.read(prefix + p) for p in chosen if posixpath.basename(p) == MANIFEST}
        gone = sorted(p for p, raw in read.items() if raw is None and _checkpoint_of(p) is None)
        if not gone:
            return objects, latest, chosen, read
        log.info(
            "%s%s went since the listing (its output made again); listing the run again", prefix, gone[0]
        )
    raise TemporaryError(
        f"{prefix}{gone[0]} was listed but gone when read, in {LISTING_ATTEMPTS} listings: that output is being "
        "made again on the volume right now; run the same pull again once it is written (nothing was pulled)"
    )


def _listing(s3: VolumeS3, prefix: str, run: str, what: str) -> tuple[dict[str, RemoteObject], str | None]:
    """The run's files and the checkpoint LATEST names, that checkpoint among the files. A run training on the
    volume may commit between the listing (seconds of pages for a large run) and the read of LATEST: LATEST
    then names a checkpoint the listing does not hold, so the listing is read again."""
    for _ in range(LISTING_ATTEMPTS):
        objects = s3.list_files(prefix)
        if not objects:
            raise InputError(
                f"no run {run!r} on volume {s3.bucket} (nothing under {prefix}); `trainpod ls` lists the runs"
            )
        latest_raw = s3.read(prefix + f"checkpoints/{LATEST}")
        latest = latest_raw.decode().strip() if latest_raw else None
        listed = latest is None or any(p.startswith(f"checkpoints/{latest}/") for p in objects)
        if what == "export" or listed:
            return objects, latest
        log.info(
            "%scheckpoints/%s was committed while the run's files were listed; listing them again",
            prefix,
            latest,
        )
    raise TemporaryError(
        f"{prefix}checkpoints/{LATEST} names {latest}, which was not among the run's files in "
        f"{LISTING_ATTEMPTS} listings: the run is committing checkpoints right now, run the same pull again "
        "(if it stays so, that checkpoint's folder was deleted on the volume by hand)"
    )


def _bytes_to_come(sizes: dict[str, int], dest: Path) -> int:
    """What the files of `sizes` still need in DEST: none for one there at its size, the rest of one begun."""
    needed = 0
    for path, size in sizes.items():
        final = dest / path
        partial = final.with_name(final.name + PARTIAL)
        if final.is_file() and final.stat().st_size == size:
            continue
        begun = partial.stat().st_size if partial.is_file() else 0
        needed += size - begun if begun <= size else size
    return needed


def _no_room(dest: Path, prefix: str, sizes: dict[str, int]) -> VolumeFull:
    """Exit 5 before a download that cannot fit (not a traceback after the bytes that did), or when the disk
    filled midway; what was pulled stays for the same pull to go on from."""
    return VolumeFull(
        f"no space left at {dest} for the pull of {prefix}: it needs about {size_text(_bytes_to_come(sizes, dest))} "
        f"more and {size_text(free_bytes(dest))} is free; free space on this machine or pull into another DEST "
        "(what was pulled is kept: the same pull goes on from it)"
    )


def _checkpoint_of(path: str) -> str | None:
    """The checkpoint (step-N) a run's file belongs to: one in its folder, or another rank's RNG state of it."""
    parts = path.split("/")
    if len(parts) < 3 or parts[0] != "checkpoints":
        return None
    name = parts[2].split(".rank-")[0] if parts[1] == RANK_RNG_FOLDER else parts[1]
    return name if step_of(name) is not None else None


def _drop_vanished_checkpoints(vanished: set[str], latest: str | None, dest: Path, prefix: str, echo) -> None:
    """Checkpoints the run's retention deleted from the volume while they were pulled (a run training commits a
    newer one and deletes the oldest beyond checkpoint.keep_last): what DEST got of one is removed, a folder
    no manifest vouches for, unless an earlier pull left it whole; the rest of the pull stands. When it was
    the checkpoint LATEST named, DEST gets no LATEST for it, and the pull is exit 75: a newer one is there now."""
    for name in sorted(vanished, key=step_of):
        folder = dest / "checkpoints" / name
        if not (folder / MANIFEST).is_file():
            shutil.rmtree(folder, ignore_errors=True)
            for rank_rng in (dest / "checkpoints" / RANK_RNG_FOLDER).glob(f"{name}.rank-*"):
                rank_rng.unlink()
        if name != latest:
            echo(
                f"skipped {prefix}checkpoints/{name}: the run's retention (checkpoint.keep_last) deleted it from "
                "the volume while it was being pulled, as the run committed a newer one; run the same pull again "
                "to get the newer ones (what was pulled is kept)"
            )
    if latest in vanished:
        raise TemporaryError(
            f"{prefix}checkpoints/{latest}, the newest checkpoint when the pull began, was deleted from the volume "
            "while it was being pulled: the run's retention (checkpoint.keep_last) deletes older checkpoints as it "
            "commits newer ones, so a newer one is there now; run the same pull again to get it (what was pulled "
            "is kept)"
        )


def _remove_interrupted_pulls_of_deleted_checkpoints(
    objects: dict[str, RemoteObject], dest: Path, prefix: str, echo
) -> None:
    """What an interrupted pull got of a checkpoint the run's retention has since deleted on the volume: a
    folder with no manifest.json (never a committed checkpoint: a commit renames its folder into place with
    the manifest in it) that no later pull can finish, gigabytes left in DEST for good otherwise."""
    on_volume = {_checkpoint_of(p) for p in objects} - {None}
    for folder in sorted((dest / "checkpoints").glob("step-*")):
        if step_of(folder.name) is None or folder.name in on_volume or (folder / MANIFEST).exists():
            continue
        shutil.rmtree(folder, ignore_errors=True)
        for rank_rng in (dest / "checkpoints" / RANK_RNG_FOLDER).glob(f"{folder.name}.rank-*{PARTIAL}"):
            rank_rng.unlink()
        echo(
            f"removed {folder}: an interrupted pull's part of a checkpoint the run's retention has since deleted "
            f"from {prefix}checkpoints/"
        )


def _refuse_other_checkpoints(manifests: dict[str, bytes], dest: Path, prefix: str) -> None:
    """A committed checkpoint's files are never rewritten (checkpoint/store.py): one of the same step that DEST
    holds with other files in its manifest (committed here, by a run continued from an older pull) is not pulled
    over. Its eval's score may come later (CheckpointStore.record_eval: a stop interrupted that eval, the next
    start ran it), which makes it no other checkpoint: its manifest is pulled with the score."""
    for path, raw in manifests.items():
        local = dest / path
        if (
            path.startswith("checkpoints/")
            and local.is_file()
            and _unscored(local.read_bytes()) != _unscored(raw)
        ):
            folder = posixpath.dirname(path)
            raise InputError(
                f"{dest / folder} holds another checkpoint than {prefix}{folder} on the volume (their manifests "
                "differ); nothing was pulled and nothing is replaced. Pull into another DEST, or move that "
                "folder away first"
            )


def _unscored(manifest: bytes) -> dict:
    """A checkpoint's manifest without what record_eval adds to it after the commit."""
    return {k: v for k, v in _parsed(manifest).items() if k not in ("eval_loss", "score")}


def _unvouch_remade_outputs(manifests: dict[str, bytes], dest: Path) -> dict[str, set[str]]:
    """Outputs DEST holds from an earlier pull that the volume has since made again (a conversion run again into
    the same `output`, at another step or dtype): their old manifest.json goes before any file is replaced, so
    a pull interrupted midway leaves a folder no manifest vouches for, never a mix of the two outputs under
    the old one's. The files it listed are kept in manifest.json.tmp-pull beside it until the pull ends, for
    this pull or the next one to remove those the new output no longer has. Returns them by manifest path.
    Checkpoints are never remade (refused above)."""
    remade = {}
    for path, raw in manifests.items():
        if path.startswith("checkpoints/"):
            continue
        local = dest / path
        aside = local.with_name(MANIFEST + PARTIAL)
        before = set(_names_in(aside))
        if local.is_file() and local.read_bytes() != raw:
            before |= set(manifest_expectations(path, _parsed(local.read_bytes())))
            atomic.write_json(aside, sorted(before))
            local.unlink()
            atomic.fsync_dir(local.parent)
        if aside.is_file():
            remade[path] = before
    return remade


def _names_in(aside: Path) -> list[str]:
    try:
        names = atomic.read_json(aside)
    except (FileNotFoundError, ValueError):
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _remove_files_the_remade_outputs_dropped(
    remade: dict[str, set[str]], manifests: dict[str, bytes], pulled: set[str], dest: Path, echo
) -> None:
    """The files an output's earlier version listed and its new one does not (model.safetensors of a bf16 merge
    remade in float32 as model-0000N-of-0000M shards): left beside the new files, transformers would load the
    old model.safetensors before the new index. Files no manifest listed (the user's) are kept."""
    for path, before in remade.items():
        dropped = before - set(manifest_expectations(path, _parsed(manifests[path]))) - pulled
        gone = sorted(p for p in dropped if (dest / p).is_file())
        for p in gone:
            (dest / p).unlink()
        (dest / path).with_name(MANIFEST + PARTIAL).unlink(missing_ok=True)
        if gone:
            echo(
                f"removed {len(gone)} file(s) of the earlier {posixpath.dirname(path)} that the volume's remade "
                f"one no longer has: {', '.join(posixpath.basename(p) for p in gone[:5])}"
            )


def _remove_partials_of_files_gone(
    objects: dict[str, RemoteObject], dest: Path, what: str, versions: PulledVersions, echo
) -> None:
    """The `.tmp-pull` of an interrupted download of a file the volume no longer has (an output made again
    without it since: a float32 remake's shards in place of a bf16 merge's model.safetensors), which no pull
    would finish or remove, gigabytes left in DEST for good. Within what this pull mirrors whole (export/, or
    the run for `all`); a checkpoint's are removed with the checkpoint (_remove_interrupted_pulls_of_deleted_
    checkpoints). The list an output remade keeps beside its manifest is no download."""
    if what == "checkpoint":
        return
    root = dest if what == "all" else dest / "export"
    gone = []
    for partial in sorted(root.rglob(f"*{PARTIAL}")):
        path = partial.relative_to(dest).as_posix().removesuffix(PARTIAL)
        if partial.is_file() and partial.name != MANIFEST + PARTIAL and path not in objects:
            partial.unlink()
            versions.note(path + PARTIAL, None)
            gone.append(path)
    if gone:
        echo(
            f"removed {len(gone)} interrupted download(s) of file(s) no longer on the volume: "
            f"{', '.join(gone[:5])}"
        )


def _point_latest(checkpoints: Path, latest: str, echo) -> None:
    """LATEST names the pulled checkpoint, unless it names a newer one this folder holds already (a run
    continued here): LATEST never moves backwards, or the next start would delete the newer checkpoints as
    the leftovers of an interrupted commit."""
    local, pulled = step_of(_read_text(checkpoints / LATEST)), step_of(latest)
    if (
        local is not None
        and local > (-1 if pulled is None else pulled)
        and (checkpoints / step_dir_name(local)).is_dir()
    ):
        echo(
            f"kept {checkpoints / LATEST} at step-{local}, newer than the volume's {latest}; "
            f"{latest} is beside it in {checkpoints}"
        )
        return
    atomic.write_text(checkpoints / LATEST, latest + "\n")


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def _fetch(
    s3: VolumeS3,
    prefix: str,
    path: str,
    remote: RemoteObject,
    expected: dict,
    dest: Path,
    versions: PulledVersions,
) -> int:
    """Make dest/path the volume's file, verified; returns 1 when it was downloaded, 0 when it was there."""
    want = expected.get(path) or Expected(remote.size, md5=remote.etag if _plain_md5(remote.etag) else None)
    if remote.size != want.size:
        raise TemporaryError(
            f"{prefix}{path} has {remote.size} bytes on the volume, its manifest says {want.size}; it is being "
            "rewritten or damaged: run the same pull again later"
        )
    final = dest / path
    this_version = not want.by_size_alone or versions.current(path, remote.etag)
    if final.is_file() and want.matches(final) and this_version:
        return 0
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + PARTIAL)
    if want.by_size_alone:  # the bytes of an interrupted download continue only at the version they began
        if not versions.current(path + PARTIAL, remote.etag):
            partial.unlink(missing_ok=True)
        versions.note(path + PARTIAL, remote.etag)
    kept, read_at = _download(s3, prefix + path, partial, want.size)
    if kept:
        log.info("%s%s: continued an interrupted download after %s bytes", prefix, path, f"{kept:,}")
    unlisted = path not in expected
    if not _holds(want, partial, unlisted, kept, read_at, remote.etag):
        partial.unlink()
        if kept:  # the bytes kept from an interrupted pull were of an older version: once more, whole
            _, read_at = _download(s3, prefix + path, partial, want.size)
        if not kept or not _holds(want, partial, unlisted, 0, read_at, remote.etag):
            partial.unlink(missing_ok=True)
            raise TemporaryError(
                f"{prefix}{path} does not match its checksum after a whole download; the volume's copy is being "
                "rewritten or damaged: run the same pull again later"
            )
    os.replace(partial, final)
    atomic.fsync_dir(final.parent)
    if want.by_size_alone:
        versions.note(path + PARTIAL, None)
        versions.note(path, read_at or remote.etag)
    return 1


def _holds(
    want: Expected, partial: Path, unlisted: bool, kept: int, read_at: str | None, listed: str
) -> bool:
    """Whether `partial` is the file to rename into place. One no manifest lists (a log, status.json, a
    program's file) may have been appended to or rewritten by a run still training since the listing: read
    whole in one GET, it is one version of the object, checked by that version's ETag where it is an MD5
    (botocore checks its length); continued from an interrupted pull, only at the version listed."""
    if not unlisted:
        return want.matches(partial)
    if kept:
        return read_at in (None, listed) and want.matches(partial)
    if want.matches(partial):
        return True
    return read_at is not None and (not _plain_md5(read_at) or _digest(partial, "md5") == read_at)


class _Vanished(TemporaryError):
    """A file deleted from the volume between the listing and its download."""


def _download(s3: VolumeS3, key: str, partial: Path, size: int) -> tuple[int, str | None]:
    """Complete `partial` from the volume; returns how many bytes an interrupted pull had left in it and the
    ETag of the version read (VolumeS3.download)."""
    try:
        return s3.download(key, partial, size)
    except FileNotFoundError:
        raise _Vanished(
            f"{key} disappeared from the volume while being pulled (a training run deletes old checkpoints as "
            "it commits new ones); run the same pull again"
        ) from None


def _parsed(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except ValueError:
        return {}  # not a trainpod manifest: its folder's files are checked by size and ETag
    return data if isinstance(data, dict) else {}


def _plain_md5(etag: str) -> bool:
    return len(etag) == 32 and all(c in "0123456789abcdef" for c in etag)
