"""The pretraining parts of `make gpu-check` (bench/gpu_check.py): throughput and MFU, peak memory per
preset against the preflight estimate, and what checkpoint commits cost the GPU.

Every part builds the shipped preset's model with the real Pretrainer (compile, attention, precision and
optimizer as the preset says) on random token shards of the preset's vocabulary: throughput does not
depend on what the tokens say, and no corpus has to be downloaded onto a bare GPU machine. In --dry mode
(CPU) the same code runs a tiny model for a few steps, so the harness is exercised between GPU runs.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainpod import atomic
from trainpod.config import load_config
from trainpod.config.pretrain import PretrainConfig
from trainpod.context import RunContext
from trainpod.data.datagen import MANIFEST_FILE, MANIFEST_FORMAT
from trainpod.data.shards import HEADER_BYTES, shard_header, token_dtype, write_shard
from trainpod.preemption import PreemptionWatch
from trainpod.train.distributed import init_distributed
from trainpod.train.reporting import RunReporter, peak_flops
from trainpod.volume import Volume
from trainpod.workloads.pretrain import Pretrainer

REPO = Path(__file__).resolve().parents[1]
DATASET = "gpu-check-random"
# A tiny model for --dry: the code paths of the real presets, seconds on a CPU.
DRY_MODEL = [
    "model.vocab_size=512",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.intermediate_size=128",
    "train.seq_len=64",
    "train.micro_batch_size=2",
    "train.grad_accum_steps=1",
    "train.compile=false",
    "train.precision=auto",
    "train.eval_batches=2",
]


def preset_config(preset: str, dry: bool, *overrides: str) -> PretrainConfig:
    """The shipped preset with the random dataset and a few steps; in --dry mode, the tiny model."""
    base = [
        f"data.dataset={DATASET}",
        "train.eval_every=0",
        "train.log_every=1000",
        "train.warmup_steps=1",  # the presets warm up for thousands of steps; these runs take a few
        *(DRY_MODEL if dry else []),
    ]
    return load_config(PretrainConfig, REPO / "configs/pretrain" / f"{preset}.yaml", [*base, *overrides])


def random_dataset(volume: Path, vocab: int, tokens: int) -> None:
    """Token shards of uniform random ids (train and val) with a manifest as datagen writes it."""
    folder = Volume(volume).dataset(DATASET)
    if (folder / MANIFEST_FILE).exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    rng, dtype = np.random.default_rng(0), token_dtype(vocab)
    splits = {}
    for split, count in (("train", tokens), ("val", max(tokens // 20, 4096))):
        info = write_shard(folder / f"{split}_000000.bin", rng.integers(0, vocab, count).astype(dtype))
        splits[split] = {"tokens": info.tokens, "shards": [info.to_json()]}
    header = shard_header(0, dtype)
    tokenizer = _any_tokenizer(volume)
    atomic.write_json(
        folder / MANIFEST_FILE,
        {
            "format": MANIFEST_FORMAT,
            "complete": True,
            "name": DATASET,
            "dtype": dtype.name,
            "shard_format": {
                "magic": int(header[0]),
                "version": int(header[1]),
                "header_bytes": HEADER_BYTES,
            },
            "splits": splits,
            "total_tokens": sum(s["tokens"] for s in splits.values()),
            "documents": 0,
            # Only export reads the tokenizer, and no part exports: any tokenizer folder stands in.
            "tokenizer": {"path": str(tokenizer), "name": None, "sha256": "", "vocab_size": vocab},
            "sources": [],
            "config": {},
            "config_hash": "random",
        },
    )


def _any_tokenizer(volume: Path) -> Path:
    folder = volume / "tokenizers" / "gpu-check-bytes"
    if not (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer, models, pre_tokenizers

        folder.mkdir(parents=True, exist_ok=True)
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
        tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def make_trainer(volume: Path, config: PretrainConfig) -> Pretrainer:
    vocab = config.model.vocab_size or 32768
    steps = config.train.max_steps
    tokens_needed = (steps + 2) * config.train.tokens_per_step_per_rank + config.train.seq_len * 4
    random_dataset(volume, vocab, max(tokens_needed, 1 << 16))
    run = Volume(volume).run(config.name)
    shutil.rmtree(run.root, ignore_errors=True)
    run.create()
    trainer = Pretrainer(RunContext(Volume(volume), run, PreemptionWatch()), config, init_distributed())
    trainer.reporter = RunReporter(run, steps, 0, enabled=False)
    return trainer


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_steps(trainer: Pretrainer, model: torch.nn.Module, first: int, count: int) -> list[float]:
    """Seconds of each of `count` optimizer steps from step `first`, the device drained after each."""
    seconds = []
    for step in range(first, first + count):
        _sync()
        started = time.perf_counter()
        result = trainer.train_step(model, step)
        result.loss.item()  # the step's work is done once its loss can be read
        _sync()
        seconds.append(time.perf_counter() - started)
    return seconds


def throughput(volume: Path, preset: str, dry: bool) -> dict[str, Any]:
    """Steady-state tokens/s and MFU after warm-up; compile, eval and commit time reported apart."""
    warmup, measured = (1, 3) if dry else (5, 20)
    config = preset_config(preset, dry, f"train.max_steps={warmup + measured + 3}")
    _reset_peak_memory()
    trainer = make_trainer(volume, config)
    model = trainer.wrap_for_training()
    model.train()
    first_step = timed_steps(trainer, model, 1, 1)[0]  # compiles, when compile is on
    warm = timed_steps(trainer, model, 2, warmup - 1) if warmup > 1 else []
    steady = timed_steps(trainer, model, warmup + 1, measured)
    # The preset's memory from the same steps (what `preset_memory` measures, without a process of its own
    # and a second compile: two minutes of a lent GPU's fifteen), before the profile, eval and commit.
    memory = _peak_memory(config, trainer)
    # After the timed window, so the profiler's own cost stays out of the figures above.
    profile = profile_steps(trainer, model, warmup + measured + 1, 2)
    # No eval: these runs read no validation windows (train.eval_every=0), so one timed nothing (the
    # first H100 run's "one eval 0.00 s"), and a real one compiles the eval graph, a minute of a lent
    # GPU's fifteen for no target. A window's forward is a third of a step's FLOPs.
    commit_started = time.perf_counter()
    trainer.commit(warmup + measured)
    commit_s = time.perf_counter() - commit_started
    step_s = statistics.median(steady)
    tokens = config.train.tokens_per_step_per_rank
    peak = peak_flops(trainer.dist.device)
    return {
        "preset": preset,
        "parameters": trainer.n_params,
        "tokens_per_step": tokens,
        "compile": config.train.compile,
        "attention": trainer.model_config._attn_implementation,
        "first_step_s": first_step,
        "warmup_steps_s": warm,
        "steady_step_s": steady,
        "tokens_per_s": tokens / step_s,
        "flops_per_token": trainer.flops_per_token,
        "peak_flops": peak,
        "mfu": tokens / step_s * trainer.flops_per_token / peak if peak else None,
        "commit_s": commit_s,
        "profile": profile,
        **memory,
    }


# Where a step's device time goes, by kernel (or, on CPU, operator) name: the first pattern that a name
# contains decides. Attention before matmul (flash kernels hold "gemm"-like names of their own), the loss
# before the generic fused kernels inductor names after their ops.
PROFILE_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_mha")),
    ("optimizer", ("adam", "multi_tensor_apply", "_foreach")),
    ("loss", ("cross_entropy", "log_softmax", "logsumexp", "nll_loss")),
    (
        "matmul",
        ("gemm", "xmma", "cutlass", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "mm_"),
    ),
    ("communication", ("nccl",)),
    ("memory copy", ("memcpy", "memset", "aten::copy_")),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    return next(
        (label for label, needles in PROFILE_CATEGORIES if any(n in lowered for n in needles)), "other"
    )


def profile_steps(trainer: Pretrainer, model: torch.nn.Module, first: int, count: int) -> dict[str, Any]:
    """torch.profiler over `count` steps: the device time per step by category and the top kernels, and how
    much of the step's wall time the device was busy (a low share: the host or launches hold it back).
    A profiler failure is recorded, never raised: the unit's timed figures stand without it."""
    try:
        return _profile_steps(trainer, model, first, count)
    except Exception as exc:  # the profile explains a figure; it must not cost the figure
        return {"error": f"{type(exc).__name__}: {exc}"}


def _profile_steps(trainer: Pretrainer, model: torch.nn.Module, first: int, count: int) -> dict[str, Any]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        wall = sum(timed_steps(trainer, model, first, count))
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if cuda and event.device_type != DeviceType.CUDA:
            continue  # on a GPU, kernels alone: the CPU ops that launched them would count twice
        seconds = (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e6
        if seconds > 0:
            times[event.key] = times.get(event.key, 0.0) + seconds
    busy = sum(times.values())
    if not busy:  # "busy 0%" would read as a host-bound step: the profiler saw nothing, which it says
        raise RuntimeError(
            "the profiler recorded no device kernel in the steps (CUPTI missing or not allowed here?)"
        )
    by_category: dict[str, float] = {}
    for name, seconds in times.items():
        category = kernel_category(name)
        by_category[category] = by_category.get(category, 0.0) + seconds
    top = sorted(times.items(), key=lambda item: item[1], reverse=True)[:15]
    return {
        "steps": count,
        "timer": "device kernels" if cuda else "CPU operators (self time)",
        "wall_s_per_step": wall / count,
        "busy_s_per_step": busy / count,
        "busy_share_of_wall": busy / wall if wall else None,
        "share_by_category": {k: v / busy for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "top": [{"name": name[:160], "s_per_step": t / count, "share": t / busy} for name, t in top],
    }


def preset_memory(volume: Path, preset: str, dry: bool) -> dict[str, Any]:
    """Peak GPU memory of a few full steps of `preset`, beside the preflight estimate when there is one."""
    config = preset_config(preset, dry, "train.max_steps=4")
    _reset_peak_memory()
    trainer = make_trainer(volume, config)
    model = trainer.wrap_for_training()
    model.train()
    timed_steps(trainer, model, 1, 3)
    return {"preset": preset, "parameters": trainer.n_params, **_peak_memory(config, trainer)}


def _reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_memory(config: PretrainConfig, trainer: Pretrainer) -> dict[str, Any]:
    """The GPU's peak since `_reset_peak_memory` (None on CPU) beside the preflight estimate."""
    cuda = torch.cuda.is_available()
    return {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "estimate_bytes": preflight_estimate(config, trainer),
    }


def preflight_estimate(config: PretrainConfig, trainer: Pretrainer) -> int:
    """What preflight predicts for this config (train/memory.py)."""
    from trainpod.train import memory

    vocab = config.model.vocab_size or 32768
    estimate = memory.estimate_training_memory(config, vocab, world_size=trainer.dist.world_size)
    return estimate.allocated  # what max_memory_allocated sees: no CUDA context, no fragmentation


def checkpoint_cost(volume: Path, preset: str, dry: bool) -> dict[str, Any]:
    """Training time with a commit every k steps against none, and what that makes of one every 5 minutes.

    The stall per commit is the extra time the commits cost the loop (with async commits: the copy
    to host memory and whatever the background write slows); scaled, a commit every 300 s of training
    keeps 300 / (300 + stall) of the throughput.
    """
    steps, every = (12, 4) if dry else (60, 20)
    results = {}
    for label, interval in (("none", 10**9), ("every_k", every)):
        config = preset_config(
            preset,
            dry,
            f"train.max_steps={steps}",
            f"checkpoint.every_steps={interval}",
            "checkpoint.every_minutes=1e6",
        )
        trainer = make_trainer(volume, config)
        model = trainer.wrap_for_training()
        timed_steps(trainer, model, 1, 2)  # compile and warm up outside the comparison
        trainer._last_commit_time = time.monotonic()
        _sync()
        started = time.perf_counter()
        trainer._loop(model, 2)
        _sync()
        # Both runs commit at their last step; the steps the loop ran are 3..steps.
        commits = sum(1 for step in range(3, steps + 1) if step % interval == 0 or step == steps)
        results[label] = {"seconds": time.perf_counter() - started, "commits": commits}
        trainer.reporter.close()
    extra_commits = results["every_k"]["commits"] - results["none"]["commits"]
    stall = max(results["every_k"]["seconds"] - results["none"]["seconds"], 0.0) / max(extra_commits, 1)
    return {
        "preset": preset,
        "steps": steps - 2,
        "commit_every_steps": every,
        "runs": results,
        "stall_per_commit_s": stall,
        "throughput_ratio_5min": 300.0 / (300.0 + stall),
        # What the trainer made of checkpoint.mode (auto: async on a GPU, sync on CPU), not the setting.
        "mode": "async" if trainer.background_commits else "sync",
    }
