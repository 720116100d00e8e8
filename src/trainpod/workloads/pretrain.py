"""`trainpod run pretrain`: a Llama decoder from scratch on token shards, exactly resumable.

    TRAINPOD_CONFIG=configs/pretrain/tiny.yaml TRAINPOD_VOLUME=/tmp/vol trainpod run pretrain
    torchrun --nproc_per_node 2 -m trainpod run pretrain --config configs/pretrain/tiny.yaml

The loop, commits and the stop protocol are train/trainer.py's; this file holds what is
pretraining's own: token-shard batches, a model built from the config, full-weight checkpoints.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch.nn.parallel import DistributedDataParallel

from trainpod.card import pretrained_model_card
from trainpod.checkpoint.tree import load_state_file
from trainpod.config.pretrain import PretrainConfig
from trainpod.context import RunContext
from trainpod.data.datagen import dataset_shards, dataset_vocab, load_dataset_manifest
from trainpod.data.shards import open_shard
from trainpod.errors import InputError
from trainpod.train import distributed as D
from trainpod.train.batches import (
    TokenBatches,
    accumulation_note,
    eval_batches,
    rescaled_accumulation,
    to_device,
)
from trainpod.train.export import DTYPES, export_hf
from trainpod.train.loss import CausalLMLoss
from trainpod.train.memory import check_fits, checkpoint_bytes
from trainpod.train.model import (
    autocast_dtype,
    build_model,
    causal_fast_path,
    llama_config,
    parameter_count,
    resolve_attention,
)
from trainpod.train.optim import build_optimizer, decay_groups
from trainpod.train.parallel import resolve_parallel
from trainpod.train.schedule import cosine_with_warmup
from trainpod.train.shape import flops_per_token, model_shape, padded_vocab
from trainpod.train.sharding import (
    decoder_layers,
    gathered_copy,
    has_shards,
    load_full_into,
    load_full_weights_into,
    load_sharded,
    load_sharded_weights,
    local_value,
    require_process_group,
    shard_model,
    sharded_state,
)
from trainpod.train.state import load_optimizer_state, load_weights, unique_weights
from trainpod.train.trainer import StepResult, Trainer, train_and_export
from trainpod.volume import Volume

log = logging.getLogger(__name__)


class Pretrainer(Trainer):
    def __init__(self, ctx: RunContext, config: PretrainConfig, dist: D.DistContext):
        t = config.train
        super().__init__(ctx, config, config.checkpoint, t.max_steps, t.log_every, t.eval_every, dist)
        self.train_cfg = t
        self._setup_data()
        with self.abandoning_setup():  # the model's load, minutes for a large one
            self._setup_model()

    # ------------------------------------------------------------------------------- setup
    def _setup_data(self) -> None:
        dataset_dir = self.ctx.resolve_dataset(self.cfg.data.dataset)
        manifest = load_dataset_manifest(dataset_dir)
        self.val_shards = dataset_shards(dataset_dir, manifest, "val")
        self.tokenizer_dir = self.ctx.resolve_tokenizer(self.cfg.data.tokenizer, manifest)
        self.tokenizer_vocab = manifest["tokenizer"]["vocab_size"]
        if self.dist.rank == 0:  # the one rank holding the run's lease
            self.ctx.carry_tokenizer(self.tokenizer_dir, self.tokenizer_vocab)
        t = self.train_cfg
        self.grad_accum_steps = t.grad_accum_steps  # rescaled when a checkpoint of another rank count resumes
        self.batches = TokenBatches(
            dataset_shards(dataset_dir, manifest, "train"),
            open_shard,
            t.micro_batch_size,
            t.seq_len,
            self.dist.rank,
            self.dist.world_size,
            t.seed,
            pin_memory=self.dist.device.type == "cuda",
            grad_accum_steps=t.grad_accum_steps,
        )
        # Read once, here: every eval uses the same windows, and a validation split too small for them is
        # an error before the first step, not at the first eval hours in. The same windows on any rank
        # count (rank r takes windows r, r + ranks, ...): a run resumed on another GPU count evaluates what
        # it evaluated before, and its evals still compare for best-k retention.
        windows = (
            eval_batches(self.val_shards, open_shard, t.micro_batch_size, t.seq_len, t.eval_batches)
            # A split dataset whose val split got no document (a small corpus, a small val_ratio) has
            # none to read: that is the same error, not a run that silently never evaluates.
            if t.eval_every and (self.val_shards or "val" in manifest["splits"])
            else []
        )
        self.eval_windows = windows[self.dist.rank :: self.dist.world_size]
        self.eval_window_count = len(windows)
        # What a rank with one window fewer runs its last round's forward on, uncounted: every rank runs as
        # many forwards (FSDP gathers in each, DDP may sync its buffers).
        self.eval_filler = windows[0] if windows else None

    def _setup_model(self) -> None:
        t, device = self.train_cfg, self.dist.device
        vocab = self.cfg.model.vocab_size or padded_vocab(self.tokenizer_vocab)
        if vocab < self.tokenizer_vocab:
            raise InputError(
                f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary "
                f"({self.tokenizer_vocab}); raise model.vocab_size or leave it unset"
            )
        self.autocast_dtype = autocast_dtype(t.precision, device)
        head_dim = self.cfg.model.hidden_size // self.cfg.model.num_heads
        # whole sequences, never padded
        attention = causal_fast_path(resolve_attention(t.attention, device, head_dim=head_dim))
        self.model_config = llama_config(self.cfg.model, vocab, t.seq_len, attention)
        self.model = build_model(self.model_config, t.seed, device)
        if t.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.n_params = parameter_count(self.model_config)
        self._checkpoint_bytes = checkpoint_bytes(
            tuple(p.numel() for p in self.model.parameters()), t.optimizer
        )
        self.flops_per_token = flops_per_token(model_shape(self.cfg, vocab), t.seq_len)
        self.parallel = resolve_parallel(t.parallel, self.dist.world_size, self.n_params, t.optimizer)
        # The module a step runs: the model and its chunked loss (train/loss.py) as one, so that DDP, FSDP
        # and torch.compile each wrap both; `loss_module(inputs, targets)` is the mean loss.
        self.loss_module: torch.nn.Module = CausalLMLoss(self.model)
        if self.parallel == "fsdp":
            require_process_group(self.parallel)
            bf16 = self.autocast_dtype == torch.bfloat16
            shard_model(decoder_layers(self.model), self.loss_module, device, bf16)
        self.optimizer = build_optimizer(
            t.optimizer,
            decay_groups(self.model, t.weight_decay),
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            device=device,
        )
        self._aliases: list[str] = []
        log.info(
            "model: %s parameters, attention %s, precision %s, device %s, %d rank(s) (%s)",
            f"{self.n_params:,}",
            attention,
            self.autocast_dtype or "fp32",
            device,
            self.dist.world_size,
            self.parallel,
        )

    def wrap_for_training(self) -> torch.nn.Module:
        """The loss module, under DDP when several ranks replicate it (FSDP sharded it in place already),
        and compiled when asked for."""
        model = self.loss_module
        if self.dist.distributed and self.parallel == "ddp":
            model = DistributedDataParallel(
                model,
                device_ids=[self.dist.local_rank] if self.dist.device.type == "cuda" else None,
                gradient_as_bucket_view=True,  # gradients live in the buckets: no second fp32 copy
            )
        if self.train_cfg.compile:
            model = torch.compile(model)
        return model

    # ------------------------------------------------------------------------- checkpoints
    def sharded_state(self) -> dict[str, Any] | None:
        return sharded_state(self.model, self.optimizer) if self.parallel == "fsdp" else None

    def checkpoint_files(self) -> dict[str, Any]:
        if self.parallel == "fsdp":
            return {}  # every rank wrote its shards (sharded_state)
        weights, self._aliases = unique_weights(self.model)
        return {"model.safetensors": weights, "optimizer.safetensors": self.optimizer.state_dict()}

    def load_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        """Either layout into either: sharded (written by FSDP on any rank count) or full weights (one
        GPU or DDP), into a sharded or a replicated model."""
        if has_shards(path):
            load_sharded(self.model, self.optimizer, path)
            return
        weights = (path / "model.safetensors").read_bytes()
        optimizer_state = load_state_file(path, "optimizer", self.dist.device)
        if self.parallel == "fsdp":
            full = safetensors.torch.load(weights)
            load_full_into(self.model, self.optimizer, full, optimizer_state, state["aliased_weights"])
            return
        load_weights(self.model, weights, state["aliased_weights"])
        load_optimizer_state(self.optimizer, optimizer_state)

    def load_checkpoint_weights(self, path: Path, state: dict[str, Any]) -> None:
        if has_shards(path):
            load_sharded_weights(self.model, path)
            return
        weights = (path / "model.safetensors").read_bytes()
        if self.parallel == "fsdp":
            load_full_weights_into(self.model, safetensors.torch.load(weights), state["aliased_weights"])
            return
        load_weights(self.model, weights, state["aliased_weights"])

    def checkpoint_weight_files(self, path: Path) -> tuple[str, ...] | None:
        # A sharded checkpoint's DCP files hold each rank's weights and optimizer state together: all of them.
        return None if has_shards(path) else ("model.safetensors", "trainer_state.json")

    def extra_state(self) -> dict[str, Any]:
        return {"aliased_weights": self._aliases}

    def data_state(self) -> dict[str, Any]:
        return self.batches.state_dict()

    def load_data_state(self, state: dict[str, Any]) -> None:
        configured = self.train_cfg.grad_accum_steps
        accumulation = rescaled_accumulation(state, self.dist.world_size, configured)
        if accumulation != self.grad_accum_steps:
            if self.dist.is_main:
                tokens = (
                    accumulation
                    * self.dist.world_size
                    * self.train_cfg.micro_batch_size
                    * self.train_cfg.seq_len
                )
                note = accumulation_note(state, self.dist.world_size, configured, accumulation)
                log.warning("%s (%s tokens a step)", note, f"{tokens:,}")
            self.grad_accum_steps = self.batches.grad_accum_steps = accumulation
        self.batches.load_state_dict(state)

    def checkpoint_bytes_estimate(self) -> int:
        return self._checkpoint_bytes

    # ---------------------------------------------------------------------------- training
    def train_step(self, model: torch.nn.Module, step: int) -> StepResult:
        t = self.train_cfg
        self.set_lr(cosine_with_warmup(step - 1, t.max_steps, t.lr, t.warmup_steps, t.min_lr_ratio))
        accumulation = self.grad_accum_steps
        total = torch.zeros((), device=self.dist.device)
        for micro in range(accumulation):
            inputs, targets = (to_device(x, self.dist.device) for x in self.batches.next_batch())
            last = micro == accumulation - 1
            with self._gradient_sync(model, last), self._autocast():
                loss = model(inputs, targets)
                (loss / accumulation).backward()
            total += loss.detach() / accumulation
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(total, local_value(grad_norm), accumulation * t.micro_batch_size * t.seq_len)

    @property
    def has_eval_data(self) -> bool:
        return bool(self.val_shards)

    @torch.no_grad()
    def compile_eval_graph(self, model: torch.nn.Module) -> None:
        if not self.train_cfg.compile:
            return
        started = time.perf_counter()
        model.eval()
        inputs, targets = self.eval_filler  # every rank, with or without windows: FSDP's forward gathers
        with self._autocast():
            model(to_device(inputs, self.dist.device), to_device(targets, self.dist.device))
        model.train()
        log.info("compiled the eval graph before the first step (%.0f s)", time.perf_counter() - started)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, step: int) -> float:
        model.eval()
        total = torch.zeros((), device=self.dist.device)
        # The ranks share the same windows on any rank count (_setup_data); until_stop runs as many rounds on
        # each, and yields None to a rank whose windows ran out, which runs its forward uncounted.
        for batch in self.until_stop(self.eval_windows):
            inputs, targets = batch if batch is not None else self.eval_filler
            with self._autocast():
                loss = model(to_device(inputs, self.dist.device), to_device(targets, self.dist.device))
            if batch is not None:
                total += loss
        # Every window holds as many tokens: their mean is the token-weighted mean.
        return D.all_reduce_sum(self.dist, total.item()) / self.eval_window_count

    # ------------------------------------------------------------------------------ finish
    def export(self) -> Path | None:
        # Sharded: gathered in full on rank 0 (every rank takes part).
        model = gathered_copy(self.model) if self.parallel == "fsdp" else self.model
        if not self.dist.is_main:
            return None
        dtype_name = self.cfg.export.dtype
        if dtype_name == "auto":
            dtype_name = "bfloat16" if self.autocast_dtype == torch.bfloat16 else "float32"
        return export_hf(
            model,
            self.tokenizer_dir,
            self.ctx.run.export / "hf",
            DTYPES[dtype_name],
            model_card=pretrained_model_card(
                self.ctx.run.name, self.cfg.data.dataset, self.model_config, self.summary()
            ),
            weights=self.exported_weights,
            abandoning=self.abandoning_export,
            publishing=self.publishing_export,
        )

    def summary(self) -> dict[str, Any]:
        return super().summary() | {"parameters": self.n_params}


def disk_estimate(config: PretrainConfig) -> int:
    """The checkpoints retention keeps, the one being written, and the fp32 export."""
    vocab = config.model.vocab_size or padded_vocab(65536)  # before the tokenizer is read: a safe upper bound
    shape = model_shape(config, vocab)
    kept = config.checkpoint.keep_last + config.checkpoint.keep_best + 1
    # An 8-bit optimizer's state is a quarter of AdamW's: counted as AdamW's, boot refused (exit 5, 'grow the
    # network volume') the 4b preset on a volume with room for its checkpoints.
    return checkpoint_bytes(shape.tensor_sizes, config.train.optimizer) * kept + shape.params * 4


def preflight(ctx: RunContext, config: PretrainConfig) -> None:
    """Fail with exit 2 before anything is written: the dataset must exist (with a validation split for
    export.weights=best) and, on a GPU, the estimated peak memory (train/memory.py, logged on any machine)
    must fit it."""
    manifest = load_dataset_manifest(ctx.resolve_dataset(config.data.dataset))
    if config.export.weights == "best" and "val" not in manifest["splits"]:
        # No eval would score a checkpoint: the run would export the last step's weights after it all.
        raise InputError(
            f"export.weights=best needs a validation split, and dataset {config.data.dataset} has none; make it "
            "with datagen's mode: split, or set export.weights=last"
        )
    vocab = config.model.vocab_size or padded_vocab(manifest["tokenizer"]["vocab_size"])
    check_fits(config, vocab, world_size=int(os.environ.get("WORLD_SIZE", "1")))


def check_gpu_memory(config: PretrainConfig, volume: Volume, gpus: int) -> None:
    """At boot, before the ranks start: the estimated peak GPU memory (train/memory.py) on `gpus` ranks
    is logged and, on a GPU, must fit it (exit 2 naming the knobs)."""
    vocab = config.model.vocab_size or padded_vocab(dataset_vocab(config.data.dataset, volume) or 65536)
    check_fits(config, vocab, world_size=max(gpus, 1))


def run(ctx: RunContext, config: PretrainConfig) -> dict[str, Any]:
    """Train to `train.max_steps`, export, and return the summary; raises Preempted on SIGTERM."""
    summary = train_and_export(Pretrainer, ctx, config)
    if not math.isfinite(summary.get("loss") or 0.0):
        log.warning("the final loss is not finite; check the learning rate and data")
    return summary
