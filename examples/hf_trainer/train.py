"""An HF Trainer script made spot-safe by trainpod's callback (a tiny Llama built here, no hub access).

    trainpod run command --config examples/hf_trainer/command.yaml
    TRAINPOD_RUN_DIR=/tmp/hf-run python examples/hf_trainer/train.py

Three lines differ from a plain Trainer script: the callback, `output_dir=callback.staging_dir`,
and `resume_from_checkpoint=callback.resume_from_checkpoint()`. The final model goes to
runs/<run>/export/hf/ (written beside it, then renamed into place).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from trainpod.integrations.hf import TrainpodCallback


class RandomTokens(torch.utils.data.Dataset):
    """Token sequences drawn once from a fixed seed: the same data in every run."""

    def __init__(self, count: int = 96, length: int = 24, vocab: int = 128):
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randint(vocab, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class SleepPerStep(TrainerCallback):
    """Slows training down so that an interruption can be watched (and tested) at a given step."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, *_, **__):
        time.sleep(self.seconds)


def export(trainer: Trainer, run_dir: Path) -> Path:
    target = run_dir / "export" / "hf"
    tmp = target.with_name(f"hf.tmp-{os.getpid()}")
    trainer.save_model(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--sleep-per-step", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same float sums in every run
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        attention_dropout=0.1,  # randomness the resumed run must replay exactly
    )
    model = LlamaForCausalLM(config)

    callback = TrainpodCallback()
    training_args = TrainingArguments(
        output_dir=callback.staging_dir,
        max_steps=args.max_steps,
        save_steps=args.save_steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        logging_steps=1,
        seed=42,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=RandomTokens(),
        callbacks=[callback, SleepPerStep(args.sleep_per_step)],
    )
    resume = callback.resume_from_checkpoint()
    print(f"resuming from {resume}" if resume else "starting from scratch", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    print(f"finished: model at {export(trainer, callback.ckpt.run_dir)}", flush=True)


if __name__ == "__main__":
    main()
