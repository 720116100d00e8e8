"""The stored form of a tokenized SFT dataset and its reader.

datasets/<name>/ holds `train.safetensors` (and `val.safetensors` when val_ratio > 0) with flat
arrays `input_ids` (int32), `trained` (uint8: 1 where the token is a training target), `offsets`
(int64, sample i is offsets[i]:offsets[i+1]) and `row_index` (int64, the sample's position among
all rows of all datasets), plus `manifest.json`, written last inside a folder renamed into place.

Preference data (settings.preference in the manifest) stores each row's pair as two samples one after the
other, in the same split and with the row's row_index: sample 2k holds the chosen answer, 2k+1 the rejected
one, after the same prompt ids; PreferencePairs reads them as pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from trainpod.atomic import read_json
from trainpod.errors import InputError

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "trainpod-sft/1"
IGNORE_INDEX = -100  # what transformers' loss skips


@dataclass(frozen=True)
class SftExample:
    input_ids: np.ndarray  # int64
    labels: np.ndarray  # int64: the token where trained, IGNORE_INDEX elsewhere (not shifted)
    row_index: int


class SftExamples(Sequence):
    """The samples of one split, read from flat arrays without copying them per sample."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.input_ids = arrays["input_ids"]
        self.trained = arrays["trained"].astype(bool)
        self.offsets = arrays["offsets"]
        self.row_index = arrays["row_index"]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> SftExample:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        ids = self.input_ids[start:end].astype(np.int64)
        labels = np.where(self.trained[start:end], ids, IGNORE_INDEX)
        return SftExample(ids, labels, int(self.row_index[index]))

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def empty(cls) -> SftExamples:
        return cls(
            {
                "input_ids": np.zeros(0, np.int32),
                "trained": np.zeros(0, np.uint8),
                "offsets": np.zeros(1, np.int64),
                "row_index": np.zeros(0, np.int64),
            }
        )


class PreferencePairs(Sequence):
    """The (chosen, rejected) pairs of one split of preference data: samples 2k and 2k+1 of `flat`."""

    def __init__(self, flat: SftExamples):
        if len(flat) % 2:
            raise InputError(
                f"a preference split holds {len(flat)} samples, not a chosen and a rejected one per row; "
                "delete the dataset's folder and run datagen again"
            )
        self.flat = flat

    def __len__(self) -> int:
        return len(self.flat) // 2

    def __getitem__(self, index: int) -> tuple[SftExample, SftExample]:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        return self.flat[2 * index], self.flat[2 * index + 1]

    @property
    def lengths(self) -> np.ndarray:
        """The longer sample of each pair: what a batch of pairs pads to."""
        lengths = self.flat.lengths
        return np.maximum(lengths[0::2], lengths[1::2])


def is_preference(manifest: dict) -> bool:
    """Whether a dataset's samples are preference pairs (sft.preference; its stored settings record it)."""
    return bool(manifest.get("settings", {}).get("preference", False))


@dataclass(frozen=True)
class SftData:
    train: SftExamples
    val: SftExamples
    manifest: dict
    pad_id: int


def split_arrays(examples: list[tuple[int, np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """(row index, ids, trained) triples -> the flat arrays of one split's file."""
    lengths = np.array([len(ids) for _, ids, _ in examples], dtype=np.int64)
    return {
        "input_ids": np.concatenate([ids for _, ids, _ in examples]).astype(np.int32)
        if examples
        else np.zeros(0, np.int32),
        "trained": np.concatenate([m for _, _, m in examples]).astype(np.uint8)
        if examples
        else np.zeros(0, np.uint8),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "row_index": np.array([row for row, _, _ in examples], dtype=np.int64),
    }


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a complete SFT dataset in `folder`; None when there is none."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = read_json(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"{path} is unreadable ({exc}); delete {folder} and run datagen again") from None
    return manifest if manifest.get("complete") and manifest.get("format") == MANIFEST_FORMAT else None


def load_sft(path: Path) -> SftData:
    """The dataset prepare_sft wrote at `path`; InputError naming what is missing and what makes it."""
    path = Path(path)
    make_it = (
        f"make it with `trainpod run datagen` and a config with `sft:` and name: {path.name} "
        "(e.g. configs/datagen/sft-tiny.yaml)"
    )
    manifest = read_manifest(path)
    if manifest is None:
        raise InputError(
            f"{path} holds no complete SFT dataset ({MANIFEST_FILE} of {MANIFEST_FORMAT}); {make_it}"
        )
    splits = {}
    for split in ("train", "val"):
        recorded = manifest["splits"].get(split)
        if recorded is None:
            splits[split] = SftExamples.empty()
            continue
        file = path / recorded["file"]
        if not file.is_file() or file.stat().st_size != recorded["bytes"]:
            raise InputError(
                f"{file} is listed in {path / MANIFEST_FILE} but is missing or resized; delete {path} and {make_it}"
            )
        splits[split] = SftExamples(load_file(str(file)))
    return SftData(splits["train"], splits["val"], manifest, int(manifest["tokenizer"]["pad_id"]))
