"""`trainpod run pretrain`: a Llama decoder from scratch on token shards, exactly resumable.

    TRAINPOD_CONFIG=configs/pretrain/tiny.yaml TRAINPOD_VOLUME=/tmp/vol trainpod run pretrain
    torchrun --nproc_per_node 2 -m trainpod run pretrain --config configs/pretrain/tiny.yaml

The loop, commits and the stop protocol are train/trainer.py's; this file holds what is
pretraining's own: token-shard batches, a model built from the config, full-weight checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from trainpod.checkpoint import PendingCheckpoint
from trainpod.config.pretrain import PretrainConfig
from trainpod.context import RunContext
from trainpod.data.datagen import dataset_shards, load_dataset_manifest
from trainpod.data.shards import open_shard
from trainpod.errors import InputError
from trainpod.train import distributed as D
from trainpod.train.batches import TokenBatches, eval_batches
from trainpod.train.export import DTYPES, export_hf
from trainpod.train.model import (
    autocast_dtype,
    build_model,
    flops_per_token,
    llama_config,
    padded_vocab,
    parameter_count,
    resolve_attention,
)
from trainpod.train.optim import build_optimizer, decay_groups
from trainpod.train.schedule import cosine_with_warmup
from trainpod.train.state import load_optimizer_state, load_weights, weights_bytes
from trainpod.train.trainer import StepResult, Trainer, train_and_export

log = logging.getLogger(__name__)

# Bytes per parameter a checkpoint holds: fp32 weights + two AdamW moments.
CHECKPOINT_BYTES_PER_PARAM = 12


class Pretrainer(Trainer):
    def __init__(self, ctx: RunContext, config: PretrainConfig, dist: D.DistContext):
        t = config.train
        super().__init__(ctx, config, config.checkpoint, t.max_steps, t.log_every, t.eval_every, dist)
        self.train_cfg = t
        self._setup_data()
        self._setup_model()

    # ------------------------------------------------------------------------------- setup
    def _setup_data(self) -> None:
        dataset_dir = self.ctx.resolve_dataset(self.cfg.data.dataset)
        manifest = load_dataset_manifest(dataset_dir)
        self.val_shards = dataset_shards(dataset_dir, manifest, "val")
        self.tokenizer_dir = self.ctx.resolve_tokenizer(self.cfg.data.tokenizer, manifest)
        self.tokenizer_vocab = manifest["tokenizer"]["vocab_size"]
        t = self.train_cfg
        self.batches = TokenBatches(
            dataset_shards(dataset_dir, manifest, "train"),
            open_shard,
            t.micro_batch_size,
            t.seq_len,
            self.dist.rank,
            self.dist.world_size,
            t.seed,
        )

    def _setup_model(self) -> None:
        t, device = self.train_cfg, self.dist.device
        vocab = self.cfg.model.vocab_size or padded_vocab(self.tokenizer_vocab)
        if vocab < self.tokenizer_vocab:
            raise InputError(
                f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary "
                f"({self.tokenizer_vocab}); raise model.vocab_size or leave it unset"
            )
        self.autocast_dtype = autocast_dtype(t.precision, device)
        attention = resolve_attention(t.attention, device)
        self.model_config = llama_config(self.cfg.model, vocab, t.seq_len, attention)
        self.model = build_model(self.model_config, t.seed, device)
        if t.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.n_params = parameter_count(self.model_config)
        self.flops_per_token = flops_per_token(self.model_config, self.n_params, t.seq_len)
        self.optimizer = build_optimizer(
            "adamw",
            decay_groups(self.model, t.weight_decay),
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            device=device,
        )
        log.info(
            "model: %s parameters, attention %s, precision %s, device %s, %d rank(s)",
            f"{self.n_params:,}",
            attention,
            self.autocast_dtype or "fp32",
            device,
            self.dist.world_size,
        )

    def wrap_for_training(self) -> torch.nn.Module:
        model: torch.nn.Module = self.model
        if self.dist.distributed:
            model = DistributedDataParallel(
                model, device_ids=[self.dist.local_rank] if self.dist.device.type == "cuda" else None
            )
        if self.train_cfg.compile:
            model = torch.compile(model)
        return model

    # ------------------------------------------------------------------------- checkpoints
    def write_checkpoint(self, pending: PendingCheckpoint) -> None:
        weights, self._aliases = weights_bytes(self.model)
        pending.write_bytes("model.safetensors", weights)
        with pending.open("optimizer.pt") as f:
            torch.save(self.optimizer.state_dict(), f)

    def load_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        load_weights(self.model, (path / "model.safetensors").read_bytes(), state["aliased_weights"])
        optimizer_state = torch.load(path / "optimizer.pt", map_location=self.dist.device, weights_only=True)
        load_optimizer_state(self.optimizer, optimizer_state)

    def extra_state(self) -> dict[str, Any]:
        return {"aliased_weights": self._aliases}

    def data_state(self) -> dict[str, Any]:
        return self.batches.state_dict()

    def load_data_state(self, state: dict[str, Any]) -> None:
        self.batches.load_state_dict(state)

    def checkpoint_bytes_estimate(self) -> int:
        return self.n_params * CHECKPOINT_BYTES_PER_PARAM

    # ---------------------------------------------------------------------------- training
    def train_step(self, model: torch.nn.Module, step: int) -> StepResult:
        t = self.train_cfg
        self.set_lr(cosine_with_warmup(step - 1, t.max_steps, t.lr, t.warmup_steps, t.min_lr_ratio))
        total = torch.zeros((), device=self.dist.device)
        for micro in range(t.grad_accum_steps):
            inputs, targets = self.batches.next_batch()
            inputs, targets = inputs.to(self.dist.device, non_blocking=True), targets.to(self.dist.device)
            last = micro == t.grad_accum_steps - 1
            sync = contextlib.nullcontext() if last or not self.dist.distributed else model.no_sync()
            with sync, self._autocast():
                logits = model(input_ids=inputs).logits
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
                (loss / t.grad_accum_steps).backward()
            total += loss.detach() / t.grad_accum_steps
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(total, grad_norm, t.tokens_per_step_per_rank)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.autocast_dtype)

    @property
    def has_eval_data(self) -> bool:
        return bool(self.val_shards)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, step: int) -> float:
        t = self.train_cfg
        model.eval()
        batches = eval_batches(
            self.val_shards,
            open_shard,
            t.micro_batch_size,
            t.seq_len,
            t.eval_batches,
            self.dist.rank,
            self.dist.world_size,
        )
        total = torch.zeros((), device=self.dist.device)
        for inputs, targets in batches:
            with self._autocast():
                logits = model(input_ids=inputs.to(self.dist.device)).logits
            total += F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.to(self.dist.device).view(-1)
            )
        return D.all_reduce_mean(self.dist, total / max(len(batches), 1)).item()

    # ------------------------------------------------------------------------------ finish
    def export(self) -> Path | None:
        if not self.dist.is_main:
            return None
        dtype_name = self.cfg.export.dtype
        if dtype_name == "auto":
            dtype_name = "bfloat16" if self.autocast_dtype == torch.bfloat16 else "float32"
        return export_hf(self.model, self.tokenizer_dir, self.ctx.run.export / "hf", DTYPES[dtype_name])

    def summary(self) -> dict[str, Any]:
        return super().summary() | {"parameters": self.n_params}


def config_type(tree: dict[str, Any]) -> type:
    return PretrainConfig


def disk_estimate(config: PretrainConfig) -> int:
    """The checkpoints retention keeps, the one being written, and the fp32 export."""
    vocab = config.model.vocab_size or padded_vocab(65536)  # before the tokenizer is read: a safe upper bound
    params = parameter_count(llama_config(config.model, vocab, config.train.seq_len))
    kept = config.checkpoint.keep_last + config.checkpoint.keep_best + 1
    return params * CHECKPOINT_BYTES_PER_PARAM * kept + params * 4


def preflight(ctx: RunContext, config: PretrainConfig) -> None:
    """Fail with exit 2 before anything is written: the dataset must exist."""
    ctx.resolve_dataset(config.data.dataset)


def run(ctx: RunContext, config: PretrainConfig) -> dict[str, Any]:
    """Train to `train.max_steps`, export, and return the summary; raises Preempted on SIGTERM."""
    summary = train_and_export(Pretrainer, ctx, config)
    if not math.isfinite(summary.get("loss") or 0.0):
        log.warning("the final loss is not finite; check the learning rate and data")
    return summary
