"""Config of supervised finetuning data: instruction/chat datasets, the chat template, cutoff, packing.

Shaped after LLaMA-Factory's dataset_info.json and axolotl's `datasets:` list, so a user of either
recognises it. `trainpod run datagen` picks `SftDatagenConfig` when the YAML has a top-level `sft:`:

    TRAINPOD_CONFIG=configs/datagen/sft-tiny.yaml TRAINPOD_VOLUME=./demo-volume trainpod run datagen
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainpod.config.loader import Section, without_settings_added_later

# Settings added since the first SFT datasets, with their value of before (config/loader.py,
# without_settings_added_later); tests/test_sft_data.py pins the key of today's settings.
SETTINGS_ADDED_LATER: dict[tuple[str, ...], object] = {}

BUILTIN_SFT_TINY = "builtin:sft-tiny"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"

SftFormat = Literal["alpaca", "sharegpt", "messages", "text"]
SftTemplate = Literal["auto", "chatml", "qwen", "llama3", "alpaca"]

# Which column keys mean something for which format (LLaMA-Factory's dataset_info.json "columns"/"tags").
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "alpaca": ("prompt", "query", "response", "system", "history"),
    "sharegpt": (
        "messages",
        "system",
        "role_tag",
        "content_tag",
        "user_tag",
        "assistant_tag",
        "system_tag",
    ),
    "text": ("text",),
}
FORMAT_COLUMNS["messages"] = FORMAT_COLUMNS["sharegpt"]

# The defaults per format: LLaMA-Factory's for alpaca and sharegpt, OpenAI's for messages.
DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "alpaca": {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "system": "system",
        "history": "history",
    },
    "sharegpt": {
        "messages": "conversations",
        "system": "system",
        "role_tag": "from",
        "content_tag": "value",
        "user_tag": "human",
        "assistant_tag": "gpt",
        "system_tag": "system",
    },
    "messages": {
        "messages": "messages",
        "system": "system",
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        "system_tag": "system",
    },
    "text": {"text": "text"},
}


class SftColumns(Section):
    """Column (JSON key) names of one dataset; unset ones take the format's default."""

    prompt: str | None = Field(None, min_length=1, description="alpaca: the instruction column.")
    query: str | None = Field(
        None, min_length=1, description="alpaca: the optional input column, appended to the instruction."
    )
    response: str | None = Field(None, min_length=1, description="alpaca: the answer column.")
    system: str | None = Field(
        None, min_length=1, description="alpaca/sharegpt/messages: a system prompt column."
    )
    history: str | None = Field(
        None, min_length=1, description="alpaca: earlier turns as a list of [instruction, answer] pairs."
    )
    messages: str | None = Field(
        None, min_length=1, description="sharegpt/messages: the column holding the list of turns."
    )
    text: str | None = Field(None, min_length=1, description="text: the column holding the document.")
    role_tag: str | None = Field(
        None, min_length=1, description="sharegpt/messages: the key of a turn's role."
    )
    content_tag: str | None = Field(
        None, min_length=1, description="sharegpt/messages: the key of a turn's text."
    )
    user_tag: str | None = Field(
        None, min_length=1, description="sharegpt/messages: the role value of the user."
    )
    assistant_tag: str | None = Field(
        None, min_length=1, description="sharegpt/messages: the role value of the assistant."
    )
    system_tag: str | None = Field(
        None, min_length=1, description="sharegpt/messages: the role value of a system turn."
    )


class SftSourceConfig(Section):
    """One dataset: files in one format, with its own column names."""

    path: str = Field(
        min_length=1,
        description="A .json/.jsonl/.parquet file (optionally .gz), a folder or a glob: absolute, or relative "
        f"to the volume root; or '{BUILTIN_SFT_TINY}' for the embedded demo instructions.",
    )
    format: SftFormat = Field(
        "alpaca",
        description="'alpaca' (instruction/input/output), 'sharegpt' (conversations of from/value), "
        "'messages' (OpenAI role/content turns) or 'text' (plain text, loss on every token).",
    )
    columns: SftColumns = Field(
        default_factory=SftColumns,
        description="Column names where they differ from the format's defaults (LLaMA-Factory's columns/tags).",
    )
    max_samples: int | None = Field(
        None, ge=1, description="Use only the first this many rows of this dataset."
    )

    @model_validator(mode="after")
    def _columns_fit_format(self) -> SftSourceConfig:
        given = {key for key, value in self.columns.model_dump().items() if value is not None}
        foreign = sorted(given - set(FORMAT_COLUMNS[self.format]))
        if foreign:
            raise ValueError(
                f"datasets entry {self.path!r}: columns {', '.join(foreign)} mean nothing for format "
                f"{self.format!r}; remove them, or use one of: {', '.join(FORMAT_COLUMNS[self.format])}"
            )
        return self

    def column(self, key: str) -> str:
        """The column name for `key` in this dataset (the user's, else the format's default)."""
        return getattr(self.columns, key) or DEFAULT_COLUMNS[self.format][key]


class SftDataConfig(Section):
    """Datasets -> chat-templated token ids with answer-only labels, cut at cutoff_len."""

    datasets: list[SftSourceConfig] = Field(min_length=1, description="Datasets, concatenated in this order.")
    template: SftTemplate = Field(
        "auto",
        description="'auto': the tokenizer's own chat_template (apply_chat_template), else chatml; or one of "
        "chatml, qwen, llama3, alpaca (LLaMA-Factory's templates of those names).",
    )
    cutoff_len: int = Field(
        2048, ge=8, description="Most tokens per sample; longer samples are cut (overflow)."
    )
    overflow: Literal["truncate", "drop"] = Field(
        "truncate",
        description="A sample over cutoff_len: 'truncate' shares the budget between prompt and answer turn by "
        "turn as LLaMA-Factory does; 'drop' leaves the sample out (counted in manifest.json).",
    )
    packing: bool = Field(
        False, description="Pack several samples per row (no attention across samples); read by the trainer."
    )
    val_ratio: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of samples held out for validation, chosen by a hash of the index.",
    )
    train_on_prompt: bool = Field(
        False, description="Also train on system/user tokens (default: only the assistant answers)."
    )
    seed: int = Field(0, ge=0, description="Seed of the validation choice.")

    def stored_settings(self) -> dict:
        """The settings the stored token ids depend on (packing happens at batch time, so it is not one)."""
        settings = self.model_dump(mode="json", exclude={"packing"})
        return without_settings_added_later(settings, SETTINGS_ADDED_LATER)


class SftDatagenConfig(Section):
    """`trainpod run datagen` for finetuning data: tokenized SFT samples in datasets/<name>/."""

    kind: Literal["sft"] = Field("sft", description="'sft': this datagen config makes SFT samples.")
    name: str = Field(pattern=NAME_PATTERN, description="Dataset name: the result goes to datasets/<name>/.")
    tokenizer: str = Field(
        min_length=1,
        description="A folder holding the tokenizer files (e.g. a model folder): absolute, or relative to the "
        "volume root, e.g. tokenizers/tiny-stories-1k.",
    )
    sft: SftDataConfig = Field(description="The datasets, the chat template and the cutoff.")
