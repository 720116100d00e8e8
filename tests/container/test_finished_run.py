"""A run started again after DONE exits 0 at once and leaves the volume exactly as it was."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import DONE, INTERRUPT_ENV, Pods, snapshot

pytestmark = pytest.mark.container


def test_run_started_again_after_done_exits_zero_quickly_and_changes_nothing(
    pods: Pods, baseline: tuple[Path, bytes], tmp_path: Path
) -> None:
    volume = tmp_path / "volume"
    shutil.copytree(baseline[0], volume, symlinks=True)
    assert (volume / DONE).is_file()
    before = snapshot(volume)
    box = pods.run(volume, INTERRUPT_ENV, pod="pod-baseline", timeout=60)
    logs = box.logs()
    assert box.exit_code() == 0, f"exited {box.exit_code()} on a finished run:\n{logs[-2000:]}"
    # No wall-clock assertion (docs/design.md, "Tests"): it returned without training one step.
    assert " step " not in logs and "committed checkpoint" not in logs, (
        f"a finished run trained again:\n{logs[-2000:]}"
    )
    after = snapshot(volume)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"starting a finished run changed the volume: {changed[:20]}"
