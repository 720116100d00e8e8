"""Checkpoint commit time against a raw write + fsync of the same bytes on the same disk.

    python bench/bench_checkpoint.py [--mb 512]

The commit does more than write: it hashes every byte (sha256, for verification at start), writes
the manifest, renames the folder, fsyncs directories and replaces LATEST. Target: <= 1.3x raw.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from abba import paired  # noqa: E402

from trainpod.checkpoint import CheckpointStore  # noqa: E402

TARGET = 1.3


def _payloads(total_mb: int) -> dict[str, bytes]:
    """Three files shaped like a checkpoint: weights (1/3) and optimizer moments (2/3), random bytes."""
    weights = os.urandom(total_mb * (1 << 20) // 3)
    return {
        "model.safetensors": weights,
        "optimizer.pt": os.urandom(2 * len(weights)),
        "rng.pt": os.urandom(4096),
    }


def raw_write(root: Path, payloads: dict[str, bytes]) -> float:
    folder = root / "raw"
    folder.mkdir()
    started = time.perf_counter()
    for name, data in payloads.items():
        with open(folder / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - started


def commit(root: Path, payloads: dict[str, bytes], step: int) -> float:
    store = CheckpointStore(root / "checkpoints", keep_last=100)
    started = time.perf_counter()
    pending = store.begin(step)
    for name, data in payloads.items():
        pending.write_bytes(name, data)
    store.commit(pending, step, {"bench": True}, started=time.monotonic())
    return time.perf_counter() - started


def _drop(root: Path) -> None:
    for child in root.iterdir():
        shutil.rmtree(child)
    os.sync()


def preset_checkpoint_mb() -> int:
    """The checkpoint size of the smallest shipped preset (125m): fp32 weights + two AdamW moments."""
    from trainpod.config import load_config
    from trainpod.config.pretrain import PretrainConfig
    from trainpod.train.model import llama_config, parameter_count

    config = load_config(PretrainConfig, Path(__file__).resolve().parents[1] / "configs/pretrain/125m.yaml")
    params = parameter_count(llama_config(config.model, config.model.vocab_size, config.train.seq_len))
    return params * 12 // (1 << 20)


PAIRS = 8


def run(workdir: Path, quick: bool = False, total_mb: int | None = None) -> str:
    total_mb = total_mb or (512 if quick else preset_checkpoint_mb())
    payloads = _payloads(total_mb)
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root, steps = Path(tmp), itertools.count()
        raw_times, commit_times = paired(
            PAIRS,
            lambda: raw_write(root, payloads),
            lambda: commit(root, payloads, next(steps)),
            lambda: _drop(root),
        )
    ratio = min(commit_times) / min(raw_times)
    pair_ratio = statistics.median(c / r for c, r in zip(commit_times, raw_times, strict=True))
    mb = sum(len(d) for d in payloads.values()) / 1e6

    def timing(times: list[float]) -> str:
        best, median = min(times), statistics.median(times)
        return f"best {best:.3f} s ({mb / best:.0f} MB/s), median {median:.3f} s"

    return "\n".join(
        [
            "## Checkpoint commit vs raw write + fsync",
            "",
            f"{mb:.0f} MB in 3 files shaped like the 125m preset's checkpoint (weights + AdamW moments), "
            f"{PAIRS} back-to-back pairs in alternating order (ABBA), same disk. The disk of this machine "
            "swings one raw write + fsync by 2-4x between back-to-back trials, so the target is judged on "
            "the best run of each (interference only adds time); the median of the pair ratios is shown too.",
            "",
            "| metric | measured | target | result |",
            "| --- | --- | --- | --- |",
            f"| raw write + fsync | {timing(raw_times)} | | |",
            f"| trainpod commit (hash, manifest, rename, LATEST) | {timing(commit_times)} | | |",
            f"| commit / raw, best of each | {ratio:.2f}x | <= {TARGET}x | {'pass' if ratio <= TARGET else 'FAIL'} |",
            f"| commit / raw, median of the {PAIRS} pair ratios | {pair_ratio:.2f}x | | |",
            "",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=None, help="default: the 125m preset's checkpoint size")
    parser.add_argument("--workdir", default="bench-out")
    args = parser.parse_args()
    print(run(Path(args.workdir), total_mb=args.mb))
