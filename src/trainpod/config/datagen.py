"""The datagen workload's config: where documents come from, the tokenizer, and how shards are cut.

TRAINPOD_CONFIG=configs/datagen/tiny.yaml trainpod run datagen
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainpod.config.loader import Section, without_settings_added_later

BUILTIN_TINY_STORIES = "builtin:tiny-stories"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
# llm.c's header stores the token count as int32 (data_common.py asserts len(toks) < 2**31).
MAX_SHARD_TOKENS = 2**31 - 1
# Output settings added since the first datasets were made (trainpod 0.1.0), each with the value that
# gives the output of before it existed (without_settings_added_later). A new field of DatagenConfig,
# TokenizerSettings or SourceConfig that shards or the tokenizer depend on goes here; tests/test_datagen.py
# pins the hash of today's settings so that one left out fails there.
SETTINGS_ADDED_LATER: dict[tuple[str, ...], object] = {}


class TokenizerSettings(Section):
    """Train a byte-level BPE on the sources, or reuse an existing tokenizer folder as it is."""

    name: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="Folder name under $TRAINPOD_VOLUME/tokenizers/ to train into or reuse; "
        "default: the dataset's name.",
    )
    path: str | None = Field(
        None,
        description="An existing tokenizer folder (holding tokenizer.json) to use instead of training one: "
        "absolute, or relative to the volume root.",
    )
    vocab_size: int = Field(
        32768,
        ge=260,
        le=2**32,
        description="Vocabulary size of the trained BPE, special token included (at least 256 bytes + 4).",
    )
    min_frequency: int = Field(2, ge=1, description="A pair must occur this often to be merged.")
    max_train_documents: int = Field(
        200_000,
        ge=1,
        description="Train the BPE on at most this many documents from the start of the sources.",
    )
    eot_token: str = Field(
        "<|endoftext|>",
        min_length=1,
        description="End-of-text token put before every document; also bos/eos.",
    )


class SourceConfig(Section):
    """One input: local files (a path, folder or glob), a Hugging Face dataset, or the builtin corpus."""

    path: str | None = Field(
        None,
        description="A file, folder or glob of .txt/.jsonl/.parquet files (optionally .gz): absolute, or "
        f"relative to the volume root; or '{BUILTIN_TINY_STORIES}' for the embedded demo corpus.",
    )
    hf: str | None = Field(
        None,
        description="A Hugging Face dataset name, streamed with `datasets` at the commit its repository is at "
        "when the dataset is begun (every resume reads that commit).",
    )
    hf_config: str | None = Field(None, description="The Hugging Face dataset's config (subset) name.")
    hf_split: str = Field("train", min_length=1, description="The Hugging Face dataset's split.")
    format: Literal["auto", "text", "jsonl", "parquet"] = Field(
        "auto",
        description="File format; 'auto' picks it from the suffix (.txt, .jsonl, .parquet, each +.gz).",
    )
    text_field: str = Field("text", min_length=1, description="The column or JSON key holding the text.")
    separator: Literal["blank_line", "line", "file"] = Field(
        "blank_line",
        description="How a text file splits into documents: at blank lines, one per line, or one per file.",
    )

    @model_validator(mode="after")
    def _one_origin(self) -> SourceConfig:
        if (self.path is None) == (self.hf is None):
            raise ValueError(
                f"sources entry has path={self.path!r} and hf={self.hf!r}; give exactly one of them "
                "(path: local files or a glob; hf: a Hugging Face dataset name)"
            )
        return self

    def describe(self) -> str:
        if self.hf is not None:
            return f"hf:{self.hf}" + (f"/{self.hf_config}" if self.hf_config else "") + f"[{self.hf_split}]"
        return str(self.path)


class DatagenConfig(Section):
    """Documents -> tokenizer -> llm.c-format token shards in $TRAINPOD_VOLUME/datasets/<name>/."""

    kind: Literal["tokens"] = Field(
        "tokens",
        description="What datagen makes: 'tokens' (token shards), 'sft' (SFT samples) or 'generator' (your "
        "generator's records).",
    )
    name: str = Field(pattern=NAME_PATTERN, description="Dataset name: shards go to datasets/<name>/.")
    tokenizer: TokenizerSettings = TokenizerSettings()
    sources: list[SourceConfig] = Field(min_length=1, description="Inputs, read in this order.")
    mode: Literal["smoke", "full", "split"] = Field(
        "split",
        description="'full': every document into train; 'split': every document, a val_ratio share into "
        "val; 'smoke': the first smoke_documents documents, split like 'split' when val_ratio > 0.",
    )
    smoke_documents: int = Field(1000, ge=1, description="Documents read in smoke mode.")
    val_ratio: float = Field(
        0.005,
        ge=0,
        lt=1,
        description="Share of documents that go to val "
        "(chosen by a hash of the document index); above 0 in split mode.",
    )
    shard_tokens: int = Field(
        100_000_000,
        ge=1,
        le=MAX_SHARD_TOKENS,
        description="Tokens per shard (the last one per split holds the rest).",
    )
    workers: int | None = Field(
        None,
        ge=1,
        description="Encoders: threads of the main process, worker processes beyond 4; default: the CPU count.",
    )
    batch_documents: int = Field(
        1000,
        ge=1,
        description="Documents per batch sent to an encoder (tuning only: shards do not depend on it).",
    )

    @model_validator(mode="after")
    def _split_needs_ratio(self) -> DatagenConfig:
        if self.mode == "split" and self.val_ratio <= 0:
            raise ValueError(
                f"mode='split' with val_ratio={self.val_ratio} puts nothing in val; "
                "set val_ratio above 0 (e.g. 0.005) or use mode='full'"
            )
        return self

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name or self.name

    @property
    def splits(self) -> tuple[str, ...]:
        if self.mode == "full" or self.val_ratio == 0:
            return ("train",)
        return ("train", "val")

    def output_settings(self) -> dict:
        """The settings the shards depend on (tuning knobs left out), hashed to recognise a dataset.

        A setting added after datasets were first made (SETTINGS_ADDED_LATER) counts only when it is set to
        something else than its value of before: a kit upgrade that adds one must leave the hash of a half-made
        dataset (and its tokenizer's training record) as it was, or its resume is refused.
        """
        settings = self.model_dump(mode="json", exclude={"kind", "workers", "batch_documents"})
        return without_settings_added_later(settings, SETTINGS_ADDED_LATER)
