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
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from abba import paired  # noqa: E402

from trainpod.config import load_config  # noqa: E402
from trainpod.config.pretrain import PretrainConfig  # noqa: E402
from trainpod.context import RunContext  # noqa: E402
from trainpod.preemption import PreemptionWatch  # noqa: E402
from trainpod.train.distributed import init_distributed  # noqa: E402
from trainpod.train.optim import build_optimizer, decay_groups  # noqa: E402
from trainpod.train.reporting import RunReporter  # noqa: E402
from trainpod.train.schedule import cosine_with_warmup  # noqa: E402
from trainpod.volume import Volume  # noqa: E402
from trainpod.workloads.pretrain import Pretrainer  # noqa: E402

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
    """The trainer's training loop: steps, logging, status.json, TensorBoard and the commit decisions,
    with its final checkpoint commit; one-time set-up (imports, model build) is outside, as for the bare loop."""
    run = Volume(volume).run("bench")
    shutil.rmtree(run.root, ignore_errors=True)
    run.create()
    ctx = RunContext(Volume(volume), run, PreemptionWatch())
    trainer = Pretrainer(ctx, bench_config(steps), init_distributed())
    trainer.resume()
    trainer.reporter = RunReporter(run, steps, 0)
    model = trainer.wrap_for_training()
    started = time.perf_counter()
    trainer._loop(model, 0)
    elapsed = time.perf_counter() - started
    trainer.reporter.close()
    return elapsed


def bare_loop_seconds(volume: Path, steps: int) -> float:
    """What a user would write by hand: the same model, batches and optimizer, nothing else."""
    run = Volume(volume).run("bench-bare")
    run.create()
    cfg = bench_config(steps)
    trainer = Pretrainer(RunContext(Volume(volume), run, PreemptionWatch()), cfg, init_distributed())
    model, batches, t = trainer.model, trainer.batches, cfg.train
    optimizer = build_optimizer(
        "adamw",
        decay_groups(model, t.weight_decay),
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        device=torch.device("cpu"),
    )
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


def throughput(volume: Path, steps: int, pairs: int = 5) -> tuple[float, float, float]:
    """(best bare seconds, best trainer seconds, median per-pair ratio) over `pairs` ABBA pairs (abba.py)."""
    torch.set_num_threads(2)
    bare, ours = paired(
        pairs, lambda: bare_loop_seconds(volume, steps), lambda: trainer_seconds(volume, steps)
    )
    return min(bare), min(ours), statistics.median(b / o for b, o in zip(bare, ours, strict=True))


MICRO_MODEL = [
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
    "train.warmup_steps=0",
    "train.cpu_threads=1",
]


def _pretrain_cmd(volume: Path, run_name: str, *overrides: str) -> list[str]:
    sets = sum((["--set", o] for o in (*MICRO_MODEL, *overrides)), [])
    return [
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
        *sets,
    ]


def interrupted_run(volume: Path, steps_in: int) -> Path:
    """A micro-model run committed at `steps_in`, as a spot interruption right after that commit leaves it."""
    run_name = f"resume-{steps_in}"
    cmd = _pretrain_cmd(volume, run_name, f"train.max_steps={steps_in}", f"checkpoint.every_steps={steps_in}")
    subprocess.run(cmd, check=True, capture_output=True)
    run = volume / "runs" / run_name
    (run / "DONE").unlink()
    shutil.rmtree(run / "export")
    return run


def resume_seconds(volume: Path, pristine: Path, steps_in: int) -> float:
    """From process start to the first resumed step's status line, on a fresh copy of the interrupted run."""
    run = volume / "runs" / f"resume-{steps_in}"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(pristine, run)
    cmd = _pretrain_cmd(
        volume,
        run.name,
        f"train.max_steps={steps_in + 2}",
        f"checkpoint.every_steps={steps_in}",
        "train.log_every=1",
    )
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    status = run / "status.json"
    while True:
        try:
            if json.loads(status.read_text())["step"] >= steps_in + 1:
                break
        except (FileNotFoundError, ValueError, KeyError):
            pass
        if proc.poll() not in (None, 0):
            raise RuntimeError(f"the resumed run failed with exit code {proc.returncode}")
        time.sleep(0.005)
    elapsed = time.perf_counter() - started
    proc.wait()
    return elapsed


def resume_times(volume: Path, long_steps: int) -> tuple[float, float]:
    pristine = {}
    for steps_in in (10, long_steps):
        run = interrupted_run(volume, steps_in)
        pristine[steps_in] = volume / f"pristine-{steps_in}"
        shutil.copytree(run, pristine[steps_in])
    short, long = [], []
    for _ in range(3):  # interleaved, best of 3: background load hits both alike
        short.append(resume_seconds(volume, pristine[10], 10))
        long.append(resume_seconds(volume, pristine[long_steps], long_steps))
    return min(short), min(long)


def run(workdir: Path, quick: bool = False) -> str:
    volume = workdir / "pretrain-volume"
    shutil.rmtree(volume, ignore_errors=True)
    make_dataset(volume)
    steps = 10 if quick else 30
    pairs = 4 if quick else 8
    bare, ours, pair_ratio = throughput(volume, steps, pairs)
    ratio = bare / ours
    tokens = steps * 8 * 256
    long_steps = 1000 if quick else 10_000
    short, long = resume_times(volume, long_steps)
    resume_ratio = long / short
    return "\n".join(
        [
            "## Pretrain",
            "",
            f"Model: Llama 4 layers x 256 wide (~4.5M parameters with the tiny vocabulary), seq 256, micro batch 8, "
            f"{steps} steps, fp32 on CPU, 2 threads; {pairs} back-to-back pairs in alternating order (ABBA), judged on the best run of each, "
            "the median of the pair ratios shown too. Both time their training loops "
            "only (imports and model build are outside both). The trainer's loop includes a checkpoint commit at its "
            "last step (more often than the default interval of 500 steps), logging, TensorBoard and status.json. "
            "Resume: a 1-layer micro model committed at step 10 or 10,000, then a fresh process timed from its start "
            "to its first resumed step, best of 3 interleaved trials.",
            "",
            "| metric | measured | target | result |",
            "| --- | --- | --- | --- |",
            f"| bare PyTorch loop (best run) | {tokens / bare:,.0f} tokens/s | | |",
            f"| trainpod trainer (best run) | {tokens / ours:,.0f} tokens/s | | |",
            f"| trainer / bare | {ratio:.3f}x | >= {THROUGHPUT_TARGET}x | {'pass' if ratio >= THROUGHPUT_TARGET else 'FAIL'} |",
            f"| trainer / bare, median of the pair ratios | {pair_ratio:.3f}x | | |",
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
