"""The layout of a safetensors file, so that tensors can be computed straight into the bytes being written.

safetensors' own writers either write the file themselves (`save_file`: no chance to hash the bytes
on the way, so they would be read back to be hashed) or return the whole file as a new `bytes`
(`save`: one more copy of every tensor, all of it in memory at once). The format is small enough to
lay out here (https://huggingface.co/docs/safetensors: an 8-byte little-endian header length, a JSON
header of dtype, shape and byte offsets per tensor, padded with spaces to 8 bytes, then the tensors'
bytes), and the tests read every file written with safetensors itself, mlx-lm and transformers.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

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
}


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
