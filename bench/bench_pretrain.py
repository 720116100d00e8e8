"""Pretraining benchmarks, each a ratio against a baseline run in the same command.

    python bench/bench_pretrain.py [--quick]

1. Trainer tokens/s vs a bare PyTorch loop: same model, batches, AdamW, clipping and schedule;
   the trainer with checkpointing at the default interval (and its final commit), logging,
   TensorBoard and status.json. Target: >= 0.95x.
2. Start to first resumed step with the run 10,000 steps in vs 10 steps in: the data position is
   four integers, so resuming never replays batches. Target: ratio <= 1.1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trainpod.config import load_config  # noqa: E402
from trainpod.config.pretrain import PretrainConfig  # noqa: E402
from trainpod.preemption import PreemptionWatch  # noqa: E402
from trainpod.train.distributed import init_distributed  # noqa: E402
from trainpod.train.schedule import cosine_with_warmup  # noqa: E402
from trainpod.volume import Volume  # noqa: E402
from trainpod.workloads.context import RunContext  # noqa: E402
from trainpod.workloads.pretrain import Pretrainer, _adamw  # noqa: E402

THROUGHPUT_TARGET = 0.95
RESUME_TARGET = 1.1
BENCH_MODEL = [
    "model.hidden_size=256",
    "model.num_layers=4",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.intermediate_size=688",
    "train.seq_len=256",
    "train.micro_batch_size=8",
    "train.grad_accum_steps=1",
    "train.eval_every=0",
    "train.cpu_threads=2",
]


def make_dataset(volume: Path) -> None:
    volume.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "trainpod",
        "run",
        "datagen",
        "--config",
        str(REPO / "configs/datagen/tiny.yaml"),
        "--volume",
        str(volume),
    ]
    subprocess.run(cmd, check=True, capture_output=True)


def bench_config(steps: int) -> PretrainConfig:
    overrides = [
        *BENCH_MODEL,
        f"train.max_steps={steps}",
        "train.warmup_steps=2",
        "train.log_every=10",
        "name=bench",
    ]
    return load_config(PretrainConfig, REPO / "configs/pretrain/tiny.yaml", overrides)


def trainer_seconds(volume: Path, steps: int) -> float:
    run = Volume(volume).run("bench")
    shutil.rmtree(run.root, ignore_errors=True)
    run.create()
    ctx = RunContext(Volume(volume), run, PreemptionWatch())
    trainer = Pretrainer(ctx, bench_config(steps), init_distributed())
    started = time.perf_counter()
    trainer.train()
    return time.perf_counter() - started


def bare_loop_seconds(volume: Path, steps: int) -> float:
    """What a user would write by hand: the same model, batches and optimizer, nothing else."""
    run = Volume(volume).run("bench-bare")
    run.create()
    cfg = bench_config(steps)
    trainer = Pretrainer(RunContext(Volume(volume), run, PreemptionWatch()), cfg, init_distributed())
    model, batches, t = trainer.model, trainer.batches, cfg.train
    optimizer = _adamw(model, t, torch.device("cpu"))
    started = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_with_warmup(step, steps, t.lr, t.warmup_steps, t.min_lr_ratio)
        inputs, targets = batches.next_batch()
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def throughput(volume: Path, steps: int) -> tuple[float, float]:
    torch.set_num_threads(2)
    bare, ours = [], []
    for _ in range(2):  # interleaved, best of 2: background load hits both alike
        bare.append(bare_loop_seconds(volume, steps))
        ours.append(trainer_seconds(volume, steps))
    return min(bare), min(ours)


def resume_seconds(volume: Path, steps_in: int) -> float:
    """Train `steps_in` steps of a micro model, then time a fresh process to its first resumed step."""
    run_name = f"resume-{steps_in}"
    micro = [
        "model.hidden_size=16",
        "model.num_layers=1",
        "model.num_heads=2",
        "model.num_kv_heads=2",
        "model.intermediate_size=32",
        "train.seq_len=8",
        "train.micro_batch_size=1",
        "train.grad_accum_steps=1",
        "train.eval_every=0",
        "train.log_every=1000",
        f"checkpoint.every_steps={steps_in}",
        "train.warmup_steps=0",
        "train.cpu_threads=1",
    ]
    base = [
        sys.executable,
        "-m",
        "trainpod",
        "run",
        "pretrain",
        "--config",
        str(REPO / "configs/pretrain/tiny.yaml"),
        "--volume",
        str(volume),
        "--run",
        run_name,
        *sum((["--set", o] for o in micro), []),
    ]
    subprocess.run([*base, "--set", f"train.max_steps={steps_in}"], check=True, capture_output=True)
    run = volume / "runs" / run_name
    (run / "DONE").unlink()  # as if interrupted right after its last commit; max_steps grows below
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*base, "--set", f"train.max_steps={steps_in + 2}", "--set", "train.log_every=1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    status = run / "status.json"
    while True:
        try:
            if json.loads(status.read_text())["step"] >= steps_in + 1:
                break
        except (FileNotFoundError, ValueError, KeyError):
            pass
        time.sleep(0.005)
    elapsed = time.perf_counter() - started
    proc.wait()
    return elapsed


def run(workdir: Path, quick: bool = False) -> str:
    volume = workdir / "pretrain-volume"
    shutil.rmtree(volume, ignore_errors=True)
    make_dataset(volume)
    steps = 20 if quick else 60
    bare, ours = throughput(volume, steps)
    tokens = steps * 8 * 256
    ratio = bare / ours
    long_steps = 1000 if quick else 10_000
    short, long = resume_seconds(volume, 10), resume_seconds(volume, long_steps)
    resume_ratio = long / short
    return "\n".join(
        [
            "## Pretrain",
            "",
            f"Model: Llama 4 layers x 256 wide (~4.5M parameters with the tiny vocabulary), seq 256, micro batch 8, "
            f"{steps} steps, fp32 on CPU, 2 threads; best of 2 interleaved trials. The trainer's time includes its "
            "final checkpoint commit at the last step (default interval otherwise), logging, TensorBoard, status.json "
            "and loss.png.",
            "",
            "| metric | measured | target | result |",
            "| --- | --- | --- | --- |",
            f"| bare PyTorch loop | {tokens / bare:,.0f} tokens/s | | |",
            f"| trainpod trainer | {tokens / ours:,.0f} tokens/s | | |",
            f"| trainer / bare | {ratio:.3f}x | >= {THROUGHPUT_TARGET}x | {'pass' if ratio >= THROUGHPUT_TARGET else 'FAIL'} |",
            f"| start to first resumed step, 10 steps in | {short:.2f} s | | |",
            f"| start to first resumed step, {long_steps:,} steps in | {long:.2f} s | | |",
            f"| ratio | {resume_ratio:.3f} | <= {RESUME_TARGET} | {'pass' if resume_ratio <= RESUME_TARGET else 'FAIL'} |",
            "",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default="bench-out")
    args = parser.parse_args()
    print(run(Path(args.workdir), args.quick))
