"""Helpers shared by the tests/test_convert_*.py files (no tests here): a tiny Llama base model with a
tokenizer, saved like a real one, and PEFT adapters trained on nothing but with random weights.

LoRA's B starts at zero (and DoRA's magnitude at the weight norm), which makes an adapter a no-op;
every adapter here gets random values instead so that a wrong key, transpose or scale shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from trainpod.config.convert import ConvertConfig
from trainpod.config.loader import validate_tree

torch.set_num_threads(2)

VOCAB = 128
WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
INPUT_IDS = [[5, 17, 3, 99, 42, 7, 64, 120, 2, 33]]


def llama_config(hidden: int = 64, layers: int = 2, tie: bool = False) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        eos_token_id=1,
        bos_token_id=1,
        pad_token_id=0,
    )


def save_tokenizer(folder: Path) -> None:
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>").save_pretrained(
        folder
    )


def make_base(folder: Path, seed: int = 0, **shape) -> Path:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(**shape))
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def load_base(folder: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def randomize_adapter(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1 + 0.2 * torch.rand(param.shape, generator=generator))
            elif "lora_" in name or "modules_to_save" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))


def make_adapter(base: Path, folder: Path, seed: int = 1, summary: dict | None = None, **lora) -> Path:
    """A PEFT adapter for `base` with random weights, saved with its tokenizer and training_summary.json."""
    lora = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"} | lora
    model = get_peft_model(load_base(base), LoraConfig(**lora))
    randomize_adapter(model, seed)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    summary = {"method": "lora", "base_model": str(base), "quantization": None} | (summary or {})
    (folder / "training_summary.json").write_text(json.dumps(summary))
    return folder


def peft_logits(base: Path, adapter: Path) -> torch.Tensor:
    model = PeftModel.from_pretrained(load_base(base), str(adapter)).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(INPUT_IDS)).logits[0]


def base_logits(base: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_base(base)(input_ids=torch.tensor(INPUT_IDS)).logits[0]


def convert_config(tasks: list | dict | str, name: str = "ft", **fields) -> ConvertConfig:
    return validate_tree(ConvertConfig, {"name": name, "task": tasks} | fields)
