"""`trainpod du`: what takes the space on a volume, entry by entry, largest first.

    trainpod du --volume /workspace                              # a volume mounted here: then its free space
    trainpod du --s3-volume VOL --datacenter EU-RO-1             # the same, from a laptop via S3

An entry is one thing `trainpod rm` takes: datasets/<name>, tokenizers/<name>, runs/<run> (split into its
checkpoints, its export and the rest), cache/sft/<key> and cache/vlm/<key>, another cache/ folder, repos/<x>.
Sizes come from one listing of the volume (VolumeFiles.sizes: a walk here, ListObjectsV2 through S3), so the
two views cannot differ; the only files read are small ones that say who needs an entry: each run's
sft_data.json and vlm_data.json (the cache/sft/<key> and cache/vlm/<key> its resume takes) and config.yaml (the
dataset and tokenizer it names).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import yaml

from trainpod.diskspace import size_text
from trainpod.remote.listing import VolumeFiles, _json, latest_named
from trainpod.volume import SFT_DATA_PIN, VLM_DATA_PIN

NAMED_FOLDERS = ("datasets", "tokenizers", "runs", "repos")  # <top>/<name>/ is one entry
KEYED_CACHES = ("sft", "vlm")  # cache/<kind>/<key>/ is one entry; another cache/<x>/ is one as a whole
CACHE_PINS = {
    "sft": SFT_DATA_PIN,
    "vlm": VLM_DATA_PIN,
}  # the file in runs/<run>/ that pins a cache/<kind>/<key>
CHECKPOINT_FILE = re.compile(r"^checkpoints/(step-\d+)/")
LEFTOVER_MARKS = (".tmp-", ".invalid-")  # an interrupted write's or rm's folder (listing._visible skips them)


@dataclass
class Entry:
    """One entry and its files (path relative to it: bytes)."""

    path: str
    files: dict[str, int] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """dataset, tokenizer, run, repo, sft-cache, vlm-cache, cache, or markers (files beside the entries)."""
        parts = self.path.split("/")
        if len(parts) == 1:
            return "markers" if self.path in (*NAMED_FOLDERS, "cache") else "other"
        if parts[0] == "cache":
            return f"{parts[1]}-cache" if len(parts) == 3 else "cache"
        return parts[0].removesuffix("s")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())

    @property
    def leftover(self) -> bool:
        return any(mark in self.name for mark in LEFTOVER_MARKS)

    def checkpoints(self) -> dict[str, int]:
        """A run's committed checkpoint folders (step-<N>) and their bytes."""
        found: dict[str, int] = {}
        for rel, size in self.files.items():
            match = CHECKPOINT_FILE.match(rel)
            if match:
                found[match.group(1)] = found.get(match.group(1), 0) + size
        return found


def entry_of(key: str) -> str:
    """The entry a file of the volume belongs to; a file beside the entries (a lease, runs/.<run>.DEPLOYED)
    belongs to its top folder, and a file of another top folder to that folder."""
    parts = key.split("/")
    if parts[0] in NAMED_FOLDERS and len(parts) >= 3:
        return "/".join(parts[:2])
    if parts[0] == "cache" and len(parts) >= 4 and parts[1] in KEYED_CACHES:
        return "/".join(parts[:3])
    if parts[0] == "cache" and len(parts) >= 3:
        return "/".join(parts[:2])
    return parts[0]


@dataclass
class VolumeSpace:
    """The volume's entries with what says who needs them: which runs are DONE, which cache/sft/<key> and
    cache/vlm/<key> each run's resume takes, which datasets and tokenizers each run's config names."""

    entries: dict[str, Entry]
    done: set[str]
    cache_pins: dict[str, list[str]]  # cache/sft/<key>, cache/vlm/<key>: the runs that pin it
    named: dict[str, list[str]]  # datasets/<name>, tokenizers/<name>: the runs whose config names it

    def runs(self) -> Iterator[Entry]:
        return (e for e in self.entries.values() if e.kind == "run")

    def needed_by(self, path: str) -> list[str]:
        """The runs that pin `path` or name it in their config."""
        return sorted({*self.cache_pins.get(path, []), *self.named.get(path, [])})

    def unfinished(self, runs: list[str]) -> list[str]:
        return [run for run in runs if run not in self.done]


def read_space(files: VolumeFiles) -> VolumeSpace:
    entries: dict[str, Entry] = {}
    for key, size in files.sizes("").items():
        path = entry_of(key)
        entries.setdefault(path, Entry(path)).files[key[len(path) + 1 :]] = size
    space = VolumeSpace(entries, set(), {}, {})
    for run in space.runs():
        if "DONE" in run.files:
            space.done.add(run.name)
        for kind, pin_file in CACHE_PINS.items():
            pin = _json(files, f"{run.path}/{pin_file}") if pin_file in run.files else None
            if isinstance(pin, dict) and pin.get("key"):
                space.cache_pins.setdefault(f"cache/{kind}/{pin['key']}", []).append(run.name)
        for named in _named_inputs(files, run) if "config.yaml" in run.files else []:
            space.named.setdefault(named, []).append(run.name)
    return space


def _named_inputs(files: VolumeFiles, run: Entry) -> set[str]:
    """The entries a run's config.yaml names: a `dataset` or `tokenizer` field's bare name (pretrain's data.dataset
    and data.tokenizer, finetune's data.dataset, sft's tokenizer), and any path into datasets/, tokenizers/, runs/
    or repos/, relative to the volume or absolute on it (a finetune's base model in another run's export, an SFT
    file under datasets/). Another run's folder counts; its own does not."""
    raw = files.read(f"{run.path}/config.yaml")
    try:
        config = yaml.safe_load(raw or b"")
    except yaml.YAMLError:
        return set()
    found = set()
    for key, value in _fields(config):
        if not isinstance(value, str) or not value.strip():
            continue
        parts = value.strip().rstrip("/").split("/")
        if key in ("dataset", "tokenizer") and len(parts) == 1:
            found.add(f"{key}s/{parts[0]}")
        found |= _volume_entry_in(parts)
    return found - {run.path}


def _volume_entry_in(parts: list[str]) -> set[str]:
    """datasets/<name> (tokenizers/, runs/, repos/) from a path's parts: relative to the volume (starting there),
    or absolute (where the volume is mounted is not known through S3: the first such folder on the path; a path
    off the volume that happens to hold one only makes rm refuse more, never less)."""
    starts = [0] if parts[0] in NAMED_FOLDERS else []
    if parts[0] == "" and len(parts) > 1:  # absolute
        starts = [i for i, part in enumerate(parts) if part in NAMED_FOLDERS][:1]
    for i in starts:
        if len(parts) > i + 1 and parts[i + 1] and not parts[i + 1].startswith("."):
            return {f"{parts[i]}/{parts[i + 1]}"}
    return set()


def _fields(node: object) -> Iterator[tuple[str, object]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key), value
            yield from _fields(value)
    elif isinstance(node, list):
        for item in node:
            yield from _fields(item)


def entry_line(space: VolumeSpace, entry: Entry, latest: str | None = None) -> str:
    """`  12.3 GiB  runs/r: ...`: the entry's size and what it holds or who needs it."""
    return f"{size_text(entry.nbytes):>11}  {entry.path}{_detail(space, entry, latest)}"


def _detail(space: VolumeSpace, entry: Entry, latest: str | None) -> str:
    notes = []
    if entry.leftover:
        notes.append("left by an interrupted write or rm (`trainpod rm` of it finishes it)")
    if entry.kind == "run":
        notes.append(_run_split(space, entry, latest))
    if entry.kind in ("run", "repo") and space.needed_by(entry.path):
        notes.append(
            f"named by the config of {', '.join(_run_state(space, r) for r in space.needed_by(entry.path))}"
        )
    elif entry.kind in ("dataset", "tokenizer", "sft-cache", "vlm-cache"):
        runs = space.needed_by(entry.path)
        pinned = entry.kind.endswith("-cache")
        if runs:
            what = "pinned by" if pinned else "named by the config of"
            notes.append(f"{what} {', '.join(_run_state(space, r) for r in runs)}")
        elif pinned:
            notes.append("pinned by no run")
    elif entry.kind == "markers":
        notes.append("leases and markers beside the folders")
    return ": " + "; ".join(notes) if notes else ""


def _run_state(space: VolumeSpace, run: str) -> str:
    return f"{run} ({'done' if run in space.done else 'not done'})"


def _run_split(space: VolumeSpace, run: Entry, latest: str | None) -> str:
    checkpoints = run.checkpoints()
    in_checkpoints = sum(checkpoints.values())
    export = sum(size for rel, size in run.files.items() if rel.startswith("export/"))
    steps = sorted(checkpoints, key=lambda name: int(name.removeprefix("step-")))
    named = f" ({', '.join(steps)}{f'; LATEST {latest}' if latest else ''})" if steps else ""
    state = "done" if run.name in space.done else "not done"
    return (
        f"{state}, {len(checkpoints)} checkpoint(s) {size_text(in_checkpoints)}{named}, export {size_text(export)}, "
        f"the rest {size_text(run.nbytes - in_checkpoints - export)}"
    )


def du_lines(files: VolumeFiles) -> tuple[list[str], int]:
    """One line per entry, largest first, and the total bytes."""
    space = read_space(files)
    lines = []
    for entry in sorted(space.entries.values(), key=lambda e: (-e.nbytes, e.path)):
        latest = None
        if entry.kind == "run" and "checkpoints/LATEST" in entry.files:
            latest = latest_named(files, entry.path)
        lines.append(entry_line(space, entry, latest))
    return lines, sum(e.nbytes for e in space.entries.values())
