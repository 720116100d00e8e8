"""`trainpod ls` and the S3 view of `trainpod status`: what a volume holds, read from its small files.

    trainpod ls --volume ./demo-volume                               # a volume mounted here
    trainpod ls --s3-volume VOL --datacenter EU-RO-1                 # the same, from a laptop via S3
    trainpod status tiny-pretrain --s3-volume VOL --datacenter EU-RO-1

Both read only manifests, markers and status.json (never a shard or a checkpoint), through a
`VolumeFiles`: a folder on this machine or the volume's S3 API. `status` copies each run's top-level
files (status.json, DONE, FAILED, ...) into a temp folder and reports from it with the local code, so
the two views cannot differ.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Protocol

from trainpod.checkpoint.store import LATEST
from trainpod.volume import Volume

SNAPSHOT_MAX_BYTES = 1 << 20  # status.json, markers and loss.png are far below; never a checkpoint


class VolumeFiles(Protocol):
    """Read access to a volume by path (`runs/x/status.json`); folders end without a slash."""

    def folders(self, prefix: str) -> list[str]: ...

    def files(self, prefix: str) -> dict[str, int]: ...

    def read(self, key: str) -> bytes | None: ...

    def sizes(self, prefix: str) -> dict[str, int]:
        """Every file under `prefix` (a folder path ending in /, or "" for the whole volume), at any depth, by
        its path relative to it: its size in bytes. `trainpod du` sums these; nothing is read."""
        ...


class LocalFiles:
    """A volume mounted (or copied) on this machine."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def folders(self, prefix: str) -> list[str]:
        folder = self.root / prefix
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []

    def files(self, prefix: str) -> dict[str, int]:
        folder = self.root / prefix
        return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()} if folder.is_dir() else {}

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def sizes(self, prefix: str) -> dict[str, int]:
        folder = self.root / prefix
        found = {}
        for parent, _, names in os.walk(folder):
            for name in names:
                path = Path(parent) / name
                with contextlib.suppress(FileNotFoundError):  # removed since the walk listed it
                    if not path.is_symlink():  # a link's target is counted where it lies, if on the volume
                        found[path.relative_to(folder).as_posix()] = path.stat().st_size
        return found


def latest_named(files: VolumeFiles, run_path: str) -> str | None:
    """The checkpoint a run's checkpoints/LATEST names (`runs/<run>` given), None where it has none."""
    raw = files.read(f"{run_path}/checkpoints/{LATEST}")
    return raw.decode(errors="replace").strip() if raw else None


def _json(files: VolumeFiles, key: str) -> dict | None:
    raw = files.read(key)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _visible(name: str) -> bool:
    return ".tmp-" not in name and ".invalid-" not in name


def dataset_line(files: VolumeFiles, name: str) -> str:
    base = f"datasets/{name}"
    manifest = _json(files, f"{base}/manifest.json")
    if manifest and manifest.get("format", "").startswith("trainpod-datagen/") and manifest.get("complete"):
        shards = sum(len(s.get("shards", [])) for s in manifest.get("splits", {}).values())
        return f"{base}: tokens, {manifest.get('total_tokens', 0):,} in {shards} shard(s)"
    if (
        manifest
    ):  # an SFT (or VLM) dataset: its counts are a dozen figures; the samples per split say what it is
        counts = manifest.get("counts") or {}
        samples = [f"{counts[f'{s}_samples']:,} {s}" for s in ("train", "val") if f"{s}_samples" in counts]
        template = f", template {manifest['template']}" if manifest.get("template") else ""
        state = "" if manifest.get("complete") else " (incomplete)"
        what = f", {' + '.join(samples)} samples" if samples else ""
        return f"{base}: {manifest.get('format', 'data')}{state}{what}{template}"
    metadata = _json(files, f"{base}/metadata.json")
    if metadata:  # a generator's records: metadata.json has the records of each split, no `counts`
        splits = metadata.get("splits") or {}
        records = ", ".join(f"{split} {info.get('records', 0):,}" for split, info in splits.items())
        return f"{base}: generated records" + (f", {records}" if records else "")
    present = files.files(f"{base}/")
    return f"{base}: {len(present)} file(s), no manifest.json or metadata.json (being written or pushed, or plain files)"


def run_line(files: VolumeFiles, name: str) -> str:
    base = f"runs/{name}"
    top = files.files(f"{base}/")
    status = _json(files, f"{base}/status.json") or {}
    state = "done" if "DONE" in top else "failed" if "FAILED" in top else status.get("state", "no status yet")
    parts = [f"{base}: {state}"]
    if status.get("step") is not None:  # a command run's has no max_steps (its program decides)
        total = f"/{status['max_steps']}" if status.get("max_steps") else ""
        parts.append(f"step {status['step']}{total}")
    latest = files.read(f"{base}/checkpoints/{LATEST}")
    if latest:
        parts.append(f"checkpoint {latest.decode().strip()}")
    exports = [e for e in files.folders(f"{base}/export/") if _visible(e)]
    if exports:
        parts.append("export " + ", ".join(exports))
    return " | ".join(parts)


def volume_lines(files: VolumeFiles) -> list[str]:
    lines = [dataset_line(files, n) for n in files.folders("datasets/") if _visible(n)]
    lines += [f"tokenizers/{n}" for n in files.folders("tokenizers/") if _visible(n)]
    lines += [run_line(files, n) for n in files.folders("runs/") if _visible(n)]
    return lines


def snapshot_runs(files: VolumeFiles, names: list[str] | None, into: Path) -> Volume:
    """Copy each run's top-level small files, checkpoints/LATEST and the records of its hub pushes (hub/) into
    `into`, as a local volume."""
    for name in names if names else files.folders("runs/"):
        base = f"runs/{name}/"
        wanted = [n for n, size in files.files(base).items() if size <= SNAPSHOT_MAX_BYTES]
        wanted += [f"hub/{n}" for n, size in files.files(base + "hub/").items() if size <= SNAPSHOT_MAX_BYTES]
        for rel in [*wanted, f"checkpoints/{LATEST}"]:
            data = files.read(base + rel)
            if data is not None:
                target = into / "runs" / name / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
        (into / "runs" / name).mkdir(parents=True, exist_ok=True)
    return Volume(into)
