"""`trainpod rm`: free space on a volume, never taking what a live writer or a run's resume needs.

    trainpod rm runs/old-run cache/sft/0123abcd --volume /workspace     # asks first on a terminal
    trainpod rm runs/r/checkpoints/step-100 --yes --s3-volume VOL --datacenter EU-RO-1

An ENTRY is one of `trainpod du`'s (datasets/<name>, tokenizers/<name>, runs/<run>, cache/sft/<key>,
cache/vlm/<key>, cache/<folder>, repos/<x>) or runs/<run>/checkpoints/step-<N>. Every ENTRY is checked before
anything is deleted: a live lease on it (or on its run) is exit 75; the checkpoint LATEST names, a cache/sft/<key>
or cache/vlm/<key> a run not DONE pins, a dataset, tokenizer, repo or other run a run not DONE names in its config.yaml (a finetune's
base model in another run's export) are exit 2; cache/<folder>,
cache/vlm/<key> and repos/<x>, which a run may read without naming them (a cache/vlm/<key> of a run begun before
the pin), wait (exit 75) while any run is leased.

A run's removal first writes runs/.<run>.STOPPED (stopped_record), so no supervisor starts it again. A kill at any
point leaves nothing that looks complete but is partial. Mounted, the entry is renamed first to
`<name>.tmp-deleting-<id>`, a name every reader skips (listing._visible, the checkpoint store, which sweeps it
as its own retention's, and the tokenizer and SFT preparers, which sweep `<name>.tmp-*`), then deleted. Through
S3, which cannot rename, the objects that make an entry count as complete go first (a run's DONE, a dataset's or
checkpoint's manifest, the one of LATEST's checkpoint before the others, then LATEST), one at a time, then the
rest, a thousand to a request (VolumeS3.remove_many). A second `rm` of the same ENTRY finishes what the first
left.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from trainpod import atomic
from trainpod.checkpoint.lease import live_owner
from trainpod.checkpoint.store import DELETING, LATEST, MANIFEST, step_of
from trainpod.diskspace import size_text
from trainpod.errors import InputError, TemporaryError, TrainpodError
from trainpod.remote.listing import LocalFiles, VolumeFiles, _json, latest_named
from trainpod.remote.space import (
    CACHE_PINS,
    KEYED_CACHES,
    LEFTOVER_MARKS,
    NAMED_FOLDERS,
    Entry,
    VolumeSpace,
    read_space,
)
from trainpod.volume import stop_marker_keys

RM_TAKES = (
    "datasets/<name>, tokenizers/<name>, runs/<run>, runs/<run>/checkpoints/step-<N>, cache/sft/<key>, "
    "cache/vlm/<key>, cache/<folder>, repos/<x> (`trainpod du` lists them)"
)
# What makes an entry count as complete, deleted first over S3: a run's DONE, a dataset's (datagen, SFT) or
# generator's index, a tokenizer's file, a cache key's or checkpoint's manifest.
COMPLETE_MARKERS = ("DONE", MANIFEST, "metadata.json", "tokenizer.json", "trainpod_tokenizer.json")
SHARED = ("cache", "vlm-cache", "repo")  # read by runs that do not name them: held back while any run is live


@dataclass(frozen=True)
class Target:
    """One ENTRY to remove: its path on the volume and its files (path relative to it: bytes)."""

    path: str
    kind: str  # Entry.kind, or "checkpoint"
    files: dict[str, int]
    leftover_bytes: int = 0  # mounted: what an interrupted rm of it left, renamed <name>.tmp-deleting-<id>

    @property
    def run(self) -> str | None:
        return self.path.split("/")[1] if self.kind in ("run", "checkpoint") else None

    @property
    def nbytes(self) -> int:
        return sum(self.files.values()) + self.leftover_bytes


def parse_entry(raw: str) -> str:
    """ENTRY as a path relative to the volume, or exit 2 naming what rm takes."""
    path = raw.rstrip("/")
    parts = path.split("/")
    shaped = not raw.startswith("/") and all(
        p and p not in (".", "..") and not p.startswith(".") for p in parts
    )
    named = len(parts) == 2 and parts[0] in NAMED_FOLDERS
    cache = parts[0] == "cache" and (
        (len(parts) == 3 and parts[1] in KEYED_CACHES) or (len(parts) == 2 and parts[1] not in KEYED_CACHES)
    )
    checkpoint = (
        len(parts) == 4 and parts[0] == "runs" and parts[2] == "checkpoints" and step_of(parts[3]) is not None
    )
    if not (shaped and (named or cache or checkpoint)):
        raise InputError(f"trainpod rm {raw!r}: not an entry rm takes; it takes {RM_TAKES}")
    return path


def target_of(space: VolumeSpace, path: str) -> Target:
    if "/checkpoints/" in path:
        run, step = path.split("/checkpoints/")
        inside, left = f"checkpoints/{step}/", f"checkpoints/{step}{DELETING}"
        run_files = space.entries.get(run, Entry(run)).files
        files = {rel.removeprefix(inside): s for rel, s in run_files.items() if rel.startswith(inside)}
        leftover = sum(s for rel, s in run_files.items() if rel.startswith(left))
        return Target(path, "checkpoint", files, leftover)
    entry = space.entries.get(path, Entry(path))
    leftover = sum(e.nbytes for p, e in space.entries.items() if p.startswith(f"{path}{DELETING}"))
    return Target(path, entry.kind, entry.files, leftover)


def _base_name(name: str) -> str:
    for mark in LEFTOVER_MARKS:
        name = name.split(mark)[0]
    return name


def _lease_key(target: Target) -> str | None:
    top, name = target.path.split("/")[:2]
    if target.kind in ("run", "checkpoint"):
        return f"runs/{_base_name(name)}/LEASE"
    if target.kind in ("dataset", "tokenizer"):
        return f"{top}/.{_base_name(name)}.LEASE"
    return None


def _holder(owner: dict) -> str:
    return f"host {owner.get('host')}, pid {owner.get('pid')}, pod {owner.get('pod_id') or '-'}"


class Removal:
    """Every refusal of every ENTRY found before anything is deleted, then the deletions."""

    def __init__(self, files: VolumeFiles):
        self.files = files
        self.space = read_space(files)

    def targets(self, raw_entries: list[str]) -> list[Target]:
        """The entries, checked; a TrainpodError holding every refusal (exit 2 where any is the user's to
        change, else 75: a writer still holds something), nothing deleted."""
        problems: list[TrainpodError] = []
        paths = []
        for raw in raw_entries:
            try:
                paths.append(parse_entry(raw))
            except InputError as exc:
                problems.append(exc)
        targets = [target_of(self.space, path) for path in dict.fromkeys(paths)]
        going = {t.run for t in targets if t.kind == "run"}
        for target in targets:
            problems += self._refusals(target, going)
        if problems:
            raise _together(problems)
        # A run before what it needs: killed in between, no run is left whose resume lacks its data.
        return sorted(targets, key=lambda t: (t.kind not in ("checkpoint", "run"), t.path))

    def _refusals(self, target: Target, going: set[str]) -> list[TrainpodError]:
        if not target.files and not target.leftover_bytes and not self._present(target):
            return [InputError(f"{target.path}: nothing there on the volume; `trainpod du` lists what is")]
        found: list[TrainpodError] = []
        lease = _lease_key(target)
        owner = live_owner(_json(self.files, lease)) if lease else None
        if owner is not None:
            stop = (
                f"`trainpod stop {target.run}`"
                if target.run
                else "stop the datagen's pod (`trainpod stop RUN`)"
            )
            found.append(
                TemporaryError(
                    f"{target.path}: a live process writes it ({_holder(owner)}; its lease {lease}); {stop}, then "
                    "wait for its lease to expire (90 s) and run rm again"
                )
            )
        latest = latest_named(self.files, f"runs/{target.run}") if target.kind == "checkpoint" else None
        if latest is not None and latest == target.path.rsplit("/", 1)[1]:
            found.append(
                InputError(
                    f"{target.path}: checkpoints/{LATEST} names it, and the run's resume starts from it; rm "
                    f"older checkpoints, or the whole run (trainpod rm runs/{target.run})"
                )
            )
        needing = [r for r in self.space.unfinished(self.space.needed_by(target.path)) if r not in going]
        if needing:
            pin_file = CACHE_PINS.get(target.kind.removesuffix("-cache"))
            how = f"pin it in {pin_file}" if pin_file else "name it in config.yaml"
            runs = ", ".join(needing)
            found.append(
                InputError(
                    f"{target.path}: run(s) {runs}, not DONE, {how}, and their resume needs it; rm the run(s) "
                    f"first (trainpod rm {' '.join(f'runs/{r}' for r in needing)}), or let them finish"
                )
            )
        if target.kind in SHARED:
            live = [run.name for run in self.space.runs() if self._leased(run)]
            if live:
                found.append(
                    TemporaryError(
                        f"{target.path}: run(s) {', '.join(live)} hold a live lease and may read it (no run names "
                        "what it reads of cache/ and repos/); stop them first (trainpod stop RUN), or run rm "
                        "again once they end"
                    )
                )
        return found

    def _leased(self, run: Entry) -> bool:
        return "LEASE" in run.files and live_owner(_json(self.files, f"{run.path}/LEASE")) is not None

    def _present(self, target: Target) -> bool:
        """An entry listed with no files: an empty folder, or the leftovers of an interrupted rm (mounted)."""
        if isinstance(self.files, LocalFiles):
            return bool(_leftovers(self.files.root, target.path)) or (self.files.root / target.path).is_dir()
        return False

    def plan(self, targets: list[Target]) -> list[str]:
        return [f"{size_text(t.nbytes):>11}  {t.path}" for t in targets]


def _together(problems: list[TrainpodError]) -> TrainpodError:
    message = "nothing removed:\n" + "\n".join(f"  - {p}" for p in problems)
    if all(isinstance(p, TemporaryError) for p in problems):
        return TemporaryError(message)
    return InputError(message)


# ------------------------------------------------------------------------------------------ mounted
def _leftovers(root: Path, path: str) -> list[Path]:
    target = root / path
    return sorted(target.parent.glob(f"{glob.escape(target.name)}{DELETING}*"))


def stopped_record(target: Target) -> tuple[str, bytes] | None:
    """A run's STOPPED marker beside its folder, as `trainpod stop` writes it (volume.stop_marker_keys),
    written before its files go: a supervisor still watching the run (supervise.yml, a supervise pod) would take
    the run with its DONE deleted for an interrupted one and start a pod that trains it anew. `trainpod deploy` of
    the name clears it."""
    if target.kind != "run":
        return None
    return stop_marker_keys(target.run)[0], json.dumps({"unix": time.time(), "by": "trainpod rm"}).encode()


def delete_mounted(target: Target, files: VolumeFiles) -> None:
    """Rename the entry to `<name>.tmp-deleting-<id>` (fsynced: no reader sees it after this), then delete it
    and whatever an earlier interrupted rm of it left."""
    assert isinstance(files, LocalFiles)
    if (stopped := stopped_record(target)) is not None:
        atomic.write_bytes(files.root / stopped[0], stopped[1])
    folder = files.root / target.path
    if folder.exists():
        os.rename(folder, folder.with_name(f"{folder.name}{DELETING}{uuid.uuid4().hex[:8]}"))
        atomic.fsync_dir(folder.parent)
    for leftover in _leftovers(files.root, target.path):
        delete_tree(leftover)


def delete_tree(folder: Path) -> None:
    shutil.rmtree(folder)


# ------------------------------------------------------------------------------------------ S3
def removal_rank(rel: str, latest: str | None) -> int:
    """Over S3, the order of an entry's objects: what makes it count as complete first."""
    if rel in COMPLETE_MARKERS:
        return 0
    if latest and rel == f"checkpoints/{latest}/{MANIFEST}":
        return 1  # the checkpoint a resume would take: no longer valid, before the older ones
    if rel.rsplit("/", 1)[-1] in (MANIFEST, "metadata.json"):
        return 2
    if rel == f"checkpoints/{LATEST}":
        return 3
    return LAST_RANK


LAST_RANK = 4  # the rest: no order among them, deleted in batches


def delete_s3(target: Target, files: VolumeFiles) -> None:
    """Every object of the entry, in removal_rank's order, then the objects RunPod lists for its folders."""
    latest = None
    if (stopped := stopped_record(target)) is not None:
        files.put_bytes(*stopped)  # type: ignore[attr-defined]
    if target.kind == "run":
        latest = latest_named(files, target.path)
    ranks = {rel: removal_rank(rel, latest) for rel in target.files}
    # One at a time, in order: what makes the entry count as complete. Then the rest, in batches.
    for rel in sorted(
        (rel for rel, rank in ranks.items() if rank < LAST_RANK), key=lambda rel: (ranks[rel], rel)
    ):
        files.remove(f"{target.path}/{rel}")  # type: ignore[attr-defined]
    rest = sorted(rel for rel, rank in ranks.items() if rank == LAST_RANK)
    files.remove_many([f"{target.path}/{rel}" for rel in rest])  # type: ignore[attr-defined]
    for key in files.folder_objects(f"{target.path}/"):  # type: ignore[attr-defined]  # deepest first
        files.remove(key)  # type: ignore[attr-defined]
