"""`trainpod run finetune-vlm`: QLoRA, LoRA or full finetuning of a vision-language model on images + text.

    TRAINPOD_CONFIG=configs/finetune/tiny-vlm.yaml TRAINPOD_VOLUME=./demo-volume trainpod run finetune-vlm

For the Qwen2-VL, Qwen2.5-VL and Qwen3-VL families (transformers' AutoModelForImageTextToText).
Everything the text finetune does (train/trainer.py's loop, commits, SIGTERM, budget, early
stopping, W&B/TensorBoard, per-sample eval losses, generation eval) is workloads/finetune.py's
Finetuner; this subclass changes only what images change:

- data: sft/vision.py (ids with expanded image tokens, pixels per batch, never packed);
- the model: the image-text-to-text class; for QLoRA the language model in 4 bit while the vision
  tower (and the projector) stay unquantized (bitsandbytes' llm_int8_skip_modules) in the compute
  dtype (bf16 on a GPU, fp32 on CPU); the vision tower is always frozen;
- LoRA on the language model's linear layers (and the projector's with lora.train_projector);
- the export carries the image processor beside the tokenizer, so the adapter folder (or the full
  model) loads with its processor.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from trainpod.config.finetune_vlm import VlmFinetuneConfig
from trainpod.context import RunContext
from trainpod.errors import InputError
from trainpod.sft.vision import (
    VisionBatches,
    VisionProcessor,
    is_complete,
    load_vision,
    prepare_vision,
    vision_batch,
    vision_key,
    vision_settings_key,
)
from trainpod.train.base_model import load_4bit, load_model, resolve_base_model
from trainpod.train.generation_eval import Prompt
from trainpod.train.trainer import train_and_export
from trainpod.volume import VLM_DATA_PIN, read_cache_pin, write_cache_pin
from trainpod.workloads.finetune import MODEL_INPUTS, Finetuner, answer_span

log = logging.getLogger(__name__)

VISION_TOWERS = ("visual", "vision_tower", "vision_model")  # Qwen-VL's name first; LLaVA-style models' after
PROJECTORS = ("merger", "deepstack_merger_list", "multi_modal_projector")  # inside or beside the tower
VISION_INPUTS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")


def disk_estimate(config: VlmFinetuneConfig) -> int | None:
    return None  # as for text: the base model's size is known once it is resolved


def preflight(ctx: RunContext, config: VlmFinetuneConfig) -> None:
    """Fail with exit 2 before anything is written: the base model must exist (rows are checked while
    preparing, which names each bad row's file, line and field)."""
    resolve_base_model(config.base_model, ctx.volume, download=False)
    patience = config.train.early_stopping_patience
    if patience and not config.data.val_ratio:  # early stopping with nothing to evaluate never stops
        raise InputError(
            f"train.early_stopping_patience={patience} needs a validation split, and data.val_ratio is 0; set "
            "data.val_ratio (0.02, say), or set early_stopping_patience to 0"
        )


def _under(name: str, parts: tuple[str, ...]) -> bool:
    return any(part in name.split(".") for part in parts)


def frozen_in_vlm_training(name: str, train_projector: bool) -> bool:
    """Whether finetune-vlm leaves the parameter (or module) `name` untrained: the vision tower, and the
    projector inside or beside it unless lora.train_projector (estimate.py counts by the same rule)."""
    return not train_projector if _under(name, PROJECTORS) else _under(name, VISION_TOWERS)


class EvalBatches(Sequence):
    """Eval batches made when read (a rank's share is a slice of them: `batches[rank::world_size]`)."""

    def __init__(self, make: Callable[[int], dict[str, torch.Tensor]], starts: range):
        self.make, self.starts = make, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return EvalBatches(self.make, self.starts[index])
        return self.make(self.starts[index])


class VlmFinetuner(Finetuner):
    model_inputs = (*MODEL_INPUTS, *VISION_INPUTS)

    # ------------------------------------------------------------------------------- setup
    def _setup_data(self) -> None:
        data_cfg, t = self.cfg.data, self.train_cfg
        self.processor = VisionProcessor(self.base_dir, data_cfg.min_pixels, data_cfg.max_pixels)
        folder = self._on_main_first(self._prepare_vision_cache)
        self.data = load_vision(folder)
        self.max_len = data_cfg.cutoff_len
        self.batches = VisionBatches(
            self.data.train,
            self.processor,
            micro_batch_size=t.micro_batch_size,
            max_len=self.max_len,
            seed=t.seed,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            pad_id=self.data.pad_id,
            grad_accum_steps=t.grad_accum_steps,
        )

    def _prepare_vision_cache(self) -> Path:
        """cache/vlm/<key> of data, keyed by the data files' contents; a resume takes the folder its first start
        pinned in runs/<run>/vlm_data.json while it is complete and of the same settings and processor, so it
        trains on the samples it started on though the files were edited or removed since (as a text finetune
        does with sft_data.json). Without the pin, a resume after an edit prepared the edited rows and went on
        at the same (epoch, step) of another sample list: no error, and not the run that began."""
        data_cfg, volume = self.cfg.data, self.ctx.volume
        pin = self.ctx.run.root / VLM_DATA_PIN
        settings_key = vision_settings_key(data_cfg, self.processor, self.base_dir, volume.root)
        pinned = read_cache_pin(pin)
        if pinned.get("settings_key") == settings_key:
            folder = volume.cache() / "vlm" / str(pinned.get("key"))
            if is_complete(folder):
                log.info("VLM data: %s, prepared at this run's first start (%s)", folder, pin.name)
                return folder
        folder = volume.cache() / "vlm" / vision_key(data_cfg, self.processor, self.base_dir, volume.root)
        prepare_vision(data_cfg, self.processor, self.base_dir, folder, volume.root, self.ctx.watch)
        if self.dist.is_main:
            write_cache_pin(pin, settings_key, folder.name)
        return folder

    @property
    def val_ratio_field(self) -> str:
        return f"data.val_ratio={self.cfg.data.val_ratio}"

    def _setup_model(self) -> None:
        super()._setup_model()
        if self.method == "qlora":
            self._keep_frozen_vision_in_compute_dtype()

    def _keep_frozen_vision_in_compute_dtype(self) -> None:
        """peft's prepare_model_for_kbit_training upcasts every unquantized weight to fp32 (for the stability
        of trained norms); the frozen vision tower trains nothing, so it goes back to the compute dtype: bf16
        on a GPU halves its memory (Qwen3-VL-2B's ~0.4 B tower and projector: 1.6 -> 0.8 GB). The model casts
        pixels to the tower's dtype and image features to the language model's."""
        for name, param in self.model.named_parameters():
            if _under(name, VISION_TOWERS) and not param.requires_grad:
                param.data = param.data.to(self.compute_dtype)

    def _load_4bit(self, attention: str) -> torch.nn.Module:
        cfg = self.cfg
        model = load_4bit(
            self.base_dir,
            cfg.base_model,
            cfg.quantization,
            self.compute_dtype,
            attention,
            self.dist.device,
            vision=True,
            # transformers 5 matches these from a name's start, as regexes: any depth (model.visual...)
            keep_modules=[rf"(?:.*\.)?{name}" for name in VISION_TOWERS + PROJECTORS],
        )
        self._check_vision_kept(model)
        return model

    def _check_vision_kept(self, model: torch.nn.Module) -> None:
        import bitsandbytes as bnb

        quantized = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
        wrong = [n for n in quantized if _under(n, VISION_TOWERS + PROJECTORS)]
        if wrong or not quantized:
            raise InputError(
                f"base_model {self.cfg.base_model.path!r}: 4-bit loading quantized {len(quantized)} layers, "
                f"{len(wrong)} of them in the vision tower (e.g. {wrong[:2]}); this model's vision tower is not "
                f"named one of {', '.join(VISION_TOWERS)}: use method lora, or report the model"
            )

    def _load_model(self, dtype: torch.dtype, attention: str) -> torch.nn.Module:
        return load_model(self.base_dir, self.cfg.base_model, dtype, attention, self.dist.device, vision=True)

    def _peft_config(self, model: torch.nn.Module):
        from trainpod.train.lora import peft_lora_config

        lora = self.cfg.lora.model_copy(update={"target_modules": self.lora_targets(model)})
        return peft_lora_config(lora)

    def lora_targets(self, model: torch.nn.Module) -> list[str]:
        """Full names of the linear layers LoRA adapts: the language model's (all, or those whose last name
        is in lora.target_modules), and the projector's with lora.train_projector; never the output head."""
        import bitsandbytes as bnb

        wanted = self.cfg.lora.target_modules
        linear = (torch.nn.Linear, bnb.nn.Linear4bit)
        names, language_layers = [], set()
        for name, module in model.named_modules():
            if not isinstance(module, linear) or name.split(".")[-1] == "lm_head":
                continue
            if frozen_in_vlm_training(name, self.cfg.lora.train_projector):
                continue
            # A trained projector is adapted whole; the language model's layers as lora.target_modules says.
            if not _under(name, PROJECTORS):
                language_layers.add(name.split(".")[-1])
            if _under(name, PROJECTORS) or wanted == "all-linear" or name.split(".")[-1] in wanted:
                names.append(name)
        # A listed name that is none of them (a typo, the frozen tower's qkv) was dropped without a word.
        unmatched = [] if wanted == "all-linear" else [w for w in wanted if w not in language_layers]
        if unmatched or not names:
            raise InputError(
                f"lora.target_modules={wanted!r}: {', '.join(unmatched) or wanted} names no linear layer of the "
                f"language model, whose layers are: {', '.join(sorted(language_layers))}; pick from those, or use "
                "all-linear"
            )
        return names

    def _freeze_for_full(self, model: torch.nn.Module) -> None:
        """A full finetune trains the language model (and the projector with lora.train_projector)."""
        for name, param in model.named_parameters():
            if frozen_in_vlm_training(name, self.cfg.lora.train_projector):
                param.requires_grad_(False)

    def _check_positions(self, model: torch.nn.Module) -> None:
        text = getattr(model.config, "text_config", model.config)
        positions = getattr(text, "max_position_embeddings", None)
        if positions and self.max_len > positions:
            log.warning("cutoff_len %d exceeds the model's %d positions", self.max_len, positions)

    # ------------------------------------------------------------------------------- eval
    def _eval_batches(self) -> EvalBatches:
        """The validation split's batches, each made (its images decoded) when the eval reaches it: made all
        at once, a split of pages held gigabytes of pixels and took its decoding before the first stop check."""
        t = self.train_cfg
        starts = range(0, len(self.data.val), t.micro_batch_size)
        if t.eval_batches is not None:
            starts = starts[: t.eval_batches]
        return EvalBatches(self._eval_batch, starts)

    def _eval_batch(self, start: int) -> dict[str, torch.Tensor]:
        val = self.data.val
        indices = list(range(start, min(start + self.train_cfg.micro_batch_size, len(val))))
        batch = vision_batch(val, indices, self.max_len, self.data.pad_id, self.processor)
        batch["sample_index"] = torch.tensor(indices)
        return batch

    def generation_prompts(self, limit: int) -> list[Prompt]:
        """The first `limit` validation samples up to their first answer, with their images."""
        val, prompts = self.data.val, []
        for index in range(min(limit, len(val))):
            example = val[index]
            start, end = answer_span(example.labels)
            batch = vision_batch(val, [index], self.max_len, self.data.pad_id, self.processor)
            if int(batch["mm_token_type_ids"][0, start:].sum()):
                continue  # an image after the first answer: the prompt alone cannot hold its pixels
            inputs = {k: v[:, :start] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
                      for k, v in batch.items() if k in self.model_inputs and k != "labels"}  # fmt: skip
            prompts.append(
                Prompt(
                    inputs,
                    self._shown_prompt(example.input_ids[:start].tolist()),
                    self.tokenizer.decode(
                        example.input_ids[start:end].tolist(), skip_special_tokens=True
                    ).strip(),
                    index,
                    list(val.images[index]),
                    example.input_ids[start:end].tolist(),
                )
            )
        return prompts

    def _shown_prompt(self, ids: list[int]) -> str:
        """The prompt decoded, each image's run of pad tokens shown once with its count (a page is ~1,000)."""
        token = self.processor.image_token
        text = self.tokenizer.decode(ids)
        return re.sub(f"(?:{re.escape(token)})+", lambda m: f"{token}x{len(m[0]) // len(token)}", text)

    # ----------------------------------------------------------------------------- export
    def save_processor(self, folder: Path) -> None:
        self.tokenizer.save_pretrained(str(folder))
        self.processor.image_processor.save_pretrained(str(folder))

    def processor_json(self) -> dict[str, Any]:
        """The image processor with data.min_pixels/max_pixels, over the base model's copy: loaded from the
        export, it resizes images as training did."""
        return {"preprocessor_config.json": json.loads(self.processor.image_processor.to_json_string())}

    def training_summary(self) -> dict[str, Any]:
        summary = super().training_summary()
        summary["data"] |= {
            "packing": False,
            "images": self.data.manifest["counts"]["images"],
            "vision": True,
        }
        summary["vision"] = {
            "frozen": list(VISION_TOWERS),
            "projector_trained": self.cfg.lora.train_projector,
            "kept_unquantized": list(VISION_TOWERS + PROJECTORS) if self.method == "qlora" else None,
        }
        return summary


def run(ctx: RunContext, config: VlmFinetuneConfig) -> dict[str, Any]:
    """Train to the configured steps (or an eval plateau), export, and return the summary."""
    return train_and_export(VlmFinetuner, ctx, config)
