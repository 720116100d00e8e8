"""Token shards in the llm.c / nanoGPT fineweb format, written atomically and read by memmap.

A shard is a header of 256 little-endian int32 (`[0]` magic, `[1]` version, `[2]` token count) and
then the tokens, exactly as llm.c's `dev/data/data_common.py` writes them: magic 20240520 version 1
with uint16 tokens ("gpt-2"), or magic 20240801 version 7 with uint32 tokens ("llama-3") when a token
id does not fit in 16 bits. llm.c's `train_gpt2.c` and nanoGPT-style loaders read these files as is.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from trainpod.atomic import write_parts
from trainpod.errors import InputError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
HEADER_DTYPE = np.dtype("<i4")
UINT16_MAGIC, UINT16_VERSION = 20240520, 1
UINT32_MAGIC, UINT32_VERSION = 20240801, 7
# magic -> (version, token dtype), little-endian like the header
FORMATS = {
    UINT16_MAGIC: (UINT16_VERSION, np.dtype("<u2")),
    UINT32_MAGIC: (UINT32_VERSION, np.dtype("<u4")),
}


@dataclass(frozen=True)
class ShardInfo:
    """One committed shard as the progress file and the manifest record it."""

    file: str
    tokens: int
    bytes: int
    sha256: str

    def to_json(self) -> dict:
        return asdict(self)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id (0 .. vocab_size-1) fits in 16 bits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_header(token_count: int, dtype: np.dtype) -> np.ndarray:
    magic = UINT16_MAGIC if np.dtype(dtype).itemsize == 2 else UINT32_MAGIC
    header = np.zeros(HEADER_INTS, dtype=HEADER_DTYPE)
    header[0] = magic
    header[1] = FORMATS[magic][0]
    header[2] = token_count
    return header


def write_shard(path: Path, tokens: np.ndarray) -> ShardInfo:
    """Atomically write `tokens` (uint16 or uint32) as a shard at `path`; returns its size and sha256.

    Temp file in the same folder, fsync, rename, fsync the folder: a crash leaves either no shard or
    the complete one, plus at most a `*.tmp-*` file that the next run removes.
    """
    path = Path(path)
    tokens = np.ascontiguousarray(tokens)
    if tokens.dtype.itemsize not in (2, 4) or tokens.dtype.kind != "u":
        raise ValueError(f"shard tokens must be uint16 or uint32, got {tokens.dtype}")
    tokens = tokens.astype(tokens.dtype.newbyteorder("<"), copy=False)
    header = shard_header(len(tokens), tokens.dtype)
    parts = [memoryview(header).cast("B"), memoryview(tokens).cast("B")]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    write_parts(path, parts)
    return ShardInfo(path.name, len(tokens), HEADER_BYTES + tokens.nbytes, digest.hexdigest())


def read_header(path: Path) -> tuple[int, np.dtype]:
    """Validate a shard's header and size; returns (token count, token dtype)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"token shard {path} does not exist; run datagen again to rebuild the dataset")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise InputError(
            f"token shard {path} has {size} bytes, less than the {HEADER_BYTES}-byte header; "
            "it is truncated: delete the dataset folder and run datagen again"
        )
    header = np.fromfile(path, dtype=HEADER_DTYPE, count=HEADER_INTS)
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic not in FORMATS:
        raise InputError(
            f"token shard {path} has magic {magic}, not an llm.c shard "
            f"({UINT16_MAGIC} for uint16, {UINT32_MAGIC} for uint32)"
        )
    expected_version, dtype = FORMATS[magic]
    if version != expected_version:
        raise InputError(
            f"token shard {path} has version {version}; magic {magic} needs version {expected_version}"
        )
    expected_size = HEADER_BYTES + count * dtype.itemsize
    if count < 0 or size != expected_size:
        raise InputError(
            f"token shard {path} is {size} bytes but its header promises {count} tokens "
            f"({expected_size} bytes); it is damaged: delete the dataset folder and run datagen again"
        )
    return count, dtype


def open_shard(path: Path) -> np.ndarray:
    """The shard's tokens as a read-only memmap (no copy; the OS pages them in on demand)."""
    count, dtype = read_header(path)
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
