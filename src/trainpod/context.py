"""What a workload gets from the lifecycle: the volume, its run folder, the stop flag, the lease.

Below train/, convert/ and workloads/: each of them receives a RunContext; none imports another to get it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainpod import atomic, cost
from trainpod.atomic import file_sha256
from trainpod.checkpoint import Lease
from trainpod.errors import InputError
from trainpod.preemption import PreemptionWatch
from trainpod.volume import RunDir, Volume

CARRIED_TOKENIZER = "trainpod_tokenizer.json"  # in runs/<run>/tokenizer/: the source's sha256 and vocabulary


SHIPPED_DATAGEN = Path(
    "configs/datagen"
)  # from the working directory: the repo's root, the image's /opt/trainpod


def shipped_datagen_config(dataset: str) -> Path | None:
    """The shipped datagen config whose `name` is `dataset`: the 125m preset's fineweb-edu-10b missing, the
    hint was "for example configs/datagen/tiny.yaml", which makes tiny-stories."""
    for path in sorted(SHIPPED_DATAGEN.glob("*.yaml")):
        try:
            tree = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        if isinstance(tree, dict) and tree.get("name") == dataset:
            return path
    return None


@dataclass
class RunContext:
    volume: Volume
    run: RunDir
    watch: PreemptionWatch
    lease: Lease | None = None
    datagen_hint: str = "configs/datagen/tiny.yaml"

    def lease_lost(self) -> bool:
        return self.lease is not None and self.lease.lost.is_set()

    def lease_released(self) -> bool:
        """Whether this process let the run's lease go already (a stop during a multi-rank export): the run
        may be another pod's by now, so nothing more of it is written here."""
        return self.lease is not None and self.lease.released.is_set()

    @property
    def budget_usd(self) -> float | None:
        return cost.budget_usd()

    def resolve_dataset(self, name: str) -> Path:
        path = Path(name) if os.path.isabs(name) else self.volume.dataset(name)
        if not (path / "manifest.json").is_file():
            shipped = shipped_datagen_config(path.name)
            make = (
                f"`TRAINPOD_CONFIG={shipped} trainpod run datagen` (the shipped config that makes it)"
                if shipped
                else f"`TRAINPOD_CONFIG=<datagen config naming '{path.name}'> trainpod run datagen` "
                f"(for example {self.datagen_hint})"
            )
            raise InputError(
                f"dataset '{name}' not found: {path}/manifest.json does not exist. Make it first with {make}, or "
                "fix data.dataset"
            )
        return path

    def resolve_tokenizer(self, name: str | None, manifest: dict[str, Any]) -> Path:
        if name is None:
            # By name on this volume first: the recorded absolute path is where the volume was mounted
            # when datagen ran, which another pod (or /runpod-volume on serverless) may not share.
            recorded = manifest["tokenizer"]
            candidates = [self.volume.tokenizer(recorded["name"])] if recorded.get("name") else []
            if recorded.get("volume_path"):  # a datagen's tokenizer.path on the volume
                candidates.append(self.volume.root / recorded["volume_path"])
            if recorded.get("path"):
                candidates.append(Path(recorded["path"]))
        else:
            candidates = [Path(name) if os.path.isabs(name) else self.volume.tokenizer(name)]
        found = [path for path in candidates if (path / "tokenizer.json").is_file()]
        recorded_sha = manifest["tokenizer"].get("sha256")
        if name is None and recorded_sha:  # a manifest written by hand may record none: nothing to check by
            # The recorded name may hold another tokenizer by now (deleted and trained again with other
            # settings): its ids would not mean the shards' tokens, and the export would ship it.
            same = [path for path in found if file_sha256(path / "tokenizer.json") == recorded_sha]
            if found and not same:
                raise InputError(
                    f"tokenizer {found[0]} is not the one the dataset's shards were made with (its tokenizer.json "
                    f"has another sha256 than the manifest's {str(recorded_sha)[:12]}): it was replaced after "
                    "datagen ran. Set data.tokenizer to a folder holding the dataset's tokenizer, or run datagen "
                    "again under a new dataset name to make shards with this one"
                )
            found = same
        if found:
            return found[0]
        shown = ", ".join(str(p) for p in candidates) or "(none recorded in the dataset manifest)"
        raise InputError(
            f"tokenizer not found at {shown}; run datagen again or set data.tokenizer to its folder"
        )

    def carry_tokenizer(self, tokenizer_dir: Path, vocab_size: int) -> None:
        """Keep the tokenizer this run trains with in runs/<run>/tokenizer/ (atomically, under the run's lease),
        so that its checkpoints export without the dataset: its manifest names the tokenizer, and a dataset
        deleted after pretraining (gigabytes of shards) made every checkpoint of the run unexportable."""
        from transformers import AutoTokenizer

        # Known by content: the same tokenizer read where the volume is mounted elsewhere is not copied again.
        record = {"sha256": file_sha256(tokenizer_dir / "tokenizer.json"), "vocab_size": vocab_size}
        try:
            if atomic.read_json(self.run.tokenizer / CARRIED_TOKENIZER) == record:
                return
        except (OSError, ValueError):
            pass
        # Saved as an export saves it: the tokenizer's own files, not a model folder's weights beside them.
        staged = atomic.temp_name(self.run.tokenizer)
        try:
            AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(staged)
            atomic.write_json(staged / CARRIED_TOKENIZER, record)
            atomic.replace_dir(staged, self.run.tokenizer)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise

    def carried_tokenizer(self) -> tuple[Path, int] | None:
        """The run's own tokenizer folder and its vocabulary size; None for a run started before runs kept it."""
        try:
            record = atomic.read_json(self.run.tokenizer / CARRIED_TOKENIZER)
            return self.run.tokenizer, int(record["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
