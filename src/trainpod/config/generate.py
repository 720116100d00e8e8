"""The config of a user data generator run: `generator: package.module:function` in a datagen YAML.

    TRAINPOD_CONFIG=configs/datagen/generator-tiny.yaml trainpod run datagen

A datagen YAML with `kind: generator` is this config (workloads/datagen.py picks it). What the function must look like, and what lands
in $TRAINPOD_VOLUME/datasets/<name>/, is documented in trainpod/data/generate.py.
"""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainpod.config.datagen import NAME_PATTERN
from trainpod.config.loader import Section, without_settings_added_later

# Settings added since the first generated datasets, with their value of before (config/loader.py,
# without_settings_added_later); tests/test_generate.py pins the hash of today's settings.
SETTINGS_ADDED_LATER: dict[tuple[str, ...], object] = {}

# "package.module:function": dotted Python identifiers, one colon, one identifier after it.
GENERATOR_PATTERN = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$"
KIND_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
# The keywords the kit itself passes to the generator function; params may not shadow them.
RESERVED_PARAMS = ("seed", "chunk", "kind", "count")
# metadata.json lists every chunk's counts and seeds (~200 bytes each): 100k chunks keep it near 20 MB.
MAX_CHUNKS = 100_000
# Ratios are written as decimals in YAML; a sum off by float rounding only (0.7 + 0.2 + 0.1) is fine.
RATIO_TOLERANCE = 1e-9


def exact_ratio(value: float) -> Fraction:
    """The decimal the user wrote (0.7 -> 7/10), not the binary float nearest to it."""
    return Fraction(repr(float(value)))


class SplitRatios(Section):
    """Shares of the records that go to train.jsonl, val.jsonl and test.jsonl (by a hash of the id)."""

    train: float = Field(0.9, ge=0, le=1, description="Share of the records in train.jsonl (0 to 1).")
    val: float = Field(0.05, ge=0, le=1, description="Share of the records in val.jsonl (0 to 1).")
    test: float = Field(0.05, ge=0, le=1, description="Share of the records in test.jsonl (0 to 1).")

    @model_validator(mode="after")
    def _sum_to_one(self) -> SplitRatios:
        total = self.train + self.val + self.test
        if abs(total - 1) > RATIO_TOLERANCE:
            raise ValueError(
                f"splits: train={self.train} + val={self.val} + test={self.test} = {total:g}, not 1; "
                "change them so they add up to 1 (e.g. train: 0.9, val: 0.05, test: 0.05)"
            )
        return self


class GeneratorDatagenConfig(Section):
    """Run a user's generator function in parallel, crash-safely, into datasets/<name>/*.jsonl."""

    kind: Literal["generator"] = Field(
        "generator", description="'generator': this datagen config runs your generator."
    )
    name: str = Field(
        pattern=NAME_PATTERN,
        description="Dataset name: the output goes to $TRAINPOD_VOLUME/datasets/<name>/.",
    )
    generator: str = Field(
        pattern=GENERATOR_PATTERN,
        description="The function that makes the records, as package.module:function "
        "(e.g. generators.edits:generate), importable from python_path or a checkout under repos/.",
    )
    python_path: list[str] = Field(
        default_factory=list,
        description="Extra folders to import the generator from: absolute, or relative to the volume root, "
        "to each synced checkout under repos/ (the first that exists wins), or to the current directory; "
        "every repos/<name>/ checkout is importable anyway.",
    )
    records: int = Field(ge=1, description="Total number of records to generate (at least 1).")
    chunk_records: int = Field(
        1000,
        ge=1,
        description="Records per chunk: the unit of parallel work and of crash-safe commits.",
    )
    kinds: dict[str, float] | None = Field(
        None,
        description="Kinds of record and their shares, summing to 1 (e.g. {single: 0.7, compound: 0.2, "
        "noop: 0.1}); each record gets a 'kind' field. Leave it out for one kind (kind=None).",
    )
    splits: SplitRatios = Field(
        default_factory=SplitRatios,
        description="Shares of train/val/test, summing to 1.",
    )
    seed: int = Field(0, ge=0, description="Base seed; each (chunk, kind) gets a seed derived from it.")
    workers: int | None = Field(
        None,
        ge=1,
        description="Generator processes; default: the CPU count. The output does not depend on it.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the generator function as they are (JSON/YAML values).",
    )

    @field_validator("kinds")
    @classmethod
    def _kinds_sum_to_one(cls, kinds: dict[str, float] | None) -> dict[str, float] | None:
        if kinds is None:
            return None
        if not kinds:
            raise ValueError("kinds is empty; list at least one kind with its share, or leave kinds out")
        problems = [
            f"kind {name!r} is not a plain name (letters, digits, '.', '_', '-')"
            for name in kinds
            if re.fullmatch(KIND_PATTERN, name) is None
        ]
        problems += [f"kinds.{name} = {share} is negative" for name, share in kinds.items() if share < 0]
        total = sum(kinds.values())
        if abs(total - 1) > RATIO_TOLERANCE:
            problems.append(f"the shares add up to {total:g}, not 1")
        if problems:
            raise ValueError(
                "kinds: " + "; ".join(problems) + "; give each kind a share >= 0 so that they add up to 1"
            )
        return kinds

    @field_validator("params")
    @classmethod
    def _params_do_not_shadow_the_kit(cls, params: dict[str, Any]) -> dict[str, Any]:
        clashes = sorted(set(params) & set(RESERVED_PARAMS))
        if clashes:
            raise ValueError(
                f"params has {', '.join(clashes)}, which the kit passes itself ({', '.join(RESERVED_PARAMS)}); "
                "rename those params"
            )
        try:
            json.dumps(params, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"params must be plain JSON values ({exc}); use strings, numbers, lists, maps"
            ) from None
        return params

    @model_validator(mode="after")
    def _chunk_count_fits(self) -> GeneratorDatagenConfig:
        if self.chunk_count > MAX_CHUNKS:
            raise ValueError(
                f"records={self.records} in chunks of chunk_records={self.chunk_records} makes "
                f"{self.chunk_count} chunks, more than {MAX_CHUNKS}; raise chunk_records to at least "
                f"{math.ceil(self.records / MAX_CHUNKS)}"
            )
        return self

    @property
    def chunk_count(self) -> int:
        return math.ceil(self.records / self.chunk_records)

    @property
    def module_name(self) -> str:
        return self.generator.partition(":")[0]

    @property
    def function_name(self) -> str:
        return self.generator.partition(":")[2]

    def output_settings(self) -> dict:
        """What the records depend on (the worker count left out), hashed to recognise a dataset."""
        settings = self.model_dump(mode="json", exclude={"kind", "workers"})
        return without_settings_added_later(settings, SETTINGS_ADDED_LATER)
