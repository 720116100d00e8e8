"""HF-format export: safetensors weights, config and tokenizer that transformers loads as they are."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel
from transformers.utils import logging as transformers_logging

from trainpod import atomic
from trainpod.card import MODEL_CARD
from trainpod.errors import InputError
from trainpod.preemption import WorkAbandoned

log = logging.getLogger(__name__)

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


EXPORT_FORMAT_FAMILY = "trainpod-export/"  # every version's: a hub task pushes any of them
EXPORT_FORMAT = f"{EXPORT_FORMAT_FAMILY}1"
MANIFEST = "manifest.json"


def write_export_manifest(tmp: Path, weights: dict[str, Any] | None = None) -> None:
    """The manifest.json of the finished export folder `tmp`, listing each file's size and sha256: `trainpod
    pull` checks the files by it, where RunPod's S3 ETags may be no MD5s (conversions' outputs carry the same
    in their manifests). Written before the rename into place, so that hashing a large export's files
    (minutes) can be abandoned while the rename cannot. `weights`: the step whose weights these are, and why
    (export.weights: Trainer.take_export_weights)."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {
        "format": EXPORT_FORMAT,
        "files": {
            str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": atomic.file_sha256(p)}
            for p in files
        },
        **({"weights": weights} if weights else {}),
        "created_unix": time.time(),
    }
    atomic.write_json(tmp / MANIFEST, manifest)


def carry_training_template(folder: Path, template_name: str | None) -> None:
    """Give the exported model in `folder` the chat template it was trained with (training_summary.json's
    data.template) and that template's end-of-turn token among generation_config.json's eos_token_id: a
    built-in one (sft.template chatml, qwen, llama3, alpaca) becomes its tokenizer's chat_template; the
    tokenizer's own (`tokenizer`) is there already. Plain text (None) leaves the folder as it is.

    Without them the base's tokenizer (Llama 2's, Mistral's: no chat_template, or its own of another
    format) and its generation config go out as they were: transformers' apply_chat_template fails or
    renders what the model never saw, and generate(), vLLM and mlx-lm run past the <|im_end|> or <|eot_id|>
    the model learned to end its answers with (a base Qwen2.5's eos_token_id is <|endoftext|> alone)."""
    if template_name is None:
        return
    from trainpod.sft.templates import build_template, own_template_turn_end

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if template_name in ("tokenizer", "auto"):
        try:
            turn_end = own_template_turn_end(tokenizer)
        except InputError:  # a template that renders no plain conversation: stops as the base did
            return
    else:
        template = build_template(template_name, tokenizer)
        tokenizer.chat_template = template.jinja()
        tokenizer.save_pretrained(folder)
        turn_end = tokenizer.convert_tokens_to_ids(template.turn_end)
    generation_file = folder / "generation_config.json"
    if not generation_file.is_file() or turn_end in (None, tokenizer.unk_token_id):
        return
    generation = json.loads(generation_file.read_text(encoding="utf-8"))
    eos = generation.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if turn_end not in eos:
        generation["eos_token_id"] = [*eos, turn_end]
        atomic.write_json(generation_file, generation)


def export_hf(
    model: PreTrainedModel,
    tokenizer_dir: Path,
    target: Path,
    dtype: torch.dtype,
    extra_json: dict[str, Any] | None = None,
    template_name: str | None = None,
    model_card: str | None = None,
    manifest: bool = True,
    weights: dict[str, Any] | None = None,
    abandoning: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    publishing: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Path:
    """Write `model`, its tokenizer (with the chat template `template_name` it was trained with:
    carry_training_template), `extra_json` files and its model card (README.md: trainpod/card.py) to `target`
    atomically (replacing an older export),
    with an export manifest naming the step of the weights (`weights`) unless the caller's own output manifest
    covers the folder (`manifest=False`: a conversion's, convert/output.py). Everything before the rename into
    place runs inside `abandoning()` (PreemptionWatch.abandoning: a stop ends it there, leaving the temp folder
    as a kill would), the rename inside `publishing()` (Lease.publishing: none once the run's lease was released
    at a stop)."""
    tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    transformers_logging.disable_progress_bar()  # a progress bar per shard clutters the run's log
    try:
        with abandoning():
            exported = model if dtype == next(model.parameters()).dtype else _copy_as(model, dtype)
            exported.save_pretrained(tmp, safe_serialization=True)
            write_top_level_rope(tmp / "config.json")
            AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(tmp)
            # A vision-language model's image processor travels with its tokenizer.
            for name in PROCESSOR_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    atomic.write_bytes(tmp / name, (Path(tokenizer_dir) / name).read_bytes())
            for name, content in (extra_json or {}).items():
                atomic.write_json(tmp / name, content)
            carry_training_template(tmp, template_name)
            if model_card is not None:  # before the manifest, which lists it: a hub task pushes what it lists
                atomic.write_text(tmp / MODEL_CARD, model_card)
            if manifest:
                write_export_manifest(tmp, weights)
        with publishing():
            atomic.replace_dir(tmp, target)  # a publish begun is never abandoned
    except WorkAbandoned:
        # Left for the next start (lifecycle._remove_leftovers): deleting gigabytes from a network volume could
        # take longer than the seconds left before the SIGKILL, and the run's lease is released after this.
        raise
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
