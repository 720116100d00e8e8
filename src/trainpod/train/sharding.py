"""FSDP2 across GPUs, and checkpoints that reshard: written by N ranks, resumed on M (docs/design.md).

    train.parallel: auto | ddp | fsdp                   (configs/pretrain/*.yaml)
    torchrun --nproc_per_node 8 -m trainpod run pretrain --config configs/pretrain/1b.yaml

- Which of DDP and FSDP a run uses (`train.parallel: auto`) is train/parallel.py's `resolve_parallel`,
  apart from torch so that `trainpod estimate` chooses as the trainer does without importing it.
- `shard_model`: `fully_shard` on every decoder layer and then on the module that runs the loss
  (torchtitan's layout): each layer's weights are gathered just before it runs and freed after,
  so a rank holds 1/N of the weights, gradients and optimizer state plus one layer in full. With
  bf16 autocast the gathers move bf16 (half the bytes) and gradients are reduced in fp32.
- Sharded checkpoints go through torch.distributed.checkpoint (DCP) into the pending checkpoint's
  folder (`model/`: one `__<rank>_0.distcp` per rank and DCP's `.metadata`); rank 0 then hashes
  every file into the manifest and publishes with the store's protocol, unchanged. DCP records
  each tensor's global shape and each shard's offsets, so any rank count (or an unsharded model)
  loads it: `load_sharded` reads what each rank now holds.
- `load_full_into`: the other direction, a full-weights checkpoint (`model.safetensors` +
  `optimizer.safetensors`, written by one GPU or DDP) into a sharded model.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainpod.errors import InputError

log = logging.getLogger(__name__)

SHARDED_DIR = "model"  # the DCP folder inside a checkpoint; its `.metadata` marks a sharded checkpoint


def device_mesh(device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks to shard one by one: the classes transformers lists as never split across devices."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def shard_model(
    layers: Sequence[torch.nn.Module], root: torch.nn.Module, device: torch.device, bf16: bool
) -> None:
    """`fully_shard` each of `layers`, then `root` (the module whose forward runs the whole step, so the
    parameters outside the layers, e.g. embeddings and the tied head, are gathered around it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = device_mesh(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
    for index, layer in enumerate(layers):
        # The last layer's gathered weights are needed again first in the backward: keeping them
        # saves one all-gather per step (torchtitan does the same).
        fully_shard(layer, reshard_after_forward=index < len(layers) - 1, **kwargs)
    fully_shard(root, **kwargs)


def set_gradient_sync(root: torch.nn.Module, enabled: bool) -> None:
    """FSDP's `no_sync`: off for the micro-batches before the last, so gradients reduce once per step."""
    root.set_requires_gradient_sync(enabled)


@contextlib.contextmanager
def gathered_root(root: torch.nn.Module) -> Iterator[None]:
    """The root unit's weights gathered around a forward that bypasses the root's own (an eval calling
    the model inside the loss wrapper); the layers gather their own. Nothing for an unsharded root."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(root, FSDPModule):
        yield
        return
    root.unshard()
    try:
        yield
    finally:
        root.reshard()


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a DTensor's full value (e.g. a replicated gradient norm), else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# --------------------------------------------------------------------------------- saving
def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Weights and optimizer state keyed by parameter name, each rank's shards as DTensors."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optimizer_state}


class ShardWriter:
    """Each rank's side of a sharded commit: DCP writes this rank's shards into the pending checkpoint.

    In the foreground `dcp.save` returns once every rank has written (it gathers the plans and rank 0
    writes `.metadata`). In the background `dcp.async_save` copies the shards to host memory and
    returns; its writes and final gather run on a thread over a gloo group of their own, so they
    never interleave with training's collectives. At most one is in flight per rank: the next commit
    waits for it.
    """

    def __init__(self) -> None:
        self._group: Any = None
        self._in_flight: Future | None = None

    def save(self, state: dict[str, Any], folder: Path, background: bool) -> Future | None:
        import torch.distributed.checkpoint as dcp

        self.wait()
        if not background:
            dcp.save(state, checkpoint_id=str(folder))
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")  # collective: every rank makes it at once
        self._in_flight = dcp.async_save(state, checkpoint_id=str(folder), process_group=self._group)
        return self._in_flight

    def wait(self) -> None:
        future, self._in_flight = self._in_flight, None
        if future is not None:
            future.result()

    def forget(self) -> None:
        """On a stop: the write in flight goes on by itself (its temp folder is never published)."""
        self._in_flight = None


def adopt_shards(pending: Any, folder: Path) -> None:
    """Hash the files DCP wrote under `folder` (inside `pending`'s temp folder) into its manifest."""
    for path in sorted(folder.iterdir()):
        pending.adopt(f"{SHARDED_DIR}/{path.name}", path)


# -------------------------------------------------------------------------------- loading
def has_shards(checkpoint: Path) -> bool:
    return (checkpoint / SHARDED_DIR / ".metadata").is_file()


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """Load a DCP checkpoint written by any number of ranks into `model` and `optimizer`, sharded or not:
    each rank reads the pieces of every tensor it now holds. ValueError when the shapes do not fit."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = sharded_state(model, optimizer)
    groups = state["optim"]["param_groups"]  # each names its parameters
    in_one_group = len(groups) > 1 and _parameter_groups_written(checkpoint) == 1
    if in_one_group:  # a full finetune before its norms and biases left weight decay (train/optim.py)
        state["optim"]["param_groups"] = [
            {**groups[0], "params": [name for g in groups for name in g["params"]]}
        ]
    _load_dcp(state, checkpoint)
    if in_one_group:  # every group takes the one group's settings, its weight_decay included: an exact resume
        written = state["optim"]["param_groups"][0]
        state["optim"]["param_groups"] = [{**written, "params": group["params"]} for group in groups]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_sharded_weights(model: torch.nn.Module, checkpoint: Path) -> None:
    """The weights alone of a DCP checkpoint (written by any number of ranks) into `model`: an export of a step,
    which needs no optimizer state (AdamW's is twice the weights, read from the network volume and held in
    memory for nothing). An unsharded model in one process with no process group (a conversion), or every
    rank's shards of a sharded one (a collective: export.weights best). ValueError when the shapes do not fit."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    # DCP warns that it loads in a single process, which is what is asked of it here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _load_dcp(state, checkpoint)
    set_model_state_dict(model, state["model"])


def _load_dcp(state: dict[str, Any], checkpoint: Path) -> None:
    """`state` filled in place from the checkpoint's DCP shards; ValueError when it does not fit this model."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, checkpoint_id=str(checkpoint / SHARDED_DIR))
    except Exception as exc:  # DCP reports a misfit as CheckpointException, wrapping each rank's error
        raise ValueError(f"the sharded checkpoint does not fit this model: {_first_line(exc)}") from None


def _parameter_groups_written(checkpoint: Path) -> int:
    """How many optimizer parameter groups a DCP checkpoint holds (keys optim.param_groups.<i>.<setting>)."""
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(checkpoint / SHARDED_DIR)).read_metadata().state_dict_metadata
    return len({key.split(".")[2] for key in keys if key.startswith("optim.param_groups.")})


def load_full_into(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    aliases: list[str],
) -> None:
    """Full weights and an `optimizer.state_dict()` (written by one GPU or DDP) into a sharded model.

    Every rank has read the whole files, so each cuts its own shards out of them (`distribute_tensor`
    with no source rank): no communication, where torch's full-state-dict loading broadcasts every
    tensor from rank 0. ValueError when the tensors do not fit."""
    from trainpod.train.state import load_optimizer_state

    load_full_weights_into(model, weights, aliases)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {
        index: {
            key: _shard_like(value, params[index]) if _param_shaped(value, params[index]) else value
            for key, value in per_param.items()
        }
        for index, per_param in optimizer_state["state"].items()
        if index < len(params)
    }
    load_optimizer_state(optimizer, {"state": state, "param_groups": optimizer_state["param_groups"]})


def load_full_weights_into(
    model: torch.nn.Module, weights: dict[str, torch.Tensor], aliases: list[str]
) -> None:
    """Full weights (written by one GPU or DDP) into a sharded model, each rank cutting its own shards; no
    optimizer state (an export of a step). ValueError when the tensors do not fit."""
    from trainpod.train.state import weights_misfit

    problem = weights_misfit(model.state_dict(), weights, aliases)
    if problem:
        raise ValueError(problem)
    with torch.no_grad():
        for name, param in model.named_parameters():
            _local(param).copy_(_local(_shard_like(weights[name], param)))


def _param_shaped(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape) and value.dim() > 0


def _shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`full` cut into `param`'s sharding (a DTensor like it), or `full` itself for a plain parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=param.device, dtype=param.dtype)
    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight in full on rank 0's CPU, for the HF export (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def gathered_copy(model: torch.nn.Module) -> torch.nn.Module | None:
    """A whole, unsharded copy of a sharded HF model on rank 0's CPU, for its export (None on the other
    ranks; every rank must call it: the gather is a collective)."""
    from transformers import AutoModelForCausalLM

    weights = full_weights(model)
    if dist.get_rank() != 0:
        return None
    with torch.device("meta"):
        copy = AutoModelForCausalLM.from_config(model.config)
    copy.load_state_dict(weights, assign=True)
    copy.tie_weights()
    return copy


def require_process_group(parallel: str) -> None:
    if parallel == "fsdp" and not dist.is_initialized():
        raise InputError(
            "train.parallel=fsdp needs a process group; start under torchrun (trainpod run ... "
            "--nproc-per-node N, or boot on a GPU pod) or set train.parallel=ddp"
        )
