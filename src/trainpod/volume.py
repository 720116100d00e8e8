"""Where everything lives on the network volume (docs/design.md, "The volume").

$TRAINPOD_VOLUME/
  datasets/<name>/   tokenizers/<name>/   repos/<name>@<ref>/   cache/
  runs/<run>/config.yaml checkpoints/ export/ hub/ logs/ tensorboard/ loss.png status.json then.json DONE LEASE
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainpod import atomic
from trainpod.errors import ConfigError, InputError

DEFAULT_VOLUME = "/workspace"
# runs/<run>/: the cache/sft/<key> its first start tokenized data.sft into (workloads/finetune.py), which every
# resume takes; `trainpod du` and `rm` read it to tell who needs a key.
SFT_DATA_PIN = "sft_data.json"
# The same for finetune-vlm: the cache/vlm/<key> its first start prepared data into (workloads/finetune_vlm.py).
VLM_DATA_PIN = "vlm_data.json"
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"  # the configs' `name` (config/*.py NAME_PATTERN)
# runs/<run>/: how the conversion a deploy's `then` runs after DONE in the same pod last ended (runpod/finish.py
# writes it, supervisors and `trainpod status` read it): {"workload", "outcome": "done" or "failed", "exit",
# "reason", "unix"}. Absent while one runs (its start is marked START-<workload>, finish.start_marker).
THEN_RECORD = "then.json"
STOPPED_MARKER = (
    "STOPPED"  # written by `trainpod stop` (and `trainpod rm` of a run), removed by `trainpod deploy`
)


def stop_marker_keys(run: str) -> tuple[str, str]:
    """Where `trainpod stop` records a stop, relative to the volume's root: runs/.<run>.STOPPED, beside the run
    folder as the deploy record is (runpod/supervise.deploy_record_key: a run stopped before its first start gets
    no folder), then runs/<run>/STOPPED, where older kits wrote it: still read, and removed with the new one. Here,
    below both runpod/ (supervisors read it) and remote/ (`trainpod rm` writes it)."""
    return f"runs/.{run}.{STOPPED_MARKER}", f"runs/{run}/{STOPPED_MARKER}"


def is_then_record(record: object) -> bool:
    """A THEN_RECORD's fields as runpod/finish.py writes them (a supervisor reads it through S3 as well)."""
    return (
        isinstance(record, dict)
        and record.get("outcome") in ("done", "failed")
        and isinstance(record.get("unix"), (int, float))
    )


def is_run_name(name: str) -> bool:
    """A name that is one folder under runs/: no '/', not '.' or '..', nothing that leaves the volume."""
    return re.fullmatch(RUN_NAME_PATTERN, name) is not None


def check_run_name(name: str) -> str:
    """TRAINPOD_RUN (or --run) as given, or a ConfigError (exit 2) before runs/<name>/ points elsewhere."""
    if not is_run_name(name):
        raise ConfigError(
            [
                f"TRAINPOD_RUN={name!r} (or --run) is not a run name: runs/<run>/ must be one folder on the "
                "volume; use letters, digits, '.', '_' and '-', starting with a letter or digit, e.g. "
                "TRAINPOD_RUN=my-run-1"
            ]
        )
    return name


@dataclass(frozen=True)
class Volume:
    root: Path

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Volume:
        environ = os.environ if environ is None else environ
        return cls(Path(environ.get("TRAINPOD_VOLUME") or DEFAULT_VOLUME))

    def dataset(self, name: str) -> Path:
        return self.root / "datasets" / name

    def tokenizer(self, name: str) -> Path:
        return self.root / "tokenizers" / name

    def run(self, name: str) -> RunDir:
        return RunDir(self.root / "runs" / name)

    def cache(self) -> Path:
        return self.root / "cache"

    def check_writable(self) -> None:
        """Fail with exit 2 before anything is written if the volume cannot take writes."""
        if not self.root.is_dir():
            raise InputError(  # (or --volume): `trainpod run --volume ./demo-volume` was told of a variable unset
                f"TRAINPOD_VOLUME (or --volume) {self.root} does not exist or is not a directory; "
                "mount the network volume there, create the folder, or point TRAINPOD_VOLUME (--volume) at a "
                "writable folder."
            )
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise InputError(
                f"TRAINPOD_VOLUME (or --volume) {self.root} is not writable by uid {os.getuid()}; "
                "fix its permissions or point TRAINPOD_VOLUME (--volume) at a writable folder."
            )


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def hub(self) -> Path:
        """Records of the export folders convert's hub tasks pushed to the Hugging Face Hub (convert/hub.py)."""
        return self.root / "hub"

    def hub_pushes(self) -> list[dict[str, Any]]:
        """The records in `hub`, one per repo and branch, as `trainpod status` shows them; an unreadable one is
        skipped (status says what it can)."""
        pushes = []
        for path in sorted(self.hub.glob("*.json")):
            try:
                record = atomic.read_json(path)
            except (OSError, ValueError):
                continue
            if (
                isinstance(record, dict)
                and {"repo_id", "revision", "source", "commit", "url"} <= record.keys()
            ):
                pushes.append(record)
        return pushes

    @property
    def then_record(self) -> Path:
        return self.root / THEN_RECORD

    def then_outcome(self) -> dict[str, Any] | None:
        """THEN_RECORD when it is a record of an ended conversion, else None (none yet, or unreadable)."""
        try:
            record = atomic.read_json(self.then_record)
        except (OSError, ValueError):
            return None
        return record if is_then_record(record) else None

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def tokenizer(self) -> Path:
        """The tokenizer a pretrain run trains with, kept beside its checkpoints (RunContext.carry_tokenizer)."""
        return self.root / "tokenizer"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    @property
    def done(self) -> Path:
        return self.root / "DONE"

    @property
    def lease(self) -> Path:
        return self.root / "LEASE"

    def create(self) -> None:
        for path in (self.root, self.checkpoints, self.export, self.logs, self.tensorboard):
            path.mkdir(parents=True, exist_ok=True)


def read_cache_pin(pin: Path) -> dict[str, Any]:
    """A run's data pin (SFT_DATA_PIN, VLM_DATA_PIN): {"settings_key": ..., "key": <the cache folder's name>},
    or {} where there is none or it cannot be read (the start then prepares its data and pins it anew)."""
    try:
        pinned = atomic.read_json(pin)
    except (OSError, ValueError):
        return {}
    return pinned if isinstance(pinned, dict) else {}


def write_cache_pin(pin: Path, settings_key: str, key: str) -> None:
    atomic.write_json(pin, {"settings_key": settings_key, "key": key})
