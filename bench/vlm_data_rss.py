"""Peak RSS of VLM data preparation (sft/vision.py) for N synthetic OCR images: flat in N is the goal,
since pixels are made per batch and only ids and image paths are stored.

    PYTHONPATH=src:tests python bench/vlm_data_rss.py 2000 20000

Each N runs in a fresh process (ru_maxrss is a high-water mark); the tiny Qwen2-VL processor and the
56x56 images are tests/vlm_support.py's. Prints one line per N: rows, seconds, peak RSS in MiB, and
the peak RSS of the process before preparing (imports, processor) for reference.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(n: int, root: Path) -> None:
    from trainpod.config.finetune_vlm import VisionDataConfig
    from trainpod.sft.vision import VisionBatches, VisionProcessor, load_vision, prepare_vision

    from vlm_support import VLM_BASE, make_tiny_vlm, write_ocr_jsonl

    if not (root / VLM_BASE).is_dir():
        make_tiny_vlm(root / VLM_BASE)
    data_file = root / f"data-{n}/ocr.jsonl"
    if not data_file.exists():
        write_ocr_jsonl(data_file, n, seed=1)
    processor = VisionProcessor(root / VLM_BASE)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    config = VisionDataConfig(datasets=[{"path": str(data_file)}], cutoff_len=64, max_images=1)
    folder = prepare_vision(config, processor, root / VLM_BASE, root / f"cache-{n}", root)
    seconds = time.perf_counter() - started
    data = load_vision(folder)
    batches = VisionBatches(data.train, processor, micro_batch_size=2, max_len=64, seed=0, rank=0, world_size=1,
                            pad_id=data.pad_id)  # fmt: skip
    for _ in range(50):
        batches.next_batch()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "rows": n,
                "prepare_s": round(seconds, 1),
                "peak_rss_mib": round(peak),
                "rss_before_mib": round(before),
            }
        )
    )


def main() -> None:
    if sys.argv[1] == "--child":
        child(int(sys.argv[2]), Path(sys.argv[3]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, sys.argv[1:]):
            subprocess.run([sys.executable, __file__, "--child", str(n), tmp], check=True)


if __name__ == "__main__":
    main()
