"""Optimizer and RNG states as tensor trees in safetensors files (checkpoint/tree.py), written by the
checkpoint writer: they load back exactly, and training continues as if never saved."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from trainpod.checkpoint import CheckpointStore, tree
from trainpod.checkpoint.writer import CheckpointWriter
from trainpod.train.state import capture_rng, restore_rng


def commit_and_load(tmp_path, value, background: bool = False):
    """`value` committed as `state.safetensors` through the writer, then loaded back."""
    writer = CheckpointWriter(CheckpointStore(tmp_path / "checkpoints"))
    writer.commit(1, {"state.safetensors": value}, {}, background=background)
    committed = writer.wait() if background else writer.store.latest()
    return tree.load(committed.path / "state.safetensors"), committed.path / "state.safetensors"


def make_optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    import bitsandbytes as bnb  # its CPU kernels: the 8-bit state's structure is what is tested here

    return {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw_32bit": bnb.optim.PagedAdamW32bit}[kind](
        params, lr=1e-2, betas=(0.9, 0.95)
    )


def train(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


@pytest.mark.parametrize("kind", ["adamw", "adamw_8bit", "paged_adamw_32bit"])
@pytest.mark.parametrize("background", [False, True])
def test_an_optimizer_state_loads_back_and_training_continues_identically(tmp_path, kind, background):
    torch.manual_seed(0)
    # 4096 elements: bitsandbytes keeps smaller tensors in 32 bits; this one gets 8-bit state and its quant maps.
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(8))]
    optimizer = make_optimizer(kind, params)
    train(optimizer, params, 3, seed=1)

    loaded, _ = commit_and_load(tmp_path, optimizer.state_dict(), background)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = make_optimizer(kind, resumed_params)
    resumed.load_state_dict(loaded)
    assert list(loaded["state"]) == [0, 1], "parameter indices stay ints"
    assert loaded["param_groups"][0]["betas"] == (0.9, 0.95), "betas stay a tuple"

    train(optimizer, params, 3, seed=2)
    train(resumed, resumed_params, 3, seed=2)
    for a, b in zip(params, resumed_params, strict=True):
        assert torch.equal(a, b), "the optimizer state must load back bit for bit"


def test_plain_values_keep_their_types_and_exact_values(tmp_path):
    value = {
        "numbers": (1, 2.5, 0.1 + 0.2, -0.0, None, True, "text"),
        7: [float("nan"), float("inf"), -float("inf"), 2**70],
        "nested": {"deep": [{"t": torch.arange(3)}, (torch.tensor(1.5),)]},
        "empty": {},
        "empty list": [],
    }
    loaded, _ = commit_and_load(tmp_path, value)
    assert loaded["numbers"] == value["numbers"] and type(loaded["numbers"]) is tuple
    assert math.copysign(1, loaded["numbers"][3]) == -1, "negative zero stays negative"
    nan, inf, minus_inf, big = loaded[7]
    assert math.isnan(nan) and inf == math.inf and minus_inf == -math.inf and big == 2**70
    assert torch.equal(loaded["nested"]["deep"][0]["t"], torch.arange(3))
    assert type(loaded["nested"]["deep"][1]) is tuple and loaded["nested"]["deep"][1][0].item() == 1.5
    assert loaded["empty"] == {} and loaded["empty list"] == []


def test_the_file_is_plain_safetensors_with_each_tensor_under_its_path(tmp_path):
    state = {
        "state": {0: {"exp_avg": torch.ones(2), "step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1}],
    }
    _, path = commit_and_load(tmp_path, state)
    tensors = safetensors.torch.load_file(path)
    assert set(tensors) == {"state.0.exp_avg", "state.0.step"}
    with safetensors.safe_open(path, framework="pt") as f:
        assert tree.METADATA_KEY in f.metadata()


def test_a_flat_dict_of_tensors_stays_a_plain_safetensors_file(tmp_path):
    loaded, path = commit_and_load(tmp_path, {"w": torch.ones(2)})
    assert set(loaded) == {"w"}
    with safetensors.safe_open(path, framework="pt") as f:
        assert tree.METADATA_KEY not in (f.metadata() or {})


def test_a_key_holding_a_dot_does_not_overwrite_another_tensor_with_the_same_path(tmp_path):
    loaded, _ = commit_and_load(tmp_path, {"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}})
    assert loaded["a.b"].item() == 0 and loaded["a"]["b"].item() == 1


def test_a_value_that_cannot_be_stored_is_refused_with_its_path(tmp_path):
    writer = CheckpointWriter(CheckpointStore(tmp_path))
    with pytest.raises(TypeError, match=r"state\.0\.scale: a ndarray cannot be stored"):
        writer.commit(1, {"optimizer.safetensors": {"state": {0: {"scale": np.ones(2)}}}}, {})
    assert writer.store.latest() is None, "nothing is committed"


def test_rng_states_load_back_and_draw_the_same_numbers(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    loaded, _ = commit_and_load(tmp_path, [capture_rng()])
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng(loaded[0])
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_cuda_rng_states_from_a_machine_with_more_gpus_restore_on_one_with_fewer(tmp_path, monkeypatch):
    # A checkpoint of an 8-GPU pod resumed on a 4-GPU pod (docs/design.md: a resume on M ranks of a
    # checkpoint from N): each rank's state holds 8 CUDA generators, and torch's set_rng_state_all looks
    # up torch.cuda.default_generators[i] for each, an IndexError (a crash at every start) past the 4th.
    # Faked here with 4 CPU generators standing in for the CUDA ones; torch's own functions run.
    saved = capture_rng() | {"cuda": [torch.Generator().manual_seed(i).get_state() for i in range(8)]}
    loaded, _ = commit_and_load(tmp_path, [saved])
    generators = tuple(torch.Generator() for _ in range(4))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    restore_rng(loaded[0])
    for index, generator in enumerate(generators):
        assert torch.equal(generator.get_state(), saved["cuda"][index])


def test_a_checkpoint_written_before_tensor_trees_loads_its_pt_file(tmp_path):
    state = {"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]}
    torch.save(state, tmp_path / "optimizer.pt")
    loaded = tree.load_state_file(tmp_path, "optimizer")
    assert torch.equal(loaded["state"][0]["exp_avg"], torch.ones(2))
    (tmp_path / "optimizer.pt").unlink()
    with pytest.raises(FileNotFoundError) as missing:
        tree.load_state_file(tmp_path, "optimizer")
    assert missing.value.filename == str(tmp_path / "optimizer.safetensors"), "names the file it wanted"


def test_flattening_copies_nothing_and_keeps_tensors_apart_from_the_structure():
    moment = torch.ones(3)
    structure, tensors = tree.flatten({"m": moment, "lr": 0.1})
    assert tensors["m"] is moment, "the writer snapshots the tensors; flatten must not copy them"
    assert tree.unflatten(structure, copy.copy(tensors)) == {"m": moment, "lr": 0.1}


def test_loaded_tensors_own_their_memory_and_do_not_change_with_the_file(tmp_path):
    loaded, path = commit_and_load(tmp_path, {"state": {0: {"m": torch.ones(1024)}}})
    with open(path, "r+b") as f:  # safetensors maps the file on the CPU: a loaded tensor must not follow it
        f.seek(-64, 2)
        f.write(bytes(64))
    assert torch.equal(loaded["state"][0]["m"], torch.ones(1024))
