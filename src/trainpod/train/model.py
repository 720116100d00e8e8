"""The pretraining model: transformers' LlamaForCausalLM built from `ModelConfig`, randomly initialised,
and the attention kernels both training workloads choose from. Its sizes on paper (tensor sizes, FLOPs
per token, the padded vocabulary), which `trainpod estimate` reads without torch, are train/shape.py's."""

from __future__ import annotations

import importlib.util

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainpod.config.pretrain import ModelConfig
from trainpod.errors import InputError

# SDPA with is_causal=True and no mask, for sequences that are neither padded nor packed (pretraining).
# transformers builds a dense mask for "sdpa" under torch.compile (its packed-sequence check cannot
# run while tracing), and a mask makes SDPA leave its flash kernel; a name its mask table does not
# know makes create_causal_mask return None, and its sdpa function then passes is_causal=True.
CAUSAL_SDPA = "sdpa_causal"


FLASH_ATTN_MAX_HEAD_DIM = 256  # flash-attn 2's kernels stop at 256 dimensions per head


def resolve_attention(
    requested: str,
    device: torch.device,
    field: str = "train.attention",
    head_dim: int | None = None,
    supported: set[str] | None = None,
) -> str:
    """flash-attn 2 on a GPU where it is installed and the heads fit its kernels; else SDPA, packed rows
    included (transformers gives it a block-diagonal mask built from the restarting position ids).
    flash_attention_2 asked for (in `field`) where it cannot run is an InputError
    (exit 2): transformers raised ImportError building the model (or flash-attn at the first step), a
    crash at every start.

    `supported`: the implementations the model class declares (`supported_attention`; None: unknown).
    `auto` picks among them (SDPA, else flex attention on a GPU, else eager: Gemma 2 and gpt-oss have
    no SDPA); one asked for that the model lacks is an InputError, where transformers raised ValueError
    loading the model at every start.

    Packed rows once got flex attention on a GPU without flash-attn (its block mask skips the blocks across
    samples, where SDPA computes them and masks them out), but on the first GPU it met (an H100, torch
    2.11 with transformers 5.17, 2026-11-27) the packing probe (sft/packing_probe.py) measured a packed
    Qwen2 sample moving 1.40 of its spread from itself alone under flex attention, 35x the rounding noise,
    and refused every packed finetune on that image: packed rows now get SDPA wherever the model has it,
    and flex attention only where it has none (Gemma 2, gpt-oss; the config cannot ask for it). Later
    that day flex attention kept packed rows apart on the same GPU at the same heads with no 4-bit layers
    (0.012, as SDPA; bench/results/gpu-2026-11-27/notes.md), so the cause is not found; the probe still
    measures every packed run."""
    if supported is not None and requested != "auto" and requested not in supported:
        raise InputError(
            f"{field}={requested}: the model does not implement it (it implements {', '.join(sorted(supported))}); "
            f"set {field}=auto or one of those"
        )
    flash_attn = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
    too_wide = head_dim is not None and head_dim > FLASH_ATTN_MAX_HEAD_DIM
    if requested == "flash_attention_2" and (too_wide or not flash_attn):
        missing = (
            f"these heads have {head_dim} dimensions, over its {FLASH_ATTN_MAX_HEAD_DIM}"
            if too_wide
            else "this image has no flash-attn package"
            if device.type == "cuda"
            else f"this process has {device}"
        )
        raise InputError(
            f"{field}=flash_attention_2 needs flash-attn on a GPU, and {missing}; set {field}=auto "
            "(flash-attn where it is installed, else SDPA) or sdpa"
        )
    if requested != "auto":
        return requested

    def implemented(name: str) -> bool:
        return supported is None or name in supported

    if flash_attn and not too_wide and implemented("flash_attention_2"):
        return "flash_attention_2"
    if implemented("sdpa"):
        return "sdpa"
    if device.type == "cuda" and implemented("flex_attention"):
        return "flex_attention"
    return "eager"


def causal_fast_path(attention: str) -> str:
    """The attention to use for whole, unpadded sequences: `attention`, with "sdpa" made mask-free."""
    if attention != "sdpa":
        return attention  # flash-attn needs no mask without padding; eager is the reference
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    return CAUSAL_SDPA


def llama_config(model: ModelConfig, vocab_size: int, seq_len: int, attention: str = "sdpa") -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.mlp_width,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads or model.num_heads,
        max_position_embeddings=seq_len,
        rope_theta=model.rope_theta,
        tie_word_embeddings=model.tie_embeddings,
        initializer_range=model.init_std,
        attention_dropout=model.dropout,
        use_cache=False,
    )
    config._attn_implementation = attention
    return config


def build_model(config: LlamaConfig, seed: int, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """A freshly initialised model, identical for the same seed on every rank and every start."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model


def parameter_count(config: LlamaConfig) -> int:
    """Parameters of the model `config` describes, counted on the meta device (no memory used); train/shape.py
    gives the same count without torch."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors are counted once


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on a GPU that has it; None (fp32) otherwise or when asked for fp32."""
    if precision == "fp32":
        return None
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if precision == "bf16":
        raise InputError(
            f"train.precision=bf16 needs a GPU with bf16 support; this process has {device}. "
            "Use train.precision=auto or fp32"
        )
    return None
