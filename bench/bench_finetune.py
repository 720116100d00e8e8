"""Finetune benchmarks: trainpod's finetune loop vs a plain transformers Trainer + peft script.

    python bench/bench_finetune.py [--quick]

Same tiny Llama, same tokenized SFT samples (short instruction rows), same LoRA settings, micro
batch, optimizer, schedule and thread count; the Trainer is fed trainpod's padded batches in
trainpod's order. Tokens/s counts real (non-padding) tokens.
1. trainpod without packing (padded batches, as the baseline) vs the Trainer: target >= 1.0x.
2. trainpod with packing vs the same Trainer baseline: target >= 1.5x; packing efficiency reported.
Both time their training loops only (model load and data preparation are outside both); trainpod's
loop includes its checkpoint commits at the default interval, logging, TensorBoard and status.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))  # the tiny tokenizer and instruction rows the tests build

import torch  # noqa: E402
from abba import paired  # noqa: E402

from trainpod.config import load_config  # noqa: E402
from trainpod.config.finetune import FinetuneConfig  # noqa: E402
from trainpod.context import RunContext  # noqa: E402
from trainpod.preemption import PreemptionWatch  # noqa: E402
from trainpod.sft import SftBatches, load_sft, sft_cache_key  # noqa: E402
from trainpod.train.distributed import init_distributed  # noqa: E402
from trainpod.train.lora import peft_lora_config  # noqa: E402
from trainpod.volume import Volume  # noqa: E402
from trainpod.workloads.finetune import Finetuner  # noqa: E402

from finetune_support import BASE, SFT_FILE, make_base_model  # noqa: E402

UNPACKED_TARGET = 1.0
PACKED_TARGET = 1.5
MICRO_BATCH = 8
CUTOFF = 512


def short_rows(count: int, seed: int) -> list[dict[str, str]]:
    """Short instruction rows whose lengths vary as real ones do (log-normal: most a few words,
    some a few dozen), e.g. "Repeat the words." with 1 to 80 words to repeat."""
    import random

    from sft_support import WORDS

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        words = " ".join(
            rng.choice(WORDS) for _ in range(min(80, max(1, round(rng.lognormvariate(1.6, 0.9)))))
        )
        rows.append({"instruction": "Repeat the words.", "input": words, "output": words})
    return rows


def make_inputs(volume: Path) -> None:
    """The tests' base model builder at benchmark size, and short rows of varied length as the data."""
    make_base_model(
        volume, hidden_size=256, intermediate_size=704, layers=4, kv_heads=4, max_positions=CUTOFF
    )
    (volume / SFT_FILE).write_text("".join(json.dumps(row) + "\n" for row in short_rows(3000, seed=1)))


def bench_config(steps: int, packing: bool, extra: Sequence[str] = ()) -> FinetuneConfig:
    """The benchmark's finetune config; `extra` overrides come last (the GPU check's QLoRA on a bigger model)."""
    datasets = json.dumps([{"path": SFT_FILE, "format": "alpaca"}])
    overrides = [
        "name=bench-finetune",
        f"base_model.path={BASE}",
        "method=lora",
        f"data.sft.datasets={datasets}",
        "data.sft.template=chatml",
        f"data.sft.cutoff_len={CUTOFF}",
        "data.sft.val_ratio=0",
        f"data.packing={str(packing).lower()}",
        f"train.max_steps={steps}",
        f"train.micro_batch_size={MICRO_BATCH}",
        "train.grad_accum_steps=1",
        "train.eval_every=0",
        "train.log_every=10",
        "train.gradient_checkpointing=false",
        "train.cpu_threads=2",
        "checkpoint.every_steps=100",  # finetune's default interval
        *extra,
    ]
    return load_config(FinetuneConfig, REPO / "configs/finetune/tiny.yaml", overrides)


def trainpod_run(
    volume: Path, steps: int, packing: bool, extra: Sequence[str] = ()
) -> tuple[float, int, float]:
    """(seconds, real tokens, packing efficiency) of trainpod's finetune loop, commits included."""
    ctx = fresh_run_context(volume, "bench-finetune")
    return timed_loop(Finetuner(ctx, bench_config(steps, packing, extra), init_distributed()))


def fresh_run_context(volume: Path, name: str) -> RunContext:
    """An empty run folder `name` on the volume (an earlier run's removed) and its context."""
    run = Volume(volume).run(name)
    shutil.rmtree(run.root, ignore_errors=True)
    run.create()
    return RunContext(Volume(volume), run, PreemptionWatch())


def timed_loop(trainer: Finetuner) -> tuple[float, int, float]:
    """(seconds, real tokens, packing efficiency) of a built Finetuner's training loop (text or VLM)."""
    trainer.resume()
    trainer.reporter = trainer.make_reporter(0)
    model = trainer.wrap_for_training()
    _sync()
    started = time.perf_counter()
    trainer._loop(model, 0)
    _sync()
    elapsed = time.perf_counter() - started
    trainer.reporter.close()
    return elapsed, trainer.progress.tokens_seen, trainer.batches.packing_efficiency


def trainpod_padded_rows(volume: Path, steps: int, extra: Sequence[str] = ()) -> dict[str, list[list[int]]]:
    """The rows of trainpod's first `steps` padded micro batches, in its order, padding removed."""
    cfg = bench_config(steps, packing=False, extra=extra)
    data = load_sft(
        volume / "cache" / "sft" / sft_cache_key(cfg.data.sft, volume / cfg.base_model.path, volume)
    )
    t, cutoff = cfg.train, cfg.data.sft.cutoff_len
    batches = SftBatches(data.train, t.micro_batch_size, cutoff, False, t.seed, 0, 1, data.pad_id)
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for _ in range(steps):
        batch = batches.next_batch()
        for ids, labels, mask in zip(
            batch["input_ids"], batch["labels"], batch["attention_mask"], strict=True
        ):
            rows["input_ids"].append(ids[mask.bool()].tolist())
            rows["labels"].append(labels[mask.bool()].tolist())
    return rows


def trainer_baseline(volume: Path, steps: int, extra: Sequence[str] = ()) -> tuple[float, int]:
    """What users write by hand: transformers' Trainer, peft LoRA, DataCollatorForSeq2Seq padding; fed
    trainpod's padded batches in trainpod's order, so both sides compute the same batches (random draws
    of their own differed by 2-4% in padding and real tokens, which the comparison should not measure)."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

    cfg = bench_config(steps, packing=False, extra=extra)
    dataset = Dataset.from_dict(trainpod_padded_rows(volume, steps, extra))
    base = str(volume / cfg.base_model.path)
    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(cfg.train.seed)
    gpu = torch.cuda.is_available()
    model = baseline_model(base, cfg, gpu, AutoModelForCausalLM)
    model = get_peft_model(model, peft_lora_config(cfg.lora))  # the same adapters as trainpod's
    collator = CountingCollator(DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
    trainer = in_order_trainer(model, baseline_arguments(volume, cfg, steps, gpu), dataset, collator)
    return timed_train(trainer), collator.real_tokens


def baseline_arguments(volume: Path, cfg: FinetuneConfig, steps: int, gpu: bool) -> Any:
    """The Trainer's TrainingArguments matching trainpod's settings: batch, schedule, optimizer, clipping."""
    from transformers import TrainingArguments

    t = cfg.train
    return TrainingArguments(
        output_dir=str(volume / "trainer-baseline"),
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=t.lr,
        lr_scheduler_type="cosine",
        warmup_steps=round(t.warmup_ratio * steps),  # as trainpod rounds warmup_ratio
        weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip,
        optim="adamw_torch_fused" if gpu else "adamw_torch",  # as trainpod's adamw: fused on CUDA
        bf16=gpu and cfg.train.precision != "fp32",
        gradient_checkpointing=t.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        use_cpu=not gpu,
        dataloader_num_workers=0,
        disable_tqdm=True,
        remove_unused_columns=False,  # the VLM baseline's rows carry pixels the collator reads
        seed=t.seed,
    )


def in_order_trainer(model: Any, args: Any, dataset: Any, collator: Any) -> Any:
    """A transformers Trainer that reads `dataset` in order (trainpod's batch order) instead of shuffling."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer

    class InOrderTrainer(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> SequentialSampler:
            return SequentialSampler(self.train_dataset)

    return InOrderTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)


def timed_train(trainer: Any) -> float:
    """Seconds of `trainer.train()`, the GPU drained before each clock reading."""
    _sync()
    started = time.perf_counter()
    trainer.train()
    _sync()
    return time.perf_counter() - started


def baseline_model(
    folder: str, cfg: FinetuneConfig, gpu: bool, auto_model: Any, keep_modules: Sequence[str] = ()
) -> Any:
    """The baseline's base model as a user's script loads it: fp32 on CPU, bf16 on a GPU, 4-bit for QLoRA
    (`keep_modules` unquantized beside the output head: a VLM's vision tower)."""
    if cfg.method != "qlora":
        dtype = torch.bfloat16 if gpu else torch.float32
        return auto_model.from_pretrained(folder, dtype=dtype).to("cuda" if gpu else "cpu")
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if gpu else torch.float32
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
        llm_int8_skip_modules=[*keep_modules, "lm_head"] if keep_modules else None,
    )
    model = auto_model.from_pretrained(
        folder, quantization_config=quantization, dtype=compute, device_map={"": 0 if gpu else "cpu"}
    )
    return prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=cfg.train.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )


def _sync() -> None:
    """Drain the GPU before reading a clock (kernels run asynchronously); nothing on CPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class CountingCollator:
    """Counts the real (non-padding) tokens of the batches the Trainer trains on, as trainpod counts its own."""

    def __init__(self, collate: Any):
        self.collate = collate
        self.real_tokens = 0

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        self.real_tokens += sum(len(feature["input_ids"]) for feature in features)
        return self.collate(features)


def compare(
    volume: Path, steps: int, packing: bool, pairs: int, extra: Sequence[str] = ()
) -> dict[str, float]:
    """Tokens/s of the best run of each over `pairs` ABBA pairs (abba.py), the median pair ratio beside it."""
    return rates(
        *paired(
            pairs,
            lambda: trainer_baseline(volume, steps, extra),
            lambda: trainpod_run(volume, steps, packing, extra),
        )
    )


def rates(
    base_runs: Sequence[tuple[float, int]], ours_runs: Sequence[tuple[float, int, float]]
) -> dict[str, float]:
    """Best tokens/s of each side, their ratio, the median of the pair ratios, and trainpod's packing efficiency."""
    base_rates = [tokens / seconds for seconds, tokens in base_runs]
    ours_rates = [tokens / seconds for seconds, tokens, _efficiency in ours_runs]
    return {
        "ours": max(ours_rates),
        "baseline": max(base_rates),
        "ratio": max(ours_rates) / max(base_rates),
        "pair_ratio": statistics.median(o / b for o, b in zip(ours_rates, base_rates, strict=True)),
        "efficiency": ours_runs[-1][2],
    }


def run(workdir: Path, quick: bool = False) -> str:
    volume = workdir / "finetune-volume"
    shutil.rmtree(volume, ignore_errors=True)
    volume.mkdir(parents=True)
    make_inputs(volume)
    torch.set_num_threads(2)
    steps, pairs = (10, 2) if quick else (40, 4)
    trainpod_run(volume, 1, False)  # prepares (and caches) the tokenized samples both sides read
    unpacked = compare(volume, steps, packing=False, pairs=pairs)
    packed = compare(volume, steps, packing=True, pairs=pairs)

    def verdict(ratio: float, target: float) -> str:
        return "pass" if ratio >= target else "FAIL"

    return "\n".join(
        [
            "## Finetune",
            "",
            f"Model: Llama 4 layers x 256 wide, LoRA r=8 on every linear layer, fp32 on CPU, 2 threads; 3000 short "
            f"alpaca rows of varied length (1-80 words, log-normal; chatml, cutoff {CUTOFF}), micro batch {MICRO_BATCH}, {steps} steps. Baseline: transformers' "
            "Trainer + peft with DataCollatorForSeq2Seq (padding to the longest in the batch) on the same token ids. "
            f"{pairs} back-to-back pairs in alternating order (ABBA), judged on the best run of each (this "
            "machine's speed drifts by tens of percent between runs; interference only slows a run), the "
            "median of the pair ratios shown too; tokens are real tokens (no padding), counted on both sides.",
            "",
            "| metric | measured | target | result |",
            "| --- | --- | --- | --- |",
            f"| Trainer + peft baseline (best run) | {unpacked['baseline']:,.0f} tokens/s | | |",
            f"| trainpod, padded (best run) | {unpacked['ours']:,.0f} tokens/s | | |",
            f"| trainpod padded / baseline | {unpacked['ratio']:.2f}x | >= {UNPACKED_TARGET}x | "
            f"{verdict(unpacked['ratio'], UNPACKED_TARGET)} |",
            f"| trainpod padded / baseline, median of the pair ratios | {unpacked['pair_ratio']:.2f}x | | |",
            f"| trainpod, packed (best run) | {packed['ours']:,.0f} tokens/s | | |",
            f"| trainpod packed / baseline | {packed['ratio']:.2f}x | >= {PACKED_TARGET}x | "
            f"{verdict(packed['ratio'], PACKED_TARGET)} |",
            f"| trainpod packed / baseline, median of the pair ratios | {packed['pair_ratio']:.2f}x | | |",
            f"| packing efficiency (real tokens / batch slots) | packed {packed['efficiency']:.1%}, "
            f"padded {unpacked['efficiency']:.1%} | | |",
            "",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default="bench-out")
    args = parser.parse_args()
    print(run(Path(args.workdir), args.quick))
