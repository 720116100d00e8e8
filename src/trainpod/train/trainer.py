"""The training loop, commit and stop protocol that pretrain and finetune share.

A workload's trainer subclasses `Trainer` and supplies what differs: one optimizer step
(`train_step`), an evaluation (`evaluate`), and what a checkpoint holds beyond the counters
(`checkpoint_files` / `load_checkpoint`, `data_state` / `load_data_state`). Everything here is
the same for every workload:

- after each step the ranks agree (one small all-reduce) on committing, stopping and the budget;
- a periodic commit snapshots the state at that step and, with async commits (checkpoint.mode),
  is written by a background thread while training goes on (checkpoint/writer.py); at most one
  is in flight, the next snapshot waits for it;
- SIGTERM finishes the step in flight; then the commit in flight is finished if its measured time
  fits the warning window (else abandoned), the current step is committed if that fits too, and
  the run exits 143; a SIGTERM during a periodic commit stops right after it;
- a spent budget commits and exits 3; an eval plateau (when the workload asks for early stopping)
  commits and ends training as if max_steps were reached.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

import trainpod
from trainpod.checkpoint import CheckpointStore, CommittedCheckpoint
from trainpod.checkpoint.store import step_dir_name
from trainpod.checkpoint.tree import load_state_file
from trainpod.checkpoint.writer import CheckpointWriter, ShardFiles
from trainpod.config import config_hash
from trainpod.config.checkpoint import CheckpointConfig
from trainpod.context import RunContext
from trainpod.diskspace import check_headroom, is_disk_full, volume_full, volume_full_as_exit_5
from trainpod.errors import BudgetExhausted, Diverged, InputError, Preempted, TemporaryError, VolumeFull
from trainpod.preemption import WorkAbandoned
from trainpod.train import distributed as D
from trainpod.train.reporting import RunReporter, peak_flops
from trainpod.train.sharding import SHARDED_DIR, ShardWriter, set_gradient_sync
from trainpod.train.state import capture_rng, restore_rng, seed_rng

log = logging.getLogger(__name__)

ASSUMED_VOLUME_BYTES_PER_S = 200e6  # network volumes write 200-400 MB/s; used before a commit is measured
PLOT_SECONDS_BEFORE_KILL = 2.5  # matplotlib's import and one draw take ~1 s on a busy CPU; keep a margin


T = TypeVar("T")
# The settings a config gives each optimizer group (lr follows the schedule, set at every step).
CONFIGURED_SETTINGS = ("weight_decay", "betas", "eps")


class EvalInterrupted(Exception):
    """A stop was asked for during an eval (`Trainer.until_stop`): the eval is dropped, the step before it
    is committed in the warning window, and the eval runs after the resume instead (`_evaluate_pending`)."""


@dataclass
class Progress:
    """Counters that travel in every checkpoint."""

    step: int = 0
    tokens_seen: int = 0
    # Wall time of every attempt since its trainer started (loading, steps, evals, commits), for the cost
    # and TRAINPOD_BUDGET_USD: the pod bills all of it, not only the steps.
    elapsed_s: float = 0.0
    best_eval_loss: float | None = None
    last_eval_loss: float | None = None
    last_eval_step: int | None = None
    evals_without_improvement: int = 0
    best_score: float | None = None  # of the trainer's ranked_metric (eval_loss unless configured)
    last_score: float | None = None
    last_score_step: int | None = None
    # The training loss of the newest log line: the summary (DONE, the export's) names it also after a resume
    # that trains no step (a stop during the final export makes it again from the last checkpoint).
    last_loss: float | None = None

    def note_eval(self, step: int, eval_loss: float, score: float | None, min_delta: float) -> None:
        """An eval's loss and ranked score (None: a generation metric not measured at this eval) into the history
        early stopping reads. A score that is not finite (a diverged eval) never becomes the best: as the
        best, no later eval could beat it (every comparison with NaN is false), and early stopping ended a
        run that had recovered once its patience ran out."""
        self.last_eval_loss, self.last_eval_step = eval_loss, step
        if math.isfinite(eval_loss):
            self.best_eval_loss = (
                eval_loss if self.best_eval_loss is None else min(self.best_eval_loss, eval_loss)
            )
        if score is None:
            return
        self.last_score, self.last_score_step = score, step
        if math.isfinite(score) and (self.best_score is None or score < self.best_score - min_delta):
            self.best_score, self.evals_without_improvement = score, 0
        else:
            self.evals_without_improvement += 1


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss of the step, on the device (read only when logging)
    grad_norm: torch.Tensor
    tokens: int  # tokens this rank processed in the step


class Trainer:
    """Subclasses set `self.model` (the module whose parameters train) and `self.optimizer`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_module: torch.nn.Module  # what a step runs: the model with its loss (sharded in place under FSDP)
    parallel = "ddp"  # or "fsdp" (train/sharding.py), set by the workload from train.parallel
    flops_per_token: float | None = None  # for MFU; None where it is not meaningful
    improvement_threshold = 0.0  # an eval counts as better only if it beats the best by more than this
    # What early stopping and best-k retention rank by, lower is better: eval_loss, or a metric the
    # workload's evaluate() puts into self.eval_metrics (e.g. eval_cer from generation).
    ranked_metric = "eval_loss"

    def __init__(
        self,
        ctx: RunContext,
        config: Any,
        checkpoint: CheckpointConfig,
        max_steps: int,
        log_every: int,
        eval_every: int,
        dist: D.DistContext,
    ):
        self.ctx = ctx
        self.cfg = config
        self.checkpoint_cfg = checkpoint
        self.max_steps = max_steps
        self.log_every = log_every
        self.eval_every = eval_every
        self.dist = dist
        self.progress = Progress()
        self.store = CheckpointStore(
            ctx.run.checkpoints, checkpoint.keep_last, checkpoint.keep_best, checkpoint.verify
        )
        # Rank 0's lease (the others hold none): a commit whose lease was lost while it wrote is not published.
        self.store.lease = ctx.lease
        on_gpu = dist.device.type == "cuda"
        self.writer = CheckpointWriter(self.store, pin_memory=on_gpu)
        self.shard_writer = ShardWriter()  # this rank's DCP writes, for sharded (FSDP) checkpoints
        self.background_commits = checkpoint.background_commits(dist.device.type)
        self.last_committed_step: int | None = None  # rank 0's knowledge; the others never read it
        self.finished_early: str | None = None  # the reason, when an eval plateau ended training
        self.exported_weights: dict[str, Any] | None = None  # the step the export holds (take_export_weights)
        self._last_commit_time = time.monotonic()  # when the newest commit's snapshot was taken
        self._snapshot_hook: Any = None  # the optimizer's step pre-hook, once a background commit ran
        self._only_parameters: bool | None = None  # _state_changes_only_in_optimizer_steps, once known
        self._committed_unix: float | None = None
        self._last_metrics: dict[str, Any] = {}  # the newest logged metrics, for status.json and DONE
        self._lr = 0.0
        self._budget_warned = False
        self._uncounted_since = time.perf_counter()  # this attempt's time not yet in progress.elapsed_s
        self.eval_metrics: dict[str, float] = {}  # more metrics of the latest eval (set by evaluate)
        self.reporter: RunReporter | None = None  # made in train(): rank 0 writes, the others do not
        # The GPU's bf16 peak for both MFUs (a log line's and the run's), looked up once; None off a GPU or unknown.
        self._peak_flops = peak_flops(dist.device)
        self.autocast_dtype: torch.dtype | None = None  # the workload's mixed precision (bf16), if any
        # The first step whose loss or gradient norm was NaN or inf (0: none), kept on the device so that
        # noting it costs no host sync; read where the loop syncs anyway (a log line, a commit).
        self._first_nonfinite_step = torch.zeros((), dtype=torch.int64, device=dist.device)

    # ----------------------------------------------------------------------- workload hooks
    def train_step(self, model: torch.nn.Module, step: int) -> StepResult:
        """One optimizer step; `model` is in train mode already."""
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, step: int) -> float:
        """The mean eval loss over every rank."""
        raise NotImplementedError

    @property
    def has_eval_data(self) -> bool:
        raise NotImplementedError

    def compile_eval_graph(self, model: torch.nn.Module) -> None:
        """Before the first step, when an eval is still to come: if `model` is compiled, run what makes
        torch.compile build the graph an eval needs (eval mode and no_grad are a second graph). Built at
        the first eval instead, it would take 10-60 s between two commits, and a SIGTERM meanwhile could
        not be answered before SIGKILL (docs/design.md, "Stopping"); here no step since the checkpoint is
        lost."""

    def sharded_state(self) -> dict[str, Any] | None:
        """The state every rank writes its own shards of (FSDP: train/sharding.py), or None when rank 0
        writes everything through `checkpoint_files`."""
        return None

    def checkpoint_files(self) -> dict[str, Any]:
        """The weights (or adapter) and optimizer files of a checkpoint, by file name (rank 0 only):
        a dict of tensors for `.safetensors`, a structure of tensors for `.pt` (checkpoint/writer.py).
        Live tensors are fine: the writer snapshots them before training goes on."""
        raise NotImplementedError

    def load_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def load_checkpoint_weights(self, path: Path, state: dict[str, Any]) -> None:
        """The weights alone of the committed checkpoint at `path`, for an export of an older step
        (export.weights: best); by default the whole checkpoint."""
        self.load_checkpoint(path, state)

    def checkpoint_weight_files(self, path: Path) -> tuple[str, ...] | None:
        """The files of the committed checkpoint at `path` that `load_checkpoint_weights` reads, which the
        export's verification hashes; None: every file (the default load reads the whole checkpoint)."""
        return None

    def data_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_data_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def checkpoint_bytes_estimate(self) -> int:
        """Bytes a commit writes, for the first SIGTERM decision before a commit has been timed."""
        raise NotImplementedError

    def extra_state(self) -> dict[str, Any]:
        """More JSON state for trainer_state.json (tracker run ids, ...)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def should_stop_early(self) -> str | None:
        """From the eval history in `self.progress`: the reason to end training now, or None.

        Asked after each eval and after a resume (a run that stopped early and was interrupted
        before DONE must not train on). No early stopping by default.
        """
        return None

    def wrap_for_training(self) -> torch.nn.Module:
        return self.model

    def export(self) -> Path | None:
        """Write the final artifacts under export/ (rank 0); returns their folder. What comes before their
        rename into place runs inside `abandoning_export()`, the rename inside `publishing_export()`."""
        raise NotImplementedError

    @contextlib.contextmanager
    def abandoning_setup(self) -> Iterator[None]:
        """Where a stop signal ends the setup of a start (the model's load and wrapping, the checkpoint's
        verification and read) at once with Preempted, exit 143: nothing of this start is committed yet, and
        the next start sets up again. Answered at the first step, a load of minutes (a large model read from
        the network volume, quantized on load) met the SIGKILL with the run's lease held, which a new pod on
        another host waited out.

        One rank only: under several, the setup holds collectives (barriers, the broadcast of the checkpoint
        to resume, FSDP's wrap) that a rank leaving alone would leave the others waiting in; the ranks stop
        together at the first step boundary, as before.
        """
        if self.dist.world_size > 1:
            yield
            return
        try:
            with self.ctx.watch.abandoning():
                yield
        except WorkAbandoned:
            raise Preempted(
                f"stopped by {self.ctx.watch.signal_name} during the setup, before this start trained a step; "
                "the next start sets up again"
            ) from None

    def take_export_weights(self) -> None:
        """Put the weights export.weights asks for into the model on every rank, before `export()`: the final
        step's as they are ('last'), or the best checkpoint's by the ranked metric ('best', among the checkpoints
        retention keeps: an early-stopped run ends its patience's evals past its best). The choice is read from
        the committed manifests alone, so an export stopped and made again at the next start picks the same one.
        `exported_weights` records it for the export's manifest, its summary and DONE."""
        chosen: dict[str, Any] = {"chosen": "last", "step": self.progress.step}
        if self.dist.is_main and getattr(self.cfg.export, "weights", "last") == "best":
            # The verification hashes the candidate's every file (minutes for tens of GB on the network volume):
            # a stop ends it as it ends the load below.
            with self._abandoning_export_on_one_rank():
                best = self._best_checkpoint()
            if best is not None:
                chosen = {"chosen": "best", "step": best.step, "metric": best.ranked_by, "value": best.score}
            of = f", the best by {best.ranked_by} ({best.score:.4f})" if best else ""
            log.info(
                "exporting the weights of step %d%s; the last step is %d",
                chosen["step"],
                of,
                self.progress.step,
            )
        self.exported_weights = chosen = D.broadcast_object(self.dist, chosen)
        if chosen["step"] == self.progress.step:
            return  # the model holds them: the last step is committed and nothing trained since
        path = self.store.root / step_dir_name(chosen["step"])
        # Reading a large checkpoint from the network volume takes minutes: a stop ends it as it ends the export's
        # writes.
        with self._abandoning_export_on_one_rank():
            self.load_checkpoint_weights(path, json.loads((path / "trainer_state.json").read_text()))

    def _abandoning_export_on_one_rank(self) -> contextlib.AbstractContextManager[None]:
        """`abandoning_export()` on one rank; under several, what comes before the export's collectives (rank 0's
        choice, FSDP's load) runs on, the ranks leaving together after it, the lease released at the stop."""
        return self.abandoning_export() if self.dist.world_size == 1 else contextlib.nullcontext()

    def _best_checkpoint(self) -> CommittedCheckpoint | None:
        """The best-ranked committed checkpoint that verifies (rank 0), else None with a warning: no kept
        checkpoint was scored by an eval at its own step (a run shorter than eval_every), or none that was
        verifies."""
        ranked = self.store.ranked()
        for candidate in ranked:
            # The files the export reads alone: the optimizer state beside the weights (AdamW's, twice them) is
            # minutes of reads on the network volume for nothing, and damaged there it spoils no export.
            _, problem = self.store.verify(candidate.path, self.checkpoint_weight_files(candidate.path))
            if not problem:
                return candidate
            log.warning("%s ranks best but is invalid (%s); trying the next", candidate.path.name, problem)
        why = (
            f"every kept checkpoint an eval scored ({', '.join(c.path.name for c in ranked)}) fails verification"
            if ranked
            else "no kept checkpoint was scored by an eval at its own step"
        )
        log.warning(
            "export.weights=best: %s; exporting the last step's weights (step %d)", why, self.progress.step
        )
        return None

    def abandoning_export(self) -> contextlib.AbstractContextManager[None]:
        """Where a stop signal ends rank 0's writes of the final export at once (PreemptionWatch.abandoning);
        the last step is committed already, so the next start loads it and makes the export again. Run on, an
        export of a large model met the SIGKILL with the run's lease held, which a new pod on another host
        waited out.

        Under several ranks these writes come after the export's collective (FSDP gathers the weights on
        every rank), which runs on to its end after a stop while the lease is released at the signal
        (`train_and_export`); the ranks then leave together on rank 0's word.
        """
        return self.ctx.watch.abandoning()

    def publishing_export(self) -> contextlib.AbstractContextManager[None]:
        """Around the export's rename into place (rank 0): refused (WorkAbandoned) once the run's lease was
        released at a stop, when a new pod may hold the run and write export/ itself (Lease.publishing)."""
        return self.ctx.lease.publishing() if self.ctx.lease is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------------------ resume
    def resume(self) -> int:
        """Load the newest valid checkpoint, if any; returns the step training continues after."""
        step = -1.0
        if self.dist.is_main:
            # The verification reads every byte (minutes for tens of GB on a network volume): a stop ends it
            # as it ends the rest of the setup. Each of its writes (a leftover's removal, a rename aside,
            # LATEST) is whole or a leftover the next start removes.
            with self.abandoning_setup():
                latest = self.store.latest()  # also removes what an interrupted commit left behind
            step = float(latest.step) if latest else -1.0
        D.wait_for_main(self.dist)  # verify_mode sha256 reads every byte: minutes for a large model
        step = int(D.broadcast_from_main(self.dist, step))
        if step < 0:
            log.info("no checkpoint found; starting from step 0")
            return 0
        path = self.store.root / f"step-{step}"
        try:
            with self.abandoning_setup():
                state = self._load_committed(path)
        except (FileNotFoundError, KeyError, TypeError, ValueError) as exc:
            raise checkpoint_misfit(path, exc) from None
        self.last_committed_step = step
        self._committed_unix = json.loads((path / "manifest.json").read_text()).get("created_unix")
        if state.get("config_hash") != config_hash(self.cfg):
            log.warning("the config changed since %s was written; continuing with the new one", path.name)
        log.info(
            "resumed from %s (step %d, %s tokens seen)", path.name, step, f"{self.progress.tokens_seen:,}"
        )
        return step

    def _load_committed(self, path: Path) -> dict[str, Any]:
        state = json.loads((path / "trainer_state.json").read_text())
        configured = [{k: g[k] for k in CONFIGURED_SETTINGS if k in g} for g in self.optimizer.param_groups]
        self.load_checkpoint(path, state)
        self._apply_edited_optimizer_settings(configured, path)
        rng = load_state_file(path, "rng")
        if len(rng) != self.dist.world_size and self.dist.is_main:
            log.warning(
                "%s was written by %d rank(s), this run has %d: the weights and data position carry over "
                "(train/sharding.py, train/batches.py); ranks beyond the checkpoint's draw fresh random "
                "streams, so dropout differs from an uninterrupted run",
                path.name,
                len(rng),
                self.dist.world_size,
            )
        if self.dist.rank < len(rng):
            restore_rng(rng[self.dist.rank])
        else:
            seed_rng(
                getattr(self.cfg.train, "seed", 0) * 1_000_003
                + int(state["progress"]["step"])
                + self.dist.rank
            )
        self.load_data_state(state["data"])
        self.progress = Progress(**state["progress"])
        if self.progress.best_score is None and self.ranked_metric == "eval_loss":
            self.progress.best_score = self.progress.best_eval_loss  # a checkpoint from before scores
        self.load_extra_state(state)
        return state

    # ---------------------------------------------------------------------------- training
    def train(self) -> None:
        start_step = self.resume()
        self._check_first_checkpoint_fits()
        self._warn_if_best_k_sees_few_evals()
        self.finished_early = self.should_stop_early()
        model = self.wrap_for_training()
        self.reporter = self.make_reporter(start_step)
        self._last_metrics = self.reporter.resumed_metrics  # the loss the committed step was logged with
        self.reporter.last_eval_loss = self.progress.last_eval_loss  # log lines show it from the first one
        try:
            if not self.finished_early:
                if self._eval_after(start_step):
                    self.compile_eval_graph(model)
                try:
                    self._evaluate_pending(model, start_step)
                except EvalInterrupted:  # stopped again before a step: the resumed step is the committed one
                    self._stop(start_step)
            if not self.finished_early:  # again: the pending eval may end the run (a plateau)
                self._loop(model, start_step)
            self._committed(self.writer.wait())
            D.wait_for_main(self.dist)  # for the last commit in flight, minutes for a large model
            self.reporter.plot_loss()
        except (Preempted, BudgetExhausted):
            self._plot_if_time_left()
            raise
        finally:
            self.writer.close()  # after an error: a commit still in flight is a valid one, let it land
            self.reporter.close()

    def _check_first_checkpoint_fits(self) -> None:
        """Before any step: not one GPU hour on steps that cannot be committed (VolumeFull, exit 5). Rank 0
        measures and every rank raises: raised on rank 0 alone, the others crashed in their next collective
        when it left (exit 1, a failed start retried on a full volume) and the launcher reported theirs."""
        full = None
        if self.dist.is_main:
            try:
                check_headroom(self.store.root, self._next_checkpoint_bytes(), first=True)
            except VolumeFull as exc:
                full = str(exc)
        full = D.broadcast_object(self.dist, full)
        if full is not None:
            raise VolumeFull(full)

    def _warn_if_best_k_sees_few_evals(self) -> None:
        """keep_best ranks the checkpoints committed at an eval's step. Where checkpoint.every_steps does not
        divide eval_every, most evals have no checkpoint (eval_every 300, every_steps 500: one in five), and
        the best kept is the best of those few, with nothing said."""
        every, keep_best = self.checkpoint_cfg.every_steps, self.checkpoint_cfg.keep_best
        if not (self.dist.is_main and keep_best and self.eval_every and self.has_eval_data):
            return
        if self.eval_every % every == 0:
            return
        both = every * self.eval_every // math.gcd(every, self.eval_every)
        log.warning(
            "checkpoint.keep_best=%d ranks the checkpoints committed at an eval's step: with eval_every=%d and "
            "checkpoint.every_steps=%d, only the eval of every %d-th step has one. Set checkpoint.every_steps "
            "to a divisor of eval_every (e.g. %d) for the best eval's checkpoint to be kept",
            keep_best,
            self.eval_every,
            every,
            both,
            self.eval_every,
        )

    def _plot_if_time_left(self) -> None:
        """Redraw loss.png on a stop only when SIGKILL is far enough off (drawing takes ~1 s on a CPU)."""
        if self.dist.is_main and self.ctx.watch.seconds_left() > PLOT_SECONDS_BEFORE_KILL:
            self.reporter.plot_loss()

    def make_reporter(self, start_step: int) -> RunReporter:
        return RunReporter(self.ctx.run, self.max_steps, start_step, enabled=self.dist.is_main)

    def _loop(self, model: torch.nn.Module, start_step: int) -> None:
        # Train mode once here and again after each eval, not in every step: model.train() walks every
        # module (hundreds with LoRA layers), about 1% of a small model's step on CPU.
        model.train()
        window_start, window_tokens, window_steps = time.perf_counter(), 0, 0
        loss_sum = torch.zeros((), device=self.dist.device)
        for step in range(start_step + 1, self.max_steps + 1):
            result = self.train_step(model, step)
            self._note_nonfinite(step, result)
            loss_sum += result.loss
            tokens = result.tokens * self.dist.world_size
            self.progress.step, self.progress.tokens_seen = step, self.progress.tokens_seen + tokens
            self._count_elapsed()  # the step, and all since the one before: its eval, log line and commit
            window_tokens, window_steps = window_tokens + tokens, window_steps + 1
            metrics: dict[str, Any] = {}
            if self._eval_due(step):
                try:
                    metrics["eval_loss"] = self._evaluate(model, step)
                    metrics |= self.eval_metrics
                except EvalInterrupted:
                    model.train()
                    log.info("the eval at step %d was stopped; it runs after the resume", step)
            if step % self.log_every == 0 or step == self.max_steps or metrics:
                seconds = time.perf_counter() - window_start
                metrics |= self._step_metrics(
                    step, loss_sum / window_steps, result.grad_norm, window_tokens, seconds, window_steps
                )
                self.reporter.log_step(metrics)
                self.progress.last_loss = metrics["loss"]
                self._refuse_diverged()
                self._write_status("running", metrics)
                if "eval_loss" in metrics:
                    self.reporter.plot_loss()  # every eval: the curve a person looks at stays current
                window_start, window_tokens, window_steps = time.perf_counter(), 0, 0
                loss_sum.zero_()
            self._after_step(step)
            if self.finished_early:
                return

    def _count_elapsed(self) -> None:
        now = time.perf_counter()
        self.progress.elapsed_s += now - self._uncounted_since
        self._uncounted_since = now

    def _note_nonfinite(self, step: int, result: StepResult) -> None:
        finite = torch.isfinite(result.loss) & torch.isfinite(result.grad_norm)
        first = self._first_nonfinite_step
        first.copy_(torch.where(finite | (first > 0), first, step))

    def _refuse_diverged(self) -> None:
        """Diverged on every rank once any rank's loss or gradient norm was NaN or inf. Through clipping a
        NaN gradient makes every weight NaN for good; committed, such states replaced the good checkpoints
        (keep_last), and the run ended DONE with a NaN model exported."""
        first = int(D.all_reduce_max(self.dist, [float(self._first_nonfinite_step.item())])[0])
        if not first:
            return
        newest = "no checkpoint was committed before it" if self.last_committed_step is None else (
            f"step-{self.last_committed_step} stays the newest checkpoint")  # fmt: skip
        raise Diverged(
            f"training diverged: the loss or gradient norm was NaN or inf at step {first}; nothing from that "
            f"step on is committed ({newest}). Lower train.lr, lengthen the warmup or set train.grad_clip, "
            "and check the data; then start again: the run resumes from its newest checkpoint"
        )

    def _eval_due(self, step: int) -> bool:
        return bool(self.eval_every) and step % self.eval_every == 0 and self.has_eval_data

    def _eval_after(self, step: int) -> bool:
        """Whether an eval is due at some step after `step`, up to `max_steps`."""
        if not (self.eval_every and self.has_eval_data):
            return False
        return (step // self.eval_every + 1) * self.eval_every <= self.max_steps

    def until_stop(self, batches: Iterable[T], local: bool = False) -> Iterator[T | None]:
        """`batches` of an eval, ending it (EvalInterrupted) when a stop is asked for between two of them:
        an eval takes seconds to minutes, and a SIGTERM must reach the next step boundary, and its commit,
        within 5 s. Several ranks agree before each batch (one all-reduce of the stop flags, as
        `_after_step` agrees each step), so every rank ends the eval at the same batch, or none does. They
        run as many rounds as the rank with the most batches (`batches` must then have a length); a rank
        with fewer takes part in the agreements of the rounds it has no batch for, which yield None (an
        FSDP rank runs a forward for them all the same). `local`: this rank alone runs the eval (rank 0's
        generation eval); it checks its own flag and the caller tells the others."""
        if local or self.dist.world_size == 1:
            for batch in batches:
                if self.ctx.watch.requested:
                    raise EvalInterrupted
                yield batch
            return
        rounds = int(D.all_reduce_max(self.dist, [float(len(batches))])[0])  # type: ignore[arg-type]
        mine = iter(batches)  # read as the eval goes, as on one rank
        for _ in range(rounds):
            if D.all_reduce_max(self.dist, [float(self.ctx.watch.requested)])[0]:
                raise EvalInterrupted
            yield next(mine, None)

    def _evaluate_pending(self, model: torch.nn.Module, step: int) -> None:
        """The eval a stop interrupted at `step`, the step the run resumed from: run now, before any step,
        the run goes on as an uninterrupted one (the same eval losses, best score and plateau count;
        an eval draws no random numbers)."""
        if step == 0 or not self._eval_due(step) or self.progress.last_eval_step == step:
            return
        log.info("running the eval of step %d, which the stop interrupted", step)
        metrics = {"step": step, "eval_loss": self._evaluate(model, step), **self.eval_metrics}
        if self.dist.is_main:  # its checkpoint, committed before the eval, competes for best-k as if after
            p = self.progress
            score = (self.ranked_metric, p.last_score) if p.last_score_step == step else None
            self.store.record_eval(step, p.last_eval_loss, score)
        # status.json shows the step's whole row (its loss too, logged before the stop), as after an eval in a run
        self._write_status("running", self.reporter.log_step(metrics, into_its_row=True))

    def _evaluate(self, model: torch.nn.Module, step: int) -> float:
        self.eval_metrics = {}
        eval_loss = self.evaluate(model, step)
        model.train()
        # A generation metric is measured only every k-th eval: no score at the others.
        score = eval_loss if self.ranked_metric == "eval_loss" else self.eval_metrics.get(self.ranked_metric)
        self.progress.note_eval(step, eval_loss, score, self.improvement_threshold)
        self.finished_early = self.should_stop_early()
        if self.finished_early:
            log.info("stopping early at step %d: %s", step, self.finished_early)
        return eval_loss

    def _step_metrics(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, tokens: int, seconds: float, steps: int
    ) -> dict[str, Any]:
        tokens_per_s = tokens / seconds if seconds > 0 else None
        mfu = None
        if self._peak_flops and tokens_per_s and self.flops_per_token:
            mfu = tokens_per_s * self.flops_per_token / (self._peak_flops * self.dist.world_size)
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

    def _gradient_sync(
        self, model: torch.nn.Module, last_micro_batch: bool
    ) -> contextlib.AbstractContextManager:
        """Reduce gradients across ranks only after the step's last micro-batch (`model`: the wrapped one)."""
        if self.parallel == "fsdp":
            set_gradient_sync(self.loss_module, last_micro_batch)
            return contextlib.nullcontext()
        if last_micro_batch or not self.dist.distributed:
            return contextlib.nullcontext()
        return model.no_sync()

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for a forward pass in `autocast_dtype`; none in fp32."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.autocast_dtype)

    def _apply_edited_optimizer_settings(self, configured: list[dict[str, Any]], path: Path) -> None:
        """A checkpoint's optimizer state brings its groups' settings, which would drop one the config changed
        since (train.weight_decay, beta1, beta2, eps): each is set again from the config, in every group, where
        the first group's differs from it. Where it does not, the checkpoint's stay (a full finetune's one
        group keeps its decay on norms and biases: train/optim.py in_groups_of)."""
        groups = self.optimizer.param_groups
        edited = [key for key in configured[0] if _setting(groups[0][key]) != _setting(configured[0][key])]
        for key in edited:
            for group, settings in zip(groups, configured, strict=True):
                group[key] = settings[key]
        if edited and self.dist.is_main:
            log.info(
                "the optimizer trains with the config's %s, edited since %s was written",
                ", ".join(f"{key} {_setting(configured[0][key])}" for key in edited),
                path.name,
            )

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._lr = lr

    # --------------------------------------------------------------------- commit and stop
    def _after_step(self, step: int) -> None:
        """Agree across ranks on committing and stopping, then do it (one all-reduce per step)."""
        if self.dist.is_main:
            with self._disk_full_is_exit_5(step):
                self._committed(self.writer.poll())
        ck = self.checkpoint_cfg
        terminal = step == self.max_steps or self.finished_early is not None
        due = step % ck.every_steps == 0 or terminal
        due_by_time = self.dist.is_main and time.monotonic() - self._last_commit_time >= ck.every_minutes * 60
        over_budget = self.dist.is_main and self._over_budget()
        # Only rank 0 holds the lease and the clock: every flag is agreed on, or ranks would part ways
        # (one raising while the others wait in a collective for it).
        flags = [due, due_by_time, over_budget, self.ctx.watch.requested, self.ctx.lease_lost()]
        due, due_by_time, over_budget, stop, lease_lost = (
            bool(v) for v in D.all_reduce_max(self.dist, [float(f) for f in flags])
        )
        if lease_lost:
            self.writer.abandon()  # the run is another process's now: nothing more of ours may land
            raise TemporaryError("another writer took over this run's lease; stopping without a commit")
        if stop:
            self._stop(step)
        if due or due_by_time or over_budget:
            # The last commit of a run (end, plateau, budget) is waited for: the run exits right after it.
            self.commit(step, background=self.background_commits and not (terminal or over_budget))
            # A SIGTERM that came during the commit (or its snapshot) stops now, not after another step.
            if D.all_reduce_max(self.dist, [float(self.ctx.watch.requested)])[0]:
                self._stop(step)
        if over_budget:
            raise BudgetExhausted(
                f"TRAINPOD_BUDGET_USD is spent (${self.reporter.cost(self.progress.elapsed_s):.2f}); "
                f"committed step {step}. Raise the budget and start again to continue."
            )

    def _stop(self, step: int) -> None:
        self._commit_before_stop(step)
        # Every rank names the same checkpoint, though only rank 0 keeps track of them.
        newest = int(
            D.broadcast_from_main(
                self.dist, float(-1 if self.last_committed_step is None else self.last_committed_step)
            )
        )
        raise Preempted(
            f"stopped by {self.ctx.watch.signal_name or 'a stop on another rank'} at step {step}; "
            f"newest checkpoint: {f'step {newest}' if newest >= 0 else 'none yet'}"
        )

    def _commit_before_stop(self, step: int) -> None:
        """Within the seconds before SIGKILL: finish the commit in flight if it fits (else abandon it),
        then commit `step` if that fits too. Rank 0 decides; every rank takes part in the commit."""
        commit_now = 0.0
        # By the soonest SIGKILL of any rank, not rank 0's clock: a rank signalled alone (its node preempted)
        # would be killed in the middle of a commit that rank 0, never signalled, thought had all the time.
        soonest = -D.all_reduce_max(self.dist, [-self.ctx.watch.seconds_left()])[0]
        self.ctx.watch.expect_kill_within(soonest)
        # Rank 0 finishes or abandons the commit in flight for every rank: its shard writes either
        # completed (rank 0's DCP future resolves only after every rank's) or will never be published.
        self.shard_writer.forget()
        if self.dist.is_main:
            self._finish_or_abandon_in_flight()
            if self.last_committed_step == step:
                log.info("stop requested at step %d, which is already committed", step)
            else:
                commit_now = float(self._fits("a commit", self._expected_commit_seconds()))
        if D.broadcast_from_main(self.dist, commit_now):
            self.commit(step)

    def _finish_or_abandon_in_flight(self) -> None:
        in_flight = self.writer.in_flight_step
        if in_flight is None:
            return
        remaining = max(self._expected_commit_seconds() - self.writer.in_flight_seconds(), 0.0)
        if self._fits(f"finishing the commit of step {in_flight} in flight", remaining):
            self._committed(self.writer.wait())
        else:
            self._committed(self.writer.abandon())
            log.warning("abandoned the commit of step %d; its temp folder goes at the next start", in_flight)

    def _fits(self, what: str, seconds: float) -> bool:
        """Whether `seconds` of work, times the margin, fit before the expected SIGKILL (logged when not)."""
        needed = seconds * self.checkpoint_cfg.commit_margin
        left = self.ctx.watch.seconds_left()
        if needed < left:
            return True
        log.warning(
            "stop requested: %s needs about %.1f s but only %.1f s are left before SIGKILL; "
            "exiting without one (losing the steps since %s)",
            what,
            needed,
            left,
            self.last_committed_step,
        )
        return False

    def _expected_commit_seconds(self) -> float:
        if self.writer.last_commit_seconds is not None:
            return self.writer.last_commit_seconds
        return 0.5 + self.checkpoint_bytes_estimate() / ASSUMED_VOLUME_BYTES_PER_S

    def _over_budget(self) -> bool:
        budget = self.ctx.budget_usd
        cost = self.reporter.cost(self.progress.elapsed_s)
        if budget is None or cost is None:
            return False
        if cost >= 0.9 * budget and not self._budget_warned:
            log.warning("90%% of TRAINPOD_BUDGET_USD spent ($%.2f of $%.2f)", cost, budget)
            self._budget_warned = True
        return cost >= budget

    def commit(self, step: int, background: bool = False) -> CommittedCheckpoint | None:
        """Commit the state after `step`: every rank sends its RNG state, rank 0 snapshots everything and
        writes it, in the foreground or (`background`) on the writer's thread while training goes on."""
        self._refuse_diverged()
        snapshot_time = time.monotonic()
        rng_states = D.gather_to_main(self.dist, capture_rng())
        shards = self._save_shards(step, background)
        committed = None
        if self.dist.is_main:
            files = self.checkpoint_files()
            files |= {"rng.safetensors": rng_states, "trainer_state.json": self._trainer_state()}
            # Only a checkpoint evaluated at its own step competes for best-k retention.
            p = self.progress
            eval_loss = p.last_eval_loss if p.last_eval_step == step else None
            score = (self.ranked_metric, p.last_score) if p.last_score_step == step else None
            if background:
                self._hold_optimizer_steps_for_snapshots()
            with self._disk_full_is_exit_5(step):
                committed = self.writer.commit(
                    step,
                    files,
                    self._manifest_metadata(),
                    eval_loss,
                    background,
                    score=score,
                    shards=shards,
                    defer_copies=background and self._state_changes_only_in_optimizer_steps(),
                )
            self._committed(committed)
        self._last_commit_time = snapshot_time
        # Rank 0 wrote a synchronous commit, or waited for the one in flight before this one's snapshot.
        D.wait_for_main(self.dist)
        return committed

    def _hold_optimizer_steps_for_snapshots(self) -> None:
        """A background commit's CPU copies are made by the writer thread during the next forward and
        backward (`defer_copies`): the weights and optimizer state change only in `optimizer.step()`,
        which waits here for the copies to be done. (Gradients, which the backward changes, are not
        saved; the data position, RNG and trainer state are captured before `commit` returns.)"""
        if self._snapshot_hook is None:
            self._snapshot_hook = self.optimizer.register_step_pre_hook(
                lambda *_: self.writer.wait_for_snapshot()
            )

    def _state_changes_only_in_optimizer_steps(self) -> bool:
        """Whether the model's state is all parameters: a buffer in it (batch norm's statistics, say)
        may change in a forward, before the optimizer step that a deferred copy waits for."""
        if self._only_parameters is None:
            parameters = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
            self._only_parameters = set(self.model.state_dict()) <= parameters
        return self._only_parameters

    def _save_shards(self, step: int, background: bool) -> ShardFiles | None:
        """Every rank writes its shards of `sharded_state()` (FSDP) into rank 0's pending checkpoint
        (train/sharding.py); rank 0 gets them to hash and publish. None for an unsharded model."""
        state = self.sharded_state()
        if state is None:
            return None
        pending = None
        if self.dist.is_main:
            pending = self.writer.begin(step)
            (pending.dir / SHARDED_DIR).mkdir()
        folder = Path(D.broadcast_object(self.dist, str(pending.dir / SHARDED_DIR) if pending else None))
        written = self.shard_writer.save(state, folder, background)
        return ShardFiles(pending, folder, written) if pending else None

    def _next_checkpoint_bytes(self) -> int:
        """The newest committed checkpoint's size (the next one is as large), else the estimate."""
        for checkpoint in self.store.committed()[:1]:
            return checkpoint.nbytes
        return self.checkpoint_bytes_estimate()

    def _volume_full(self, step: int) -> VolumeFull:
        kept = f"step-{self.last_committed_step}" if self.last_committed_step is not None else "none yet"
        what = f"checkpoint step-{step} (the newest committed checkpoint, {kept}, is intact)"
        return volume_full(self.store.root, what, self._next_checkpoint_bytes())

    @contextlib.contextmanager
    def _disk_full_is_exit_5(self, step: int) -> Iterator[None]:
        """A writer call (which may surface a background commit's error) with ENOSPC made exit 5, naming the
        checkpoint that failed: a background commit's error surfaces at a later step than its own."""
        self.writer.failed_step = None
        try:
            yield
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            raise self._volume_full(self.writer.failed_step or step) from exc

    def _committed(self, checkpoint: CommittedCheckpoint | None) -> None:
        """Record a commit that finished (rank 0): the newest committed step, for stops and status.json."""
        if checkpoint is None:
            return
        check_headroom(self.store.root, checkpoint.nbytes)
        self.last_committed_step = checkpoint.step
        self._committed_unix = time.time()
        self._write_status("running", {})

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "progress": self.progress.__dict__,
            "data": self.data_state(),
            "world_size": self.dist.world_size,
            "config_hash": config_hash(self.cfg),
            **self.extra_state(),
        }

    def _manifest_metadata(self) -> dict[str, Any]:
        return {
            "world_size": self.dist.world_size,
            "config_hash": config_hash(self.cfg),
            "tokens_seen": self.progress.tokens_seen,
            "versions": {"trainpod": trainpod.__version__, "torch": torch.__version__},
        }

    def _write_status(self, state: str, metrics: dict[str, Any]) -> None:
        self._count_elapsed()  # up to now: a log line's eval, a commit
        if not self.dist.is_main:
            return
        checkpoint = None
        if self.last_committed_step is not None:
            checkpoint = {"step": self.last_committed_step, "committed_unix": self._committed_unix}
        shown = {**(metrics or self._last_metrics), "run_mfu": self._run_mfu()}
        self.reporter.write_status(state, self.progress.step, shown, checkpoint, self.progress.elapsed_s)
        if metrics:
            self._last_metrics = metrics

    def _run_mfu(self) -> float | None:
        """The whole run's MFU: every token over all the time it was billed for (progress.elapsed_s: its
        evals, commits and startup too), what `trainpod estimate` prices a run with. A log window's `mfu`
        reads low after a window with an eval or a commit, and high in one without."""
        if not (self._peak_flops and self.flops_per_token and self.progress.elapsed_s > 0):
            return None
        flops = self.progress.tokens_seen * self.flops_per_token
        return flops / (self._peak_flops * self.dist.world_size * self.progress.elapsed_s)

    # ------------------------------------------------------------------------------ finish
    def summary(self) -> dict[str, Any]:
        metrics = self._last_metrics
        return {
            "step": self.progress.step,
            "tokens_seen": self.progress.tokens_seen,
            # a checkpoint from before progress carried the loss has it in the resumed log line alone
            "loss": self.progress.last_loss if self.progress.last_loss is not None else metrics.get("loss"),
            "eval_loss": self.progress.last_eval_loss,
            "best_eval_loss": self.progress.best_eval_loss,
            "tokens_per_s": metrics.get("tokens_per_s"),
            "elapsed_s": self.progress.elapsed_s,
            "finished_early": self.finished_early,
            "exported_weights": self.exported_weights,
        }


def _setting(value: Any) -> Any:
    """An optimizer group's setting as the config gives it (a checkpoint may hold AdamW's betas as a list)."""
    return tuple(value) if isinstance(value, list) else value


def checkpoint_misfit(path: Path, exc: Exception) -> InputError:
    """One line for a committed checkpoint this run cannot load (its settings changed since, or it was
    written by another workload or version): which checkpoint, what does not fit, and the two fixes."""
    if isinstance(exc, FileNotFoundError):
        what = f"it has no {Path(exc.filename or '?').name}"
    elif isinstance(exc, KeyError):
        what = f"its trainer_state.json has no {exc}"
    else:
        what = str(exc)
    return InputError(
        f"checkpoint {path} does not fit this run: {what}. The config changed since it was written (or "
        f"another workload or version wrote it): restore the old settings (the run's config.yaml holds "
        f"them), or start a new run name (--run NAME or TRAINPOD_RUN) to train from scratch"
    )


def train_and_export(trainer_class: type[Trainer], ctx: RunContext, config: Any) -> dict[str, Any]:
    """A workload's whole run on every rank: train to the end, export, and return the DONE summary."""
    # FSDP needs a process group even on one GPU (its device mesh is made from it).
    dist = D.init_distributed(always_group=getattr(config.train, "parallel", None) == "fsdp")
    try:
        if config.train.cpu_threads and dist.device.type == "cpu":
            torch.set_num_threads(config.train.cpu_threads)
        trainer = trainer_class(ctx, config, dist)
        trainer.train()
        exported, abandoned = _export_unless_stopped(trainer, ctx)
        D.wait_for_main(dist)  # rank 0 writes the export: tens of minutes for a 70B model
        # Rank 0 alone knows whether its export was published; the other ranks wait here for its word, and
        # every rank leaves the same way (one raising alone would leave the others in a collective).
        abandoned, committed = D.broadcast_object(dist, (abandoned, trainer.last_committed_step))
        if abandoned:
            raise Preempted(
                f"stopped by {ctx.watch.signal_name or 'a stop on rank 0'} during the export; step {committed} "
                "is committed and the next start makes the export again from it"
            )
        return trainer.summary() | {
            "export": str(exported) if exported else None,
            "checkpoints": [c.path.name for c in trainer.store.committed()],
        }
    finally:
        D.shutdown(dist)


def _export_unless_stopped(trainer: Trainer, ctx: RunContext) -> tuple[Path | None, bool]:
    """The final export's folder (rank 0's), and whether a stop abandoned it or let the run's lease go first.

    Under several ranks a stop releases the lease at once (PreemptionWatch.releasing: rank 0's, set by the
    lifecycle) while the export's collective runs on, and nothing is published after (Lease.publishing). A
    new pod may take the run over meanwhile and remove this export's temp folder: what fails after the
    release is the stop's doing, not a crash of the run.
    """
    with ctx.watch.releasing():
        try:
            with volume_full_as_exit_5(ctx.run.root, "the export"):
                trainer.take_export_weights()
                exported = trainer.export()
        except WorkAbandoned:
            return None, True
        except Exception as exc:
            if not ctx.lease_released():
                raise
            log.warning("the export failed after the run's lease was released at the stop: %s", exc)
            return None, True
    return exported, ctx.lease_released()
