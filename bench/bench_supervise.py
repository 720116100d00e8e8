"""Spot recovery end to end: interruption to first resumed step, and steps lost per interruption.

    python bench/bench_supervise.py

Runs the container tier's supervisor scenario (tests/container/test_supervise_e2e.py): a fake
RunPod API whose pods are real containers of the cpu image, two `docker stop -t 5` interruptions,
the supervisor bringing the run back each time. The scenario writes its figures to
bench-out/supervise_e2e.json; this reads them into the report. Target: no steps lost beyond the
last checkpoint interval. (The wait for RunPod to schedule a pod is not in these figures.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCENARIO = "tests/container/test_supervise_e2e.py"


def run(workdir: Path, quick: bool = False) -> str:
    figures_file = REPO / "bench-out" / "supervise_e2e.json"
    figures_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "container", SCENARIO, "-p", "no:cacheprovider"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0 or not figures_file.exists():
        return f"## Spot recovery\n\nThe scenario failed (exit {result.returncode}):\n\n```\n{result.stdout[-2000:]}\n```\n"
    rows = json.loads(figures_file.read_text())["interruptions"]
    lines = [
        "## Spot recovery (supervisor, real containers)",
        "",
        "The container tier's scenario: deploy against a fake RunPod API whose pods are real `cpu` image containers, "
        "two `docker stop -t 5` interruptions, the supervisor starting the pod again each time, DONE, the pod "
        "stopped; final weights byte-identical to an uninterrupted run. Checkpoints every 2 steps.",
        "",
        "| interruption | stopped after step | resumed from checkpoint | steps lost | interruption to first resumed step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i, row in enumerate(rows, 1):
        lines.append(
            f"| {i} | {row['interrupted_at_step']} | {row['resumed_from_checkpoint']} | {row['steps_lost']} | "
            f"{row['seconds_to_first_resumed_step']:.1f} s |"
        )
    lost = max(row["steps_lost"] for row in rows)
    lines += [
        "",
        f"Steps lost per interruption: at most {lost} (target: none beyond the last checkpoint interval of 2): "
        f"{'pass' if lost <= 2 else 'FAIL'}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run(REPO / "bench-out"))
