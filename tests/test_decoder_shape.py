"""train/decoder_shape.py's arithmetic gives the base model transformers builds from a config.json: parameters, the
linear weights 4-bit loading quantizes and LoRA's parameters, of Llama, Mistral, Qwen2 and Qwen3 on the meta device,
tied and untied, with GQA and biases; `trainpod estimate` reads it without importing transformers and builds any
other model on the meta device as before. This test may import them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainpod.config import load_config
from trainpod.config.finetune import FinetuneConfig
from trainpod.estimate import _meta_model_shape, base_model_shape
from trainpod.train.decoder_shape import decoder_shape

from finetune_support import TINY_FINETUNE

TINY = {"vocab_size": 400, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2}
# name: config.json; keys left out take the class's defaults, as a hand-written config.json has them.
CONFIGS = {
    "llama, GQA, untied (Llama 3 8B)": {
        "model_type": "llama", **TINY, "num_attention_heads": 4, "num_key_value_heads": 2,
    },
    "llama, tied (Llama 3.2 1B), kv heads by default": {
        "model_type": "llama", **TINY, "num_attention_heads": 4, "tie_word_embeddings": True,
    },
    "llama with attention and MLP biases and its own head_dim": {
        "model_type": "llama", **TINY, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
        "attention_bias": True, "mlp_bias": True,
    },
    "mistral, 8 kv heads by default": {"model_type": "mistral", **TINY, "num_attention_heads": 16},
    "mistral, head_dim not width / heads (Mistral Nemo)": {
        "model_type": "mistral", **TINY, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    },
    "qwen2, q/k/v biases, untied (Qwen2.5-7B)": {
        "model_type": "qwen2", **TINY, "num_attention_heads": 4, "num_key_value_heads": 2,
    },
    "qwen2, tied (Qwen2.5-0.5B), kv heads by default": {
        "model_type": "qwen2", **TINY, "num_attention_heads": 4, "tie_word_embeddings": True,
    },
    "qwen3, q/k norms, head_dim 128 by default": {
        "model_type": "qwen3", **TINY, "num_attention_heads": 4, "num_key_value_heads": 2,
    },
    "qwen3 with attention biases, tied": {
        "model_type": "qwen3", **TINY, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
        "attention_bias": True, "tie_word_embeddings": True,
    },
}  # fmt: skip
TARGETS = {"all-linear": "all-linear", "attention q and v": ["q_proj", "v_proj"],
           "MLP and k": ["gate_proj", "down_proj", "k_proj"]}  # fmt: skip


def meta_model(config: dict) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("targets", TARGETS.values(), ids=TARGETS.keys())
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_arithmetic_gives_the_meta_built_models_parameters_linear_weights_and_lora_sizes(config, targets):
    model = meta_model(config)
    linears = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
    ]
    lora = sum(
        8 * (module.in_features + module.out_features)
        for name, module in linears
        if targets == "all-linear" or name.rsplit(".", 1)[-1] in targets
    )
    shape = decoder_shape(config)
    assert shape is not None, "a decoder the arithmetic knows"
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert shape.linear_weights == sum(module.weight.numel() for _, module in linears)
    assert shape.lora_parameters(8, targets) == lora
    text = model.config
    assert (shape.width, shape.layers, shape.vocab) == (
        text.hidden_size,
        text.num_hidden_layers,
        text.vocab_size,
    )


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_estimate_on_paper_gives_every_number_its_meta_device_build_gave(config, tmp_path):
    folder = write_config(tmp_path / "base", config)
    settings = [f"base_model.path={folder}", 'lora.target_modules=["q_proj", "v_proj"]']
    finetune = load_config(FinetuneConfig, TINY_FINETUNE, settings)
    on_paper = base_model_shape(finetune, None, [])
    assert on_paper == _meta_model_shape(finetune, AutoConfig.from_pretrained(folder))


def test_an_architecture_the_arithmetic_does_not_know_is_still_estimated_on_the_meta_device(tmp_path):
    """GPT-2 (a Conv1D model, no q/k/v projections) and a Llama config that brings its own code: not on paper."""
    gpt2 = {
        "model_type": "gpt2",
        "vocab_size": 300,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 128,
    }
    remote = {**CONFIGS["llama, GQA, untied (Llama 3 8B)"], "auto_map": {"AutoConfig": "custom.Config"}}
    assert decoder_shape(gpt2) is None and decoder_shape(remote) is None
    folder = write_config(tmp_path / "gpt2", gpt2)
    finetune = load_config(FinetuneConfig, TINY_FINETUNE, [f"base_model.path={folder}", "method=full"])
    shape = base_model_shape(finetune, None, [])
    model = meta_model(gpt2)
    assert shape["parameters"] == shape["full_parameters"] == sum(p.numel() for p in model.parameters())
    assert (shape["width"], shape["layers"], shape["vocab"]) == (64, 2, 300)
