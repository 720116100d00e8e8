"""The model card (README.md) of a merged model: what a folder pushed to the Hugging Face Hub (a convert `hub`
task) shows on its page, and what a person handed the folder reads first.

The metadata is huggingface_hub's ModelCardData: `base_model` (a hub base only: the Hub links the model to it
and lists it among the base's finetunes; a folder on the volume means nothing elsewhere), `library_name`,
`pipeline_tag` and tags. The text says how it was made from training_summary.json and how to load it.
"""

from __future__ import annotations

from typing import Any

MODEL_CARD = "README.md"


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
    from huggingface_hub import ModelCardData

    summary = summary or {}
    method = str(summary.get("method") or "lora")
    objective = str(summary.get("objective") or "sft")
    data = ModelCardData(
        base_model=base_name if base_revision else None,
        library_name="transformers",
        pipeline_tag="image-text-to-text" if vision else "text-generation",
        # "dpo" (orpo, simpo) as TRL tags its models: the Hub lists them under it
        tags=["trainpod", method, *([objective] if objective != "sft" else []), "merged"],
    )
    pinned = f" at commit `{base_revision}`" if base_revision else ""
    into = (
        "the base's weights rounded to 4 bits and back, those QLoRA trained it against, so that the model "
        "computes what the finetuned one did"
        if dequantized
        else "the base's weights"
    )
    loader = "AutoModelForImageTextToText" if vision else "AutoModelForCausalLM"
    return f"""---
{data.to_yaml()}
---

# Finetuned `{base_name}`

`{base_name}`{pinned}, finetuned with trainpod ({_method_line(summary, method)}). The adapter was merged
in float32 into {into}, and saved as {dtype}.

{_training_table(summary)}
```python
from transformers import AutoTokenizer, {loader}

model = {loader}.from_pretrained("<this folder or its Hub repo id>", dtype="auto")
tokenizer = AutoTokenizer.from_pretrained("<this folder or its Hub repo id>")
```

`training_summary.json` beside the weights holds everything the run recorded (data, settings, results).
"""


def _method_line(summary: dict[str, Any], method: str) -> str:
    lora = summary.get("lora") or {}
    shape = f", rank {lora['r']}, alpha {lora['alpha']:g}" if "r" in lora and "alpha" in lora else ""
    objective = str(summary.get("objective") or "sft")
    return f"{method}{shape}{_objective_line(objective, summary.get(objective) or {})}"


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
    """The run's results and data as a table; '' when the summary records none."""
    results, data = summary.get("results") or {}, summary.get("data") or {}
    rows = [
        ("steps", results.get("step")),
        ("epochs", results.get("epoch")),
        ("final train loss", _number(results.get("loss"))),
        ("final eval loss", _number(results.get("eval_loss"))),
        ("training samples", None if "train_pairs" in data else data.get("train_samples")),
        ("training preference pairs", data.get("train_pairs")),
        ("prompt format", data.get("template")),
        ("sequence length", data.get("cutoff_len")),
    ]
    shown = [(name, value) for name, value in rows if value is not None]
    if not shown:
        return ""
    lines = ["| training | |", "| --- | --- |", *(f"| {name} | {value} |" for name, value in shown)]
    return "\n".join(lines) + "\n"


def _number(value: Any) -> str | None:
    return f"{value:.4f}" if isinstance(value, int | float) else None
