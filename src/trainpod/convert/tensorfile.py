"""A safetensors file laid out in one memory buffer, so tensors are computed straight into their place.

safetensors' own writers either write the file themselves (`save_file`: no chance to hash the bytes
on the way, so they would be read back to be hashed) or return the whole file as a new `bytes`
(`save`: one more copy of every tensor). The format is small enough to lay out here
(https://huggingface.co/docs/safetensors: an 8-byte little-endian header length, a JSON header of
dtype, shape and byte offsets per tensor, padded with spaces to 8 bytes, then the tensors' bytes),
and the tests read every file written with safetensors itself, mlx-lm and transformers.
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


@dataclass
class TensorFile:
    buffer: torch.Tensor  # uint8: the whole file, header included
    slots: dict[
        str, torch.Tensor
    ]  # views into `buffer` in file order, one per tensor, for the caller to fill

    def bytes(self) -> memoryview:
        return memoryview(self.buffer.numpy()).cast("B")

    def end(self, name: str) -> int:
        """Where the bytes of tensor `name` end in the file."""
        slot = self.slots[name]
        return slot.data_ptr() - self.buffer.data_ptr() + slot.nbytes


def layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> TensorFile:
    """Allocate a file for tensors named and shaped as in `specs` ({name: (dtype, shape)}); unfilled."""
    for name, (dtype, _shape) in specs.items():
        if dtype not in _NAMES:
            raise ValueError(f"tensor {name}: dtype {dtype} is not written by trainpod's safetensors layout")
    # Widest elements first (as safetensors orders them), so every tensor starts aligned to its size.
    order = sorted(specs, key=lambda name: (-specs[name][0].itemsize, name))
    header: dict[str, object] = {"__metadata__": metadata}
    offsets, end = {}, 0
    for name in order:
        dtype, shape = specs[name]
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [end, end + size]}
        offsets[name] = end
        end += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    start = 8 + len(header_bytes)
    buffer = torch.empty(start + end, dtype=torch.uint8)
    buffer[:start] = torch.frombuffer(
        bytearray(struct.pack("<Q", len(header_bytes)) + header_bytes), dtype=torch.uint8
    )
    slots = {}
    for name in order:
        dtype, shape = specs[name]
        size = math.prod(shape) * dtype.itemsize
        slots[name] = buffer[start + offsets[name] : start + offsets[name] + size].view(dtype).view(shape)
    return TensorFile(buffer, slots)
