"""The layout of a safetensors file, so that tensors can be computed straight into the bytes being written
and read straight into a buffer of ours (merges in convert/, checkpoint weights in checkpoint/writer.py).

safetensors' own writers either write the file themselves (`save_file`: no chance to hash the bytes
on the way, so they would be read back to be hashed) or return the whole file as a new `bytes`
(`save`: one more copy of every tensor, all of it in memory at once). The format is small enough to
lay out here (https://huggingface.co/docs/safetensors: an 8-byte little-endian header length, a JSON
header of dtype, shape and byte offsets per tensor, padded with spaces to 8 bytes, then the tensors'
bytes), and the tests read every file written with safetensors itself, mlx-lm and transformers.
Reading goes the other way for the same reason: safetensors hands out a tensor of its own (a fresh
mmap of the file, faulted in page by page, or a fresh allocation), where a merge wants the bytes in
the output's chunk buffer or in one scratch buffer reused for every tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from trainpod.errors import TemporaryError

_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {name: dtype for dtype, name in _NAMES.items()}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TensorLayout:
    header: bytes  # the 8-byte header length and the JSON header: the file's first bytes
    tensors: list[Entry]  # in file order; their bytes follow the header back to back

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(entry.nbytes for entry in self.tensors)


def layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> TensorLayout:
    """The file for tensors named and shaped as in `specs` ({name: (dtype, shape)}).

    Widest elements first (as safetensors orders them): every tensor then starts at an offset that is
    a multiple of its element size, counted from the file's start or from any earlier tensor's start.
    """
    for name, (dtype, _shape) in specs.items():
        if dtype not in _NAMES:
            raise ValueError(f"tensor {name}: dtype {dtype} is not written by trainpod's safetensors layout")
    entries = [
        Entry(name, specs[name][0], tuple(specs[name][1]))
        for name in sorted(specs, key=lambda name: (-specs[name][0].itemsize, name))
    ]
    header: dict[str, object] = {"__metadata__": metadata}
    end = 0
    for entry in entries:
        header[entry.name] = {
            "dtype": _NAMES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [end, end + entry.nbytes],
        }
        end += entry.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    return TensorLayout(struct.pack("<Q", len(header_bytes)) + header_bytes, entries)


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file."""

    path: Path
    dtype_name: str  # safetensors' name ("F32", "BF16", ...), also for dtypes torch cannot hold here
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype_name]


def read_index(path: Path) -> dict[str, StoredTensor]:
    """{name: StoredTensor} from the header of the safetensors file at `path` (its tensors are not read)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    data_start = 8 + length
    return {
        name: StoredTensor(path, entry["dtype"], tuple(entry["shape"]), data_start + begin, end - begin)
        for name, entry in header.items()
        for begin, end in [entry["data_offsets"]]
    }


def read_into(fd: int, tensor: StoredTensor, out: torch.Tensor) -> None:
    """The bytes of `tensor` from the open file `fd` into the contiguous `out` (of its dtype and shape)."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    if len(view) != tensor.nbytes:
        raise ValueError(f"{tensor.path}: reading {tensor.nbytes} bytes into a buffer of {len(view)}")
    done = 0
    while done < tensor.nbytes:  # a read may return fewer bytes than asked for
        got = os.preadv(fd, [view[done:]], tensor.offset + done)
        if got == 0:
            # Its header was checked against its size before, so the file changed while being read.
            raise TemporaryError(
                f"{tensor.path} ends inside the bytes of a tensor: it was truncated while being converted; "
                "the next start converts it again"
            )
        done += got
