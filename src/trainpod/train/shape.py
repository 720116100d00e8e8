"""The pretraining model on paper: its parameter tensors, parameter count and FLOPs per token, from
`ModelConfig` alone, without torch or transformers.

    from trainpod.train.shape import model_shape
    shape = model_shape(config, vocab_size=32768)       # shape.tensor_sizes, shape.params

`trainpod estimate` and `trainpod deploy` run on a laptop before a GPU is paid for; building
transformers' LlamaForCausalLM on the meta device to read these sizes made them import torch and
transformers first (9 s on two cores). The sizes here are the ones that build gives, tensor for tensor
(tests/test_shape.py compares them for every pretrain preset and odd shapes); the trainer builds the
real model (train/model.py) and counts its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainpod.config.pretrain import ModelConfig, PretrainConfig

VOCAB_MULTIPLE = 64  # embedding rows padded to a multiple of 64 keep the lm_head matmul on fast paths


def padded_vocab(tokenizer_vocab: int) -> int:
    return -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclass(frozen=True)
class ModelShape:
    """What the estimates need to know of a model: its parameter tensors and widths."""

    tensor_sizes: tuple[int, ...]  # numel of each parameter tensor (tied ones once)
    hidden: int
    kv_hidden: int
    mlp: int
    layers: int
    vocab: int
    embedding_params: int  # input embedding + output head (once when tied)
    heads: int = 1  # attention heads: the compiled graph saves one fp32 log-sum-exp per head and token

    @property
    def params(self) -> int:
        return sum(self.tensor_sizes)


def model_shape(config: PretrainConfig, vocab_size: int) -> ModelShape:
    """The shape of the LlamaForCausalLM that train/model.py's llama_config builds from `config.model`."""
    return llama_shape(config.model, vocab_size)


def llama_shape(model: ModelConfig, vocab_size: int) -> ModelShape:
    """LlamaForCausalLM's parameters in the order model.parameters() gives them: the embedding; per
    decoder layer q, k, v, o (no biases), gate, up, down (no biases) and the two RMSNorms' weights; the
    final norm; the output head unless it is the embedding (tied)."""
    h, heads = model.hidden_size, model.num_heads
    kv = (model.num_kv_heads or heads) * (h // heads)
    mlp = model.mlp_width
    layer = (h * h, kv * h, kv * h, h * h, mlp * h, mlp * h, h * mlp, h, h)
    embedding = vocab_size * h
    head = () if model.tie_embeddings else (embedding,)
    return ModelShape(
        tensor_sizes=(embedding, *layer * model.num_layers, h, *head),
        hidden=h,
        kv_hidden=kv,
        mlp=mlp,
        layers=model.num_layers,
        vocab=vocab_size,
        embedding_params=embedding * (1 if model.tie_embeddings else 2),
        heads=heads,
    )


def flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls plus attention's 12 * layers * width * seq_len (PaLM).
    N leaves out the input embedding (a lookup) but keeps the output head, which is a matmul: when tied the
    one tensor is both."""
    matmul_params = shape.params - shape.embedding_params + shape.vocab * shape.hidden
    return 6 * matmul_params + 12 * shape.layers * shape.hidden * seq_len
