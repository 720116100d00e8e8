"""Training throughput with periodic checkpoints, async and sync, against the same trainer with none.

    python bench/bench_checkpoint_async.py [--quick]

The pretrain trainer's own step and commit path (`train_step` + `_after_step`), on a model sized so
that a sync commit costs well over 10% of the time between two commits (a wide, shallow model on
short sequences: much state, little compute per step). Target: async >= 0.97x the trainer with none.

Whole runs on this machine drift by tens of percent from one to the next (runs of one variant spread
from 3.5 to 5.3 s), which buries a few percent. So each variant runs as one trainer whose steps
alternate between windows of `window` steps that begin with a commit and windows of `window` steps
without one, and neighbouring windows, which see the same machine, are compared: a window with a
commit is the time between two commits of a run that commits every `window` steps; one without is the
same steps with checkpoints off. Every window ends with no commit in flight (the wait is timed), so
no commit's cost spills into the next window. The variants run in the order sync, async, async, sync.

The window is sized before the runs so that a sync commit costs SYNC_SHARE of it on this machine today
(a fixed 20 steps made the ratio depend on the machine's speed that day: a slower step hides more of
the same commit), and every run uses that window.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
from bench_pretrain import make_dataset  # noqa: E402

from trainpod.config import load_config  # noqa: E402
from trainpod.config.pretrain import PretrainConfig  # noqa: E402
from trainpod.context import RunContext  # noqa: E402
from trainpod.preemption import PreemptionWatch  # noqa: E402
from trainpod.train.distributed import init_distributed  # noqa: E402
from trainpod.train.reporting import RunReporter  # noqa: E402
from trainpod.volume import Volume  # noqa: E402
from trainpod.workloads.pretrain import Pretrainer  # noqa: E402

TARGET = 0.97
SYNC_SHARE = 0.12  # of a window, what one sync commit costs (the issue asks for >= 10%)
# Training on one core of the two leaves the other to the writer, as a GPU host does: there training is one
# Python thread launching kernels and the writer hashes and writes on cores that would idle. With training
# on every core, background work has no idle core to run on and async cannot beat sync (BENCHMARKS.md).
THREADS = 1
MODEL = [
    "model.hidden_size=384",
    "model.num_layers=2",
    "model.num_heads=6",
    "model.num_kv_heads=6",
    "model.intermediate_size=1024",
    "train.seq_len=16",
    "train.micro_batch_size=1",
    "train.grad_accum_steps=1",
    "train.eval_every=0",
    "train.log_every=1000000",
    "train.warmup_steps=2",
    f"train.cpu_threads={THREADS}",
    "checkpoint.every_minutes=100000",
    "checkpoint.keep_last=2",
    "checkpoint.keep_best=0",
    "name=bench-async",
]
ORDER = ("sync", "async", "async", "sync")


def make_trainer(volume: Path, mode: str, window: int) -> Pretrainer:
    run = Volume(volume).run("bench-async")
    shutil.rmtree(run.root, ignore_errors=True)
    run.create()
    # A commit opens every other window.
    overrides = [
        *MODEL,
        "train.max_steps=1000000",
        f"checkpoint.mode={mode}",
        f"checkpoint.every_steps={2 * window}",
    ]
    config = load_config(PretrainConfig, REPO / "configs/pretrain/tiny.yaml", overrides)
    trainer = Pretrainer(RunContext(Volume(volume), run, PreemptionWatch()), config, init_distributed())
    trainer.resume()
    trainer.reporter = RunReporter(run, 1000000, 0)
    return trainer


@dataclass
class Windows:
    """Seconds of each window with a commit and of the window without one that follows it."""

    with_commit: list[float] = field(default_factory=list)
    without: list[float] = field(default_factory=list)

    def ratio(self) -> float:
        """Throughput committing every `window` steps over throughput with checkpoints off."""
        return sum(self.without) / sum(self.with_commit)

    def commit_cost(self) -> float:
        """Seconds one commit adds to the training loop, on average."""
        return (sum(self.with_commit) - sum(self.without)) / len(self.without)

    def ratio_interval(self) -> tuple[float, float]:
        """95% interval of `ratio` from the spread of the pairs' differences: windows on this machine
        vary by several times a commit's cost, so the interval says how far the ratio can be trusted."""
        differences = [w - n for w, n in zip(self.with_commit, self.without, strict=True)]
        margin = 1.96 * statistics.stdev(differences) / len(differences) ** 0.5
        mean_without = statistics.mean(self.without)
        cost = self.commit_cost()
        return mean_without / (mean_without + cost + margin), mean_without / (mean_without + cost - margin)

    def __iadd__(self, other: Windows) -> Windows:
        self.with_commit += other.with_commit
        self.without += other.without
        return self


def size_window(volume: Path) -> tuple[int, float, float]:
    """The window (steps) in which one sync commit costs SYNC_SHARE, from the median of 20 steps and of
    5 sync commits on a trainer of its own; with those two medians (seconds)."""
    torch.set_num_threads(THREADS)
    trainer = make_trainer(volume, "sync", 1_000_000)
    model = trainer.wrap_for_training()
    model.train()
    steps, commits = [], []
    for step in range(1, 31):
        started = time.perf_counter()
        trainer.train_step(model, step)
        steps.append(time.perf_counter() - started)
        if step > 25:
            started = time.perf_counter()
            trainer.commit(step)
            commits.append(time.perf_counter() - started)
    trainer.reporter.close()
    step_s, commit_s = statistics.median(steps[5:25]), statistics.median(commits)
    return max(5, round(commit_s / (SYNC_SHARE * step_s))), step_s, commit_s


def measure(volume: Path, mode: str, pairs: int, window_steps: int) -> tuple[Windows, int]:
    """`pairs` windows with a commit, each followed by one without (the model build is outside the
    timing, as is a first pair that allocates the writer's host buffers); and the parameter count."""
    torch.set_num_threads(THREADS)
    trainer = make_trainer(volume, mode, window_steps)
    model = trainer.wrap_for_training()
    model.train()
    assert trainer.background_commits == (mode == "async")
    step = 0

    def window() -> float:
        nonlocal step
        started = time.perf_counter()
        for _ in range(window_steps):
            step += 1
            trainer.train_step(model, step)
            trainer._after_step(step)
        trainer.writer.wait()
        return time.perf_counter() - started

    for _ in range(2 * window_steps - 1):  # the next step is the first to commit
        step += 1
        trainer.train_step(model, step)
        trainer._after_step(step)
    window(), window()
    windows = Windows()
    for _ in range(pairs):
        windows.with_commit.append(window())
        windows.without.append(window())
    committed = trainer.writer.store.committed()
    assert committed and committed[0].step == step - 2 * window_steps + 1, (
        "each window with a commit committed"
    )
    trainer.reporter.close()
    return windows, trainer.n_params


def run(workdir: Path, quick: bool = False) -> str:
    volume = workdir / "async-volume"
    shutil.rmtree(volume, ignore_errors=True)
    make_dataset(volume)
    pairs = 8 if quick else 40
    window_steps, step_s, commit_s = size_window(volume)
    runs: dict[str, list[Windows]] = {"sync": [], "async": []}
    for mode in ORDER:
        windows, n = measure(volume, mode, pairs, window_steps)
        runs[mode].append(windows)
    pooled = {}
    for mode, measured in runs.items():
        pooled[mode] = Windows()
        for windows in measured:
            pooled[mode] += windows

    def each_run(mode: str) -> str:
        return ", ".join(f"{windows.ratio():.3f}x" for windows in runs[mode])

    def interval(mode: str) -> str:
        low, high = pooled[mode].ratio_interval()
        return f"95% interval {low:.3f}-{high:.3f}x"

    window = statistics.mean(pooled["sync"].without + pooled["async"].without)
    sync_cost, async_cost = pooled["sync"].commit_cost(), pooled["async"].commit_cost()
    share = sync_cost / window
    async_ratio = pooled["async"].ratio()
    verdict = "pass" if async_ratio >= TARGET else "FAIL"
    params = f"{n / 1e6:.1f}M parameters, a {n * 12 / 1e6:.0f} MB checkpoint of fp32 weights + AdamW moments"
    return "\n".join(
        [
            "## Async checkpoints: training with periodic commits vs none",
            "",
            f"The pretrain trainer's step and commit path, Llama 2 layers x 384 wide ({params}), seq 16, "
            f"micro batch 1, fp32 on CPU, {THREADS} thread(s) on the 2-core machine. Each variant trains "
            f"one trainer through {pairs} pairs of {window_steps}-step windows, one opening with a commit and "
            f"the next without (a commit every {window_steps} steps vs checkpoints off, compared between "
            "neighbouring windows so the machine's drift cancels); each window ends with no commit in flight. "
            f"The window was sized first so that a sync commit costs {SYNC_SHARE:.0%} of it today (median step "
            f"{step_s * 1000:.1f} ms, median sync commit {commit_s * 1000:.0f} ms). Runs in the order "
            f"{', '.join(ORDER)}; the ratio pools both runs of a variant (each run's beside it) and its 95% "
            "interval, from the spread of the pairs' differences.",
            "",
            "| metric | measured | target | result |",
            "| --- | --- | --- | --- |",
            f"| window without a commit (mean) | {window:.2f} s for {window_steps} steps | | |",
            f"| one sync commit's cost | {sync_cost * 1000:.0f} ms = {share:.0%} of the window | >= 10% | "
            f"{'pass' if share >= 0.10 else 'FAIL'} |",
            f"| sync commits / off | {pooled['sync'].ratio():.3f}x (runs {each_run('sync')}; "
            f"{interval('sync')}) | | |",
            f"| async commits / off | {async_ratio:.3f}x (runs {each_run('async')}; {interval('async')}) | "
            f">= {TARGET}x | {verdict} |",
            f"| one async commit's cost | {async_cost * 1000:.0f} ms, {1 - async_cost / sync_cost:.0%} of a "
            "sync commit hidden | | |",
            "",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default="bench-out")
    args = parser.parse_args()
    print(run(Path(args.workdir), args.quick))
