"""finetune-vlm with method lora and full on CPU (test_finetune_vlm.py covers qlora): a tiny Qwen2-VL
trains a few steps with gradient checkpointing (as the shipped 2B config does), the vision tower stays
frozen (and for full, the projector too unless lora.train_projector), full finetuning changes the
language model's weights, and a run stopped by SIGTERM or SIGKILL resumes to byte-identical weights."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trainpod.errors import InputError

from support import run_trainpod, signal_when_step_reached, start_trainpod
from vlm_support import STEPS, VLM_BASE, VLM_RUN, adapter_bytes, build_vlm_finetuner, fresh, vlm_args

pytestmark = pytest.mark.slow

SETTINGS = {
    # lora also adapts the projector (lora.train_projector), so its exception to the frozen tower is tested
    "lora": ("--set", "method=lora", "--set", "lora.train_projector=true"),
    "full": ("--set", "method=full"),
}


def method_args(method: str) -> tuple[str, ...]:
    return vlm_args(*SETTINGS[method], "--set", "train.gradient_checkpointing=true")


def exported_bytes(volume: Path, method: str) -> bytes:
    if method == "lora":
        return adapter_bytes(volume)
    return (volume / "runs" / VLM_RUN / "export/hf/model.safetensors").read_bytes()


def trained_tensor_names(volume: Path) -> list[str]:
    """The names of the tensors the last checkpoint holds: what the optimizer trained."""
    path = volume / "runs" / VLM_RUN / f"checkpoints/step-{STEPS}/trainable.safetensors"
    with safe_open(str(path), "pt") as tensors:
        return list(tensors.keys())


def is_vision(name: str) -> bool:
    return ".visual." in f".{name}"


def is_projector(name: str) -> bool:
    return ".merger." in f".{name}"


@pytest.fixture(scope="module")
def finished(vlm_base_volume: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    volumes = {}
    for method in SETTINGS:
        volume = fresh(vlm_base_volume, tmp_path_factory.mktemp(f"vlm-{method}"))
        result = run_trainpod(*method_args(method), volume=volume, timeout=900)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"method {method}" in result.stdout + result.stderr
        volumes[method] = volume
    return volumes


def test_lora_trains_adapters_on_the_language_model_and_projector_and_none_in_the_vision_tower(finished):
    volume = finished["lora"]
    trained = trained_tensor_names(volume)
    assert trained and all("lora_" in name for name in trained), "lora must train adapters only"
    vision = [name for name in trained if is_vision(name)]
    assert vision and all(is_projector(name) for name in vision), (
        f"the vision tower must stay frozen (only the projector is adapted): {vision}"
    )
    assert any("language_model" in name for name in trained)
    adapter = volume / "runs" / VLM_RUN / "export/adapter"
    summary = json.loads((adapter / "training_summary.json").read_text())
    assert summary["method"] == "lora" and summary["vision"]["projector_trained"]
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as tensors:
        names = [k for k in list(tensors.keys()) if is_projector(k) and "lora_B" in k]
        projector_b = [tensors.get_tensor(k) for k in names]
    assert projector_b and any(t.abs().sum() > 0 for t in projector_b), (
        "the projector's adapters must have trained (lora_B starts at zero)"
    )


def test_full_finetuning_changes_the_language_model_and_leaves_the_vision_tower_bit_identical(finished):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    volume = finished["full"]
    trained = trained_tensor_names(volume)
    assert trained and not any(is_vision(name) for name in trained), (
        "full finetuning without lora.train_projector trains neither the vision tower nor the projector"
    )
    export = volume / "runs" / VLM_RUN / "export/hf"
    tuned = AutoModelForImageTextToText.from_pretrained(str(export)).state_dict()
    base = AutoModelForImageTextToText.from_pretrained(str(volume / VLM_BASE)).state_dict()
    vision = [k for k in base if is_vision(k)]
    assert vision and all(torch.equal(tuned[k], base[k]) for k in vision)
    language = [k for k in base if "language_model.layers" in k and k.endswith("proj.weight")]
    unchanged = [k for k in language if torch.equal(tuned[k], base[k])]
    assert language and not unchanged, f"full finetuning left these weights unchanged: {unchanged}"
    assert AutoImageProcessor.from_pretrained(str(export)).merge_size == 2


def test_qlora_keeps_the_frozen_vision_tower_in_the_compute_dtype_while_adapters_stay_fp32(
    vlm_base_volume, tmp_path
):
    """peft's kbit preparation upcasts every unquantized weight to fp32; the frozen tower goes back to the
    compute dtype (bf16 here, as on a GPU: half the memory), the trained projector adapters stay fp32."""
    volume = fresh(vlm_base_volume, tmp_path / "volume")
    trainer = build_vlm_finetuner(
        volume, ["quantization.compute_dtype=bfloat16", "lora.train_projector=true"]
    )
    vision = {name: p for name, p in trainer.model.named_parameters() if is_vision(name)}
    frozen = {name: p.dtype for name, p in vision.items() if "lora_" not in name}
    adapters = {name: p for name, p in vision.items() if "lora_" in name}
    assert frozen and set(frozen.values()) == {torch.bfloat16}, frozen
    assert not any(vision[name].requires_grad for name in frozen), "the vision tower must stay frozen"
    assert adapters and all(p.dtype == torch.float32 and p.requires_grad for p in adapters.values())


@pytest.mark.parametrize(
    ("method", "signum", "at"),
    [("lora", signal.SIGTERM, 3), ("full", signal.SIGKILL, 5)],
    ids=["lora-sigterm", "full-sigkill"],
)
def test_an_interrupted_run_resumes_to_byte_identical_weights(
    vlm_base_volume, finished, tmp_path, method, signum, at
):
    volume = fresh(vlm_base_volume, tmp_path / "volume")
    proc = start_trainpod(*method_args(method), volume=volume)
    out = signal_when_step_reached(proc, volume, at, signum, timeout=600, run=VLM_RUN)
    assert proc.returncode == (143 if signum == signal.SIGTERM else -signal.SIGKILL), out
    result = run_trainpod(*method_args(method), volume=volume, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from step-" in result.stdout + result.stderr
    assert exported_bytes(volume, method) == exported_bytes(finished[method], method)


def test_a_lora_target_module_that_names_no_language_model_layer_is_refused_naming_it(
    vlm_base_volume, tmp_path
):
    """finetune-vlm adapts the language model's layers whose name is listed; a listed name that is none of them
    (a typo, or the frozen vision tower's qkv) was dropped without a word, training fewer adapters than asked."""
    volume = fresh(vlm_base_volume, tmp_path / "volume")
    with pytest.raises(InputError, match=r"qkv names no linear layer of the language model.*o_proj"):
        build_vlm_finetuner(volume, ["method=lora", 'lora.target_modules=["q_proj","qkv"]'])


def test_a_training_forward_of_the_vlm_builds_no_kv_cache(vlm_base_volume, tmp_path):
    """A VLM's language model reads use_cache from its text_config, not the top config the finetune turned it
    off in: each training forward built a KV cache of every layer (memory for nothing, and with a cache
    transformers' masks skip the packed-row detection)."""
    volume = fresh(vlm_base_volume, tmp_path / "volume")
    trainer = build_vlm_finetuner(volume, ["method=lora"])
    trainer.model.train()
    output = trainer.model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    cache = output.get("cache", output.get("past_key_values"))
    assert cache is None, (
        f"a training forward built a {type(cache).__name__}; set use_cache=False in text_config"
    )
