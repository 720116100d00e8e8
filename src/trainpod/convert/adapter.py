"""A PEFT LoRA adapter folder as written by `PeftModel.save_pretrained`, and the checks against a base.

Key layout (peft 0.21): `base_model.model.<module>.lora_A.weight` (r, in), `...lora_B.weight` (out, r),
and with DoRA `...lora_magnitude_vector` (out,). Per-module rank and alpha follow peft's own
`rank_pattern`/`alpha_pattern` matching (peft.utils.other.get_pattern_key).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from peft.utils.other import get_pattern_key
from safetensors import SafetensorError, safe_open

from trainpod.errors import InputError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
TRAINING_SUMMARY = "training_summary.json"
PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(?:(?P<part>lora_A|lora_B)\.weight|(?P<magnitude>lora_magnitude_vector)(?:\.weight)?)$"
)
# Whole copies of a base weight that peft saves beside the LoRA tensors (modules_to_save, the embedding layers
# of a resized vocabulary or an embedding LoRA): <module>[.modules_to_save|.original_module|.base_layer].weight.
_COPY_KEY = re.compile(r"^(?P<module>.+?)(?:\.(?:modules_to_save|original_module|base_layer))?\.weight$")
_EMBEDDING_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<part>[AB])$")


@dataclass
class LoraModule:
    name: str  # the module's path in the base model, e.g. model.layers.0.self_attn.q_proj
    lora_a: torch.Tensor | None = None  # (r, in)
    lora_b: torch.Tensor | None = None  # (out, r)
    magnitude: torch.Tensor | None = None  # DoRA: (out,)

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    @property
    def weight_shape(self) -> tuple[int, int]:
        """The (out, in) shape of the base weight this module adapts."""
        return (self.lora_b.shape[0], self.lora_a.shape[1])


@dataclass
class PeftAdapter:
    folder: Path
    config: dict[str, Any]
    modules: dict[str, LoraModule]
    other_tensors: list[str] = field(default_factory=list)  # neither LoRA A/B nor a DoRA magnitude
    other_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # their shapes, by name
    summary: dict[str, Any] | None = None

    @property
    def uses_dora(self) -> bool:
        return bool(self.config.get("use_dora"))

    def scale(self, module: LoraModule) -> float:
        """lora_alpha / r for this module (alpha / sqrt(r) with rsLoRA), patterns resolved as peft does."""
        alpha_pattern = self.config.get("alpha_pattern") or {}
        alpha = alpha_pattern.get(
            get_pattern_key(list(alpha_pattern), module.name), self.config.get("lora_alpha", 8)
        )
        rank = module.rank
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank

    @property
    def default_scale(self) -> float:
        rank, alpha = self.config.get("r", 8), self.config.get("lora_alpha", 8)
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank

    @property
    def quantization(self) -> dict[str, Any] | None:
        """The 4-bit settings the adapter was trained with (QLoRA), from training_summary.json."""
        if not self.summary or self.summary.get("method") != "qlora":
            return None
        return self.summary.get("quantization") or None

    def files(self) -> dict[str, Path]:
        names = [ADAPTER_WEIGHTS, ADAPTER_CONFIG] + ([TRAINING_SUMMARY] if self.summary else [])
        return {f"adapter/{name}": self.folder / name for name in names}


def load_adapter(folder: Path) -> PeftAdapter:
    missing = [name for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG) if not (folder / name).is_file()]
    if missing:
        present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        raise InputError(
            f"no PEFT adapter at {folder}: {', '.join(missing)} missing (found: {present or 'nothing'}). "
            "Finish the finetune first (`trainpod run finetune`), or point `adapter` at a folder written by "
            "PeftModel.save_pretrained"
        )
    config = _read_json(folder / ADAPTER_CONFIG)
    summary = _read_json(folder / TRAINING_SUMMARY) if (folder / TRAINING_SUMMARY).is_file() else None
    modules: dict[str, LoraModule] = {}
    others: dict[str, tuple[int, ...]] = {}
    try:
        tensors = safetensors.torch.load_file(folder / ADAPTER_WEIGHTS)
    except SafetensorError as exc:
        raise _damaged(folder / ADAPTER_WEIGHTS, exc) from None
    for key, tensor in tensors.items():
        match = _LORA_KEY.match(key.removeprefix(PEFT_PREFIX))
        if not key.startswith(PEFT_PREFIX) or match is None:
            others[key] = tuple(tensor.shape)
            continue
        module = modules.setdefault(match["module"], LoraModule(match["module"]))
        if match["magnitude"]:
            module.magnitude = tensor
        elif match["part"] == "lora_A":
            module.lora_a = tensor
        else:
            module.lora_b = tensor
    broken = [m.name for m in modules.values() if m.lora_a is None or m.lora_b is None]
    if broken:
        raise InputError(
            f"{folder / ADAPTER_WEIGHTS}: module {broken[0]} has only one of lora_A/lora_B; the file is "
            "incomplete or not a LoRA adapter. Save it again with PeftModel.save_pretrained"
        )
    return PeftAdapter(folder, config, modules, list(others), others, summary)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} is not valid JSON ({exc}); write it again or fix it by hand") from None
    if not isinstance(value, dict):
        raise InputError(f"{path} holds a {type(value).__name__}, not a JSON object")
    return value


# ------------------------------------------------------------------------------------ the base model
def weight_files(base_dir: Path) -> list[Path]:
    """The safetensors files transformers loads from a model folder: model.safetensors, else the shards its
    index names. Other *.safetensors beside them are not the model's weights (Mistral's repos carry the
    same weights again as consolidated.safetensors, under other names)."""
    if (base_dir / "model.safetensors").is_file():
        return [base_dir / "model.safetensors"]
    index = base_dir / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(base_dir.glob("*.safetensors"))
    shards = sorted({base_dir / name for name in _read_json(index).get("weight_map", {}).values()})
    missing = [path.name for path in shards if not path.is_file()]
    if missing:
        raise InputError(
            f"base model {base_dir}: {index.name} names {', '.join(missing[:3])}, which the folder lacks; "
            "download or copy the model again"
        )
    return shards


def base_weight_shapes(base_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a HF safetensors model folder, read from the headers (no weights loaded)."""
    files = weight_files(base_dir)
    if not files:
        raise InputError(
            f"base model {base_dir} holds no *.safetensors weights; give `base_model` a folder written by "
            "save_pretrained(safe_serialization=True)"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(path, "pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open handles have keys(), not iteration
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except SafetensorError as exc:
            raise _damaged(path, exc) from None
    return shapes


def _damaged(path: Path, exc: Exception) -> InputError:
    """safetensors checks a file's header and length when it opens it: a file cut short by an interrupted
    copy fails there, which is a bad input (exit 2), not a crash."""
    return InputError(
        f"{path} is not a readable safetensors file ({exc}); it is truncated or damaged: copy or save it again"
    )


def base_config(base_dir: Path) -> dict[str, Any]:
    if not (base_dir / "config.json").is_file():
        raise InputError(f"base model {base_dir} has no config.json; it is not a transformers model folder")
    return _read_json(base_dir / "config.json")


def base_layer_count(config: dict[str, Any]) -> int | None:
    """The base's decoder layers from its config.json: num_hidden_layers, or the name its architecture gives
    it (GPT-J's and GPT-2's n_layer, MPT's n_layers), which transformers' attribute_map maps it to."""
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    known = model_type in CONFIG_MAPPING  # a lazy mapping, whose get() is dict's, which finds none of them
    attribute_map = CONFIG_MAPPING[model_type].attribute_map if known else {}
    names = ["num_hidden_layers", attribute_map.get("num_hidden_layers")]
    counts = [config.get(name) for name in names + ["n_layer", "n_layers", "num_layers"] if name]
    return next((count for count in counts if isinstance(count, int) and count > 0), None)


def vision_module_shapes(base_dir: Path) -> dict[str, tuple[int, ...]]:
    """A vision-language model's parameter shapes by module name, from its config on the meta device:
    its hub files name weights otherwise (model.layers.* for model.language_model.layers.*, renamed on load)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(base_dir))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_against_base(adapter: PeftAdapter, base_dir: Path) -> None:
    """Exit 2 naming the module and both shapes when the adapter was not trained on this base."""
    vision = bool((adapter.summary or {}).get("vision"))
    # The weight files are read for a VLM too: a damaged one is exit 2 here, not a crash in the merge.
    shapes = base_weight_shapes(base_dir)
    if vision:
        shapes = vision_module_shapes(base_dir)
    tied = base_config(base_dir).get("tie_word_embeddings", False)
    # GPT-2's Conv1D layers store their weight as (in, out); peft marks adapters of them fan_in_fan_out.
    layout = "(in, out)" if adapter.config.get("fan_in_fan_out") else "(out, in)"
    problems = []
    for module in adapter.modules.values():
        key = f"{module.name}.weight"
        if key not in shapes and tied and module.name.endswith("lm_head"):
            key = key.replace("lm_head", "model.embed_tokens")  # tied heads are stored once, as the embedding
        expected = module.weight_shape if layout == "(out, in)" else module.weight_shape[::-1]
        if key not in shapes:
            problems.append(
                f"module {module.name}: the adapter adapts a weight of shape {expected} {layout}, "
                f"the base model has no {module.name}.weight"
            )
        elif tuple(shapes[key][:2]) != expected:
            problems.append(
                f"module {module.name}: the adapter expects weight shape {expected} {layout}, "
                f"the base model's is {shapes[key]}"
            )
    copies, vocabularies = _copies_against_base(adapter, shapes, tied)
    problems += copies
    if problems:
        _refuse_a_quantized_base(base_dir)  # its packed weights are why the shapes differ
        shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
        base_vocabulary = _vocab_size(base_config(base_dir))
        resized = sorted(v for v in vocabularies if v != base_vocabulary) if base_vocabulary else []
        fix = (
            f"The adapter was trained with the base's vocabulary resized from {base_vocabulary} to {resized[0]} "
            f"tokens (tokens added to the tokenizer, model.resize_token_embeddings({resized[0]})): point "
            "`base_model` at the resized model it was trained on (saved with save_pretrained)"
            if len(resized) == 1
            else "Point `base_model` at the model the adapter was trained on (training_summary.json's "
            "base_model names it)"
        )
        raise InputError(
            f"the adapter {adapter.folder} does not fit the base model {base_dir}:\n  - "
            + "\n  - ".join(shown)
            + "\n"
            + fix
        )


def _refuse_a_quantized_base(base_dir: Path) -> None:
    """A base saved quantized (a hub org/<model>-bnb-4bit, a common QLoRA base) whose packed weights (bitsandbytes'
    uint8 of shape (n, 1)) do not fit the adapter's shapes: each module was refused for its shape, with 'point
    base_model at the model the adapter was trained on', which it was. Both a merge and mlx-lm need the 16-bit
    base. (One whose adapted weights keep their shapes, gpt-oss's MXFP4 experts beside 16-bit attention, is
    not refused here: mlx-lm loads it.)"""
    from trainpod.train.base_model import stored_quantization

    quantization = stored_quantization(base_dir)
    if quantization is None:
        return
    raise InputError(
        f"base model {base_dir} is stored quantized ({quantization}, config.json's quantization_config): an adapter "
        "can be neither merged into packed weights nor loaded on them by mlx-lm. Set base_model to the 16-bit "
        "model it was quantized from (on the hub, the same name without a suffix like -bnb-4bit); a QLoRA "
        "adapter's merge rounds that one to 4 bits with the settings training_summary.json records "
        "(qlora_base: dequantized)"
    )


def _copies_against_base(
    adapter: PeftAdapter, shapes: dict[str, tuple[int, ...]], tied: bool
) -> tuple[list[str], set[int]]:
    """The whole weight copies (modules_to_save, saved embedding layers) and embedding LoRA tensors that do not
    fit the base's weights, and the vocabulary sizes those of the embedding or head imply: peft's load into
    the base raised 'size mismatch' in the merge, a traceback and exit 1."""
    problems, vocabularies = [], set()
    for name, shape in adapter.other_shapes.items():
        key = name.removeprefix(PEFT_PREFIX)
        copy, lora = _COPY_KEY.match(key), _EMBEDDING_LORA_KEY.match(key)
        if not name.startswith(PEFT_PREFIX) or (copy is None and lora is None):
            continue
        module = (copy or lora)["module"]
        weight = f"{module}.weight"
        if weight not in shapes and tied and module.endswith("lm_head"):
            weight = weight.replace("lm_head", "model.embed_tokens")
        if weight not in shapes:
            continue  # peft says what it cannot place
        base = shapes[weight]
        if copy is not None:  # the weight itself
            fits, rows, rest_fits = shape == base, shape[0], shape[1:] == base[1:]
        elif lora["part"] == "A":  # (r, rows of the embedding)
            fits, rows, rest_fits = shape[1:] == base[:1], shape[1], True
        else:  # (embedding width, r)
            fits, rows, rest_fits = shape[:1] == base[1:2], None, False
        if not fits:
            problems.append(f"{name} is {shape}, the base model's {weight} is {base}")
            if rest_fits:  # only the rows differ: a vocabulary resized, if the rows are the base's vocabulary
                vocabularies.add(rows)
    return problems, vocabularies


def _vocab_size(config: dict[str, Any]) -> int | None:
    return config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
