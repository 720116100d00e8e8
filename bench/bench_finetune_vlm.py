"""VLM finetune benchmarks: trainpod's finetune-vlm loop vs transformers' Trainer + peft, and the share of
training time that evaluation by generation takes at the shipped 2B config's settings.

    python bench/run_all.py --only finetune_vlm      # or: python bench/bench_finetune_vlm.py [--quick]

A small Qwen2-VL built here (tests/vlm_support.py at benchmark size: language model 4 layers x 256, vision
tower 2 blocks x 128), rendered strings in 112x112 images (16 image tokens each), fp32 on CPU, 2 threads (1 for part 2).
1. QLoRA (bitsandbytes NF4 on CPU, the vision tower and projector kept unquantized on both sides, the
   same LoRA targets): trainpod vs a Trainer fed trainpod's processed batches in trainpod's order; tokens/s
   of real tokens; target >= 1.0x. trainpod's loop makes each batch's pixels inside its timing; the
   baseline's were made before it starts (which favours the baseline).
2. Generation eval's share of training time at the shipped config's settings
   (configs/finetune/qwen3-vl-2b-qlora-ocr.yaml: micro batch, accumulation, gradient checkpointing,
   eval_every, every_evals, max_samples, max_new_tokens, max_steps, read from the file), by parts: a
   training step's seconds (median after a warm-up step) and a greedy answer's seconds through the
   workload's own generation eval, each answer forced to max_new_tokens and, apart, to the length the
   longest OCR reference needs; scaled linearly to the whole run:
   share = (generation evals x samples x seconds per answer) / (max_steps x seconds per step).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
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
from trainpod.workloads.finetune import answer_span  # noqa: E402
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
        "generation_eval.every_evals=0",  # the shipped config's 1 runs at evals, and there are none
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
QUICK_TOKENS = 16  # --quick's forced answer length: a 256-token answer alone takes 10-45 s on this CPU
# One thread for the share's parts: on this 2-core machine under other jobs' load (5-6), two threads
# made every op wait at OpenMP's barrier for a descheduled thread, ~8 ms an op whatever its size (cProfile: a
# layer norm of 2 x 40 x 64 floats 8-15 ms), a step of the tiny test VLM 8-10 s against 0.4-1.5 s at one.
SHARE_THREADS = 1


def work_clock() -> float:
    """Seconds the work costs. CPU: this process's CPU time (one thread: what the step or the answer needs,
    whatever else runs on the machine, while its wall time grew 3-5x under other jobs' load). GPU:
    wall time, the device's work done."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def clock_basis() -> str:
    return "wall time" if torch.cuda.is_available() else "CPU time of the process (time.process_time)"


WARM_STEPS = 1  # the first step builds the optimizer's state and the autograd graph's caches: not timed


def shipped_settings(steps: int) -> list[str]:
    """The shipped 2B config's batch and checkpointing settings as overrides, for `steps` steps and no eval
    inside them (the answers are timed apart, after the steps)."""
    t = load_config(VlmFinetuneConfig, SHIPPED, []).train
    optimizer = [f"train.optimizer={t.optimizer}"] if torch.cuda.is_available() else []  # paged: CUDA only
    return [
        *optimizer,
        f"train.max_steps={steps}",
        f"train.micro_batch_size={t.micro_batch_size}",
        f"train.grad_accum_steps={t.grad_accum_steps}",
        f"train.gradient_checkpointing={str(t.gradient_checkpointing).lower()}",
        f"train.lr={t.lr}",
        f"train.eval_every={t.eval_every}",  # more than `steps`: no eval within the timed steps
        "train.early_stopping_metric=cer",
        "generation_eval.every_evals=1",
        "data.val_ratio=0.25",  # ~100 validation samples: as many as the shipped max_samples (64) exist
    ]


class StepTimedVlmFinetuner(VlmFinetuner):
    """The finetune-vlm trainer with each optimizer step's seconds kept (its micro batches and accumulation,
    the pixels made inside it) and each generation eval's seconds and generated tokens."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.step_seconds: list[float] = []  # work_clock's
        self.step_wall_seconds: list[float] = []
        self.generated_tokens = 0

    def train_step(self, model: torch.nn.Module, step: int):
        started, wall = work_clock(), time.perf_counter()
        result = super().train_step(model, step)
        self.step_seconds.append(work_clock() - started)
        self.step_wall_seconds.append(time.perf_counter() - wall)
        return result

    def timed_generation_eval(self, samples: int, new_tokens: int) -> tuple[float, float, int]:
        """(work_clock seconds, wall seconds, tokens generated) of the workload's own generation eval (`_generation_eval`: prompts,
        greedy answers, scores, predictions file) on `samples` validation samples, each answer forced to
        `new_tokens` tokens: its end-of-sequence is suppressed until then (min_new_tokens)."""
        gen = self.cfg.generation_eval.model_copy(
            update={"max_samples": samples, "max_new_tokens": new_tokens}
        )
        self.cfg = self.cfg.model_copy(update={"generation_eval": gen})
        self.model.eval()  # as evaluate() leaves it: no dropout, and the KV cache on under checkpointing
        self.model.get_base_model().generation_config.min_new_tokens = new_tokens
        tokens_before = self.generated_tokens
        started, wall = work_clock(), time.perf_counter()
        self._generation_eval(self.max_steps)
        return work_clock() - started, time.perf_counter() - wall, self.generated_tokens - tokens_before

    def count_generated(self) -> None:
        generate = self.model.generate

        def counted(**inputs: Any) -> torch.Tensor:
            output = generate(**inputs)
            self.generated_tokens += output.shape[1] - inputs["input_ids"].shape[1]
            return output

        self.model.generate = counted

    def answer_tokens_needed(self, samples: int) -> int:
        """The longest answer, end-of-turn token included, among the first `samples` validation samples: the
        most new tokens the references need (the shortest max_new_tokens that can score them exactly)."""
        return max(
            end - start for start, end in (answer_span(self.data.val[i].labels) for i in range(samples))
        )


def generation_share(
    volume: Path, timed_steps: int, answers: int, forced_tokens: int | None = None, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """Seconds per training step and per greedy answer at the shipped settings, measured on the model at
    volume/models/vlm, for `scale_to_shipped_run`: `timed_steps` steps after WARM_STEPS, `answers` answers
    forced to `forced_tokens` (default: the shipped max_new_tokens) and as many forced to the tokens the
    longest reference needs. `extra`: more config overrides (bench/gpu_finetune.py's GPU settings)."""
    steps = WARM_STEPS + timed_steps
    trainer = StepTimedVlmFinetuner(
        fresh_run_context(volume, RUN),
        bench_config(steps, [*shipped_settings(steps), *extra]),
        init_distributed(),
    )
    timed_loop(trainer)
    trainer.count_generated()
    shipped_gen = load_config(VlmFinetuneConfig, SHIPPED, []).generation_eval
    samples = min(shipped_gen.max_samples, len(trainer.data.val))
    needed = trainer.answer_tokens_needed(samples)
    forced = forced_tokens or shipped_gen.max_new_tokens
    trainer.timed_generation_eval(1, 4)  # warm-up: the first generate() call builds its caches
    forced_s, forced_wall_s, forced_generated = trainer.timed_generation_eval(answers, forced)
    needed_s, _, _ = trainer.timed_generation_eval(answers, needed)
    step_seconds = trainer.step_seconds[WARM_STEPS:]
    return {
        "basis": clock_basis(),
        "timed_steps": len(step_seconds),
        "step_s": statistics.median(step_seconds),
        "step_range": (min(step_seconds), max(step_seconds)),
        "step_wall_s": statistics.median(trainer.step_wall_seconds[WARM_STEPS:]),
        "answers": answers,
        "forced_tokens": forced,
        "forced_answer_s": forced_s / answers,
        "forced_answer_wall_s": forced_wall_s / answers,
        "forced_token_ms": 1000 * forced_s / forced_generated,
        "needed_tokens": needed,
        "needed_answer_s": needed_s / answers,
        "val_samples": samples,
        "forced_below_max": forced != shipped_gen.max_new_tokens,
        "threads": torch.get_num_threads(),
    }


def scale_to_shipped_run(measured: dict[str, Any]) -> dict[str, float]:
    """share = (generation evals x samples x seconds per answer) / (max_steps x seconds per step), with the
    shipped config's counts: evals at every eval_every-th step, a generation eval at every every_evals-th."""
    shipped = load_config(VlmFinetuneConfig, SHIPPED, [])
    t, gen = shipped.train, shipped.generation_eval
    generation_evals = (t.max_steps // t.eval_every) // gen.every_evals
    train_s = t.max_steps * measured["step_s"]
    forced_s = generation_evals * gen.max_samples * measured["forced_answer_s"]
    needed_s = generation_evals * gen.max_samples * measured["needed_answer_s"]
    return {
        "generation_evals": generation_evals,
        "train_s": train_s,
        "forced_s": forced_s,
        "needed_s": needed_s,
        "forced_share": forced_s / train_s,
        "needed_share": needed_s / train_s,
    }


# ----------------------------------------------------------------------------------------- report
def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run(workdir: Path, quick: bool = False, share_only: bool = False) -> str:
    """The table of the speed pairs and the generation share's; `share_only`: the latter alone (seconds)."""
    volume = workdir / "finetune-vlm-volume"
    shutil.rmtree(volume, ignore_errors=True)
    volume.mkdir(parents=True)
    make_inputs(volume)
    torch.set_num_threads(SHARE_THREADS)
    load_before = load_average()
    share = generation_share(volume, 1, 1, QUICK_TOKENS) if quick else generation_share(volume, 8, 4)
    load_between = load_average()
    torch.set_num_threads(2)
    if share_only:
        return share_report(share, (load_before, load_between))
    steps, pairs = (8, 2) if quick else (30, 4)
    prepare = build_trainer(volume, bench_config(1))  # prepares (and caches) the samples both sides read
    timed_loop(prepare)
    targets = sorted(prepare.model.peft_config["default"].target_modules)
    speed = compare(volume, steps, pairs, targets)
    load_after = load_average()
    return (
        speed_report(speed, steps, pairs, len(targets), (load_between, load_after))
        + "\n"
        + share_report(share, (load_before, load_between))
    )


def speed_report(speed: dict[str, float], steps: int, pairs: int, n_targets: int, loads: tuple) -> str:
    verdict = "pass" if speed["ratio"] >= TARGET else "FAIL"
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
            "it; real tokens counted on both sides. Load average (1, 5, 15 min) of the 2-core machine: "
            f"{loads[0]} before, {loads[1]} after; ratios within this run are what count.",
            "",
            "| metric | measured | target | result |",
            "| --- | --- | --- | --- |",
            f"| Trainer + peft QLoRA baseline (best run) | {speed['baseline']:,.0f} tokens/s | | |",
            f"| trainpod finetune-vlm QLoRA (best run) | {speed['ours']:,.0f} tokens/s | | |",
            f"| trainpod / baseline | {speed['ratio']:.2f}x | >= {TARGET}x | {verdict} |",
            f"| trainpod / baseline, median of the pair ratios | {speed['pair_ratio']:.2f}x | | |",
            "",
        ]
    )


def share_report(measured: dict[str, Any], loads: tuple) -> str:
    shipped = load_config(VlmFinetuneConfig, SHIPPED, [])
    t, gen = shipped.train, shipped.generation_eval
    scaled, m = scale_to_shipped_run(measured), measured
    forced_is = (
        "a smoke run, not max_new_tokens" if m["forced_below_max"] else "max_new_tokens, the most allowed"
    )
    answers = f"{scaled['generation_evals']} x {gen.max_samples} answers"
    return "\n".join(
        [
            f"Generation eval at the shipped settings ({SHIPPED.relative_to(REPO)}: {t.max_steps} steps of micro "
            f"batch {t.micro_batch_size} x accumulation {t.grad_accum_steps}, gradient checkpointing "
            f"{'on' if t.gradient_checkpointing else 'off'}; an eval every {t.eval_every} steps, a generation eval "
            f"at every {gen.every_evals} of them: greedy answers to {gen.max_samples} samples of up to "
            f"{gen.max_new_tokens} new tokens), by parts on the model above, {m['threads']} thread(s), seconds "
            f"of {m['basis']}. **Measured**: the median of {m['timed_steps']} optimizer steps after "
            f"{WARM_STEPS} warm-up step(s); {m['answers']} answers through the workload's own generation eval "
            "(VlmFinetuner._generation_eval: prompts, generate, CER/WER, predictions file) after a warm-up "
            f"answer, each forced to its length (min_new_tokens): to {m['forced_tokens']} tokens ({forced_is}), "
            f"and to the {m['needed_tokens']} the longest of the first {m['val_samples']} references needs "
            "(end-of-turn included). **Scaled**: share = (generation evals x samples x seconds per answer) / "
            f"(max_steps x seconds per step) = ({scaled['generation_evals']} x {gen.max_samples} x answer) / "
            f"({t.max_steps} x step); commits, logging and the loss eval are in neither part. Wall time beside, "
            f"for the load: average {loads[0]} before, {loads[1]} after.",
            "",
            "| part | measured | scaled to the shipped run |",
            "| --- | --- | --- |",
            f"| training step (median; range {m['step_range'][0]:.2f}-{m['step_range'][1]:.2f} s) | "
            f"{m['step_s']:.2f} s (wall {m['step_wall_s']:.2f} s) | {t.max_steps} steps: {scaled['train_s']:,.0f} s |",
            f"| answer forced to {m['forced_tokens']} tokens | {m['forced_answer_s']:.2f} s, "
            f"{m['forced_token_ms']:.1f} ms a token (wall {m['forced_answer_wall_s']:.2f} s) | "
            f"{answers}: {scaled['forced_s']:,.0f} s |",
            f"| answer forced to {m['needed_tokens']} tokens | {m['needed_answer_s']:.2f} s | "
            f"{answers}: {scaled['needed_s']:,.0f} s |",
            f"| **generation eval / training**, answers of {m['forced_tokens']} tokens | | "
            f"**{scaled['forced_share']:.0%}** |",
            f"| **generation eval / training**, answers of {m['needed_tokens']} tokens | | "
            f"**{scaled['needed_share']:.0%}** |",
            "",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--share-only", action="store_true", help="the generation share alone")
    parser.add_argument("--workdir", default="bench-out")
    args = parser.parse_args()
    print(run(Path(args.workdir), args.quick, args.share_only))
