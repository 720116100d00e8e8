"""HF-format export: safetensors weights, config and tokenizer that transformers loads as they are."""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel
from transformers.utils import logging as transformers_logging

from trainpod import atomic

log = logging.getLogger(__name__)

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_hf(
    model: PreTrainedModel,
    tokenizer_dir: Path,
    target: Path,
    dtype: torch.dtype,
    extra_json: dict[str, Any] | None = None,
) -> Path:
    """Write `model`, its tokenizer and `extra_json` files to `target` atomically (replacing an older export)."""
    tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    transformers_logging.disable_progress_bar()  # a progress bar per shard clutters the run's log
    try:
        exported = model if dtype == next(model.parameters()).dtype else _copy_as(model, dtype)
        exported.save_pretrained(tmp, safe_serialization=True)
        write_top_level_rope(tmp / "config.json")
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(tmp)
        for name in PROCESSOR_FILES:  # a vision-language model's image processor travels with its tokenizer
            if (Path(tokenizer_dir) / name).is_file():
                atomic.write_bytes(tmp / name, (Path(tokenizer_dir) / name).read_bytes())
        for name, content in (extra_json or {}).items():
            atomic.write_json(tmp / name, content)
        atomic.replace_dir(tmp, target)
    except BaseException:  # on a full volume the space comes back at once, not at the next start
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported the model in HF format to %s", target)
    return target


# transformers 5 writes a model's RoPE settings only as `rope_parameters`; other readers of the folder
# (mlx-lm's llama, qwen2, mistral...; llama.cpp's converter) read `rope_theta` and `rope_scaling` from
# the top level and, without them, silently build the model with their own defaults (mlx-lm's qwen2 a
# base of 1e6, its llama 10000 and no scaling). transformers reads a config carrying both forms.
_ROPE_KEYS_OUTSIDE = ("partial_rotary_factor",)


def write_top_level_rope(config_file: Path) -> None:
    """Give config.json (and its text_config) the top-level RoPE keys its `rope_parameters` imply."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    changed = False
    for section in (config, config.get("text_config")):
        parameters = section.get("rope_parameters") if isinstance(section, dict) else None
        if not isinstance(parameters, dict) or "rope_theta" not in parameters:
            continue  # nested per-layer-type parameters (Gemma 3) and the like: left as transformers wrote them
        legacy = {"rope_theta": parameters["rope_theta"]}
        if parameters.get("rope_type", "default") != "default":
            legacy["rope_scaling"] = {
                k: v for k, v in parameters.items() if k not in ("rope_theta", *_ROPE_KEYS_OUTSIDE)
            }
        legacy.update({k: parameters[k] for k in _ROPE_KEYS_OUTSIDE if k in parameters})
        for key, value in legacy.items():
            if section.get(key) is None:
                section[key] = value
                changed = True
    if changed:
        atomic.write_json(config_file, config)


def _copy_as(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    import copy

    return copy.deepcopy(model).to(dtype)
