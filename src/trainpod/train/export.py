"""HF-format export: safetensors weights, config and tokenizer that transformers loads as they are."""

from __future__ import annotations

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


def _copy_as(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    import copy

    return copy.deepcopy(model).to(dtype)
