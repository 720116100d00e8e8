"""`trainpod run pretrain`: a Llama decoder from scratch on token shards, exactly resumable.

    TRAINPOD_CONFIG=configs/pretrain/tiny.yaml TRAINPOD_VOLUME=/tmp/vol trainpod run pretrain
    torchrun --nproc_per_node 2 -m trainpod run pretrain --config configs/pretrain/tiny.yaml

Each optimizer step is one `_train_step`; after it the ranks agree (one small all-reduce) on
whether to commit a checkpoint and whether a stop was requested. SIGTERM finishes the step in
flight, commits when the measured commit time fits the warning window, and exits 143.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import trainpod
from trainpod.checkpoint import CheckpointStore, CommittedCheckpoint
from trainpod.config import config_hash
from trainpod.config.pretrain import PretrainConfig
from trainpod.data.datagen import dataset_shards, load_dataset_manifest
from trainpod.data.shards import open_shard
from trainpod.errors import BudgetExhausted, InputError, Preempted, TemporaryError
from trainpod.train import distributed as D
from trainpod.train.batches import TokenBatches, eval_batches
from trainpod.train.export import DTYPES, export_hf
from trainpod.train.model import (
    build_model,
    flops_per_token,
    llama_config,
    padded_vocab,
    parameter_count,
    resolve_attention,
)
from trainpod.train.reporting import RunReporter, peak_flops
from trainpod.train.schedule import cosine_with_warmup
from trainpod.train.state import capture_rng, load_weights, restore_rng, weights_bytes
from trainpod.workloads.context import RunContext

log = logging.getLogger(__name__)

ASSUMED_VOLUME_BYTES_PER_S = 200e6  # network volumes write 200-400 MB/s; used before a commit is measured


@dataclass
class Progress:
    """Counters that travel in every checkpoint."""

    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0  # training time over every attempt, for cost and ETA
    best_eval_loss: float | None = None
    last_eval_loss: float | None = None
    last_eval_step: int | None = None


class Pretrainer:
    def __init__(self, ctx: RunContext, config: PretrainConfig, dist: D.DistContext):
        self.ctx = ctx
        self.cfg = config
        self.dist = dist
        self.train_cfg = config.train
        self.progress = Progress()
        self.store = CheckpointStore(
            ctx.run.checkpoints,
            config.checkpoint.keep_last,
            config.checkpoint.keep_best,
            config.checkpoint.verify,
        )
        self.last_committed_step: int | None = None
        self._last_commit_time = time.monotonic()
        self._last_metrics: dict[str, Any] = {}  # the newest logged metrics, for status.json and DONE
        self._lr = 0.0
        self._budget_warned = False
        self.reporter: RunReporter | None = None  # made in train(): rank 0 writes, the others do not
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
        self.autocast_dtype = _autocast_dtype(t.precision, device)
        attention = resolve_attention(t.attention, device)
        self.model_config = llama_config(self.cfg.model, vocab, t.seq_len, attention)
        self.model = build_model(self.model_config, t.seed, device)
        if t.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.n_params = parameter_count(self.model_config)
        self.flops_per_token = flops_per_token(self.model_config, self.n_params, t.seq_len)
        self.optimizer = _adamw(self.model, t, device)
        log.info(
            "model: %s parameters, attention %s, precision %s, device %s, %d rank(s)",
            f"{self.n_params:,}",
            attention,
            self.autocast_dtype or "fp32",
            device,
            self.dist.world_size,
        )

    def _wrap_for_training(self) -> torch.nn.Module:
        model: torch.nn.Module = self.model
        if self.dist.distributed:
            model = DistributedDataParallel(
                model, device_ids=[self.dist.local_rank] if self.dist.device.type == "cuda" else None
            )
        if self.train_cfg.compile:
            model = torch.compile(model)
        return model

    # ------------------------------------------------------------------------------ resume
    def resume(self) -> int:
        """Load the newest valid checkpoint, if any; returns the step training continues after."""
        step = -1.0
        if self.dist.is_main:
            latest = self.store.latest()  # also removes what an interrupted commit left behind
            step = float(latest.step) if latest else -1.0
        step = int(D.broadcast_from_main(self.dist, step))
        if step < 0:
            log.info("no checkpoint found; starting from step 0")
            return 0
        path = self.store.root / f"step-{step}"
        state = json.loads((path / "trainer_state.json").read_text())
        load_weights(self.model, (path / "model.safetensors").read_bytes(), state["aliased_weights"])
        optimizer_state = torch.load(path / "optimizer.pt", map_location=self.dist.device, weights_only=True)
        self.optimizer.load_state_dict(optimizer_state)
        rng = torch.load(path / "rng.pt", weights_only=True)
        if len(rng) != self.dist.world_size:
            raise InputError(
                f"checkpoint {path.name} was written by {len(rng)} rank(s), this run has "
                f"{self.dist.world_size}; resume with the same number of GPUs or start a new run"
            )
        restore_rng(rng[self.dist.rank])
        self.batches.load_state_dict(state["data"])
        self.progress = Progress(**state["progress"])
        self.last_committed_step = step
        if state.get("config_hash") != config_hash(self.cfg):
            log.warning("the config changed since %s was written; continuing with the new one", path.name)
        log.info(
            "resumed from %s (step %d, %s tokens seen)", path.name, step, f"{self.progress.tokens_seen:,}"
        )
        return step

    # ---------------------------------------------------------------------------- training
    def train(self) -> None:
        start_step = self.resume()
        model = self._wrap_for_training()
        reporter = RunReporter(self.ctx.run, self.train_cfg.max_steps, start_step, enabled=self.dist.is_main)
        self.reporter = reporter
        try:
            self._loop(model, start_step)
            reporter.plot_loss()  # not on a stop: the seconds before SIGKILL are not for drawing
        finally:
            reporter.close()

    def _loop(self, model: torch.nn.Module, start_step: int) -> None:
        t = self.train_cfg
        window_start, window_tokens, window_steps = time.perf_counter(), 0, 0
        loss_sum = torch.zeros((), device=self.dist.device)
        for step in range(start_step + 1, t.max_steps + 1):
            step_started = time.perf_counter()
            loss, grad_norm = self._train_step(model, step)
            loss_sum += loss
            tokens = t.tokens_per_step_per_rank * self.dist.world_size
            self.progress.step, self.progress.tokens_seen = step, self.progress.tokens_seen + tokens
            self.progress.elapsed_s += time.perf_counter() - step_started
            window_tokens, window_steps = window_tokens + tokens, window_steps + 1
            metrics: dict[str, Any] = {}
            if t.eval_every and step % t.eval_every == 0 and self.val_shards:
                metrics["eval_loss"] = self._evaluate(model)
            if step % t.log_every == 0 or step == t.max_steps or metrics:
                seconds = time.perf_counter() - window_start
                metrics |= self._step_metrics(
                    step, loss_sum / window_steps, grad_norm, window_tokens, seconds, window_steps
                )
                self.reporter.log_step(metrics)
                self._write_status("running", metrics)
                window_start, window_tokens, window_steps = time.perf_counter(), 0, 0
                loss_sum.zero_()
            self._after_step(step)

    def _train_step(self, model: torch.nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.train_cfg
        lr = cosine_with_warmup(step - 1, t.max_steps, t.lr, t.warmup_steps, t.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        model.train()
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
        self._lr = lr
        return total, grad_norm

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.autocast_dtype)

    @torch.no_grad()
    def _evaluate(self, model: torch.nn.Module) -> float:
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
        eval_loss = D.all_reduce_mean(self.dist, total / max(len(batches), 1)).item()
        self.progress.last_eval_loss, self.progress.last_eval_step = eval_loss, self.progress.step
        if self.progress.best_eval_loss is None or eval_loss < self.progress.best_eval_loss:
            self.progress.best_eval_loss = eval_loss
        return eval_loss

    def _step_metrics(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, tokens: int, seconds: float, steps: int
    ) -> dict[str, Any]:
        tokens_per_s = tokens / seconds if seconds > 0 else None
        peak = peak_flops(self.dist.device)
        mfu = (
            (tokens_per_s * self.flops_per_token / (peak * self.dist.world_size))
            if peak and tokens_per_s
            else None
        )
        return {
            "step": step,
            "loss": D.all_reduce_mean(self.dist, loss.detach().clone()).item(),
            "lr": self._lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "steps_per_s": steps / seconds if seconds > 0 else None,
            "cost_usd": self.reporter.cost(self.progress.elapsed_s),
        }

    # --------------------------------------------------------------------- commit and stop
    def _after_step(self, step: int) -> None:
        """Agree across ranks on committing and stopping, then do it (one all-reduce per step)."""
        ck = self.cfg.checkpoint
        due = step % ck.every_steps == 0 or step == self.train_cfg.max_steps
        due_by_time = self.dist.is_main and time.monotonic() - self._last_commit_time >= ck.every_minutes * 60
        over_budget = self.dist.is_main and self._over_budget()
        # Only rank 0 holds the lease and the clock: every flag is agreed on, or ranks would part ways
        # (one raising while the others wait in a collective for it).
        flags = [due, due_by_time, over_budget, self.ctx.watch.requested, self.ctx.lease_lost()]
        due, due_by_time, over_budget, stop, lease_lost = (
            bool(v) for v in D.all_reduce_max(self.dist, [float(f) for f in flags])
        )
        if lease_lost:
            raise TemporaryError("another writer took over this run's lease; stopping without a commit")
        if stop:
            self._commit_before_stop(step)
            raise Preempted(
                f"stopped by {self.ctx.watch.signal_name or 'signal'} at step {step}; "
                f"newest checkpoint: step {self.last_committed_step}"
            )
        if due or due_by_time or over_budget:
            self.commit(step)
            # A SIGTERM that came during the commit stops now, not after another step.
            if D.all_reduce_max(self.dist, [float(self.ctx.watch.requested)])[0]:
                raise Preempted(
                    f"stopped by {self.ctx.watch.signal_name or 'signal'} at step {step}, which is committed"
                )
        if over_budget:
            raise BudgetExhausted(
                f"TRAINPOD_BUDGET_USD is spent (${self.reporter.cost(self.progress.elapsed_s):.2f}); "
                f"committed step {step}. Raise the budget and start again to continue."
            )

    def _commit_before_stop(self, step: int) -> None:
        if self.last_committed_step == step:
            log.info("stop requested at step %d, which is already committed", step)
            return
        fits = 1.0
        if self.dist.is_main:
            needed = self._expected_commit_seconds() * self.cfg.checkpoint.commit_margin
            left = self.ctx.watch.seconds_left()
            fits = float(needed < left)
            if not fits:
                log.warning(
                    "stop requested: a commit needs about %.1f s but only %.1f s are left before SIGKILL; "
                    "exiting without one (losing the steps since %s)",
                    needed,
                    left,
                    self.last_committed_step,
                )
        if D.broadcast_from_main(self.dist, fits):
            self.commit(step)

    def _expected_commit_seconds(self) -> float:
        if self.store.last_commit_seconds is not None:
            return self.store.last_commit_seconds
        state_bytes = self.n_params * 4 * 3  # fp32 weights + two AdamW moments
        return 0.5 + state_bytes / ASSUMED_VOLUME_BYTES_PER_S

    def _over_budget(self) -> bool:
        budget = self.ctx.budget_usd
        cost = self.reporter.cost(self.progress.elapsed_s)
        if budget is None or cost is None:
            return False
        if cost >= 0.9 * budget and not self._budget_warned:
            log.warning("90%% of TRAINPOD_BUDGET_USD spent ($%.2f of $%.2f)", cost, budget)
            self._budget_warned = True
        return cost >= budget

    def commit(self, step: int) -> CommittedCheckpoint | None:
        """Write a checkpoint of the state after `step` (rank 0 writes; every rank sends its RNG state)."""
        started = time.monotonic()
        rng_states = D.gather_to_main(self.dist, capture_rng())
        committed = None
        if self.dist.is_main:
            pending = self.store.begin(step)
            weights, aliases = weights_bytes(self.model)
            pending.write_bytes("model.safetensors", weights)
            with pending.open("optimizer.pt") as f:
                torch.save(self.optimizer.state_dict(), f)
            with pending.open("rng.pt") as f:
                torch.save(rng_states, f)
            pending.write_bytes(
                "trainer_state.json", json.dumps(self._trainer_state(aliases), indent=2).encode()
            )
            # Only a checkpoint evaluated at its own step competes for best-k retention.
            eval_loss = self.progress.last_eval_loss if self.progress.last_eval_step == step else None
            committed = self.store.commit(
                pending, step, self._manifest_metadata(), eval_loss, started=started
            )
            log.info("committed checkpoint step-%d in %.2f s", step, self.store.last_commit_seconds)
        self.last_committed_step = step
        self._last_commit_time = time.monotonic()
        self._write_status("running", {})
        D.barrier(self.dist)
        return committed

    def _trainer_state(self, aliases: list[str]) -> dict[str, Any]:
        return {
            "progress": self.progress.__dict__,
            "data": self.batches.state_dict(),
            "aliased_weights": aliases,
            "world_size": self.dist.world_size,
            "config_hash": config_hash(self.cfg),
        }

    def _manifest_metadata(self) -> dict[str, Any]:
        return {
            "world_size": self.dist.world_size,
            "config_hash": config_hash(self.cfg),
            "tokens_seen": self.progress.tokens_seen,
            "versions": {"trainpod": trainpod.__version__, "torch": torch.__version__},
        }

    def _write_status(self, state: str, metrics: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        checkpoint = None
        if self.last_committed_step is not None:
            checkpoint = {
                "step": self.last_committed_step,
                "committed_unix": time.time() - (time.monotonic() - self._last_commit_time),
            }
        self.reporter.write_status(
            state, self.progress.step, metrics or self._last_metrics, checkpoint, self.progress.elapsed_s
        )
        if metrics:
            self._last_metrics = metrics

    # ------------------------------------------------------------------------------ finish
    def export(self) -> Path | None:
        if not self.dist.is_main:
            return None
        dtype_name = self.cfg.export.dtype
        if dtype_name == "auto":
            dtype_name = "bfloat16" if self.autocast_dtype == torch.bfloat16 else "float32"
        return export_hf(self.model, self.tokenizer_dir, self.ctx.run.export / "hf", DTYPES[dtype_name])

    def summary(self) -> dict[str, Any]:
        metrics = self._last_metrics
        return {
            "step": self.progress.step,
            "tokens_seen": self.progress.tokens_seen,
            "loss": metrics.get("loss"),
            "eval_loss": self.progress.last_eval_loss,
            "best_eval_loss": self.progress.best_eval_loss,
            "tokens_per_s": metrics.get("tokens_per_s"),
            "parameters": self.n_params,
            "elapsed_s": self.progress.elapsed_s,
        }


def _autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    if precision == "fp32":
        return None
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if precision == "bf16":
        raise InputError(
            f"train.precision=bf16 needs a GPU with bf16 support; this process has {device}. "
            "Use train.precision=auto or fp32"
        )
    return None


def _adamw(model: torch.nn.Module, t: Any, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms or biases); fused kernels on CUDA."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=device.type == "cuda"
    )


def run(ctx: RunContext, config: PretrainConfig) -> dict[str, Any]:
    """Train to `train.max_steps`, export, and return the summary; raises Preempted on SIGTERM."""
    dist = D.init_distributed()
    try:
        if config.train.cpu_threads and dist.device.type == "cpu":
            torch.set_num_threads(config.train.cpu_threads)
        trainer = Pretrainer(ctx, config, dist)
        trainer.train()
        exported = trainer.export()
        D.barrier(dist)
        summary = trainer.summary() | {
            "export": str(exported) if exported else None,
            "checkpoints": [c.path.name for c in trainer.store.committed()],
        }
        if not math.isfinite(summary.get("loss") or 0.0):
            log.warning("the final loss is not finite; check the learning rate and data")
        return summary
    finally:
        D.shutdown(dist)
