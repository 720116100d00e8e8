"""Plain LoRA merged tensor by tensor, without building the model or injecting PEFT's layers.

For every adapted Linear weight this computes `W + (B @ A) * scale` in float32 (after the 4-bit
round trip for QLoRA's dequantized base), exactly the operations, in the same order and dtypes, of
peft's `LoraLayer.merge` (`get_delta_weight`, then `weight += delta`), so the result is the same as
`merge_and_unload()`, bit for bit; every other tensor is cast as it is. Each tensor is computed
straight into its place in the output shard's buffer, which is hashed and written while the next
tensors are computed; a tensor kept as it is (the embeddings, the output head, the norms) is read from
the base file straight into that place. Against peft's path (transformers builds the fp32 model, peft wraps every
target in a LoraLayer, merges, save_pretrained writes, the manifest reads the files back) this skips
the model construction, the adapter injection and one full read of the output.

Anything whose merge is more than that goes through peft itself (merge.merged_model): DoRA,
modules_to_save, trained biases, embedding or conv LoRA, unknown adapter settings, and bases whose
weights are tied, renamed on load or not all floating point. `reason_for_peft` says which applies.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from trainpod import tensorfile
from trainpod.convert.adapter import PeftAdapter, weight_files
from trainpod.convert.output import Staging
from trainpod.train.export import DTYPES

# adapter_config.json fields that do not change the merged weights once A and B are trained (the
# rank and alpha ones are read by PeftAdapter.scale as peft reads them).
_NEUTRAL = {
    "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "lora_dropout", "megatron_core", "qalora_group_size",
}  # fmt: skip
# Fields with a plain-LoRA value other than "unset"; every remaining field must be unset (None, false,
# empty), so a setting this module does not know sends the merge to peft instead of merging it wrongly.
_PLAIN = {"peft_type": {"LORA"}, "bias": {"none"}, "init_lora_weights": {True, False, "gaussian"}}


def skeleton(base_dir: Path) -> PreTrainedModel:
    """The base model's structure on the meta device: names, module types, ties, no weights (milliseconds)."""
    config = AutoConfig.from_pretrained(str(base_dir))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


_FLOATING = {"F64", "F32", "F16", "BF16"}  # safetensors' dtype names


def base_tensors(base_dir: Path) -> dict[str, tensorfile.StoredTensor]:
    """Every tensor of the base's weight files, from their headers."""
    found = {}
    for path in weight_files(base_dir):
        found.update(tensorfile.read_index(path))
    return found


def reason_for_peft(adapter: PeftAdapter, model: PreTrainedModel, base_dir: Path) -> str | None:
    """Why this merge needs peft's own path (None: the tensor-level merge is exact for it)."""
    for key, value in adapter.config.items():
        if key in _NEUTRAL or value in _PLAIN.get(key, ()) or (key not in _PLAIN and not value):
            continue
        return f"adapter_config.json sets {key}={value!r}"
    if adapter.other_tensors or any(m.magnitude is not None for m in adapter.modules.values()):
        return "the adapter holds tensors besides LoRA A/B"
    if getattr(model, "all_tied_weights_keys", None) or model._keys_to_ignore_on_save:
        return "the base model ties or drops weights when saved"
    stored = base_tensors(base_dir)
    if set(stored) != set(model.state_dict()):
        return "the base model's stored weight names differ from its modules' (renamed on load)"
    if any(tensor.dtype_name not in _FLOATING for tensor in stored.values()):
        return "the base model stores tensors that are not floating point"
    modules = dict(model.named_modules())
    for module in adapter.modules.values():
        if type(modules.get(module.name)) is not torch.nn.Linear or module.lora_a.ndim != 2:
            return f"{module.name} is not a plain Linear layer"
    return None


def write_merged(
    adapter: PeftAdapter,
    base_dir: Path,
    model: PreTrainedModel,
    staging: Staging,
    dtype: str,
    round_trip: Any | None,
    max_shard_size: int | str,
) -> None:
    """Write the merged weights and config.json/generation_config.json as save_pretrained would.

    `round_trip(weight_fp32) -> weight_fp32` is the 4-bit round trip applied to every Linear weight
    but the output head first (QLoRA's dequantized base), None for none.
    """
    stored = base_tensors(base_dir)
    target = DTYPES[dtype]
    shapes = {name: torch.empty(tensor.shape, dtype=target, device="meta") for name, tensor in stored.items()}
    split = split_torch_state_dict_into_shards(
        shapes, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    head = model.get_output_embeddings()
    round_tripped = set()
    if round_trip is not None:
        round_tripped = {
            f"{name}.weight"
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head
        }
    lora = {f"{m.name}.weight": m for m in adapter.modules.values()}
    staging.folder.mkdir(parents=True)
    with ExitStack() as stack:
        files = {
            path: stack.enter_context(open(path, "rb", buffering=0))  # noqa: SIM115 - closed by the stack
            for path in {tensor.path for tensor in stored.values()}
        }
        scratch = _Scratch()

        def fill(name: str, slot: torch.Tensor) -> None:
            source = stored[name]
            kept = name not in lora and name not in round_tripped
            if kept and source.dtype == slot.dtype:
                tensorfile.read_into(files[source.path].fileno(), source, slot)
                return
            weight = scratch.read(files[source.path].fileno(), source)
            if kept:
                slot.copy_(weight)
                return
            weight = weight.float()
            if name in round_tripped:
                weight = round_trip(weight)
            if name not in lora:
                slot.copy_(weight)
                return
            # peft: delta = (B @ A) * scaling; weight += delta. Computed in the float32 slot itself when the
            # output is float32 (delta + weight == weight + delta: IEEE addition commutes), else beside it.
            module = lora[name]
            merged = slot if slot.dtype == torch.float32 else torch.empty(slot.shape, dtype=torch.float32)
            torch.matmul(module.lora_b.float(), module.lora_a.float(), out=merged)
            merged.mul_(adapter.scale(module)).add_(weight)
            if merged is not slot:
                slot.copy_(merged)

        for shard, names in split.filename_to_tensors.items():
            specs = {name: (target, stored[name].shape) for name in names}
            staging.write_tensors(shard, tensorfile.layout(specs, {"format": "pt"}), fill)
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        staging.write_file(
            "model.safetensors.index.json", (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        )
    _write_configs(model, base_dir, staging.folder, dtype)


class _Scratch:
    """One buffer, grown to the largest tensor read through it, holding the base tensor being merged."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def read(self, fd: int, tensor: tensorfile.StoredTensor) -> torch.Tensor:
        if len(self._buffer) < tensor.nbytes:
            self._buffer = torch.empty(tensor.nbytes, dtype=torch.uint8)
        weight = self._buffer[: tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        tensorfile.read_into(fd, tensor, weight)
        return weight


def _write_configs(model: PreTrainedModel, base_dir: Path, folder: Path, dtype: str) -> None:
    """config.json and generation_config.json with what save_pretrained records (dtype, architectures)."""
    model.config.dtype = dtype
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    if model.can_generate():
        generation = model.generation_config
        if (base_dir / "generation_config.json").is_file():
            generation = GenerationConfig.from_pretrained(str(base_dir))
        generation.save_pretrained(folder)
