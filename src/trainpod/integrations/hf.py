"""Hugging Face Trainer (and TRL's trainers, which are Trainers) on trainpod's checkpoint protocol.

    from trainpod.integrations.hf import TrainpodCallback

    callback = TrainpodCallback()                        # run folder from TRAINPOD_RUN_DIR; lease; SIGTERM
    args = TrainingArguments(output_dir=callback.staging_dir, save_steps=100, ...)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume_from_checkpoint())

HF writes `checkpoint-<N>/` in place, file by file, and resumes from the newest folder by name: a
pod killed mid-save resumes from a half-written checkpoint (transformers #35782, axolotl #1631).
Here HF writes into a staging folder; once `on_save` says the folder is complete, its files are
moved into the store's temp folder, hashed, given a manifest, renamed and named by LATEST, through
the same commit path as every trainpod checkpoint. `resume_from_checkpoint()` returns the newest
checkpoint that verifies (older ones are tried in turn) or None; anything left in staging is
discarded (also when the callback is made, before HF's own get_last_checkpoint could find it); an output_dir
other than staging is the user's, and its checkpoint-<N>/ folders are never deleted. A Trainer
that starts below the newest committed step (it resumed from elsewhere, or not at all) is refused before
its first step: the program ends with the line and exit 2, the lease released. On SIGTERM the step in flight
ends, a save is made when the last one's duration (x 1.5;
HF's save and the commit, not an eval HF ran before it) fits the window, and the process exits 143 (a SIGTERM during a save: right after its commit).
A SIGTERM during an eval lets it run on only while its rest (at the pace of its batches so far) and a save fit
the window, the step then saved right after it; else the eval is abandoned at its next batch and the process
exits 143 without a save (HF saves only after its eval): the steps since the last save are lost, not the run's
lease and not a save cut short by the SIGKILL.

Not supported: `load_best_model_at_end` (it wants HF's own folder layout; exit 2 when the Trainer is made): use the
store's keep_best, which ranks each checkpoint by what HF logged at its step: `metric_for_best_model` where set
(negated under `greater_is_better`), else the eval loss.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, NoReturn

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import trainpod
from trainpod.checkpoint.directory import commit_directory
from trainpod.checkpoint.store import step_dir_name, step_of
from trainpod.checkpointer import (
    COMMIT_MARGIN,
    Checkpointer,
    end_the_program,
    exit_without_last_collection,
    on_any_rank,
)
from trainpod.errors import ConfigError, ExitCode, TemporaryError
from trainpod.log import secret_values

log = logging.getLogger(__name__)


class TrainpodCallback(TrainerCallback):
    def __init__(self, checkpointer: Checkpointer | None = None):
        self.ckpt = checkpointer or Checkpointer()
        self.ckpt.open()
        self.staging_dir = str(self.ckpt.run_dir / "hf-staging")  # on the volume: files move, never copy
        self.save_seconds: float | None = None  # HF's save plus the commit, measured at each save
        self._save_started: float | None = None
        # When the eval in progress began (its step's end), for its pace.
        self._eval_started: float | None = None
        self._eval_batches = 0  # the eval's batches run since then
        self._stopping = False
        # Before the Trainer is made: HF's own resume idiom (resume_from_checkpoint=True, get_last_checkpoint on
        # output_dir) takes the newest checkpoint-<N>/ by name, and one left here was never committed: a
        # kill came during HF's save, so it may be half written (transformers #35782). Only where the run is
        # this job's (its lease, or the kit's): a duplicate's rank 1 would delete a live job's save in progress.
        if self.ckpt.lease is not None or os.environ.get("TRAINPOD_LEASE_HELD") == "1":
            self._discard_staging()

    def resume_from_checkpoint(self) -> str | None:
        """The newest committed checkpoint that verifies, for `trainer.train(resume_from_checkpoint=...)`."""
        self._discard_staging()
        restored = self.ckpt.restore()
        return str(restored.path) if restored else None

    # ------------------------------------------------------------------------ HF's events
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any):
        if args.load_best_model_at_end:  # refused when the Trainer is made, before any paid training
            self._refuse(
                "TrainingArguments.load_best_model_at_end=True is not supported with TrainpodCallback: each "
                "checkpoint-<N>/ is moved into the run's store when it is saved, so HF would not find the best "
                "one at the end and would keep the last weights instead. Set it to False, keep the best "
                "checkpoints with keep_best (TRAINPOD_KEEP_BEST, or checkpoint.keep_best in the command "
                "config) and load the one you want from checkpoints/step-<N>/"
            )
        return control

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any):
        if Path(args.output_dir).resolve() != Path(self.staging_dir).resolve():
            # Not the kit's folder: a checkpoint-<N>/ there may be the user's own (an earlier run's, the one this
            # run resumed from), not a save a kill interrupted, so it is left alone; HF writes a step's folder
            # anew when it saves that step.
            log.warning(
                "TrainingArguments.output_dir is %s, not callback.staging_dir (%s): checkpoints are copied "
                "into the store instead of moved when it is on another filesystem, and checkpoint-* folders "
                "already there are left as they are",
                args.output_dir,
                self.staging_dir,
            )
        elif state.is_world_process_zero:
            self._discard_staging()
        newest = step_of(self.ckpt.store._latest_name())
        if newest is not None and state.global_step < newest:
            self._refuse(
                f"the Trainer starts at step {state.global_step}, but the run's newest committed checkpoint "
                f"is {self.ckpt.store.root / step_dir_name(newest)}: it would train again what is committed "
                "(every spot stop losing the steps since the start) and a save below that step is refused. "
                "Pass resume_from_checkpoint=callback.resume_from_checkpoint() to trainer.train(), or use "
                "a new run name to start over"
            )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any):
        self._save_started = self._eval_started = time.monotonic()  # an eval, if HF runs one, starts now
        self._eval_batches = 0
        return self._save_or_exit_at_a_stop(state, control)

    def on_prediction_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        eval_dataloader: Any = None,
        **_: Any,
    ):
        """At each eval batch: at a stop, the eval goes on only if its rest and then a save fit the window (the
        save comes after the eval: on_evaluate); else it is abandoned here and the process exits 143. Answered
        after an eval of minutes, the stop met the SIGKILL in it, or in the save HF began after it."""
        if self._eval_started is None:  # an eval outside training (trainer.evaluate()): from its first batch
            self._eval_started = time.monotonic()
        else:
            self._eval_batches += 1
        # Every rank decides at the same batch (HF's eval gathers each batch's losses on every rank).
        stop, lease_lost, no_time = on_any_rank(self._eval_stop_flags(state, eval_dataloader))
        if not stop:
            return control
        if lease_lost:
            log.error("another writer took over this run's lease; stopping the eval without a save")
            self._exit(ExitCode.TEMPORARY)
        if no_time:
            log.warning(
                "stop requested during an eval: the rest of it and a save need more than the %.1f s left; "
                "abandoning the eval and exiting without a save (newest: step %s)",
                self.ckpt.seconds_left(),
                self.ckpt.last_committed_step,
            )
            self._exit(ExitCode.PREEMPTED)
        return control

    def _eval_stop_flags(self, state: TrainerState, eval_dataloader: Any) -> list[bool]:
        """This rank's view during an eval: stop requested, lease lost, no time for the eval's rest and a save
        (nor a need of them: the step is committed)."""
        if not self.ckpt.stop_requested:
            return [False, False, False]
        needed = self._eval_rest_seconds(eval_dataloader) * COMMIT_MARGIN + self._save_needs_seconds()
        committed = state.global_step == self.ckpt.last_committed_step
        return [True, self._lease_lost(), committed or needed >= self.ckpt.seconds_left()]

    def _eval_rest_seconds(self, eval_dataloader: Any) -> float:
        """The eval's batches still to run, at the pace of those run (infinite when its length is unknown)."""
        try:
            total = len(eval_dataloader)
        except TypeError:  # an iterable dataset's
            return math.inf
        per_batch = (time.monotonic() - self._eval_started) / max(self._eval_batches, 1)
        return per_batch * max(total - self._eval_batches, 0)

    def _save_or_exit_at_a_stop(self, state: TrainerState, control: TrainerControl) -> TrainerControl:
        """At a step's end or an eval's: at a stop, ask HF for a save of the step if it fits the window (the
        run then exits after its commit: on_save), else exit 143 now."""
        # Every rank takes the same decision at the same step: SIGTERM reaches the ranks at slightly
        # different moments, and a rank that saves while another trains on (or exits) waits in the save's
        # barrier until SIGKILL, losing the commit.
        stop, lease_lost, no_time = on_any_rank(self._stop_flags())
        if not stop:
            return control
        if lease_lost:
            log.error("another writer took over this run's lease; stopping without a save")
            self._exit(ExitCode.TEMPORARY)
        if state.global_step == self.ckpt.last_committed_step:
            log.info("stop requested at step %d, which is committed", state.global_step)
            self._exit(ExitCode.PREEMPTED)
        if no_time:
            log.warning(
                "stop requested: a save needs about %.1f s, more than is left; exiting without one (newest: step %s)",
                self._save_needs_seconds(),
                self.ckpt.last_committed_step,
            )
            self._exit(ExitCode.PREEMPTED)
        control.should_save, control.should_evaluate, self._stopping = True, False, True
        return control

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any):
        # HF evaluates between the step's end and the save: the save is timed from here. Counted in, an eval of a
        # few seconds (eval_steps = save_steps) made every stop's save look longer than the window, and a stop
        # at a step, which saves without an eval, exited without one.
        self._save_started = time.monotonic()
        self._eval_started = None
        # A stop during the eval that let it end: the step is saved now if that fits, not after another step
        # (HF saves at save_steps alone), and no save HF would begin here is begun when it does not fit.
        return self._save_or_exit_at_a_stop(state, control)

    def _stop_flags(self) -> list[bool]:
        """This rank's view: stop requested, lease lost, no time left for a save."""
        if not self.ckpt.stop_requested:
            return [False, False, False]
        return [True, self._lease_lost(), self._save_needs_seconds() >= self.ckpt.seconds_left()]

    def _lease_lost(self) -> bool:
        return self.ckpt.lease is not None and self.ckpt.lease.lost.is_set()

    def _save_needs_seconds(self) -> float:
        """The last save's measured time (HF's writes and the commit), else a guess from the checkpoint's size;
        never the larger of the two: the guess (200 MB/s) outweighed any measured save of a checkpoint of 1 GB
        or more, and such a run never saved at a stop."""
        measured = self.save_seconds
        return (measured if measured is not None else self.ckpt.expected_commit_seconds()) * COMMIT_MARGIN

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any):
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        _barrier()  # every rank has written its part (rng_state_<rank>.pth) before rank 0 publishes
        if state.is_world_process_zero:
            _save_args_without_secrets(args, folder)
            metadata = {"writer": "trainpod.integrations.hf", "versions": {"trainpod": trainpod.__version__}}
            try:
                commit_directory(
                    self.ckpt.store,
                    state.global_step,
                    folder,
                    metadata,
                    eval_loss=_logged_at_this_step(state, "eval_loss"),
                    score=_score(args, state),
                )
                log.info("committed %s as step-%d", folder.name, state.global_step)
            except TemporaryError as exc:  # the lease was lost during the save: every rank exits 75 below
                if not self._lease_lost():
                    raise
                log.error("%s", exc)
        _barrier()
        self.ckpt.last_committed_step = (
            state.global_step
        )  # on every rank: a stop right after it saves again nowhere
        if self._save_started is not None:
            self.save_seconds = time.monotonic() - self._save_started
        # A stop that came during this save (HF's writing or the commit) ends the run here: another step and
        # its save need the window's rest, which may not hold them (the step committed here is then the last).
        stop, lease_lost = on_any_rank([self.ckpt.stop_requested, self._lease_lost()])
        if self._stopping or stop:
            self._exit(ExitCode.TEMPORARY if lease_lost else ExitCode.PREEMPTED)
        return control

    # ------------------------------------------------------------------------ helpers
    def _discard_staging(self, staging: Path | None = None) -> None:
        """checkpoint-* folders in staging were never committed: a kill came during HF's save."""
        for folder in (staging or Path(self.staging_dir)).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
            log.warning("discarding %s: HF was interrupted while writing it, it was never committed", folder)
            shutil.rmtree(folder, ignore_errors=True)

    def _refuse(self, problem: str) -> NoReturn:
        """End the program with the problem's line and exit 2, the lease released, on every rank (each meets the
        same arguments and the same LATEST). Raised, the ConfigError went out through the user's Trainer and
        script: a traceback and exit 1, a crash retried and counted at every start into the same refusal. It
        comes before HF's first step and save (when the Trainer is made, or as train() begins): HF has written
        nothing of the run, and nothing committed is touched."""
        end_the_program(ConfigError([problem]), self.ckpt.close)

    def _exit(self, code: ExitCode) -> None:
        self.ckpt.close()
        exit_without_last_collection(code)


# TrainingArguments' own token fields (push_to_hub_token: older transformers).
_HF_TOKEN_FIELDS = ("hub_token", "push_to_hub_token")


def _save_args_without_secrets(args: TrainingArguments, folder: Path) -> None:
    """HF pickles its TrainingArguments whole into every checkpoint (training_args.bin), hub_token included,
    and the commit puts it on the volume, in every pull and copy of the checkpoint. The copy committed has
    those fields, and any other holding a secret of the environment, emptied; HF never reads it back (a resume
    trains with the arguments of the script that resumes)."""
    from transformers.trainer import TRAINING_ARGS_NAME

    path = folder / TRAINING_ARGS_NAME
    if not path.is_file():
        return
    secrets = set(secret_values())
    leaking = [
        field.name
        for field in dataclasses.fields(args)
        if isinstance(value := getattr(args, field.name, None), str)
        and value
        and (field.name in _HF_TOKEN_FIELDS or value in secrets)
    ]
    if not leaking:
        return
    cleaned = copy.copy(args)
    for name in leaking:
        object.__setattr__(cleaned, name, None)
    import torch

    torch.save(cleaned, path)


def _logged_at_this_step(state: TrainerState, key: str) -> float | None:
    """The value HF logged under `key` at this step (it evaluates before it saves), else None."""
    return next(
        (e[key] for e in reversed(state.log_history) if e.get("step") == state.global_step and key in e),
        None,
    )


def _score(args: TrainingArguments, state: TrainerState) -> tuple[str, float] | None:
    """What keep_best ranks this checkpoint by, lower is better, where TrainingArguments names a metric other than
    the eval loss (metric_for_best_model, as HF's own best-model tracking reads it): its logged value, negated
    under greater_is_better (an accuracy), named "-eval_<metric>" then. None ranks by the eval loss. HF's
    save_total_limit keeps the best by this metric; keep_best replaces it, so it must rank by the same one."""
    metric = args.metric_for_best_model
    if not metric:
        return None
    key = metric if metric.startswith("eval_") else f"eval_{metric}"
    value = _logged_at_this_step(state, key)
    # HF's own default when unset: greater is better unless the metric is a loss.
    greater_is_better = (
        args.greater_is_better if args.greater_is_better is not None else not metric.endswith("loss")
    )
    if key == "eval_loss" and not greater_is_better:
        return None  # the eval loss is ranked by as it is, as without a metric
    if value is None:
        return None
    return (f"-{key}", -float(value)) if greater_is_better else (key, float(value))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
