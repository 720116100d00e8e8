"""The finetune-vlm workload as a user runs it on CPU: a tiny Qwen2-VL learns to read rendered strings
with QLoRA, is evaluated by generation (CER, WER, exact match) with predictions on the volume and
in `trainpod status`, resumes byte-identically after SIGTERM and SIGKILL, and exports an adapter
that peft loads onto the base with its processor. (bitsandbytes' 4-bit layers run on CPU here; the
GPU path is the same code with CUDA kernels.)"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from support import run_trainpod, signal_when_step_reached, start_trainpod, tree_snapshot
from vlm_support import OCR_FILE, STEPS, VLM_BASE, VLM_RUN, adapter_bytes, fresh, vlm_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(vlm_base_volume: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    volume = fresh(vlm_base_volume, tmp_path_factory.mktemp("vlm-uninterrupted"))
    result = run_trainpod(*vlm_args(), volume=volume, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return volume


def test_a_tiny_vlm_trains_and_is_evaluated_by_generation(finished):
    run = finished / "runs" / VLM_RUN
    assert (run / "DONE").exists()
    records = [
        json.loads(line) for line in (run / f"eval/step-{STEPS}.predictions.jsonl").read_text().splitlines()
    ]
    assert records, "the generation eval wrote no predictions"
    for record in records:
        assert {"prompt", "reference", "prediction", "scores", "images"} <= record.keys()
        assert record["images"] and Path(record["images"][0]).is_file()
        assert {"cer", "wer", "exact_match", "cer_normalized"} <= record["scores"].keys()
    worst = [
        json.loads(line) for line in (run / f"eval/step-{STEPS}.worst-cer.jsonl").read_text().splitlines()
    ]
    assert [w["scores"]["cer"] for w in worst] == sorted((w["scores"]["cer"] for w in worst), reverse=True)
    logged = [json.loads(line) for line in (run / "logs/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged if "eval_cer" in m] == [4, 8]
    status = json.loads((run / "status.json").read_text())
    assert status["eval_metrics"]["step"] == STEPS and status["eval_metrics"]["eval_cer"] >= 0


def test_trainpod_status_shows_the_generation_metrics_and_the_predictions(finished):
    result = run_trainpod("status", VLM_RUN, volume=finished)
    assert result.returncode == 0, result.stderr
    assert "cer " in result.stdout and "exact_match " in result.stdout
    assert f"step-{STEPS}.predictions.jsonl" in result.stdout


def test_checkpoints_compete_for_best_by_cer(finished):
    kept = {}
    for manifest in (finished / "runs" / VLM_RUN / "checkpoints").glob("step-*/manifest.json"):
        data = json.loads(manifest.read_text())
        kept[data["step"]] = data.get("score")
    scored = {step: score for step, score in kept.items() if score}
    assert scored and all(score["metric"] == "eval_cer" for score in scored.values())


def test_the_adapter_loads_with_peft_onto_the_base_and_the_processor_from_its_folder(finished):
    from huggingface_hub import ModelCard
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    adapter = finished / "runs" / VLM_RUN / "export/adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    targets = config["target_modules"]
    assert targets and not any("visual" in name for name in targets), "the vision tower must stay frozen"
    summary = json.loads((adapter / "training_summary.json").read_text())
    assert summary["method"] == "qlora" and summary["vision"]["kept_unquantized"]
    base = AutoModelForImageTextToText.from_pretrained(str(finished / VLM_BASE))
    model = PeftModel.from_pretrained(base, str(adapter))
    assert any("lora_A" in name for name, _ in model.named_parameters())
    assert AutoImageProcessor.from_pretrained(str(adapter)).merge_size == 2
    assert AutoTokenizer.from_pretrained(str(adapter)).chat_template
    card = ModelCard.load(adapter / "README.md")  # how the Hub page says to load it: on its base, as above
    assert card.data.library_name == "peft" and card.data.pipeline_tag == "image-text-to-text"
    assert "PeftModel.from_pretrained(base" in card.text and "AutoProcessor.from_pretrained" in card.text


@pytest.mark.parametrize(
    ("signum", "at", "data_edited"),
    [(signal.SIGTERM, 3, True), (signal.SIGKILL, 5, False)],
    ids=["sigterm-data-edited", "sigkill"],
)
def test_an_interrupted_run_resumes_to_the_same_adapter(
    vlm_base_volume, finished, tmp_path, signum, at, data_edited
):
    """With the data file edited while the run was stopped (rows dropped and reordered, the images as they
    were), the resume trains on the rows its first start prepared (runs/<run>/vlm_data.json): it prepared the
    edited ones and went on at the same step of another sample list, silently."""
    volume = fresh(vlm_base_volume, tmp_path / "volume")
    proc = start_trainpod(*vlm_args(), volume=volume)
    out = signal_when_step_reached(proc, volume, at, signum, timeout=600, run=VLM_RUN)
    assert proc.returncode == (143 if signum == signal.SIGTERM else -signal.SIGKILL), out
    if data_edited:
        rows = (volume / OCR_FILE).read_text().splitlines(keepends=True)
        (volume / OCR_FILE).write_text("".join(reversed(rows[8:])))
    result = run_trainpod(*vlm_args(), volume=volume, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from step-" in result.stdout + result.stderr
    assert adapter_bytes(volume) == adapter_bytes(finished)


def test_a_row_with_a_missing_image_exits_2_naming_the_file_line_and_field(vlm_base_volume, tmp_path):
    volume = fresh(vlm_base_volume, tmp_path / "volume")
    rows = (volume / OCR_FILE).read_text().splitlines()
    bad = json.loads(rows[2])
    bad["messages"][0]["content"][0]["image"] = "images/gone.png"
    rows[2] = json.dumps(bad)
    (volume / OCR_FILE).write_text("\n".join(rows) + "\n")
    result = run_trainpod(*vlm_args(), volume=volume)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert f"{volume / OCR_FILE}, line 3" in out
    assert "messages[0].content[0].image" in out and "gone.png" in out
    assert "Traceback" not in out


def test_merging_the_adapter_gives_a_model_transformers_loads_with_its_processor(finished, tmp_path):
    """The language model's adapted weights change; the vision tower (kept unquantized in training) is the
    base's, bit for bit, even with qlora_base: dequantized."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    volume = fresh(finished, tmp_path / "volume")
    config = tmp_path / "convert.yaml"
    config.write_text(
        f"name: {VLM_RUN}\nadapter: run:{VLM_RUN}\nbase_model: {VLM_BASE}\n"
        "task:\n  - kind: merge\n    dtype: float32\n    qlora_base: dequantized\n"
    )
    result = run_trainpod("run", "convert", "--config", str(config), volume=volume, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    merged_dir = volume / "runs" / VLM_RUN / "export/merged"
    merged = AutoModelForImageTextToText.from_pretrained(str(merged_dir)).state_dict()
    base = AutoModelForImageTextToText.from_pretrained(str(volume / VLM_BASE)).state_dict()
    vision = [k for k in base if ".visual." in f".{k}"]
    assert vision and all(torch.equal(merged[k], base[k]) for k in vision)
    adapted = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[adapted], base[adapted])
    assert AutoImageProcessor.from_pretrained(str(merged_dir)).merge_size == 2
    assert AutoTokenizer.from_pretrained(str(merged_dir)).chat_template


def test_an_mlx_conversion_of_a_vlm_adapter_is_refused_with_the_merge_route(finished, tmp_path):
    volume = fresh(finished, tmp_path / "volume")
    config = tmp_path / "convert.yaml"
    config.write_text(
        f"name: {VLM_RUN}\nadapter: run:{VLM_RUN}\nbase_model: {VLM_BASE}\ntask:\n  - kind: mlx\n"
    )
    result = run_trainpod("run", "convert", "--config", str(config), volume=volume)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "vision-language adapter" in out and "kind: merge" in out


def test_early_stopping_without_a_validation_split_is_exit_2_before_anything_is_written(
    vlm_base_volume, tmp_path
):
    """It never evaluated, so it never stopped early: it trained, silently, to its last paid step."""
    volume = fresh(vlm_base_volume, tmp_path / "volume")
    before = tree_snapshot(volume)
    settings = ("--set", "data.val_ratio=0", "--set", "train.early_stopping_patience=2")
    result = run_trainpod(*vlm_args(*settings), volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "needs a validation split, and data.val_ratio is 0" in output and "Traceback" not in output
    assert tree_snapshot(volume) == before
