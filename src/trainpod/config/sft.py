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
SETTINGS_ADDED_LATER: dict[tuple[str, ...], object] = {
    ("preference",): False,
    ("datasets", "*", "columns", "chosen"): None,
    ("datasets", "*", "columns", "rejected"): None,
}

BUILTIN_SFT_TINY = "builtin:sft-tiny"
BUILTIN_DPO_TINY = "builtin:dpo-tiny"  # the same instructions, each with a right and a wrong answer
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"

SftFormat = Literal["alpaca", "sharegpt", "messages", "text"]
SftTemplate = Literal["auto", "chatml", "qwen", "llama3", "alpaca"]

# Which column keys mean something for which format (LLaMA-Factory's dataset_info.json "columns"/"tags").
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "alpaca": ("prompt", "query", "response", "system", "history", "chosen", "rejected"),
    "sharegpt": (
        "messages",
        "system",
        "role_tag",
        "content_tag",
        "user_tag",
        "assistant_tag",
        "system_tag",
        "chosen",
        "rejected",
    ),
    "text": ("text",),
}
FORMAT_COLUMNS["messages"] = FORMAT_COLUMNS["sharegpt"]

# Columns of preference data alone (preference: true): the two answers to the row's prompt.
PREFERENCE_COLUMNS = ("chosen", "rejected")

# The defaults per format: LLaMA-Factory's for alpaca and sharegpt, OpenAI's for messages; chosen and
# rejected are the names of LLaMA-Factory's ranking datasets and of TRL's preference datasets.
DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "alpaca": {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "system": "system",
        "history": "history",
        "chosen": "chosen",
        "rejected": "rejected",
    },
    "sharegpt": {
        "messages": "conversations",
        "system": "system",
        "role_tag": "from",
        "content_tag": "value",
        "user_tag": "human",
        "assistant_tag": "gpt",
        "system_tag": "system",
        "chosen": "chosen",
        "rejected": "rejected",
    },
    "messages": {
        "messages": "messages",
        "system": "system",
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        "system_tag": "system",
        "chosen": "chosen",
        "rejected": "rejected",
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
    chosen: str | None = Field(
        None,
        min_length=1,
        description="preference data: the preferred answer (alpaca: a string; sharegpt/messages: a string, "
        "one assistant turn or a list of one; or, in chosen and rejected both, the whole conversation, whose turns "
        "before the answer the two share: the prompt, TRL's implicit prompt).",
    )
    rejected: str | None = Field(
        None,
        min_length=1,
        description="preference data: the dispreferred answer, in the same form as chosen.",
    )


class SftSourceConfig(Section):
    """One dataset: files in one format, with its own column names."""

    path: str = Field(
        min_length=1,
        description="A .json/.jsonl/.parquet file (optionally .gz), a folder or a glob: absolute, or relative "
        f"to the volume root; or '{BUILTIN_SFT_TINY}' for the embedded demo instructions ('{BUILTIN_DPO_TINY}': "
        "the same with a chosen and a rejected answer, for preference: true).",
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
        description="Share of samples held out for validation, chosen by a hash of the index (of the row: a "
        "preference pair's two samples stay together).",
    )
    train_on_prompt: bool = Field(
        False, description="Also train on system/user tokens (default: only the assistant answers)."
    )
    seed: int = Field(0, ge=0, description="Seed of the validation choice.")
    preference: bool = Field(
        False,
        description="Each row holds a prompt with a chosen and a rejected answer: the data of objective dpo, "
        "orpo and simpo; each answer is "
        "stored as a sample of its own, chosen then rejected, and only the answer is trained.",
    )

    @model_validator(mode="after")
    def _preference_fits(self) -> SftDataConfig:
        if self.preference:
            self._refuse_with_preference()
            return self
        for source in self.datasets:
            given = [key for key in PREFERENCE_COLUMNS if getattr(source.columns, key) is not None]
            if given:
                raise ValueError(
                    f"datasets entry {source.path!r}: columns {', '.join(given)} mean something for preference "
                    "data only; set preference: true (each row a prompt with a chosen and a rejected answer), "
                    "or remove them"
                )
            if source.path == BUILTIN_DPO_TINY:
                raise ValueError(
                    f"datasets entry {source.path!r} is preference data (a chosen and a rejected answer per "
                    f"row); set preference: true, or use {BUILTIN_SFT_TINY!r} for SFT"
                )
        return self

    def _refuse_with_preference(self) -> None:
        """What preference: true cannot go with: each refusal names the setting and its fix."""
        if self.packing:
            raise ValueError(
                "preference: true with packing: true: a preference pair is compared whole, and packing is for "
                "SFT; set packing: false"
            )
        if self.train_on_prompt:
            raise ValueError(
                "preference: true with train_on_prompt: true: preference data trains only the chosen and "
                "rejected answers (the prompt is the same in both); set train_on_prompt: false"
            )
        for source in self.datasets:
            if source.path == BUILTIN_SFT_TINY:
                raise ValueError(
                    f"datasets entry {source.path!r} holds one answer per row, no chosen and rejected; with "
                    f"preference: true use {BUILTIN_DPO_TINY!r}"
                )
            if source.format == "text":
                raise ValueError(
                    f"datasets entry {source.path!r} has format 'text', which holds no prompt and answers to "
                    "prefer; preference: true needs format alpaca, sharegpt or messages with chosen and rejected"
                )
            if source.format == "alpaca" and source.columns.response is not None:
                raise ValueError(
                    f"datasets entry {source.path!r}: columns response means nothing with preference: true "
                    "(the answers are the chosen and rejected columns); remove it, or map columns.chosen"
                )

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
