"""VLM finetune benchmarks: trainpod's finetune-vlm loop vs transformers' Trainer + peft, and the share of
training time that evaluation by generation takes at the shipped 2B config's settings.

    python bench/run_all.py --only finetune_vlm      # or: python bench/bench_finetune_vlm.py [--quick]

A small Qwen2-VL built here (tests/vlm_support.py at benchmark size: language model 4 layers x 256, vision
tower 2 blocks x 128), rendered strings in 112x112 images (16 image tokens each), fp32 on CPU, 2 threads.
1. QLoRA (bitsandbytes NF4 on CPU, the vision tower and projector kept unquantized on both sides, the
   same LoRA targets): trainpod vs a Trainer fed trainpod's processed batches in trainpod's order; tokens/s
   of real tokens; target >= 1.0x. trainpod's loop makes each batch's pixels inside its timing; the
   baseline's were made before it starts (which favours the baseline).
2. Generation eval: one eval interval of the shipped config (configs/finetune/qwen3-vl-2b-qlora-ocr.yaml:
   its micro batch, accumulation, gradient checkpointing, eval_every, eval_batches, generation samples and
   max_new_tokens, read from the file) on this model, every answer forced to max_new_tokens (the most the
   setting allows): seconds of generation against seconds of training.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))  # the tiny Qwen2-VL and the rendered OCR rows the tests build
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from abba import paired  # noqa: E402
from bench_finetune import (  # noqa: E402
    CountingCollator,
    baseline_arguments,
    baseline_model,
    fresh_run_context,
    in_order_trainer,
    rates,
    timed_loop,
    timed_train,
)

from trainpod.config import load_config  # noqa: E402
from trainpod.config.finetune_vlm import VlmFinetuneConfig  # noqa: E402
from trainpod.sft.vision import VisionBatches, VisionProcessor, load_vision, vision_key  # noqa: E402
from trainpod.train.distributed import init_distributed  # noqa: E402
from trainpod.train.lora import peft_lora_config  # noqa: E402
from trainpod.workloads.finetune_vlm import PROJECTORS, VISION_TOWERS, VlmFinetuner  # noqa: E402

from vlm_support import OCR_FILE, VLM_BASE, make_tiny_vlm, write_ocr_jsonl  # noqa: E402

TARGET = 1.0
RUN = "bench-finetune-vlm"
SHIPPED = REPO / "configs/finetune/qwen3-vl-2b-qlora-ocr.yaml"
MICRO_BATCH = 8
CUTOFF = 128
ROWS = 400
IMAGE_SIZE = 112  # 8x8 patches of 14 px, merged 2x2: 16 image tokens
TEXT = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
VISION = {"depth": 2, "embed_dim": 128, "num_heads": 4}
# The names trainpod keeps unquantized (finetune_vlm.py's _load_4bit), as regexes from a name's start.
KEEP_UNQUANTIZED = [rf"(?:.*\.)?{name}" for name in VISION_TOWERS + PROJECTORS]


def make_inputs(volume: Path) -> None:
    make_tiny_vlm(volume / VLM_BASE, TEXT, VISION)
    write_ocr_jsonl(volume / OCR_FILE, ROWS, seed=1, image_size=IMAGE_SIZE)


def bench_config(steps: int, extra: Sequence[str] = ()) -> VlmFinetuneConfig:
    """QLoRA on the benchmark's VLM, no eval, no commit within the run (every_steps 100); `extra` last."""
    overrides = [
        f"name={RUN}",
        "method=qlora",
        f"data.cutoff_len={CUTOFF}",
        "data.val_ratio=0",
        f"train.max_steps={steps}",
        f"train.micro_batch_size={MICRO_BATCH}",
        "train.grad_accum_steps=1",
        "train.eval_every=0",
        "train.early_stopping_metric=eval_loss",
        "train.log_every=10",
        "train.gradient_checkpointing=false",
        "train.cpu_threads=2",
        "checkpoint.every_steps=100",
        *extra,
    ]
    return load_config(VlmFinetuneConfig, REPO / "configs/finetune/tiny-vlm.yaml", overrides)


def build_trainer(volume: Path, cfg: VlmFinetuneConfig) -> VlmFinetuner:
    return VlmFinetuner(fresh_run_context(volume, RUN), cfg, init_distributed())


def trainpod_run(volume: Path, steps: int) -> tuple[float, int, float]:
    """(seconds, real tokens, packing efficiency) of trainpod's finetune-vlm loop."""
    return timed_loop(build_trainer(volume, bench_config(steps)))


def trainpod_processed_rows(volume: Path, steps: int) -> list[dict[str, Any]]:
    """The samples of trainpod's first `steps` micro batches in its order: ids and labels without padding,
    each with its own image's pixel_values and image_grid_thw, as trainpod's VisionBatches made them."""
    cfg = bench_config(steps)
    base = volume / VLM_BASE
    processor = VisionProcessor(base, cfg.data.min_pixels, cfg.data.max_pixels)
    data = load_vision(volume / "cache/vlm" / vision_key(cfg.data, processor, base, volume))
    t = cfg.train
    batches = VisionBatches(
        data.train, processor, micro_batch_size=t.micro_batch_size, max_len=CUTOFF, seed=t.seed, rank=0,
        world_size=1, pad_id=data.pad_id,
    )  # fmt: skip
    rows = []
    for _ in range(steps):
        batch = batches.next_batch()
        pixels = batch["pixel_values"].split(batch["image_grid_thw"].prod(-1).tolist())
        for ids, labels, mask, sample_pixels, grid in zip(
            batch["input_ids"], batch["labels"], batch["attention_mask"], pixels, batch["image_grid_thw"],
            strict=True,
        ):  # fmt: skip
            real = mask.bool()
            rows.append(
                {
                    "input_ids": ids[real].tolist(),
                    "labels": labels[real].tolist(),
                    "pixel_values": sample_pixels,
                    "image_grid_thw": grid[None],
                }
            )
    return rows


class VisionCollator:
    """A user's collator for Qwen2-VL rows whose pixels are made: the text padded by DataCollatorForSeq2Seq,
    the images' patches concatenated, the image tokens marked for M-RoPE (mm_token_type_ids)."""

    def __init__(self, tokenizer: Any, image_token_id: int):
        from transformers import DataCollatorForSeq2Seq

        self.pad = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
        self.image_token_id = image_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.pad([{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features])
        batch["pixel_values"] = torch.cat([f["pixel_values"] for f in features])
        batch["image_grid_thw"] = torch.cat([f["image_grid_thw"] for f in features])
        batch["mm_token_type_ids"] = (batch["input_ids"] == self.image_token_id).long()
        return batch


def trainer_baseline(volume: Path, steps: int, targets: list[str]) -> tuple[float, int]:
    """transformers' Trainer + peft QLoRA on trainpod's processed batches, in trainpod's order."""
    from peft import get_peft_model
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    cfg = bench_config(steps)
    rows = trainpod_processed_rows(volume, steps)
    base = str(volume / VLM_BASE)
    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(cfg.train.seed)
    gpu = torch.cuda.is_available()
    model = baseline_model(base, cfg, gpu, AutoModelForImageTextToText, KEEP_UNQUANTIZED)
    # The same adapters as trainpod's: the language model's linear layers it chose, by full name.
    model = get_peft_model(model, peft_lora_config(cfg.lora.model_copy(update={"target_modules": targets})))
    collator = CountingCollator(VisionCollator(tokenizer, tokenizer.convert_tokens_to_ids("<|image_pad|>")))
    trainer = in_order_trainer(model, baseline_arguments(volume, cfg, steps, gpu), rows, collator)
    return timed_train(trainer), collator.real_tokens


def compare(volume: Path, steps: int, pairs: int, targets: list[str]) -> dict[str, float]:
    return rates(
        *paired(pairs, lambda: trainer_baseline(volume, steps, targets), lambda: trainpod_run(volume, steps))
    )


# ----------------------------------------------------------------------------- generation eval share
def shipped_eval_settings(steps: int) -> list[str]:
    """The shipped 2B config's batch, checkpointing and eval settings as overrides, for `steps` steps."""
    shipped = load_config(VlmFinetuneConfig, SHIPPED, [])
    t, gen = shipped.train, shipped.generation_eval
    return [
        f"train.max_steps={steps}",
        f"train.micro_batch_size={t.micro_batch_size}",
        f"train.grad_accum_steps={t.grad_accum_steps}",
        f"train.gradient_checkpointing={str(t.gradient_checkpointing).lower()}",
        f"train.eval_every={min(t.eval_every, steps)}",  # --quick: one eval in its fewer steps
        f"train.eval_batches={t.eval_batches}",
        f"train.lr={t.lr}",
        f"train.early_stopping_metric={t.early_stopping_metric}",
        f"generation_eval.every_evals={gen.every_evals}",
        f"generation_eval.max_samples={gen.max_samples}",
        f"generation_eval.max_new_tokens={gen.max_new_tokens}",
        f"checkpoint.every_steps={shipped.checkpoint.every_steps}",
        "data.val_ratio=0.25",  # ~100 validation samples: the shipped max_samples (64) all exist
    ]


class TimedVlmFinetuner(VlmFinetuner):
    """The finetune-vlm trainer with its eval and generation time and its generated tokens counted."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.eval_seconds = self.generation_seconds = 0.0
        self.generated_tokens = self.generated_answers = 0
        self.prompt_tokens = 0

    def evaluate(self, model: torch.nn.Module, step: int) -> float:
        started = time.perf_counter()
        try:
            return super().evaluate(model, step)
        finally:
            self.eval_seconds += time.perf_counter() - started

    def _generation_eval(self, step: int) -> None:
        started = time.perf_counter()
        super()._generation_eval(step)
        self.generation_seconds += time.perf_counter() - started

    def generation_prompts(self, limit: int) -> list:
        prompts = super().generation_prompts(limit)
        self.prompt_tokens += sum(p.inputs["input_ids"].shape[1] for p in prompts)
        return prompts


def force_full_answers(trainer: TimedVlmFinetuner) -> None:
    """Every answer runs to max_new_tokens (end-of-sequence suppressed until then), and is counted."""
    model = trainer.model
    model.get_base_model().generation_config.min_new_tokens = trainer.cfg.generation_eval.max_new_tokens
    generate = model.generate

    def counted(**inputs: Any) -> torch.Tensor:
        output = generate(**inputs)
        trainer.generated_tokens += output.shape[1] - inputs["input_ids"].shape[1]
        trainer.generated_answers += 1
        return output

    model.generate = counted


def generation_share(volume: Path, steps: int) -> dict[str, float]:
    """Seconds of training, of the loss eval and of generation over `steps` steps at the shipped settings."""
    cfg = bench_config(steps, shipped_eval_settings(steps))
    trainer = TimedVlmFinetuner(fresh_run_context(volume, RUN), cfg, init_distributed())
    force_full_answers(trainer)
    seconds, tokens, _ = timed_loop(trainer)
    train_seconds = seconds - trainer.eval_seconds
    return {
        "steps": steps,
        "loop_s": seconds,
        "train_s": train_seconds,
        "train_tokens": tokens,
        "loss_eval_s": trainer.eval_seconds - trainer.generation_seconds,
        "generation_s": trainer.generation_seconds,
        "answers": trainer.generated_answers,
        "generated_tokens": trainer.generated_tokens,
        "prompt_tokens": trainer.prompt_tokens,
        "share": trainer.generation_seconds / train_seconds,
        "per_generated_token_ms": 1000 * trainer.generation_seconds / max(trainer.generated_tokens, 1),
        "per_train_token_ms": 1000 * train_seconds / tokens,
    }


# ----------------------------------------------------------------------------------------- report
def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run(workdir: Path, quick: bool = False) -> str:
    volume = workdir / "finetune-vlm-volume"
    shutil.rmtree(volume, ignore_errors=True)
    volume.mkdir(parents=True)
    make_inputs(volume)
    torch.set_num_threads(2)
    steps, pairs = (8, 2) if quick else (30, 4)
    prepare = build_trainer(volume, bench_config(1))  # prepares (and caches) the samples both sides read
    timed_loop(prepare)
    targets = sorted(prepare.model.peft_config["default"].target_modules)
    load_before = load_average()
    speed = compare(volume, steps, pairs, targets)
    load_after = load_average()
    interval = load_config(VlmFinetuneConfig, SHIPPED, []).train.eval_every
    share = generation_share(volume, 10 if quick else interval)
    load_end = load_average()
    return report(speed, share, steps, pairs, len(targets), (load_before, load_after, load_end))


def report(
    speed: dict[str, float], share: dict[str, float], steps: int, pairs: int, n_targets: int, loads: tuple
) -> str:
    shipped = load_config(VlmFinetuneConfig, SHIPPED, [])
    t, gen = shipped.train, shipped.generation_eval
    verdict = "pass" if speed["ratio"] >= TARGET else "FAIL"
    per_eval = share["generation_s"] / max(share["answers"], 1) * gen.max_samples
    return "\n".join(
        [
            "## VLM finetune",
            "",
            f"Model: Qwen2-VL built here (tests/vlm_support.py): language model 4 layers x 256, vision tower 2 "
            f"blocks x 128, QLoRA (NF4 on CPU through bitsandbytes; vision tower and projector unquantized) r=8 on "
            f"the language model's linear layers ({n_targets} names), fp32 compute, 2 threads; {ROWS} rendered strings in "
            f"{IMAGE_SIZE}x{IMAGE_SIZE} images (16 image tokens each), micro batch {MICRO_BATCH}, {steps} steps. "
            "Baseline: transformers' Trainer + peft QLoRA (the same unquantized modules and LoRA targets) with a "
            "collator of DataCollatorForSeq2Seq padding + concatenated pixels, fed trainpod's processed samples "
            "in trainpod's order; trainpod makes each batch's pixels inside its timed loop, the baseline's were "
            f"made before. {pairs} back-to-back pairs in ABBA order, best run of each, median pair ratio beside "
            "it; real tokens counted on both sides. The machine is shared with two other engineers' jobs: load "
            f"average (1, 5, 15 min) {loads[0]} before, {loads[1]} after; ratios within this run are what count.",
            "",
            "| metric | measured | target | result |",
            "| --- | --- | --- | --- |",
            f"| Trainer + peft QLoRA baseline (best run) | {speed['baseline']:,.0f} tokens/s | | |",
            f"| trainpod finetune-vlm QLoRA (best run) | {speed['ours']:,.0f} tokens/s | | |",
            f"| trainpod / baseline | {speed['ratio']:.2f}x | >= {TARGET}x | {verdict} |",
            f"| trainpod / baseline, median of the pair ratios | {speed['pair_ratio']:.2f}x | | |",
            "",
            f"Generation eval at the shipped settings ({SHIPPED.relative_to(REPO)}: micro batch "
            f"{t.micro_batch_size} x accumulation {t.grad_accum_steps}, gradient checkpointing, eval every "
            f"{t.eval_every} steps with {t.eval_batches} loss batches, every {gen.every_evals} eval(s) greedy "
            f"answers to {gen.max_samples} samples of up to {gen.max_new_tokens} new tokens): one eval interval "
            f"({share['steps']} steps) of the model above, every answer forced to {gen.max_new_tokens} tokens; "
            f"load average {loads[2]} at the end.",
            "",
            "| metric | measured |",
            "| --- | --- |",
            f"| training, {share['steps']} steps (commits and logging included) | {share['train_s']:.1f} s "
            f"({share['train_tokens']:,} real tokens, {share['per_train_token_ms']:.2f} ms each) |",
            f"| loss eval ({t.eval_batches} batches) | {share['loss_eval_s']:.1f} s |",
            f"| generation eval ({share['answers']} answers, {share['generated_tokens']:,} tokens after "
            f"{share['prompt_tokens']:,} prompt tokens) | {share['generation_s']:.1f} s "
            f"({share['per_generated_token_ms']:.2f} ms per generated token; {per_eval:.1f} s per eval of "
            f"{gen.max_samples}) |",
            f"| generation eval / training time | {share['share']:.0%} |",
            "",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default="bench-out")
    args = parser.parse_args()
    print(run(Path(args.workdir), args.quick))
