"""What a checkpoint holds beyond the weights, in forms that load with `weights_only=True`.

RNG states of every library (python, numpy, torch CPU and CUDA) are converted to tensors and
plain lists so that `torch.load(weights_only=True)` restores them: nothing is unpickled.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import safetensors.torch
import torch


def capture_rng() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["kind"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def unique_weights(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The model's weights (live tensors) for a safetensors file, each shared (tied) tensor once.

    Returns the tensors by name and the names left out because they alias a kept tensor.
    """
    kept: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    aliases = []
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            aliases.append(name)
            continue
        seen.add(key)
        kept[name] = tensor.detach()
    return kept, aliases


def load_weights(model: torch.nn.Module, data: bytes, aliases: list[str]) -> None:
    tensors = safetensors.torch.load(data)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if set(missing) != set(aliases) or unexpected:
        raise ValueError(
            f"checkpoint weights do not fit this model (missing {sorted(set(missing) - set(aliases))}, "
            f"unexpected {sorted(unexpected)}); the model config changed since the checkpoint was written"
        )
