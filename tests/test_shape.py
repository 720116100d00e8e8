"""train/shape.py's arithmetic gives the model the trainer builds: the tensors, parameters and FLOPs per token of
LlamaForCausalLM on the meta device, for every pretrain preset and odd shapes. `trainpod estimate` reads the
arithmetic without importing torch; this test may import it."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from trainpod.config import load_config
from trainpod.config.loader import validate_tree
from trainpod.config.pretrain import PretrainConfig
from trainpod.train.model import llama_config, parameter_count
from trainpod.train.shape import flops_per_token, model_shape, padded_vocab

from support import CONFIGS

PRESETS = sorted((CONFIGS / "pretrain").glob("*.yaml"))
# name: (model section, tokenizer vocabulary)
ODD_SHAPES = {
    "tied, multi-head": ({"hidden_size": 64, "num_layers": 2, "num_heads": 4}, 320),
    "untied": ({"hidden_size": 64, "num_layers": 3, "num_heads": 4, "tie_embeddings": False}, 320),
    "grouped-query, untied": (
        {"hidden_size": 96, "num_layers": 2, "num_heads": 6, "num_kv_heads": 2, "tie_embeddings": False},
        512,
    ),
    "one kv head, odd mlp": (
        {"hidden_size": 48, "num_layers": 1, "num_heads": 3, "num_kv_heads": 1, "intermediate_size": 176},
        256,
    ),
    "GPT-2's vocabulary, padded": ({"hidden_size": 64, "num_layers": 2, "num_heads": 2}, 50257),
    "untied, vocabulary padded": (
        {"hidden_size": 128, "num_layers": 2, "num_heads": 8, "num_kv_heads": 4, "tie_embeddings": False},
        1001,
    ),
}


def odd_config(model: dict) -> PretrainConfig:
    tree = {
        "name": "odd",
        "data": {"dataset": "d"},
        "model": model,
        "train": {"max_steps": 1, "warmup_steps": 0, "seq_len": 64},
    }
    return validate_tree(PretrainConfig, tree)


def cases() -> list:
    presets = [pytest.param(load_config(PretrainConfig, p), 32768, id=p.stem) for p in PRESETS]
    odd = [pytest.param(odd_config(model), vocab, id=name) for name, (model, vocab) in ODD_SHAPES.items()]
    return presets + odd


@pytest.mark.parametrize(("config", "tokenizer_vocab"), cases())
def test_the_arithmetic_shape_is_the_meta_built_models_tensor_for_tensor(config, tokenizer_vocab):
    vocab = config.model.vocab_size or padded_vocab(tokenizer_vocab)
    llama = llama_config(config.model, vocab, config.train.seq_len)
    with torch.device("meta"):
        model = LlamaForCausalLM(llama)
    shape = model_shape(config, vocab)
    built = tuple(p.numel() for p in model.parameters())  # tied tensors once
    assert shape.tensor_sizes == built, (
        "train/shape.py's llama_shape no longer follows LlamaForCausalLM's layout"
    )
    assert shape.params == parameter_count(llama)
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    assert shape.embedding_params == sum(p.numel() for p in model.parameters() if id(p) in embeddings)
    attention = model.model.layers[0].self_attn
    assert (shape.hidden, shape.kv_hidden, shape.heads) == (
        llama.hidden_size,
        attention.k_proj.out_features,
        llama.num_attention_heads,
    )
    assert (shape.mlp, shape.layers, shape.vocab) == (llama.intermediate_size, llama.num_hidden_layers, vocab)


@pytest.mark.parametrize(("config", "tokenizer_vocab"), cases())
def test_flops_per_token_are_what_the_trainer_counted_from_the_built_model(config, tokenizer_vocab):
    """6N over every matmul's parameters (the input embedding is a lookup; the head, tied or not, a matmul) plus
    attention's 12 x layers x width x seq_len: the formula the trainer applied to the model's config."""
    vocab = padded_vocab(tokenizer_vocab)
    llama = llama_config(config.model, vocab, config.train.seq_len)
    n = parameter_count(llama)
    embedding = 0 if llama.tie_word_embeddings else llama.vocab_size * llama.hidden_size
    expected = 6 * (n - embedding) + 12 * llama.num_hidden_layers * llama.hidden_size * config.train.seq_len
    assert flops_per_token(model_shape(config, vocab), config.train.seq_len) == expected


def test_every_pretrain_preset_is_covered():
    assert {p.stem for p in PRESETS} >= {"125m", "1b", "2b", "4b", "tiny"}, f"no presets found in {CONFIGS}"
