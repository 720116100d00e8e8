"""The model card (README.md) of every folder a convert `hub` task pushes to the Hugging Face Hub: what its
page shows, and what a person handed the folder reads first. A merged model (convert `merge`), a full
finetune's export/hf, a LoRA finetune's export/adapter (in place of peft's template of "[More Information
Needed]"), and a pretrain's export/hf or export/hf-step-<N> (convert `export`). Written inside each folder's
atomic publish and listed in its manifest; made from what the run recorded alone, no clock, so that an export
made again at a resume has the same bytes.

The metadata is huggingface_hub's ModelCardData: `base_model` (a hub base only: the Hub links the model to it
and lists it among the base's finetunes or adapters; a folder on the volume means nothing elsewhere) with
`base_model_relation` (the Hub's `finetune` or `adapter`, stated rather than left to its guess from the
files), `library_name`, `pipeline_tag` and tags. The text says how it was made (training_summary.json's
method, objective and results) and how to load it.
"""

from __future__ import annotations

from typing import Any

MODEL_CARD = "README.md"
_HERE = "<this folder or its Hub repo id>"


def merged_model_card(
    summary: dict[str, Any] | None,
    base_name: str,
    base_revision: str | None,
    dtype: str,
    dequantized: bool,
    vision: bool,
) -> str:
    """README.md for a merged model. `base_revision`: the commit of the hub id `base_name` the finetune trained
    on, set only for a hub base."""
    summary = summary or {}
    method = str(summary.get("method") or "lora")
    into = (
        "the base's weights rounded to 4 bits and back, those QLoRA trained it against, so that the model "
        "computes what the finetuned one did"
        if dequantized
        else "the base's weights"
    )
    tags, pinned = [method, *_objective_tag(summary), "merged"], _pinned(base_revision)
    metadata = _metadata("transformers", vision, tags, base_name, base_revision, "finetune")
    return f"""---
{metadata}
---

# Finetuned `{base_name}`

`{base_name}`{pinned}, finetuned with trainpod ({_method_line(summary, method)}). The adapter was merged
in float32 into {into}, and saved as {dtype}.

{_training_table(summary)}
{_transformers_loading(vision)}
`training_summary.json` beside the weights holds everything the run recorded (data, settings, results).
"""


def finetuned_model_card(summary: dict[str, Any], base_revision: str | None, dtype: str, vision: bool) -> str:
    """README.md for a full finetune's export/hf: every weight of `summary["base_model"]` trained.
    `base_revision`: the hub commit it trained on, set only for a hub base."""
    base_name = str(summary.get("base_model"))
    method = str(summary.get("method") or "full")
    tags = [method, *_objective_tag(summary)]
    metadata = _metadata("transformers", vision, tags, base_name, base_revision, "finetune")
    return f"""---
{metadata}
---

# Finetuned `{base_name}`

`{base_name}`{_pinned(base_revision)}, finetuned with trainpod ({_method_line(summary, method)}): every weight
trained, saved as {dtype}.

{_training_table(summary)}
{_transformers_loading(vision)}
`training_summary.json` beside the weights holds everything the run recorded (data, settings, results).
"""


def adapter_model_card(summary: dict[str, Any], base_revision: str | None, vision: bool) -> str:
    """README.md for a LoRA (QLoRA) finetune's export/adapter, which peft loads on top of its base.
    `base_revision`: the hub commit of `summary["base_model"]` it trained on, set only for a hub base."""
    base_name = str(summary.get("base_model"))
    method = str(summary.get("method") or "lora")
    where = (
        "adapter_config.json names it by its hub id and that commit, so that peft loads the very weights it "
        "was trained on"
        if base_revision
        else f"the folder `{base_name}`, named in adapter_config.json by its path on the machine that trained it "
        "(elsewhere, set `base_model_name_or_path` there to a copy of that folder)"
    )
    quantization = summary.get("quantization") or {}
    qlora = (
        f"""
It was trained as QLoRA, on the base's weights rounded to 4 bits ({quantization.get("quant_type", "nf4")}):
on the 16-bit base it adds the rounding error training never saw, so its outputs are close to the finetuned
model's but not the same. For the same outputs, load the base in 4 bits as trained (transformers'
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="{quantization.get("quant_type", "nf4")}")`), or
merge it (a convert task `kind: merge`, whose default `qlora_base: dequantized` merges into the rounded base).
"""
        if method == "qlora"
        else ""
    )
    metadata = _metadata(
        "peft", vision, [method, *_objective_tag(summary)], base_name, base_revision, "adapter"
    )
    return f"""---
{metadata}
---

# {"QLoRA" if method == "qlora" else "LoRA"} adapter for `{base_name}`

An adapter of `{base_name}`{_pinned(base_revision)}, finetuned with trainpod ({_method_line(summary, method)}).
It holds the trained low-rank weights alone, which peft loads on top of exactly that base: {where}.
{qlora}
{_training_table(summary)}
{_peft_loading(base_name, base_revision, vision)}
`training_summary.json` beside the adapter holds everything the run recorded (data, settings, results).
"""


def pretrained_model_card(run: str, dataset: str, config: Any, results: dict[str, Any]) -> str:
    """README.md for a pretrain's HF export: the model of transformers config `config`, trained from scratch on
    the volume's dataset `dataset`; `results`: the trainer's summary (step, tokens_seen, loss, eval_loss,
    parameters, exported_weights), as much of it as is at hand (a checkpoint's progress)."""
    from huggingface_hub import ModelCardData

    data = ModelCardData(
        library_name="transformers", pipeline_tag="text-generation", tags=["trainpod", "pretrain"]
    )
    heads = f"{config.num_attention_heads}"
    if getattr(config, "num_key_value_heads", None) not in (None, config.num_attention_heads):
        heads += f" ({config.num_key_value_heads} key/value)"
    rows = [
        ("parameters", _count(results.get("parameters"))),
        ("architecture", config.model_type),
        ("layers", config.num_hidden_layers),
        ("hidden size", config.hidden_size),
        ("attention heads", heads),
        ("vocabulary", config.vocab_size),
        ("sequence length", config.max_position_embeddings),
        ("dataset", f"`{dataset}`"),
        ("steps", results.get("step")),
        ("tokens seen", _count(results.get("tokens_seen"))),
        ("final train loss", _number(results.get("loss"))),
        ("final eval loss", _number(results.get("eval_loss"))),
        ("exported weights", _exported_weights(results.get("exported_weights"))),
    ]
    size = f"A {_count(results['parameters'])}-parameter" if results.get("parameters") else "A"
    tokens = f" on {_count(results['tokens_seen'])} tokens" if results.get("tokens_seen") else ""
    return f"""---
{data.to_yaml()}
---

# `{run}`

{size} {config.model_type} model trained from scratch with trainpod{tokens} of the dataset `{dataset}`.
It is a base model: it continues text, and was trained neither to follow instructions nor to chat.

{_table(rows)}
{_transformers_loading(False)}"""


def _metadata(
    library: str,
    vision: bool,
    tags: list[str],
    base_name: str,
    base_revision: str | None,
    relation: str,
) -> str:
    from huggingface_hub import ModelCardData

    hub_base = {"base_model": base_name, "base_model_relation": relation} if base_revision else {}
    data = ModelCardData(
        library_name=library,
        pipeline_tag="image-text-to-text" if vision else "text-generation",
        tags=["trainpod", *tags],
        **hub_base,
    )
    return data.to_yaml()


def _objective_tag(summary: dict[str, Any]) -> list[str]:
    """["dpo"] (orpo, simpo) as TRL tags its models: the Hub lists them under it; none for SFT."""
    objective = str(summary.get("objective") or "sft")
    return [objective] if objective != "sft" else []


def _pinned(base_revision: str | None) -> str:
    return f" at commit `{base_revision}`" if base_revision else ""


def _transformers_loading(vision: bool) -> str:
    loader = "AutoModelForImageTextToText" if vision else "AutoModelForCausalLM"
    reader = "AutoProcessor" if vision else "AutoTokenizer"
    return f"""```python
from transformers import {reader}, {loader}

model = {loader}.from_pretrained("{_HERE}", dtype="auto")
{reader.removeprefix("Auto").lower()} = {reader}.from_pretrained("{_HERE}")
```
"""


def _peft_loading(base_name: str, base_revision: str | None, vision: bool) -> str:
    if not vision:
        return f"""```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

model = AutoPeftModelForCausalLM.from_pretrained("{_HERE}", dtype="auto")
tokenizer = AutoTokenizer.from_pretrained("{_HERE}")
```
"""
    revision = f', revision="{base_revision}"' if base_revision else ""
    return f"""```python
from peft import PeftModel
from transformers import AutoModelForImageTextToText, AutoProcessor

base = AutoModelForImageTextToText.from_pretrained("{base_name}"{revision}, dtype="auto")
model = PeftModel.from_pretrained(base, "{_HERE}")
processor = AutoProcessor.from_pretrained("{_HERE}")
```
"""


def _method_line(summary: dict[str, Any], method: str) -> str:
    lora = summary.get("lora") or {}
    shape = f", rank {lora['r']}, alpha {lora['alpha']:g}" if "r" in lora and "alpha" in lora else ""
    objective = str(summary.get("objective") or "sft")
    shown = "full finetune" if method == "full" else method
    return f"{shown}{shape}{_objective_line(objective, summary.get(objective) or {})}"


def _objective_line(objective: str, settings: dict[str, Any]) -> str:
    """', SimPO with beta 2, gamma 1': each setting that changes what the preference objective learns, not those
    left at their no-op (DPO's sigmoid loss, label smoothing 0); '' for SFT."""
    from trainpod.config.finetune import OBJECTIVE_NAMES

    if "beta" not in settings:
        return ""
    shown = [f"beta {settings['beta']:g}"]
    if "gamma" in settings:
        shown.append(f"gamma {settings['gamma']:g}")
    if settings.get("loss", "sigmoid") != "sigmoid":
        shown.append(f"{settings['loss']} loss")
    if settings.get("label_smoothing"):
        shown.append(f"label smoothing {settings['label_smoothing']:g}")
    return f", {OBJECTIVE_NAMES.get(objective, objective)} with {', '.join(shown)}"


def _training_table(summary: dict[str, Any]) -> str:
    """The run's results and data as a table; '' when the summary records none. Only what the same training
    records alike at every resume: not its time or speed."""
    results, data = summary.get("results") or {}, summary.get("data") or {}
    return _table(
        [
            ("steps", results.get("step")),
            ("epochs", results.get("epoch")),
            ("final train loss", _number(results.get("loss"))),
            ("final eval loss", _number(results.get("eval_loss"))),
            ("exported weights", _exported_weights(results.get("exported_weights"))),
            ("training samples", None if "train_pairs" in data else data.get("train_samples")),
            ("training preference pairs", data.get("train_pairs")),
            ("prompt format", data.get("template")),
            ("sequence length", data.get("cutoff_len")),
        ]
    )


def _table(rows: list[tuple[str, Any]]) -> str:
    shown = [(name, value) for name, value in rows if value is not None]
    if not shown:
        return ""
    lines = ["| training | |", "| --- | --- |", *(f"| {name} | {value} |" for name, value in shown)]
    return "\n".join(lines) + "\n"


def _exported_weights(weights: Any) -> str | None:
    """'step 40, the best by eval_loss (1.2345)' where export.weights=best chose an earlier step than the
    last; None for the last step's (the steps row says it)."""
    if not isinstance(weights, dict) or weights.get("chosen") != "best":
        return None
    value = _number(weights.get("value"))
    return f"step {weights.get('step')}, the best by {weights.get('metric')}" + (
        f" ({value})" if value else ""
    )


def _number(value: Any) -> str | None:
    return f"{value:.4f}" if isinstance(value, int | float) else None


def _count(value: Any) -> str | None:
    return f"{value:,}" if isinstance(value, int) else None
