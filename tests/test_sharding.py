"""FSDP2's pieces that run in one process (train/sharding.py): the auto rule, and a full-weights
checkpoint cut into a sharded model's shards. The multi-rank runs are in tests/test_fsdp_resume.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainpod.config import load_config
from trainpod.config.pretrain import PretrainConfig
from trainpod.errors import ConfigError, ExitCode, InputError
from trainpod.train.loss import CausalLMLoss
from trainpod.train.model import build_model
from trainpod.train.optim import build_optimizer, decay_groups
from trainpod.train.parallel import FSDP_AUTO_PARAMS, resolve_parallel
from trainpod.train.sharding import is_sharded, load_full_into, shard_model
from trainpod.train.state import unique_weights

torch.set_num_threads(1)
TINY_PRETRAIN = Path(__file__).resolve().parents[1] / "configs/pretrain/tiny.yaml"


@pytest.mark.parametrize(
    ("requested", "world", "params", "expected"),
    [
        ("auto", 1, 10 * FSDP_AUTO_PARAMS, "ddp"),  # one GPU: nothing to shard across
        ("auto", 8, FSDP_AUTO_PARAMS - 1, "ddp"),
        ("auto", 8, FSDP_AUTO_PARAMS, "fsdp"),
        ("fsdp", 1, 1000, "fsdp"),  # asked for: FSDP2 on one GPU (a group of one)
        ("ddp", 8, 10 * FSDP_AUTO_PARAMS, "ddp"),
    ],
)
def test_auto_parallel_shards_models_of_a_billion_parameters_on_several_gpus(
    requested, world, params, expected
):
    assert resolve_parallel(requested, world, params) == expected


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit"])
def test_an_optimizer_that_cannot_step_sharded_parameters_is_never_given_fsdp(optimizer):
    # bitsandbytes' kernels take plain tensors: under FSDP the first optimizer step failed (exit 1 on
    # every start). The 4b preset (adamw_8bit) on several GPUs was auto -> fsdp.
    assert resolve_parallel("auto", 8, 4 * FSDP_AUTO_PARAMS, optimizer) == "ddp"
    with pytest.raises(InputError, match=f"train.optimizer={optimizer} cannot step the sharded parameters"):
        resolve_parallel("fsdp", 8, 4 * FSDP_AUTO_PARAMS, optimizer)
    with pytest.raises(ConfigError, match=f"train.optimizer={optimizer} cannot step") as caught:
        load_config(PretrainConfig, TINY_PRETRAIN, ["train.parallel=fsdp", f"train.optimizer={optimizer}"])
    assert caught.value.exit_code == ExitCode.BAD_INPUT


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny_model():
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_cache=False,
    )
    return build_model(config, seed=0)


def adamw(model):
    return build_optimizer(
        "adamw", decay_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, device=torch.device("cpu")
    )


def test_a_full_weights_checkpoint_loads_into_a_sharded_model_and_trains_on_identically(group_of_one):
    """One GPU's (or DDP's) checkpoint resumed under FSDP: the same weights and optimizer moments, so the
    next step gives the same weights as the unsharded model's next step."""
    ids = torch.randint(0, 96, (2, 16))
    plain = tiny_model()
    plain_loss, plain_optimizer = CausalLMLoss(plain), adamw(plain)
    plain_loss(ids, ids).backward()
    plain_optimizer.step()
    weights, aliases = unique_weights(plain)
    saved_weights = {k: v.clone() for k, v in weights.items()}
    saved_optimizer = copy.deepcopy(plain_optimizer.state_dict())  # as torch.load gives it: not live

    sharded = tiny_model()  # other values: the load must replace every one
    with torch.no_grad():
        for p in sharded.parameters():
            p.add_(1.0)
    sharded_loss = CausalLMLoss(sharded)
    shard_model(sharded.model.layers, sharded_loss, torch.device("cpu"), bf16=False)
    sharded_optimizer = adamw(sharded)
    assert is_sharded(sharded)
    load_full_into(sharded, sharded_optimizer, saved_weights, saved_optimizer, aliases)

    for loss, optimizer in (
        (plain_loss, plain_optimizer),
        (sharded_loss, sharded_optimizer),
    ):
        optimizer.zero_grad()
        loss(ids, ids).backward()
        optimizer.step()
    after = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sharded.state_dict().items()}
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=1e-6)


def test_a_checkpoint_of_another_model_shape_is_refused_before_anything_loads(group_of_one):
    from transformers import LlamaConfig

    wider = build_model(
        LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            use_cache=False,
        ),
        seed=0,
    )
    weights, aliases = unique_weights(wider)
    sharded = tiny_model()
    loss = CausalLMLoss(sharded)
    shard_model(sharded.model.layers, loss, torch.device("cpu"), bf16=False)
    with pytest.raises(ValueError, match=r"is \[96, 64\] in the checkpoint and \[96, 32\] in this model"):
        load_full_into(sharded, adamw(sharded), weights, adamw(wider).state_dict(), aliases)


def test_tied_weights_are_stored_once_and_overlapping_views_are_copied():
    """What a safetensors file can hold: no two tensors share memory (train/state.py stored_once)."""
    import safetensors.torch

    from trainpod.train.state import stored_once

    fused = torch.arange(12.0).reshape(3, 4)
    embedding = torch.randn(5, 2)
    state = {"embed": embedding, "head": embedding, "q": fused[:1], "kv": fused[1:], "t": fused.t()}
    kept, aliases = stored_once(state)
    assert aliases == {"head": "embed"}
    assert kept["embed"].data_ptr() == embedding.data_ptr(), "not copied: the writer snapshots it"
    assert kept["kv"].data_ptr() != fused.data_ptr() + 4 * 4, "a view into a kept tensor's memory is copied"
    restored = safetensors.torch.load(safetensors.torch.save(kept))
    for name, tensor in state.items():
        assert torch.equal(restored[aliases.get(name, name)], tensor)
