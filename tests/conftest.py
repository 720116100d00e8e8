"""Fixtures: a tiny dataset made once per session by the real datagen, copied into each test's volume;
a tiny base model and SFT rows for the finetune tests, also made once."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from finetune_support import make_base_model
from support import TINY_DATAGEN, run_trainpod
from vlm_support import OCR_FILE, VLM_BASE, make_tiny_vlm, write_ocr_jsonl


@pytest.fixture(scope="session")
def tiny_dataset_volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    volume = tmp_path_factory.mktemp("dataset-volume")
    result = run_trainpod("run", "datagen", "--config", str(TINY_DATAGEN), volume=volume)
    assert result.returncode == 0, f"datagen for the test dataset failed:\n{result.stdout}\n{result.stderr}"
    return volume


@pytest.fixture
def volume(tmp_path: Path, tiny_dataset_volume: Path) -> Path:
    """A fresh volume holding the tiny dataset and tokenizer, nothing else."""
    root = tmp_path / "volume"
    root.mkdir()
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, root / folder)
    return root


@pytest.fixture(scope="session")
def finetune_base_volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/base (a tiny Llama with the test tokenizer) and data/sft.jsonl; copy it before writing."""
    volume = tmp_path_factory.mktemp("finetune-base")
    make_base_model(volume)
    return volume


@pytest.fixture(scope="session")
def vlm_base_volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/vlm (a tiny Qwen2-VL with its tokenizer and image processor) and 40 OCR rows with their
    56x56 images at data/ocr/; copy it before writing."""
    volume = tmp_path_factory.mktemp("vlm-base")
    make_tiny_vlm(volume / VLM_BASE)
    write_ocr_jsonl(volume / OCR_FILE, 40, seed=5)
    return volume


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A real S3 server on 127.0.0.1 (moto's server mode), standing in for RunPod's S3-compatible API."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()
