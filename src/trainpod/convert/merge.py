"""Adapter + base model -> one merged HF model, merged in float32 and cast afterwards.

Plain LoRA (rsLoRA, rank/alpha patterns included) is merged tensor by tensor with peft's own
arithmetic (tensor_merge); everything else goes through peft's `PeftModel.merge_and_unload`, so
whatever peft can load merges correctly: DoRA, modules_to_save, trained biases, embedding LoRA.

For a QLoRA adapter the base can first be replaced by what training saw: every Linear layer that
transformers quantizes (all but the output head) quantized to 4 bits with bitsandbytes and
dequantized again, from the dtype the weights were loaded in, with the same block size, quant type
and double quantization.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from trainpod.card import MODEL_CARD, merged_model_card
from trainpod.convert import tensor_merge
from trainpod.convert.adapter import (
    TRAINING_SUMMARY,
    PeftAdapter,
    base_weight_shapes,
    vision_module_shapes,
)
from trainpod.convert.output import Staging
from trainpod.diskspace import check_room
from trainpod.errors import InputError
from trainpod.train.export import DTYPES, PROCESSOR_FILES, carry_training_template, write_top_level_rope

log = logging.getLogger(__name__)

BNB_DEFAULT_BLOCKSIZE = 64  # bitsandbytes' 4-bit block size, which transformers' loader uses


# init_lora_weights values whose change to the base (PEFT subtracts the initial adapter from it) PEFT cannot
# make again when it loads the adapter: randomized SVD (PiSSA's fast variant), or data the training had
# (CorDA's covariances, LoRA-GA's gradients; LoRA-GA falls back to a plain init and leaves the base as it is).
_UNREPEATABLE_INITS = ("pissa_niter_", "corda", "lora_ga")


def refusals(adapter: PeftAdapter, base_dir: Path) -> list[str]:
    """Why this adapter cannot be merged into its original base and give the trained model (empty: it can)."""
    problems = []
    init = adapter.config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_UNREPEATABLE_INITS):
        problems.append(
            f"init_lora_weights={init!r}: PEFT changed the base weights when it created this adapter, in a way "
            "that cannot be repeated here, so a merge into the original base would give other weights than the "
            "trained model's. Save the adapter as a plain LoRA with PEFT (save_pretrained(..., "
            "path_initial_model_for_weight_conversion=<the adapter saved before training>)) and merge that"
        )
    if adapter.config.get("lora_bias"):
        # peft merges lora_B's bias into the base layer's and raises (after the whole model is built) for a
        # layer without one: a model of the base's architecture has nowhere to put it.
        shapes = (
            vision_module_shapes(base_dir)
            if vision_settings(adapter.summary)
            else base_weight_shapes(base_dir)
        )
        lacking = [m.name for m in adapter.modules.values() if f"{m.name}.bias" not in shapes]
        if lacking:
            more = f" and {len(lacking) - 1} more" if len(lacking) > 1 else ""
            problems.append(
                f"lora_bias=True trained a bias for {lacking[0]}{more}, a layer the base model has no bias for, "
                "so a merged model of the base's architecture cannot hold it; load the adapter with PEFT on the "
                "base instead of merging it"
            )
    return problems


def base_dtype(base_dir_config: dict[str, Any]) -> str:
    recorded = base_dir_config.get("dtype") or base_dir_config.get("torch_dtype") or "float32"
    return recorded if recorded in DTYPES else "float32"


def nf4_roundtrip(
    model: torch.nn.Module, quantization: dict[str, Any], kept: Sequence[str] = ()
) -> list[str]:
    """Replace the quantizable Linear weights by quantize_4bit -> dequantize_4bit of themselves.

    `kept`: module names training left unquantized (a VLM's vision tower and projector), at any depth.
    Returns the names of the modules changed.
    """
    round_trip = nf4_round_trip(quantization)
    head = model.get_output_embeddings()
    changed = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or module is head:
                continue
            if any(part in kept for part in name.split(".")):
                continue
            module.weight.data = round_trip(module.weight.data)
            changed.append(name)
    return changed


def nf4_round_trip(quantization: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """weight -> the weight quantized to 4 bits from the training's load dtype and dequantized, as its dtype."""
    import bitsandbytes.functional as bnb

    load_dtype = quantization.get("load_dtype") or quantization.get("compute_dtype") or "bfloat16"
    if load_dtype not in DTYPES:
        raise InputError(
            f"training_summary.json: quantization load/compute dtype {load_dtype!r} is not one of "
            f"{', '.join(DTYPES)}; fix the summary or merge with qlora_base: original"
        )

    def round_trip(weight: torch.Tensor) -> torch.Tensor:
        packed, state = bnb.quantize_4bit(
            weight.to(DTYPES[load_dtype]),
            blocksize=int(quantization.get("blocksize") or BNB_DEFAULT_BLOCKSIZE),
            compress_statistics=bool(quantization.get("double_quant", False)),
            quant_type=quantization.get("quant_type", "nf4"),
        )
        return bnb.dequantize_4bit(packed, state).to(weight.dtype)

    return round_trip


def check_base_buildable(base_dir: Path, vision: bool) -> None:
    """Exit 2 before anything is written when transformers cannot build the base model from its config.json
    (a model type this transformers does not know, or one that needs the model's own Python code, which a
    merge does not run): the merge builds it, and failed there with a ValueError (exit 1, retried)."""
    import transformers
    from transformers import AutoConfig, AutoModelForImageTextToText

    auto_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    try:
        config = AutoConfig.from_pretrained(str(base_dir), trust_remote_code=False)
        with torch.device("meta"):
            auto_class.from_config(config)
    except (ValueError, KeyError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"base model {base_dir}: transformers {transformers.__version__} cannot build it as "
            f"{auto_class.__name__} ({reason}). A merge builds the base with transformers and does not run "
            "a model's own Python code (trust_remote_code); merge into a model type transformers has (a "
            "newer trainpod image for a newer architecture), or convert with a `kind: mlx` task alone"
        ) from None


def load_base_fp32(base_dir: Path, vision: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    transformers_logging.disable_progress_bar()
    auto_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return auto_class.from_pretrained(str(base_dir), dtype=torch.float32)


def vision_settings(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a vision-language finetune recorded (training_summary.json's `vision`); None for text."""
    return (summary or {}).get("vision")


def merged_model(
    adapter_dir: Path,
    base_dir: Path,
    quantization: dict[str, Any] | None,
    qlora_base: str,
    vision: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """The base with the adapter folded in, in float32."""
    from peft import PeftModel

    model = load_base_fp32(base_dir, vision=vision is not None)
    if quantization is not None and qlora_base == "dequantized":
        changed = nf4_roundtrip(model, quantization, (vision or {}).get("kept_unquantized") or ())
        log.info("merging into the 4-bit round-tripped base (%d Linear layers), as trained", len(changed))
    untied = _untie_output_head(model)
    peft_model = PeftModel.from_pretrained(model, str(adapter_dir), torch_device="cpu")
    merged = peft_model.merge_and_unload()
    if untied:
        _retie_if_equal(merged)
    return merged


def _untie_output_head(model: torch.nn.Module) -> bool:
    """Give a tied output head its own copy of the embedding, so that a LoRA merged into one of the two
    (peft merges into the shared tensor) does not change the other. True when it was tied."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    head.weight = torch.nn.Parameter(embed.weight.detach().clone())
    return True


def _retie_if_equal(model: torch.nn.Module) -> None:
    """After _untie_output_head: tie the head to the embedding again when the merge left them equal
    (stored once, as in the base); else the config says they differ (peft sets that when their tensors
    differ), so that no loader (transformers, mlx-lm, llama.cpp) ties them."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = torch.equal(head.weight, embed.weight)
    if tied:
        head.weight = embed.weight
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = tied


def write_merged(
    adapter: PeftAdapter,
    base_dir: Path,
    staging: Staging,
    dtype: str,
    quantization: dict[str, Any] | None,
    qlora_base: str,
    max_shard_size: int | str,
    base_name: str,
    base_revision: str | None,
) -> None:
    """The merged model (weights, config, tokenizer, model card) into `staging.folder` (created here).
    `base_name`, `base_revision`: the base as the finetune named it, and the hub commit it trained on (a hub
    base only), for the model card.

    Plain LoRA is merged tensor by tensor (tensor_merge, the same arithmetic as peft's); the rest by peft.
    """
    tokenizer_source = next((d for d in (adapter.folder, base_dir) if _has_tokenizer(d)), None)
    if tokenizer_source is None:
        raise InputError(
            f"no tokenizer in the adapter folder {adapter.folder} or the base model {base_dir}, and a merged "
            "model must carry one; copy the tokenizer files (tokenizer.json, tokenizer_config.json) into "
            "the adapter folder"
        )
    # Beside an older output of the same name until the new one is whole (atomic.replace_dir): its room too.
    check_room(staging.folder.parent, merged_weight_bytes(base_dir, dtype), f"the merged model ({dtype})")
    dequantize = quantization is not None and qlora_base == "dequantized"
    vision = vision_settings(adapter.summary)
    # A VLM's hub checkpoint names its weights otherwise than its modules (transformers renames them on
    # load), and its skeleton is not a causal LM: peft merges it on the loaded model.
    why = (
        "a vision-language model"
        if vision
        else tensor_merge.reason_for_peft(adapter, tensor_merge.skeleton(base_dir), base_dir)
    )
    if why is None:
        skeleton = tensor_merge.skeleton(base_dir)
        round_trip = nf4_round_trip(quantization) if dequantize else None
        tensor_merge.write_merged(adapter, base_dir, skeleton, staging, dtype, round_trip, max_shard_size)
    else:
        log.info("merging with peft's merge_and_unload: %s", why)
        write_merged_with_peft(
            adapter.folder, base_dir, staging.folder, dtype, quantization, qlora_base, max_shard_size, vision
        )
    write_top_level_rope(staging.folder / "config.json")  # what mlx-lm and llama.cpp read
    AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(staging.folder)
    for name in PROCESSOR_FILES:  # a VLM's image processor, so AutoProcessor loads the merged folder
        source = next((d / name for d in (adapter.folder, base_dir) if (d / name).is_file()), None)
        if source is not None:
            (staging.folder / name).write_bytes(source.read_bytes())
    # The chat template the adapter was trained with, and its end of turn as eos: an adapter exported before
    # its folder's tokenizer carried it has only the base's (none, for a base model's tokenizer).
    carry_training_template(staging.folder, ((adapter.summary or {}).get("data") or {}).get("template"))
    if adapter.summary is not None:
        # What the model was trained with (its chat template above all), beside it: `trainpod chat` reads it
        # there for a merge made under another run's name, whose run folder holds no finetune config; without
        # it a model finetuned on a template was prompted with plain text.
        summary = adapter.folder / TRAINING_SUMMARY
        staging.write_file(TRAINING_SUMMARY, summary.read_bytes())
    card = merged_model_card(adapter.summary, base_name, base_revision, dtype, dequantize, vision is not None)
    staging.write_file(MODEL_CARD, card.encode("utf-8"))


def merged_weight_bytes(base_dir: Path, dtype: str) -> int:
    """What the merged model's weights take: every tensor of the base, in the output's dtype."""
    return sum(math.prod(shape) for shape in base_weight_shapes(base_dir).values()) * DTYPES[dtype].itemsize


def write_merged_with_peft(
    adapter_dir: Path,
    base_dir: Path,
    folder: Path,
    dtype: str,
    quantization: dict[str, Any] | None,
    qlora_base: str,
    max_shard_size: int | str,
    vision: dict[str, Any] | None = None,
) -> None:
    """Weights and configs of the merged model by peft's merge_and_unload and save_pretrained."""
    merged = merged_model(adapter_dir, base_dir, quantization, qlora_base, vision).to(DTYPES[dtype])
    folder.mkdir(parents=True)
    merged.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
