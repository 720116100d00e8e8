"""The convert workload's config: a finetune's adapter to MLX or merged into its base, a pretrain
checkpoint to an HF model, an export folder pushed to the Hugging Face Hub. Outputs go to
$TRAINPOD_VOLUME/runs/<name>/export/<output>/.

    TRAINPOD_CONFIG=configs/convert/tiny.yaml TRAINPOD_VOLUME=/tmp/vol trainpod run convert

    name: tiny-finetune
    adapter: run:tiny-finetune        # default: run:<name>
    task:
      - kind: mlx
      - kind: merge
        dtype: float32
      - kind: hub                     # needs HF_TOKEN with write access to the repo
        source: merged
        repo_id: someone/tiny-ft
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from trainpod.config.datagen import NAME_PATTERN
from trainpod.config.loader import Section

RUN_PREFIX = "run:"
DTYPE_CHOICES = Literal["auto", "float32", "bfloat16", "float16"]
SHARD_SIZE_PATTERN = r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$"
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# A Hub model repo, owner included: the Hub's own rule (huggingface_hub's validate_repo_id: word characters,
# '-' and '.', no '--' or '..', at most 96 characters), with the owner required, since a repo without one
# lands in whichever account the token belongs to.
REPO_ID_PATTERN = r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$"
REPO_ID_MAX_CHARS = 96
# A branch name: git's ref characters, '/'-separated parts, none of them '.' or '..'.
REVISION_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*$"


def shard_size_bytes(size: str) -> int:
    """'5GB' -> 5_000_000_000, '4GiB' -> 4 * 2**30. Passed on as bytes: huggingface_hub's own parser
    (save_pretrained's, split_torch_state_dict_into_shards') knows KB/MB/GB/TB only and raised on the
    binary units and 'B' after the whole merge had run."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]+)", size.strip()).groups()
    return int(float(number) * _SIZE_UNITS[unit])


class MlxTask(Section):
    """A PEFT LoRA/DoRA adapter to an mlx-lm adapter folder (adapters.safetensors, adapter_config.json)."""

    kind: Literal["mlx"] = Field(description="'mlx': convert the adapter for mlx-lm.")
    output: str = Field(
        "mlx", pattern=NAME_PATTERN, description="Folder name under runs/<name>/export/ for the MLX adapter."
    )


class MergeTask(Section):
    """Adapter + base model -> one merged HF model (sharded safetensors, config, tokenizer)."""

    kind: Literal["merge"] = Field(description="'merge': fold the adapter into the base model's weights.")
    output: str = Field(
        "merged", pattern=NAME_PATTERN, description="Folder name under runs/<name>/export/ for the model."
    )
    dtype: DTYPE_CHOICES = Field(
        "auto",
        description="Weights dtype of the merged model (the merge itself runs in float32); "
        "'auto' keeps the base model's dtype from its config.json (float32 when it records none).",
    )
    qlora_base: Literal["dequantized", "original"] = Field(
        "dequantized",
        description="For QLoRA adapters: merge into the NF4-quantized-then-dequantized base ('dequantized', "
        "the default: the weights the adapter was trained against, so the merged model reproduces the "
        "finetuned model's outputs) or into the original 16-bit base ('original': keeps the base's "
        "precision, but adds the quantization error the adapter never saw). Ignored for LoRA adapters.",
    )
    max_shard_size: str = Field(
        "5GB",
        pattern=SHARD_SIZE_PATTERN,
        description="Largest safetensors shard, like '5GB', '500MB' or '4GiB' (transformers' max_shard_size).",
    )

    @field_validator("max_shard_size")
    @classmethod
    def _shard_size_positive(cls, size: str) -> str:
        if shard_size_bytes(size) < 1:
            raise ValueError("a shard holds at least one byte; give a size like '5GB' or '500MB'")
        return size

    @property
    def max_shard_bytes(self) -> int:
        return shard_size_bytes(self.max_shard_size)


class ExportTask(Section):
    """A committed pretrain checkpoint (any step, not only the final one) -> an HF-format model."""

    kind: Literal["export"] = Field(description="'export': a pretrain checkpoint to an HF model.")
    run: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="The pretrain run whose checkpoints/ holds the step; default: the config's name.",
    )
    step: int | Literal["latest"] = Field(
        "latest", description="Checkpoint step to export (must be committed), or 'latest' for the newest."
    )
    output: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="Folder name under runs/<name>/export/; default: hf-step-<step>.",
    )
    dtype: DTYPE_CHOICES = Field(
        "auto",
        description="Weights dtype of the export; 'auto' is the pretrain run's export.dtype, "
        "float32 when that is auto too (checkpoints hold float32 weights).",
    )

    @field_validator("step")
    @classmethod
    def _step_not_negative(cls, step: int | str) -> int | str:
        if isinstance(step, int) and step < 0:
            raise ValueError("a checkpoint step is 0 or more; give a committed step or 'latest'")
        return step


class HubTask(Section):
    """An export folder pushed to a Hugging Face Hub model repo in one commit (convert/hub.py)."""

    kind: Literal["hub"] = Field(description="'hub': push an export folder to the Hugging Face Hub.")
    source: str = Field(
        pattern=NAME_PATTERN,
        description="The folder under runs/<name>/export/ to push (merged, mlx, adapter, hf, hf-step-<N>): "
        "one with the manifest.json the kit wrote, made by an earlier task of this config or by an earlier run.",
    )
    repo_id: str = Field(
        pattern=REPO_ID_PATTERN,
        max_length=REPO_ID_MAX_CHARS,
        description="The Hub model repo, as 'owner/name'; created when missing (HF_TOKEN needs write access).",
    )
    private: bool = Field(
        True,
        description="Create the repo private (the default, so that weights are not published by accident); "
        "a repo that exists keeps its visibility.",
    )
    revision: str = Field(
        "main",
        pattern=REVISION_PATTERN,
        max_length=200,
        description="The branch to commit to; created from main when missing.",
    )

    @field_validator("repo_id")
    @classmethod
    def _repo_id_as_the_hub_takes_it(cls, repo_id: str) -> str:
        if "--" in repo_id or ".." in repo_id or repo_id.endswith((".git", ".")):
            raise ValueError(
                "a Hub repo id has no '--' or '..' and does not end in '.' or '.git'; like 'someone/tiny-ft'"
            )
        return repo_id


Task = Annotated[MlxTask | MergeTask | ExportTask | HubTask, Field(discriminator="kind")]


class ConvertConfig(Section):
    """Conversions of one run's results; each output is written atomically with a manifest.json."""

    name: str = Field(
        pattern=NAME_PATTERN,
        description="Run name: outputs go to runs/<name>/export/<output>/ on the volume.",
    )
    adapter: str | None = Field(
        None,
        description="The PEFT adapter folder (adapter_model.safetensors, adapter_config.json): absolute, "
        f"relative to the volume root, or '{RUN_PREFIX}<run>' for runs/<run>/export/adapter; "
        f"default: '{RUN_PREFIX}<name>'. Only mlx and merge tasks read it.",
    )
    base_model: str | None = Field(
        None,
        description="The base model folder the adapter was trained on (absolute or relative to the volume "
        "root; a Hugging Face id is fetched into cache/); default: training_summary.json's base_model.",
    )
    task: list[Task] = Field(
        min_length=1,
        description="What to make, in order: one task or a list, each with kind mlx, merge, export or hub "
        "(a bare kind like 'mlx' is short for {kind: mlx}).",
    )

    @field_validator("task", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        items = value if isinstance(value, list) else [value]
        return [{"kind": item} if isinstance(item, str) else item for item in items]

    @field_validator("task")
    @classmethod
    def _outputs_distinct(cls, tasks: list[Any]) -> list[Any]:
        outputs = [getattr(t, "output", None) for t in tasks if getattr(t, "output", None)]
        repeated = sorted({o for o in outputs if outputs.count(o) > 1})
        if repeated:
            raise ValueError(
                f"two tasks write the same output folder {repeated}; give each task its own 'output'"
            )
        return tasks

    @field_validator("task")
    @classmethod
    def _pushes_distinct(cls, tasks: list[Any]) -> list[Any]:
        targets = [(t.repo_id, t.revision) for t in tasks if isinstance(t, HubTask)]
        repeated = sorted(
            {f"{repo}@{revision}" for repo, revision in targets if targets.count((repo, revision)) > 1}
        )
        if repeated:
            raise ValueError(
                f"two hub tasks push to the same repo and branch {repeated}, the second replacing the first; "
                "give each its own repo_id or revision"
            )
        return tasks

    @property
    def adapter_ref(self) -> str:
        return self.adapter or f"{RUN_PREFIX}{self.name}"
