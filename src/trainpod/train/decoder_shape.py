"""A finetune's base model on paper: its parameter count, the linear layers 4-bit loading quantizes and LoRA
adapts, from its config.json alone, without torch or transformers.

    from trainpod.train.decoder_shape import decoder_shape
    shape = decoder_shape(json.loads(Path("models/base/config.json").read_text()))   # None: not known here
    shape.parameters, shape.linear_weights, shape.lora_parameters(16, "all-linear")

`trainpod estimate` and `trainpod deploy` run on a laptop before a GPU is paid for; building the base model on the
meta device for these numbers imported torch and transformers first: the tiny finetune's estimate took 5.5 s on
two cores, 0.4 s without them. The numbers here are the ones that build gives, exactly, for the decoders the
shipped finetune configs train (Llama, Mistral, Qwen2/Qwen2.5, Qwen3; tests/test_decoder_shape.py compares them,
tied and untied, GQA, biases); any other model_type is None, and the estimate builds it on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Decoder:
    """What transformers' <model_type>ForCausalLM builds from its config: which linear layers carry a bias (a config
    key that says so, or the fixed answer of its modeling_*.py), whether attention normalizes q and k per head, and
    the defaults its configuration_*.py takes for the keys a config.json leaves out."""

    defaults: dict[str, Any]
    qkv_bias: str | bool = False
    o_bias: str | bool = False
    mlp_bias: str | bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm of head_dim on q and on k in every layer


# transformers 5's defaults; head_dim None is hidden_size / num_attention_heads, num_key_value_heads None is
# num_attention_heads (every class maps a None given in config.json the same way).
DECODERS = {
    "llama": Decoder(
        {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "attention_bias": False,
         "mlp_bias": False},
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
    ),
    "mistral": Decoder(
        {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None},
    ),
    "qwen2": Decoder(  # q, k and v always carry a bias, o never
        {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": None},
        qkv_bias=True,
    ),
    "qwen3": Decoder(
        {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "attention_bias": False},
        qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Linear:
    name: str  # the module's own name, which LoRA's target_modules lists
    in_features: int
    out_features: int


@dataclass(frozen=True)
class DecoderShape:
    model_type: str
    width: int
    layers: int
    vocab: int
    parameters: int  # model.parameters() summed: a tied output head once
    layer_linears: tuple[Linear, ...]  # one decoder layer's nn.Linear modules: q, k, v, o, gate, up, down

    @property
    def linear_weights(self) -> int:
        """The weights of the decoder layers' linear modules (not their biases, not the output head): what 4-bit
        loading quantizes."""
        return self.layers * sum(m.in_features * m.out_features for m in self.layer_linears)

    def lora_parameters(self, r: int, targets: list[str] | str) -> int:
        """LoRA's A (r x in) and B (out x r) on each targeted linear module; 'all-linear' leaves the head out."""
        chosen = [m for m in self.layer_linears if targets == "all-linear" or m.name in targets]
        return self.layers * sum(r * (m.in_features + m.out_features) for m in chosen)


def decoder_shape(config: dict[str, Any]) -> DecoderShape | None:
    """The shape of the model AutoModelForCausalLM.from_config builds from this config.json, or None where the
    arithmetic does not know it: another model_type, remote code (auto_map), or a size that is no whole number."""
    decoder = DECODERS.get(config.get("model_type"))
    if decoder is None or "auto_map" in config:
        return None
    c = {**decoder.defaults, "tie_word_embeddings": False, **config}  # untied by default, all four
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if not all(_whole(c[key]) for key in sizes):
        return None
    h, mlp, vocab, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv_heads, head_dim = c["num_key_value_heads"] or heads, c["head_dim"] or h // heads
    if not _whole(kv_heads) or not _whole(head_dim):
        return None

    def bias(flag: str | bool) -> bool:
        return bool(c[flag]) if isinstance(flag, str) else flag

    q, kv = heads * head_dim, kv_heads * head_dim
    linears = (
        (Linear("q_proj", h, q), bias(decoder.qkv_bias)),
        (Linear("k_proj", h, kv), bias(decoder.qkv_bias)),
        (Linear("v_proj", h, kv), bias(decoder.qkv_bias)),
        (Linear("o_proj", q, h), bias(decoder.o_bias)),
        (Linear("gate_proj", h, mlp), bias(decoder.mlp_bias)),
        (Linear("up_proj", h, mlp), bias(decoder.mlp_bias)),
        (Linear("down_proj", mlp, h), bias(decoder.mlp_bias)),
    )
    # Each linear's weight and bias, the two RMSNorms around attention and the MLP (and Qwen3's q and k norms).
    layer = sum(m.in_features * m.out_features + (m.out_features if b else 0) for m, b in linears)
    layer += 2 * h + (2 * head_dim if decoder.qk_norm else 0)
    embedding = vocab * h
    head = 0 if c["tie_word_embeddings"] else vocab * h  # a bias-free Linear, or the embedding itself
    return DecoderShape(
        model_type=c["model_type"],
        width=h,
        layers=layers,
        vocab=vocab,
        parameters=embedding + layers * layer + h + head,  # + the final norm
        layer_linears=tuple(m for m, _ in linears),
    )


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
