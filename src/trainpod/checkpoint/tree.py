"""Structures of tensors (an optimizer's `state_dict`, RNG states) as safetensors files: nothing pickled.

    structure, tensors = flatten(optimizer.state_dict())   # JSON, {"state.0.exp_avg": tensor, ...}
    ... checkpoint/writer.py writes `tensors` as a safetensors file, `structure` in its metadata ...
    state = load(path / "optimizer.safetensors", device)   # the same structure back

torch.save pickles the structure and hands each tensor to the file through about six Python calls.
In a background commit that runs on the writer thread holding the GIL, and the training thread waits
for it: 9-11 ms of CPU for a 31 MB AdamW state on the CPU benchmark, 1.5-2.2 ms written this way
(BENCHMARKS.md, "Async checkpoints"). Here the structure becomes a small JSON text, each tensor
replaced by its dotted path, and the tensors are written as one safetensors file from their own
memory, one write each. A plain safetensors reader sees the tensors under their paths.

Containers keep their type: dicts (JSON-scalar keys; an optimizer's state is keyed by parameter
index), lists and tuples (AdamW's `betas`). Leaves are tensors, None, bool, int, float (written exactly:
JSON keeps a float's shortest round-tripping repr, NaN and infinities included) and str. Anything
else is refused with its path: a checkpoint must load back as it was written, or not be written.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import safetensors
import torch

METADATA_KEY = "trainpod.tree"  # the safetensors metadata entry that holds the structure
_SCALARS = (type(None), bool, int, float, str)
_SCALAR_TYPES = frozenset(_SCALARS)  # exact types: a subclass (an IntEnum, say) goes through encode's checks


def is_flat(value: Any) -> bool:
    """Whether `value` is what a plain safetensors file holds: {str: tensor}."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()
    )


def flatten(value: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """(the structure as JSON with each tensor replaced by its name, {name: tensor}).

    A tensor's name is its path ("state.0.exp_avg"); when a key holding a dot makes two paths equal,
    the later one gets a "#" appended, so no tensor is lost."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            name = path or "tensor"
            while name in tensors:
                name += "#"
            tensors[name] = node
            return {"tensor": name}
        if isinstance(node, _SCALARS):
            return node
        if isinstance(node, dict):
            items = []
            for key, item in node.items():
                if not isinstance(key, _SCALARS):
                    raise TypeError(f"{path or 'the state'}: a {type(key).__name__} key cannot be stored")
                items.append([key, encode(item, f"{path}.{key}" if path else str(key))])
            return {"dict": items}
        if isinstance(node, (list, tuple)):
            kind = "tuple" if isinstance(node, tuple) else "list"
            if all(type(item) in _SCALAR_TYPES for item in node):  # python's RNG state: 625 ints, one pass
                return {kind: list(node)}
            return {kind: [encode(item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(node)]}
        raise TypeError(
            f"{path or 'the state'}: a {type(node).__name__} cannot be stored in a checkpoint (tensors, "
            "dicts, lists, tuples, None, bool, int, float and str can)"
        )

    structure = encode(value, "")
    return json.dumps(structure, separators=(",", ":")), tensors


def unflatten(structure: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The value `flatten` was given, from what it returned."""

    def decode(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        ((kind, body),) = node.items()
        if kind == "tensor":
            return tensors[body]
        if kind == "dict":
            return {key: decode(item) for key, item in body}
        if kind == "list":
            return [decode(item) for item in body]
        if kind == "tuple":
            return tuple(decode(item) for item in body)
        raise ValueError(f"unknown node {kind!r} in a tensor tree")

    return decode(json.loads(structure))


def load(path: Path, device: torch.device | str = "cpu") -> Any:
    """The structure stored at `path` with its tensors on `device`; a plain safetensors file (no
    structure in its metadata) gives its {name: tensor}.

    One tensor at a time passes through host memory (an optimizer's moments are 8 bytes a parameter).
    On the CPU safetensors hands out tensors mapped from the file, so each is copied: nothing stays
    mapped from a checkpoint that retention may delete."""
    path = Path(path)
    if not path.is_file():  # safetensors' own error names no file that callers could report
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    tensors = {}
    with safetensors.safe_open(path, framework="pt", device=str(device)) as f:
        structure = (f.metadata() or {}).get(METADATA_KEY)
        for name in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
            tensor = f.get_tensor(name)
            tensors[name] = tensor.clone() if tensor.device.type == "cpu" else tensor
    return tensors if structure is None else unflatten(structure, tensors)


def load_state_file(folder: Path, stem: str, device: torch.device | str = "cpu") -> Any:
    """`<stem>.safetensors` of a checkpoint folder, or `<stem>.pt` in a checkpoint written before
    trainpod stored these as tensor trees (loaded with `weights_only=True`: nothing is unpickled).
    With neither, the FileNotFoundError names the `.safetensors` file."""
    folder = Path(folder)
    legacy = folder / f"{stem}.pt"
    if legacy.exists() and not (folder / f"{stem}.safetensors").exists():
        return torch.load(legacy, map_location=device, weights_only=True)
    return load(folder / f"{stem}.safetensors", device)
