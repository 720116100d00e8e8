"""PEFT LoRA/DoRA adapter -> mlx-lm adapter folder (adapters.safetensors + adapter_config.json).

mlx-lm 0.32 (mlx_lm/tuner/utils.py `load_adapters`, tuner/lora.py `LoRALinear`) computes
`y = W x + scale * (x @ lora_a) @ lora_b` with lora_a (in, r) and lora_b (r, out): PEFT's
lora_A (r, in) and lora_B (out, r) transposed, one `rank` and `scale` for every layer, applied to
the `keys` (paths inside a decoder layer) of the last `num_layers` layers. PEFT's per-module
rank_pattern/alpha_pattern are carried over exactly by zero-padding every module to the largest
rank (zero columns add nothing) and folding each module's scale / the common scale into lora_b.
DoRA's magnitude vector becomes `m` (mlx-lm's DoRALinear normalises W + scale * B A per output row,
as PEFT does).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

import torch

from trainpod import atomic, tensorfile
from trainpod.convert.adapter import PeftAdapter
from trainpod.convert.output import Staging
from trainpod.errors import InputError

# A decoder layer's module: Llama-likes' model.layers.<i>, GPT-NeoX's gpt_neox.layers.<i>, GPT-J's and
# GPTBigCode's transformer.h.<i>.
_LAYER_MODULE = re.compile(r"^(?:(?:model\.|gpt_neox\.)?layers|transformer\.h)\.(\d+)\.(.+)$")
# Where mlx-lm's model classes name a module otherwise than transformers (their `sanitize` renames the weights):
# GPT-NeoX (Pythia) keeps its decoder layers in model.h and the rest of gpt_neox.* and its embed_out in model.
_MLX_RENAMES = (
    (re.compile(r"^gpt_neox\.layers\."), "model.h."),
    (re.compile(r"^(?:gpt_neox\.|(?=embed_out$))"), "model."),
)
# Renames that only the base's model_type tells apart: GPT-J's transformer.* is mlx-lm's model.*, while
# GPTBigCode keeps transformer.* in mlx-lm too.
_MLX_RENAMES_BY_MODEL_TYPE = {"gptj": ((re.compile(r"^transformer\."), "model."),)}
# GPT-J's layer modules: of the architectures mlx-lm loads that keep their layers in transformer.h (GPT-J,
# GPTBigCode, GPT-2, Qwen, EXAONE's attn.attention.*, Phixtral's mixer.*), only GPT-J names them so, which tells
# its adapter apart where the base is a hub id whose config.json is not here to read.
_GPTJ_LAYER_MODULE = re.compile(r"^transformer\.h\.\d+\.(?:attn\.(?:q|k|v|out)_proj|mlp\.fc_(?:in|out))$")
_MERGE_INSTEAD = (
    "use a `kind: merge` task and convert the merged model for MLX with "
    "`mlx_lm.convert --hf-path <merged folder>`"
)
# adapter_config.json settings that change what the adapter computes in ways an mlx-lm adapter
# cannot express, with what each one is.
_UNSUPPORTED = {
    "modules_to_save": "modules_to_save stores whole trained copies of modules, which mlx-lm adapters "
    "cannot carry",
    "lora_bias": "lora_bias adds a trained bias to lora_B, which mlx-lm's LoRALinear does not have",
    "trainable_token_indices": "trainable_token_indices trains single embedding rows, which mlx-lm "
    "adapters cannot carry",
    "layer_replication": "layer_replication duplicates decoder layers, which mlx-lm cannot rebuild",
    "target_parameters": "target_parameters adapts raw parameters (MoE experts), not Linear layers",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) only applies after its "
    "invocation tokens, which mlx-lm does not do",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D layers) stores weights transposed; mlx-lm models use "
    "Linear layers",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not mlx-lm's LoRA",
}


# init_lora_weights values after which the adapter belongs to a modified base (peft's LoraLayer.update_layer).
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


def refusals(adapter: PeftAdapter) -> list[str]:
    """Why this adapter cannot become an mlx-lm adapter without changing what it computes (empty: it can)."""
    config, problems = adapter.config, []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(
            f"peft_type {config.get('peft_type')!r}: only LoRA and DoRA adapters convert to mlx-lm; "
            + _MERGE_INSTEAD
        )
    if config.get("bias", "none") != "none":
        problems.append(
            f"bias={config['bias']!r} trains the base layers' biases, which mlx-lm adapters cannot hold; "
            + _MERGE_INSTEAD
        )
    for name, why in _UNSUPPORTED.items():
        if config.get(name):
            problems.append(f"{name}={config[name]!r}: {why}; {_MERGE_INSTEAD}")
    if adapter.other_tensors:
        shown = ", ".join(adapter.other_tensors[:3]) + (" ..." if len(adapter.other_tensors) > 3 else "")
        problems.append(
            f"the adapter holds tensors that are not LoRA A/B or DoRA magnitudes ({shown}), for example "
            f"embedding LoRA or trained copies of modules; {_MERGE_INSTEAD}"
        )
    if (adapter.summary or {}).get("vision"):
        problems.append(
            "a vision-language adapter (finetune-vlm): mlx-lm adapters are for text models and this kit "
            "writes no mlx-vlm adapter format; use a `kind: merge` task and convert the merged folder with "
            "mlx-vlm (`python -m mlx_vlm.convert --hf-path <merged folder>`)"
        )
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        problems.append(
            f"init_lora_weights={init!r} changes the base weights when the adapter is created (PEFT subtracts "
            "the initial adapter from them), so the adapter is not a delta on the original base that mlx-lm "
            f"loads; {_MERGE_INSTEAD}"
        )
    if adapter.uses_dora:
        lacking = [m.name for m in adapter.modules.values() if m.magnitude is None]
        if lacking:
            problems.append(f"use_dora is set but {lacking[0]} has no lora_magnitude_vector; save it again")
    return problems


def renames_module_names(model_type: str | None) -> bool:
    """Whether mlx-lm names this base model_type's modules otherwise than transformers by model_type alone."""
    return model_type in _MLX_RENAMES_BY_MODEL_TYPE


def mlx_model_type(adapter: PeftAdapter, base_model_type: str | None) -> str | None:
    """The model_type whose mlx-lm names the adapter takes: the base's config.json one, else (a hub base not
    fetched) GPT-J where the adapted modules are GPT-J's, whose names mlx-lm changes."""
    if base_model_type is None and any(map(_GPTJ_LAYER_MODULE.match, adapter.modules)):
        return "gptj"
    return base_model_type


def mlx_name(peft_module: str, model_type: str | None = None) -> str:
    """PEFT's module path is the base model's, which is mlx-lm's too (mlx-lm keeps HF's names), but for the
    architectures whose names mlx-lm changes (_MLX_RENAMES, and by the base's model_type): a tensor under the
    HF name is refused at load."""
    for pattern, replacement in _MLX_RENAMES + _MLX_RENAMES_BY_MODEL_TYPE.get(model_type or "", ()):
        peft_module = pattern.sub(replacement, peft_module, count=1)
    return peft_module


def relative_key(module: str, model_type: str | None = None) -> str:
    """The key mlx-lm's lora_parameters.keys uses: the path inside a decoder layer, else mlx-lm's full path."""
    match = _LAYER_MODULE.match(module)
    return match.group(2) if match else mlx_name(module, model_type)


def mlx_layout(
    adapter: PeftAdapter, model_type: str | None = None
) -> tuple[tensorfile.TensorLayout, dict[str, Callable], int, float]:
    """adapters.safetensors laid out in memory, how to fill each tensor, the common rank and the common scale.

    Each transpose, zero-padding and scale fold is computed straight into the tensor's place in the
    bytes being written: the adapter's bytes are copied once, on the way from the input to the output.
    """
    rank = max(m.rank for m in adapter.modules.values())
    scale = adapter.default_scale or 1.0
    specs, fillers = {}, {}
    for module in adapter.modules.values():
        name, r, fold = mlx_name(module.name, model_type), module.rank, adapter.scale(module) / scale
        # A 16-bit lora_b keeps float32 when a scale is folded in: rounding the product would change it.
        b_dtype = (
            module.lora_b.dtype if fold == 1.0 else torch.promote_types(module.lora_b.dtype, torch.float32)
        )
        specs[f"{name}.lora_a"] = (module.lora_a.dtype, (module.lora_a.shape[1], rank))  # (in, rank)
        specs[f"{name}.lora_b"] = (b_dtype, (rank, module.lora_b.shape[0]))  # (rank, out)
        fillers[f"{name}.lora_a"] = functools.partial(_fill_a, module.lora_a, r)
        fillers[f"{name}.lora_b"] = functools.partial(_fill_b, module.lora_b, r, fold)
        if adapter.uses_dora:
            specs[f"{name}.m"] = (module.magnitude.dtype, tuple(module.magnitude.shape))
            fillers[f"{name}.m"] = module.magnitude
    return tensorfile.layout(specs, {"format": "mlx"}), fillers, rank, scale


def fill(filler: Callable | torch.Tensor, slot: torch.Tensor) -> None:
    filler(slot) if callable(filler) else slot.copy_(filler)


def _fill_a(lora_a: torch.Tensor, r: int, slot: torch.Tensor) -> None:
    """PEFT's lora_A (r, in) transposed to mlx-lm's (in, rank), zero columns beyond r (they add nothing)."""
    slot[:, :r].copy_(lora_a.T)
    slot[:, r:].zero_()


def _fill_b(lora_b: torch.Tensor, r: int, fold: float, slot: torch.Tensor) -> None:
    """PEFT's lora_B (out, r) transposed to mlx-lm's (rank, out), scaled by `fold`, zero rows beyond r."""
    if fold != 1.0:
        torch.mul(lora_b.T.float(), fold, out=slot[:r])
    else:
        slot[:r].copy_(lora_b.T)
    slot[r:].zero_()


def num_layers(adapter: PeftAdapter, base_layers: int | None) -> int:
    """mlx-lm adapts the last `num_layers` layers: all of them when the base's depth is known."""
    indices = [int(m.group(1)) for m in map(_LAYER_MODULE.match, adapter.modules) if m]
    if base_layers is not None:
        return base_layers
    config = adapter.config
    targets = config.get("target_modules")
    skipping = [
        f"{name}={config[name]!r}"
        for name in ("layers_to_transform", "layers_pattern", "exclude_modules")
        if config.get(name)
    ] + (
        [f"target_modules={targets!r} (a regex)"]
        if isinstance(targets, str) and targets != "all-linear"
        else []
    )
    if skipping or sorted(set(indices)) != list(range(max(indices, default=-1) + 1)):
        raise InputError(
            f"{', '.join(skipping) or 'the adapted layers ' + str(sorted(set(indices)))}: the adapter may skip "
            "the last layers, and the base model is not a local folder whose depth could be read (mlx-lm adapts "
            "the last num_layers layers); set base_model to the base model's folder"
        )
    return max(indices) + 1 if indices else 0


def mlx_config(
    adapter: PeftAdapter,
    rank: int,
    scale: float,
    layers: int,
    base: str,
    revision: str | None = None,
    model_type: str | None = None,
) -> dict[str, Any]:
    keys = sorted({relative_key(m, model_type) for m in adapter.modules})
    pinned = {"revision": revision} if revision else {}
    return {
        "fine_tune_type": "dora" if adapter.uses_dora else "lora",
        "num_layers": layers,
        "lora_parameters": {
            "rank": rank,
            "scale": scale,
            "dropout": float(adapter.config.get("lora_dropout") or 0.0),
            "keys": keys,
        },
        "model": base,
    } | pinned


def write_mlx_adapter(
    adapter: PeftAdapter,
    staging: Staging,
    base: str,
    base_layers: int | None,
    revision: str | None = None,
    model_type: str | None = None,
) -> None:
    """Write the mlx-lm adapter into `staging.folder` (created here). `revision`: the commit of the hub id
    `base` the finetune trained on, which the README loads (the hub's main may have moved on since).
    `model_type`: the base's, for the module names mlx-lm gives that architecture."""
    problems = refusals(adapter)
    if problems:
        raise InputError(
            f"the adapter {adapter.folder} cannot be converted to an mlx-lm adapter without changing what it "
            "computes:\n  - " + "\n  - ".join(problems)
        )
    file, fillers, rank, scale = mlx_layout(adapter, model_type)
    config = mlx_config(adapter, rank, scale, num_layers(adapter, base_layers), base, revision, model_type)
    template, turn_end = trained_chat_format(adapter)
    staging.folder.mkdir(parents=True)
    staging.write_tensors("adapters.safetensors", file, lambda name, slot: fill(fillers[name], slot))
    staging.write_file("adapter_config.json", atomic.json_bytes(config))
    if template is not None:
        staging.write_file(CHAT_TEMPLATE_FILE, template.encode("utf-8"))
    name = trained_template_name(adapter)
    readme = _readme(adapter, config, base, revision) + _chat_format_readme(
        name, template, turn_end, base, revision
    )
    staging.write_file("README.md", readme.encode("utf-8"))


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def trained_template_name(adapter: PeftAdapter) -> str | None:
    """training_summary.json's data.template: a built-in's name, `tokenizer` for its own, None for plain text."""
    return ((adapter.summary or {}).get("data") or {}).get("template")


def trained_chat_format(adapter: PeftAdapter) -> tuple[str | None, str | None]:
    """The built-in chat template the adapter was trained on (training_summary.json's data.template: chatml,
    qwen, llama3, alpaca) as a tokenizer's Jinja template, and the token its answers end with; (None, token)
    for the tokenizer's own template, the base's, which mlx-lm loads; (None, None) for plain text.

    mlx-lm takes the tokenizer, its chat template and its eos from the base alone: a base with no template
    (Llama 2, Mistral) or another one rendered prompts the adapter never saw, and one stopping at its eos
    alone (a base Qwen2.5: <|endoftext|>) ran past the <|im_end|> the answers were trained to end with."""
    name = trained_template_name(adapter)
    has_tokenizer = any((adapter.folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    if name is None or not has_tokenizer:
        return None, None
    from transformers import AutoTokenizer

    from trainpod.sft.templates import build_template, own_template_turn_end

    tokenizer = AutoTokenizer.from_pretrained(str(adapter.folder))
    if name in ("tokenizer", "auto"):
        try:
            turn_end = own_template_turn_end(tokenizer)
        except InputError:  # a template that renders no plain conversation: it stops as the base does
            return None, None
        token = tokenizer.convert_ids_to_tokens(turn_end) if turn_end is not None else None
        return None, (token if token != tokenizer.eos_token else None)  # the eos: mlx-lm stops there already
    template = build_template(name, tokenizer)
    return template.jinja(), template.turn_end or None


def _chat_format_readme(
    name: str | None, template: str | None, turn_end: str | None, base: str, revision: str | None
) -> str:
    if template is None and turn_end is None:
        return ""
    trained_on = (
        f"the chat template `{name}`, which `{CHAT_TEMPLATE_FILE}` holds"
        if template
        else "the base's chat template"
    )
    ends = f", its answers ending with `{turn_end}`" if turn_end else ""
    given = f', tokenizer_config={{"chat_template": open("{CHAT_TEMPLATE_FILE}").read()}}' if template else ""
    pinned = f', revision="{revision}"' if revision else ""
    stop = f"tokenizer.add_eos_token({json.dumps(turn_end)})\n" if turn_end else ""
    command_line = (
        f"`mlx_lm.generate` takes `--extra-eos-token {json.dumps(turn_end)}`"
        if turn_end
        else "`mlx_lm.generate`"
    )
    return f"""
## Chat format

mlx-lm takes the tokenizer, its chat template and its eos from the base model. This adapter was trained on
{trained_on}{ends}: load it so, or it is prompted as it never was or runs on past its answers' end.

```python
model, tokenizer = load("{base}", adapter_path="."{pinned}{given})
{stop}```

{command_line}{"; it renders prompts with the base's own template (if any), not this one" if template else ""}.
A merge (`kind: merge`) carries the template and the end of turn in its tokenizer and generation config.
"""


def _readme(adapter: PeftAdapter, config: dict[str, Any], base: str, revision: str | None) -> str:
    params = config["lora_parameters"]
    model, load_revision, fetch = base, "", ""
    if revision:  # mlx-lm's commands take no revision: a folder holding that commit instead
        model, load_revision = "<that folder>", f', revision="{revision}"'
        fetch = f"hf download {base} --revision {revision}  # prints the folder of that commit\n"
    pinned = f" at commit `{revision}`, the one the finetune trained on" if revision else ""
    quantization = adapter.quantization
    qlora = (
        f"""
It was trained as QLoRA, on the base's weights rounded to 4 bits ({quantization.get("quant_type", "nf4")}):
on the 16-bit base above it adds the rounding error training never saw, so its outputs are close to the
finetuned model's but not the same. For the same outputs, merge it (a convert task `kind: merge`, whose
default `qlora_base: dequantized` merges into the rounded base) and convert the merged folder with
`mlx_lm.convert --hf-path <merged folder>`.
"""
        if quantization
        else ""
    )
    return f"""# MLX adapter

Converted by trainpod from the PEFT adapter `{adapter.folder}`.

It belongs to the base model **`{base}`**{pinned}:
load it on top of exactly that model (the same weights; a 4-bit MLX copy of it also works, with the usual
quantization error).
{qlora}
```sh
pip install mlx-lm
{fetch}mlx_lm.generate --model {model} --adapter-path . --prompt "Once upon a time"
```

```python
from mlx_lm import load, generate
model, tokenizer = load("{base}", adapter_path="."{load_revision})
print(generate(model, tokenizer, prompt="Once upon a time", max_tokens=50))
```

`mlx_lm.fuse --model {model} --adapter-path . --save-path fused` folds it into the weights.

| setting | value |
| --- | --- |
| fine_tune_type | {config["fine_tune_type"]} |
| num_layers | {config["num_layers"]} |
| rank | {params["rank"]} |
| scale | {params["scale"]} |
| keys | {", ".join(params["keys"])} |
"""
