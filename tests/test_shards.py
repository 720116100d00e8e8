"""The llm.c / nanoGPT shard format: written by trainpod, read back by a reader written from the spec."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from trainpod.data.shards import open_shard, token_dtype, write_shard
from trainpod.errors import ExitCode, InputError


def read_llmc_shard(path: Path) -> np.ndarray:
    """Independent reader from llm.c dev/data/data_common.py: 256 int32 header, then the tokens."""
    with open(path, "rb") as f:
        header = struct.unpack("<256i", f.read(256 * 4))
        body = f.read()
    magic, version, count = header[:3]
    dtype = {(20240520, 1): "<u2", (20240801, 7): "<u4"}[(magic, version)]
    tokens = np.frombuffer(body, dtype=dtype)
    assert len(tokens) == count, f"{path}: header says {count} tokens, file holds {len(tokens)}"
    assert not any(header[3:]), "llm.c leaves header words 3..255 zero"
    return tokens


def test_uint16_shard_reads_back_with_llmc_header(tmp_path):
    tokens = np.array([50256, 0, 1, 65535, 42], dtype=np.uint16)
    info = write_shard(tmp_path / "train_000000.bin", tokens)
    assert np.array_equal(read_llmc_shard(tmp_path / "train_000000.bin"), tokens)
    header = np.fromfile(tmp_path / "train_000000.bin", dtype="<i4", count=3)
    assert header.tolist() == [20240520, 1, 5]
    assert info.tokens == 5 and info.bytes == 1024 + 10 == (tmp_path / "train_000000.bin").stat().st_size


def test_uint32_shard_used_when_ids_exceed_16_bits(tmp_path):
    dtype = token_dtype(128_256)
    assert dtype == np.dtype("<u4") and token_dtype(65_536) == np.dtype("<u2")
    tokens = np.array([128_000, 7, 65_536], dtype=dtype)
    write_shard(tmp_path / "s.bin", tokens)
    assert np.fromfile(tmp_path / "s.bin", dtype="<i4", count=2).tolist() == [20240801, 7]
    assert np.array_equal(read_llmc_shard(tmp_path / "s.bin"), tokens)
    assert np.array_equal(open_shard(tmp_path / "s.bin"), tokens)


def test_open_shard_is_a_memmap_of_the_tokens(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    write_shard(tmp_path / "s.bin", tokens)
    view = open_shard(tmp_path / "s.bin")
    assert isinstance(view, np.memmap) and view.dtype == np.uint16
    assert np.array_equal(view, tokens)


def test_write_shard_leaves_no_temp_file_and_sha256_matches_bytes(tmp_path):
    import hashlib

    info = write_shard(tmp_path / "s.bin", np.arange(10, dtype=np.uint16))
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]
    assert info.sha256 == hashlib.sha256((tmp_path / "s.bin").read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda b: b[:100], "less than the 1024-byte header"),
        (lambda b: struct.pack("<i", 12345) + b[4:], "magic 12345"),
        (lambda b: b[:-2], "header promises 3 tokens"),
        (lambda b: b[:4] + struct.pack("<i", 9) + b[8:], "version 9"),
    ],
)
def test_open_shard_rejects_damaged_files_with_input_error(tmp_path, damage, words):
    path = tmp_path / "s.bin"
    write_shard(path, np.array([1, 2, 3], dtype=np.uint16))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(InputError, match=words) as caught:
        open_shard(path)
    assert str(path) in str(caught.value) and caught.value.exit_code == ExitCode.BAD_INPUT


def test_open_shard_names_a_missing_file(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        open_shard(tmp_path / "nope.bin")
