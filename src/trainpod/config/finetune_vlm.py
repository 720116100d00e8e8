"""The finetune-vlm workload's config: a finetune config whose data are images with text.

    TRAINPOD_CONFIG=configs/finetune/tiny-vlm.yaml trainpod run finetune-vlm

Everything but `data` and `lora.train_projector` is the text finetune's (config/finetune.py). The
data formats are LLaMA-Factory's multimodal ones: OpenAI-style messages whose content lists image
parts, or messages/sharegpt turns with `<image>` placeholders and an `images` column; or a Hugging
Face dataset saved with `save_to_disk` whose images column holds `Image` features.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainpod.config.finetune import FinetuneConfig, LoraSettings
from trainpod.config.loader import Section

VisionFormat = Literal["messages", "sharegpt", "hf"]
DEFAULT_TURNS_COLUMN = {"messages": "messages", "sharegpt": "conversations", "hf": "messages"}


class VisionSourceConfig(Section):
    """One dataset of image + text conversations."""

    path: str = Field(
        min_length=1,
        description="A .json/.jsonl/.parquet file (optionally .gz), a folder or a glob; for format 'hf' a "
        "folder written by datasets' save_to_disk. Absolute, or relative to the volume root. Image paths in "
        "the rows are absolute, relative to the data file's folder, or relative to the volume root.",
    )
    format: VisionFormat = Field(
        "messages",
        description="'messages' (OpenAI role/content turns; content a string with <image> placeholders or a "
        "list of {type: image, image: path} and {type: text, text: ...} parts), 'sharegpt' (from/value turns "
        "with <image> placeholders), or 'hf' (a saved HF dataset with messages and an Image images column).",
    )
    turns_column: str | None = Field(
        None, min_length=1, description="Column of the turns; default: messages (conversations for sharegpt)."
    )
    images_column: str = Field(
        "images", min_length=1, description="Column listing the images of the <image> placeholders, in order."
    )
    max_samples: int | None = Field(None, ge=1, description="Use only the first this many rows.")

    @property
    def turns(self) -> str:
        return self.turns_column or DEFAULT_TURNS_COLUMN[self.format]


class VisionDataConfig(Section):
    """Conversations with images -> token ids (image tokens expanded), answer-only labels, image references."""

    datasets: list[VisionSourceConfig] = Field(
        min_length=1, description="Datasets, concatenated in this order."
    )
    cutoff_len: int = Field(
        2048,
        ge=8,
        description="Most tokens per sample, image tokens included; a longer sample is left out (cutting "
        "would split an image's tokens from its pixels) and counted.",
    )
    max_images: int = Field(
        4, ge=1, description="Most images per sample; a row with more is an error (exit 2) naming it."
    )
    min_pixels: int | None = Field(
        None, ge=1, description="Images smaller than this are upscaled; default: the processor's own."
    )
    max_pixels: int | None = Field(
        None,
        ge=1,
        description="Images larger than this are downscaled (fewer image tokens, less memory); default: the "
        "processor's own (Qwen2-VL: 12.8 M pixels, far more than an OCR line needs).",
    )
    val_ratio: float = Field(0.0, ge=0, lt=1, description="Share of samples held out for validation.")
    seed: int = Field(0, ge=0, description="Seed of the validation choice.")

    @model_validator(mode="after")
    def _pixel_range(self) -> VisionDataConfig:
        # Qwen-VL's smart_resize upscales an image under min_pixels before it looks at max_pixels: with min above
        # max, a small image came out larger than max_pixels, silently, in tokens and memory.
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(
                f"data.min_pixels={self.min_pixels} is above data.max_pixels={self.max_pixels}: no image size "
                "is within both; lower min_pixels or raise max_pixels"
            )
        return self

    @property
    def use_packing(self) -> bool:
        """Image rows are not packed: each sample's pixels travel with its own row."""
        return False


class VlmLoraSettings(LoraSettings):
    train_projector: bool = Field(
        False,
        description="Also put LoRA on the vision-language projector (the merger). The vision tower itself "
        "stays frozen in 16/32 bit.",
    )


class VlmFinetuneConfig(FinetuneConfig):
    data: VisionDataConfig  # type: ignore[assignment]
    objective: Literal["sft"] = Field(  # type: ignore[assignment]
        "sft", description="'sft': learn the answers (finetune-vlm has no preference objective)."
    )
    lora: VlmLoraSettings = VlmLoraSettings()
