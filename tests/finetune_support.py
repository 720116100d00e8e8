"""A tiny base model and SFT data on a temp volume, for the finetune tests (no hub: built here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from sft_support import make_tiny_tokenizer, write_alpaca_jsonl
from support import CONFIGS

TINY_FINETUNE = CONFIGS / "finetune/tiny.yaml"
FINETUNE_RUN = "tiny-finetune"
BASE = "models/base"
SFT_FILE = "data/sft.jsonl"


def make_base_model(
    volume: Path,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    layers: int = 2,
    kv_heads: int = 2,
    max_positions: int = 256,
) -> Path:
    """A Llama (2 layers x 64 by default) with the test tokenizer (chatml tokens included) at
    volume/models/base, and 240 short alpaca rows at volume/data/sft.jsonl."""
    folder = make_tiny_tokenizer(volume / BASE)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    write_alpaca_jsonl(volume / SFT_FILE, 240, seed=3)
    return folder


def finetune_args(*extra: str, method: str = "qlora") -> tuple[str, ...]:
    """`trainpod run finetune` on the shipped tiny config, pointed at the test's model and data."""
    datasets = json.dumps([{"path": SFT_FILE, "format": "alpaca"}])
    return (
        "run",
        "finetune",
        "--config",
        str(TINY_FINETUNE),
        "--set",
        f"base_model.path={BASE}",
        "--set",
        f"data.sft.datasets={datasets}",
        "--set",
        "data.sft.template=chatml",
        "--set",
        f"method={method}",
        "--set",
        "train.log_every=1",
        *extra,
    )


def adapter_bytes(volume: Path, run: str = FINETUNE_RUN) -> bytes:
    return (volume / "runs" / run / "export" / "adapter" / "adapter_model.safetensors").read_bytes()


def latest_step(volume: Path, run: str = FINETUNE_RUN) -> int:
    return int((volume / "runs" / run / "checkpoints" / "LATEST").read_text().strip().split("-")[1])
