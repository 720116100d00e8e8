"""A pod configured by environment variables alone: datagen, then pretrain, on one volume."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DATAGEN_ENV, DONE, EXPORT, PRETRAIN_ENV, Pods

pytestmark = pytest.mark.container


def test_datagen_then_pretrain_run_from_environment_variables_alone(pods: Pods, tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    datagen = pods.run(volume, DATAGEN_ENV, pod="cpu-pod")
    assert datagen.exit_code() == 0, f"datagen exited {datagen.exit_code()}:\n{datagen.logs()[-3000:]}"
    assert (volume / "datasets/tiny-stories/manifest.json").is_file(), "datagen wrote no manifest.json"

    pretrain = pods.run(volume, PRETRAIN_ENV, pod="gpu-pod")
    assert pretrain.exit_code() == 0, f"pretrain exited {pretrain.exit_code()}:\n{pretrain.logs()[-3000:]}"
    assert (volume / DONE).is_file(), "pretrain exited 0 but wrote no DONE marker"
    assert (volume / EXPORT).stat().st_size > 0, "no exported model.safetensors"
