"""The finetuning parts of `make gpu-check` (bench/gpu_check.py): what QLoRA of a 32B model costs, and
QLoRA tokens/s against transformers' Trainer + peft.

No hub: the models are random, built here with the layer shapes of the real ones and the tests' small
tokenizer (its ids fit any larger embedding). Memory and step time of QLoRA are linear in the number of
decoder layers (each layer adds its NF4 weights, its adapters and their optimizer states, and one
checkpointed activation), so a model with Qwen2.5-32B's layer shapes and 2 and 4 layers gives the slope
and the intercept, extrapolated to the real model's 64 layers.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the tiny tokenizer the tests build

from bench_finetune import compare, short_rows, trainpod_run  # noqa: E402

from sft_support import make_tiny_tokenizer  # noqa: E402

QWEN25_32B = {  # config.json of Qwen/Qwen2.5-32B-Instruct
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "num_hidden_layers": 64,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
}
QWEN25_05B = {  # config.json of Qwen/Qwen2.5-0.5B-Instruct
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "num_hidden_layers": 24,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}
DRY_SHAPES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
}
SFT_FILE = "data/gpu-check.jsonl"


def random_qwen2(volume: Path, name: str, shapes: dict[str, Any], layers: int) -> str:
    """A random Qwen2 with `shapes` and `layers` decoder layers, saved with the tests' tokenizer; its path."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    folder = make_tiny_tokenizer(volume / "models" / name)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config = Qwen2Config(
        **{**shapes, "num_hidden_layers": layers},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    device = (
        "cuda" if torch.cuda.is_available() else "cpu"
    )  # a 32B-wide layer initialises in seconds on a GPU
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(str(folder))
    del model
    _free()
    return f"models/{name}"


def sft_rows(volume: Path, count: int) -> None:
    path = volume / SFT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in short_rows(count, seed=7)))


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def qlora_overrides(base: str, dry: bool) -> list[str]:
    """The shipped 32B profile (r64, NF4, paged 8-bit AdamW, checkpointing, packed 4k rows), on our data."""
    datasets = json.dumps([{"path": SFT_FILE, "format": "alpaca"}])
    cutoff = 256 if dry else 4096
    return [
        f"base_model.path={base}",
        "method=qlora",
        "lora.r=64",
        "lora.alpha=128",
        "quantization.compute_dtype=auto",
        "train.optimizer=paged_adamw_8bit" if torch.cuda.is_available() else "train.optimizer=adamw",
        "train.gradient_checkpointing=true",
        f"data.sft.datasets={datasets}",
        f"data.sft.cutoff_len={cutoff}",
        "train.micro_batch_size=1",
        "train.cpu_threads=null",
    ]


def qlora_32b_memory(volume: Path, dry: bool) -> dict[str, Any]:
    """Peak GPU memory and step time of QLoRA r64 at 2 and 4 layers of Qwen2.5-32B's shapes, and at 64."""
    shapes = DRY_SHAPES if dry else QWEN25_32B
    layer_counts, steps = ((1, 2), 2) if dry else ((2, 4), 4)
    sft_rows(volume, 3000)
    measured = {}
    for layers in layer_counts:
        base = random_qwen2(volume, f"qwen2.5-32b-shaped-{layers}l", shapes, layers)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        seconds, tokens, _ = trainpod_run(volume, steps, True, qlora_overrides(base, dry))
        measured[layers] = {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
            "step_s": seconds / steps,
            "tokens_per_step": tokens / steps,
        }
        _free()
    low, high = layer_counts
    target_layers = QWEN25_32B["num_hidden_layers"]
    out: dict[str, Any] = {"shapes": shapes, "measured": measured, "target_layers": target_layers}
    for key in ("peak_allocated_bytes", "step_s"):
        if measured[low][key] is None:
            out[f"extrapolated_{key}"] = None
            continue
        slope = (measured[high][key] - measured[low][key]) / (high - low)
        out[f"extrapolated_{key}"] = measured[low][key] + slope * (target_layers - low)
        out[f"per_layer_{key}"] = slope
    return out


def qlora_speed(volume: Path, dry: bool) -> dict[str, Any]:
    """trainpod QLoRA (padded, and packed) against Trainer + peft QLoRA on the same batches (bench_finetune)."""
    shapes = DRY_SHAPES if dry else QWEN25_05B
    base = random_qwen2(volume, "qwen2.5-0.5b-shaped", shapes, 2 if dry else shapes["num_hidden_layers"])
    sft_rows(volume, 3000)
    steps, pairs = (3, 1) if dry else (30, 2)
    extra = [
        *qlora_overrides(base, dry),
        "lora.r=16",
        "lora.alpha=16",
        "train.optimizer=adamw",
        "train.gradient_checkpointing=false",
        f"train.micro_batch_size={2 if dry else 8}",
        f"data.sft.cutoff_len={256 if dry else 1024}",
    ]
    trainpod_run(volume, 1, False, extra)  # tokenizes and caches the samples both sides read
    started = time.perf_counter()
    padded = compare(volume, steps, packing=False, pairs=pairs, extra=extra)
    packed = compare(volume, steps, packing=True, pairs=pairs, extra=extra)
    return {
        "shapes": shapes,
        "steps": steps,
        "pairs": pairs,
        "padded": padded,
        "packed": packed,
        "wall_s": time.perf_counter() - started,
        "median_pair_ratio": statistics.median([padded["pair_ratio"], packed["pair_ratio"]]),
    }


# Qwen2.5-32B's heads (40 of 128 dimensions, 8 KV heads: a head count no power of two, which transformers'
# flex attention meets with repeated KV heads) on a small model; and a power-of-two head count beside it.
PACKING_SHAPES = {
    "40 heads": {"hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8},
    "32 heads": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8},
}
PACKING_ROWS = ((32, 32), (128, 128), (100, 28))  # the probe's own sizes; whole flex blocks; uneven


def packing_attention(volume: Path, dry: bool) -> dict[str, Any]:
    """How far a packed sample moves from itself alone (the packing probe's measure, sft/packing_probe.py)
    under each attention the kit can pick, in bf16 on this device: the qlora-32b part's profile when the
    probe refuses its packing. No target: above the probe's limit is a leak, near 0.01 is rounding."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainpod.sft.packing_probe import LEAK_LIMIT, _moved

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    attentions = ("sdpa", "eager") if dry else ("sdpa", "flex_attention", "eager")
    shapes = {"dry": DRY_SHAPES} if dry else PACKING_SHAPES
    generator = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"limit": LEAK_LIMIT, "dtype": str(dtype), "moved": {}}
    for label, shape in shapes.items():
        config = Qwen2Config(
            **{
                **DRY_SHAPES,
                **shape,
                "num_hidden_layers": 2,
                "intermediate_size": 4 * shape["hidden_size"] // 3,
            },
            use_cache=False,
        )
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen2ForCausalLM(config).to(dtype).eval()
        for attention in attentions:
            model.set_attn_implementation(attention)
            for first, second in PACKING_ROWS:
                ids = torch.randint(0, config.vocab_size, (1, first + second), generator=generator).to(device)
                positions = torch.cat([torch.arange(first), torch.arange(second)])[None].to(device)
                key = f"{label}, {attention}, {first}+{second}"
                try:
                    with torch.no_grad():
                        packed = model(input_ids=ids, position_ids=positions).logits.float()[0, first:]
                        alone = model(input_ids=ids[:, first:]).logits.float()[0]
                    out["moved"][key] = _moved(packed, alone)
                except Exception as exc:  # one attention failing says as much as its figure
                    out["moved"][key] = f"{type(exc).__name__}: {exc}"[:200]
        del model
        _free()
    return out


# Qwen3-VL-2B-Instruct's shapes as its config.json gives them (language model: 28 layers x 2048, MLP 6144,
# 16 heads, 8 KV heads, 151,936 tokens; vision tower: 24 blocks x 1024, MLP 4096, 16 heads), built as a
# Qwen2-VL (tests/vlm_support.py): no DeepStack, 14-pixel patches; the decode and step costs are the
# layers' and the vocabulary's, which these shapes carry.
QWEN3_VL_2B_TEXT = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
}
QWEN3_VL_2B_VISION = {"depth": 24, "embed_dim": 1024, "num_heads": 16, "mlp_ratio": 4}
PAGE_PIXELS = 868  # 62 x 62 patches of 14 px, merged 2x2: 961 image tokens, the shipped ~1,000 per page


def vlm_generation(volume: Path, dry: bool) -> dict[str, Any]:
    """The generation eval's share of training time at the shipped OCR config's settings on this GPU
    (bench_finetune_vlm.generation_share: a step's and an answer's seconds, measured, scaled to the run)
    on a 2B-shaped VLM reading page-sized images; the figures BENCHMARKS.md's VLM section assumes."""
    from bench_finetune_vlm import generation_share, scale_to_shipped_run

    from vlm_support import OCR_FILE, VLM_BASE, make_tiny_vlm, write_ocr_jsonl

    text, vision, pixels = (None, None, 56) if dry else (QWEN3_VL_2B_TEXT, QWEN3_VL_2B_VISION, PAGE_PIXELS)
    make_tiny_vlm(volume / VLM_BASE, text, vision)
    write_ocr_jsonl(volume / OCR_FILE, 40 if dry else 160, seed=1, image_size=pixels)
    extra = [
        "quantization.compute_dtype=auto",
        "data.cutoff_len=2048",
        f"data.max_pixels={pixels * pixels}",
        "train.cpu_threads=null",
    ]
    measured = generation_share(volume, 1 if dry else 8, 1 if dry else 8, 8 if dry else None, extra)
    _free()
    return {"image_pixels": pixels, "measured": measured, "scaled": scale_to_shipped_run(measured)}
