"""What a checkpoint holds beyond the weights, in forms that load with `weights_only=True`.

RNG states of every library (python, numpy, torch CPU and CUDA) are converted to tensors and
plain lists so that `torch.load(weights_only=True)` restores them: nothing is unpickled.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
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
        # Saved on a machine with more GPUs (a resume on fewer ranks), the states of the devices this one
        # lacks are left out: torch would look up a generator that does not exist (IndexError).
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def seed_rng(seed: int) -> None:
    """Seed every library's generator from one number (a rank a checkpoint has no state for)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def stored_once(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each tensor of `state` once, for a safetensors file (which refuses shared memory).

    Tied tensors (the same memory, shape, strides and dtype, e.g. an embedding and its output head)
    are kept once, under their first name; views that only overlap a kept tensor, and non-contiguous
    ones, are copied. The rest stay the live tensors (the writer snapshots them). Returns the tensors
    by name and the aliases left out, each naming the tensor it is.
    """
    kept: dict[str, torch.Tensor] = {}
    first_name: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        tensor = tensor.detach()
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if key in first_name:
            aliases[name] = first_name[key]
            continue
        first_name[key] = name
        storage = tensor.untyped_storage().data_ptr()
        shared = storage in storages
        storages.add(storage)
        kept[name] = (
            tensor.clone(memory_format=torch.contiguous_format)
            if shared or not tensor.is_contiguous()
            else tensor
        )
    return kept, aliases


def unique_weights(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The model's weights for a safetensors file, tied ones once (`stored_once`), and the names left
    out because they alias a kept tensor."""
    kept, aliases = stored_once(model.state_dict())
    return kept, list(aliases)


def load_weights(model: torch.nn.Module, data: bytes, aliases: list[str]) -> None:
    """Load safetensors `data` into `model`; ValueError saying what does not fit, before anything is loaded."""
    tensors = safetensors.torch.load(data)
    problem = weights_misfit(model.state_dict(), tensors, aliases)
    if problem:
        raise ValueError(problem)
    model.load_state_dict(tensors, strict=False)


def weights_misfit(
    expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], aliases: list[str]
) -> str:
    """What keeps `tensors` (a checkpoint's) from loading into a model whose state dict is `expected`."""
    reshaped = [name for name in expected if name in tensors and tensors[name].shape != expected[name].shape]
    if reshaped:
        name, more = reshaped[0], f" (and {len(reshaped) - 1} more tensors)" if len(reshaped) > 1 else ""
        return (
            f"{name} is {list(tensors[name].shape)} in the checkpoint and {list(expected[name].shape)} "
            f"in this model{more}"
        )
    missing = set(expected) - set(tensors)
    unexpected = sorted(set(tensors) - set(expected))
    if missing != set(aliases) or unexpected:
        return f"tensors missing {sorted(missing ^ set(aliases))[:3]}, unexpected {unexpected[:3]}"
    return ""


# AdamW's per-parameter moments; other optimizers (8-bit ones) keep quantized state of other shapes.
PARAMETER_SHAPED_STATE = ("exp_avg", "exp_avg_sq")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load `state` into `optimizer`; ValueError when it belongs to other parameters.

    torch refuses other group sizes itself but loads moments of another shape silently, and the first
    step then fails deep inside AdamW: both are checked here, before training.
    """
    try:
        optimizer.load_state_dict(state)
    except ValueError as exc:
        raise ValueError(f"the optimizer state does not fit: {exc}") from None
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if key in PARAMETER_SHAPED_STATE and value.shape != param.shape:
                    raise ValueError(
                        f"optimizer state {key} is {list(value.shape)} in the checkpoint and "
                        f"{list(param.shape)} here"
                    )
