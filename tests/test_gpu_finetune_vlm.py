"""GPU tier for finetune-vlm (`pytest -m gpu`, run where a CUDA GPU is lent; `make test` deselects it).

QLoRA of the tiny Qwen2-VL with bitsandbytes' CUDA NF4 kernels and bf16 compute, as the shipped
Qwen3-VL-2B config runs (gradient checkpointing, paged 8-bit AdamW): the language model's linear
layers are 4-bit, the vision tower and projector stay unquantized in bf16, a few steps train with
a finite loss, and the adapter is saved with its processor. The CPU twin: test_finetune_vlm.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from support import run_trainpod
from vlm_support import STEPS, VLM_RUN, build_vlm_finetuner, fresh, vlm_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU machine)"
    ),
]
GPU_SETTINGS = (
    "--set",
    "quantization.compute_dtype=auto",
    "--set",
    "train.optimizer=paged_adamw_8bit",
    "--set",
    "train.gradient_checkpointing=true",
    "--set",
    "train.cpu_threads=null",
)


def test_vlm_qlora_on_gpu_trains_with_a_finite_loss_and_saves_the_adapter(vlm_base_volume, tmp_path):
    volume = fresh(vlm_base_volume, tmp_path / "volume")
    result = run_trainpod(*vlm_args(*GPU_SETTINGS), volume=volume, timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "precision torch.bfloat16" in out and "device cuda" in out
    run = volume / "runs" / VLM_RUN
    losses = [row["loss"] for row in map(json.loads, (run / "logs/metrics.jsonl").read_text().splitlines())
              if "loss" in row]  # fmt: skip
    assert len(losses) >= STEPS and all(math.isfinite(loss) for loss in losses), losses
    adapter = run / "export/adapter"
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0
    assert (adapter / "preprocessor_config.json").is_file()
    summary = json.loads((adapter / "training_summary.json").read_text())
    assert summary["method"] == "qlora" and summary["quantization"]["compute_dtype"] == "bfloat16"
    assert summary["vision"]["kept_unquantized"]


def test_vlm_qlora_on_gpu_quantizes_only_the_language_model_and_keeps_the_vision_tower_in_bf16(
    vlm_base_volume, tmp_path
):
    import bitsandbytes as bnb

    volume = fresh(vlm_base_volume, tmp_path / "volume")
    trainer = build_vlm_finetuner(volume, [s for s in GPU_SETTINGS if s != "--set"])
    modules = dict(trainer.model.named_modules())
    quantized = [name for name, module in modules.items() if isinstance(module, bnb.nn.Linear4bit)]
    assert quantized and all("language_model" in name for name in quantized), quantized
    assert all(modules[name].weight.device.type == "cuda" for name in quantized)
    vision = {name: p for name, p in trainer.model.named_parameters() if ".visual." in f".{name}"}
    assert vision and all(p.dtype == torch.bfloat16 and p.device.type == "cuda" for p in vision.values()), {
        name: (p.dtype, p.device) for name, p in vision.items()
    }
    assert not any(p.requires_grad for name, p in vision.items() if "lora_" not in name), (
        "the vision tower must stay frozen"
    )
