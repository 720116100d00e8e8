"""The model card (README.md) of each kind of folder a hub task pushes, as the Hub reads its metadata: the base
it links to and how (finetune, adapter), the library that loads it, the task, the tags it is listed under.

.venv/bin/pytest -q tests/test_model_card.py
"""

from __future__ import annotations

import pytest
from huggingface_hub import ModelCard
from transformers import LlamaConfig

from trainpod.card import adapter_model_card, finetuned_model_card, merged_model_card, pretrained_model_card

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def summary(method: str, objective: str = "sft") -> dict:
    """training_summary.json as a finetune of the hub id org/base writes it."""
    return {
        "method": method,
        "base_model": "org/base",
        "base_model_revision": COMMIT,
        "lora": {"r": 8, "alpha": 16} if method != "full" else None,
        "quantization": {"quant_type": "nf4"} if method == "qlora" else None,
        "objective": objective,
        **({objective: {"beta": 0.1}} if objective != "sft" else {}),
        "data": {"train_samples": 200, "template": "chatml", "cutoff_len": 256},
        "results": {"step": 30, "loss": 1.25, "eval_loss": 1.5, "elapsed_s": 987.65, "tokens_per_s": 31415.9},
    }


@pytest.mark.parametrize(
    ("card", "library", "relation", "tags"),
    [
        (finetuned_model_card(summary("full", "orpo"), COMMIT, "bfloat16", False), "transformers", "finetune",
         ["trainpod", "full", "orpo"]),
        (adapter_model_card(summary("qlora", "dpo"), COMMIT, False), "peft", "adapter",
         ["trainpod", "qlora", "dpo"]),
        (merged_model_card(summary("lora"), "org/base", COMMIT, "float32", False, False), "transformers",
         "finetune", ["trainpod", "lora", "merged"]),
    ],
)  # fmt: skip
def test_a_finetunes_card_links_its_hub_base_as_the_hub_documents_each_relation(
    card, library, relation, tags
):
    loaded = ModelCard(card)
    assert loaded.data.base_model == "org/base" and loaded.data.base_model_relation == relation
    assert loaded.data.library_name == library and loaded.data.pipeline_tag == "text-generation"
    assert loaded.data.tags == tags
    assert f"`org/base` at commit `{COMMIT}`" in loaded.text and "| final eval loss | 1.5000 |" in loaded.text
    assert "987" not in loaded.text and "31415" not in loaded.text, (
        "no time or speed: the same at each resume"
    )


def test_an_adapter_of_a_base_on_the_volume_links_none_and_says_where_peft_looks_for_it() -> None:
    card = ModelCard(adapter_model_card(summary("lora") | {"base_model": "models/base"}, None, False))
    assert card.data.base_model is None and getattr(card.data, "base_model_relation", None) is None
    assert card.data.library_name == "peft"
    assert "`models/base`" in card.text and "base_model_name_or_path" in card.text
    assert "AutoPeftModelForCausalLM.from_pretrained" in card.text


def test_a_vision_adapters_card_loads_it_on_its_base_with_the_processor() -> None:
    card = ModelCard(adapter_model_card(summary("lora"), COMMIT, vision=True))
    assert card.data.pipeline_tag == "image-text-to-text"
    assert f'AutoModelForImageTextToText.from_pretrained("org/base", revision="{COMMIT}"' in card.text
    assert "PeftModel.from_pretrained" in card.text and "AutoProcessor" in card.text


def test_a_pretrained_models_card_says_it_was_trained_from_scratch_on_what() -> None:
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512
    )
    results = {"parameters": 123456, "step": 20, "tokens_seen": 40960, "loss": 3.2, "eval_loss": None}
    card = ModelCard(pretrained_model_card("tiny-pretrain", "tiny-stories", config, results))
    assert card.data.base_model is None and card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation" and card.data.tags == ["trainpod", "pretrain"]
    assert "123,456-parameter llama model trained from scratch" in card.text
    assert "40,960 tokens of the dataset `tiny-stories`" in card.text
    assert "| attention heads | 4 (2 key/value) |" in card.text and "final eval loss" not in card.text
