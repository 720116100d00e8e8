"""The checkpoint protocol as an API for your own training loop (README, "Bring your own trainer").

    from trainpod import Checkpointer

    with Checkpointer() as ckpt:              # run folder from TRAINPOD_RUN_DIR; lease; SIGTERM watch
        step = 0
        restored = ckpt.restore()             # the newest valid checkpoint (verified), or None
        if restored:
            step = restored.step
            restored.load("model", model)
            restored.load("optimizer", optimizer)
            restored.restore_rng()
        while step < max_steps:
            train_one_step(model, optimizer, step)
            step += 1
            stop = ckpt.should_stop()         # once a step, on every rank: under torchrun all agree
            if step % 100 == 0 or (stop and ckpt.commit_fits()):   # on every rank: rank 0 commits
                ckpt.commit(step, model=model, optimizer=optimizer, extra={"data_position": step})
            if stop:
                ckpt.exit_preempted()         # exit 143: the supervisor starts the pod again

It writes through the same CheckpointStore (temp folder, hashes, manifest, rename, LATEST,
retention) and the same Lease as the stock trainers: there is no second commit path. Under the
`command` workload the kit holds the run's lease for the program (TRAINPOD_LEASE_HELD=1); run
alone, the Checkpointer takes it itself (rank 0's, under torchrun). One process commits (rank 0 under
torchrun); each other rank saves its own RNG state beside the checkpoints (checkpoint/rank_rng.py).
A commit that cannot land ends the program with one line and the README's exit code, as the kit's workloads
end, not with a traceback and exit 1 (a crash, retried and counted): a full volume is exit 5, a lease lost to
another writer (or held by a live one at open()) exit 75, and a commit refused for its arguments (a step that is no whole number or older than
LATEST, a state that would not load back) exit 2, nothing committed touched. So does any other refusal of this
API, which every start of the program would meet again: a Checkpointer that cannot be made (no run folder, the
checkpoints folder given for the run's, keep_last below 2, a TRAINPOD_* setting that is no number) and a restore
asked for a state its checkpoint does not hold (RNG states too, after commit(rng=False)) are exit 2 with their
line, nothing written.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import logging
import math
import os
import pickle
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import safetensors
import safetensors.torch
import torch

import trainpod
from trainpod import refusal
from trainpod.checkpoint import CheckpointStore, CommittedCheckpoint, Lease
from trainpod.checkpoint.directory import (
    refuse_a_checkpoints_folder_for_a_run,
    refuse_older_step,
    whole_step,
)
from trainpod.checkpoint.lease import read_lease
from trainpod.checkpoint.rank_rng import RankRng
from trainpod.checkpoint.writer import CheckpointWriter
from trainpod.diskspace import volume_full_as_exit_5
from trainpod.errors import ExitCode, InputError, TemporaryError, TrainpodError, VolumeFull, is_whole_number
from trainpod.preemption import PreemptionWatch
from trainpod.train.state import capture_rng, restore_rng, stored_once

log = logging.getLogger(__name__)

RNG_FILE = "rng.pt"
EXTRA_FILE = "extra.json"
ALIASES_KEY = "trainpod_aliases"  # safetensors metadata: tied tensors stored once, restored as one
DEFAULT_WINDOW_S = 5.0  # RunPod spot: SIGKILL 5 s after SIGTERM
COMMIT_MARGIN = 1.5  # on SIGTERM, commit only if the measured commit time x this fits the window
ASSUMED_VOLUME_BYTES_PER_S = 200e6  # network volumes write 200-400 MB/s; before a commit is timed here


def _env_float(name: str, default: float) -> float:
    """Seconds: a finite number >= 0. float() takes 'nan', 'inf' and '-3', and a stop window of those made every
    commit at a stop `commit_fits` (nan compares false) or none."""
    raw = os.environ.get(name)
    try:
        seconds = float(raw) if raw else default
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise InputError(f"{name}={raw!r} is not a number of seconds >= 0; set it like {name}=5")
    return seconds


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw and not is_whole_number(raw):
        raise InputError(f"{name}={raw!r} is not a whole number; set it like {name}=2")
    return int(raw) if raw else default


def run_dir_from_env() -> Path:
    """TRAINPOD_RUN_DIR, else $TRAINPOD_VOLUME/runs/$TRAINPOD_RUN."""
    if os.environ.get("TRAINPOD_RUN_DIR"):
        return Path(os.environ["TRAINPOD_RUN_DIR"])
    if os.environ.get("TRAINPOD_RUN"):
        return Path(os.environ.get("TRAINPOD_VOLUME") or "/workspace") / "runs" / os.environ["TRAINPOD_RUN"]
    raise InputError(
        "no run folder: pass Checkpointer(run_dir=...), or set TRAINPOD_RUN_DIR (the command workload "
        "sets it), or TRAINPOD_RUN with TRAINPOD_VOLUME"
    )


class Restored:
    """A verified committed checkpoint, read back: named tensors, objects, extra state, RNG."""

    def __init__(
        self,
        committed: CommittedCheckpoint,
        rank_rng: RankRng | None = None,
        rank: int = 0,
        close: Callable[[], None] = lambda: None,
    ):
        self.step = committed.step
        self._close = close  # its Checkpointer's: the lease is released when a refusal ends the program
        self._rank_rng = rank_rng
        self._rank = rank
        self.path = committed.path
        self.manifest = committed.manifest
        extra = self.path / EXTRA_FILE
        self.extra: dict[str, Any] = json.loads(extra.read_text()) if extra.exists() else {}

    @property
    def names(self) -> list[str]:
        """The names committed: tensor sets (`.safetensors`) and objects (`.pt`)."""
        files = self.manifest.get("files", {})
        return sorted(Path(f).stem for f in files if f.endswith((".safetensors", ".pt")) and f != RNG_FILE)

    def tensors(self, name: str, device: str = "cpu") -> dict[str, torch.Tensor]:
        """`<name>.safetensors` as a state dict; tensors that were tied are tied again."""
        with safetensors.safe_open(self._file(name, ".safetensors"), framework="pt", device=device) as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
            aliases = json.loads((f.metadata() or {}).get(ALIASES_KEY, "{}"))
        return tensors | {alias: tensors[stored] for alias, stored in aliases.items()}

    def object(self, name: str, map_location: str = "cpu") -> Any:
        """`<name>.pt` (an optimizer or scheduler state dict) loaded with weights_only=True."""
        return torch.load(self._file(name, ".pt"), map_location=map_location, weights_only=True)

    def load(self, name: str, target: Any) -> None:
        """Load `name` into a module (strictly), an optimizer, a scheduler: anything with load_state_dict.

        A state that does not fit `target` (a model whose sizes or layers changed since the commit, an optimizer of
        other parameter groups) ends the program with exit 2 naming both, the lease released, as the kit's own
        trainers refuse such a checkpoint (train/trainer.py checkpoint_misfit): torch's RuntimeError or
        ValueError out of the program's restore was a traceback and exit 1 at every start, each one counted,
        until the run was FAILED with its checkpoints there to resume from once the code is mended."""
        tensors = (self.path / f"{name}.safetensors").exists()
        state = self.tensors(name) if tensors else self.object(name)
        try:
            target.load_state_dict(state)
        except torch.cuda.OutOfMemoryError:  # a RuntimeError too, but no misfit: the GPU is full
            raise
        except (RuntimeError, ValueError, KeyError) as exc:
            what = " ".join(str(exc).split())
            what = what if len(what) <= 400 else what[:397] + "..."
            end_the_program(
                InputError(
                    f"{name!r} in checkpoint {self.path.name} does not fit the {type(target).__name__} given to "
                    f"restored.load: {what}. The program changed since the commit: build the {name} as it was "
                    "then (the same sizes and layers) to resume, or start a new run name (TRAINPOD_RUN) to train "
                    "from scratch; the checkpoints stay as they are"
                ),
                self._close,
            )

    def _file(self, name: str, suffix: str) -> Path:
        """`<name><suffix>` in this checkpoint. A name it does not hold, or holds as the other kind, ends the
        program with its line and exit 2, the lease released: raised (an InputError, a FileNotFoundError), it was a
        traceback and exit 1, a crash that every start met again at the same restore. A state that only newer
        checkpoints hold is loaded when it is in `names`."""
        path = self.path / f"{name}{suffix}"
        if path.exists():
            return path
        if name in self.names:  # committed as the other kind
            held, asked, read = (
                ("an object", "tensors", "object")
                if suffix == ".safetensors"
                else ("tensors", "an object", "tensors")
            )
            problem = f"{name!r} in checkpoint {self.path.name} is {held}, not {asked}"
            fix = f"read it with restored.{read}({name!r}) or restored.load({name!r}, target)"
        else:
            problem = f"checkpoint {self.path.name} holds no state named {name!r} (it holds {self.names})"
            fix = (
                "commit it under that name, or load one of those (a state that older checkpoints lack: load it "
                "when its name is in restored.names)"
            )
        end_the_program(InputError(f"{problem}; {fix}"), self._close)

    def restore_rng(self) -> None:
        """Python, numpy, torch (and CUDA) RNG states as they were at the commit, this rank's own under
        torchrun (checkpoint/rank_rng.py); rank 0's, with a warning, where this rank wrote none."""
        if self._rank != 0 and self._rank_rng is not None:
            state, missing = self._rank_rng.read(self.step, self._rank)
            if state is not None:
                restore_rng(state)
                return
            log.warning(
                "rank %d restores rank 0's RNG state, not its own, and draws rank 0's numbers from here on "
                "(batches, dropout): %s. Each rank writes its own when it calls commit(%d) too; a loop that "
                "commits on rank 0 alone, or a stop between rank 0's commit and this rank's, leaves it out",
                self._rank,
                missing,
                self.step,
            )
        if not (self.path / RNG_FILE).exists():  # torch.load's FileNotFoundError: a traceback at every start
            end_the_program(
                InputError(
                    f"checkpoint {self.path.name} holds no RNG state ({RNG_FILE}): it was committed with "
                    "rng=False. Commit with rng=True (the default) to resume on the same random numbers, or leave "
                    "restore_rng() out"
                ),
                self._close,
            )
        restore_rng(torch.load(self.path / RNG_FILE, weights_only=True))


class Checkpointer:
    """Restore, commit, stop: the kit's checkpoint protocol for a training loop it did not write."""

    def __init__(
        self,
        run_dir: str | Path | None = None,
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        window_seconds: float | None = None,
        verify: str = "sha256",
        watch_signals: bool = True,
    ):
        # Refused before anything is made or the lease taken: the program ends with the line and exit 2. Raised,
        # it was a traceback and exit 1, a crash that every start met again at the same line of the program.
        with bad_input_ends_the_program():
            self.run_dir = Path(run_dir) if run_dir is not None else run_dir_from_env()
            # $TRAINPOD_CHECKPOINT_DIR given for the run folder: a store in checkpoints/checkpoints/
            if run_dir is not None:
                refuse_a_checkpoints_folder_for_a_run(self.run_dir, "Checkpointer(run_dir=...)")
            root = os.environ.get("TRAINPOD_CHECKPOINT_DIR") if run_dir is None else None
            kept = keep_last if keep_last is not None else _env_int("TRAINPOD_KEEP_LAST", 2)
            if kept < 2:  # as the workloads' checkpoint.keep_last and `trainpod checkpoint commit` refuse it
                where = "Checkpointer(keep_last=...)" if keep_last is not None else "TRAINPOD_KEEP_LAST"
                raise InputError(
                    f"{where}={kept}: keep at least 2 checkpoints, so that a newest one that fails verification "
                    "at the next start has an older one to fall back to (docs/design.md, 'Checkpoints'); set it "
                    "to 2 or more"
                )
            self.store = CheckpointStore(
                Path(root) if root else self.run_dir / "checkpoints",
                kept,
                keep_best if keep_best is not None else _env_int("TRAINPOD_KEEP_BEST", 0),
                verify,
            )
            if window_seconds is None:
                window_seconds = _env_float("TRAINPOD_PREEMPTION_WINDOW_S", DEFAULT_WINDOW_S)
        self.watch = PreemptionWatch(window_seconds)
        if watch_signals:
            self.watch.install()
        # The stock trainers' engine (checkpoint/writer.py): the same files, manifest, rename and LATEST.
        self.writer = CheckpointWriter(self.store)
        self.rank_rng = RankRng(self.store.root)  # the other ranks' RNG states (rank 0's is in rng.pt)
        self.lease: Lease | None = None
        self.last_committed_step: int | None = None

    # ------------------------------------------------------------------------ lease
    def __enter__(self) -> Checkpointer:
        return self.open()

    def __exit__(self, *_: Any) -> None:
        self.close()

    def open(self) -> Checkpointer:
        """Take the run's lease, unless the kit holds it for this program (TRAINPOD_LEASE_HELD=1). Under
        torchrun rank 0 takes it for every rank: another rank found it taken by rank 0 and exited 75."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if os.environ.get("TRAINPOD_LEASE_HELD") != "1" and self.lease is None and _rank() == 0:
            lease = Lease(self.run_dir / "LEASE")
            try:
                lease.acquire()
            except TemporaryError as exc:  # another live writer (a duplicate pod): its line and exit 75, not
                # a traceback and exit 1, a crash counted where the README's table leaves a duplicate uncounted
                end_the_program(exc, lambda: None)
            self.lease = lease
            # Released at any exit Python sees (sys.exit, the end of the script); after a SIGKILL the
            # next start takes the stale lease over (same host) or waits for its expiry (90 s).
            atexit.register(self.close)
        self.store.lease = self.lease  # a commit whose lease was lost while it wrote is not published
        return self

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    # ------------------------------------------------------------------------ restore
    def restore(self) -> Restored | None:
        """The newest checkpoint that verifies against its manifest; invalid ones are moved aside
        and the next older valid one is used. None when there is none (start from step 0)."""
        # Rank 0 alone commits, so it alone removes a kill's leftovers: another rank restoring while rank 0
        # already commits took rank 0's temp folder in flight for one (its write failed: FileNotFoundError).
        latest = self.store.latest(clean=_rank() == 0)
        if _rank() != 0:  # its RNG files of commits that never happened, and its temp leftovers
            self.rank_rng.remove_stale(_rank(), latest.step if latest else None)
        if latest is None:
            log.info("no checkpoint in %s; starting from scratch", self.store.root)
            return None
        self.last_committed_step = latest.step
        log.info("resuming from %s", latest.path.name)
        return Restored(latest, self.rank_rng, _rank(), self.close)

    # ------------------------------------------------------------------------ commit
    def commit(
        self,
        step: int,
        *,
        extra: dict[str, Any] | None = None,
        eval_loss: float | None = None,
        rng: bool = True,
        **states: Any,
    ) -> CommittedCheckpoint | None:
        """Commit the state after `step` atomically: nothing of it is visible until LATEST names it.

        Each keyword is one named state: a module or a flat mapping of tensors goes to
        `<name>.safetensors`; anything else with `state_dict()` (optimizer, scheduler, scaler), or a
        plain dict, to `<name>.pt` (loadable with weights_only=True). `extra` must be JSON.

        Under torchrun rank 0 commits for every rank: another rank writes only its RNG state, beside the
        checkpoints (checkpoint/rank_rng.py; no collective: this may be called on some ranks only), and
        returns None. Every rank writing the same step raced to rename its folder into place, and the
        loser crashed (ENOTEMPTY), taking the job down; a rank other than 0 holds no lease anyway.
        """
        with bad_input_ends_the_program(self.close):
            step = whole_step(step)
        if _rank() != 0:
            if rng:
                self.rank_rng.write(step, _rank(), capture_rng())
            self.last_committed_step = step
            return None
        if self.lease is not None and self.lease.lost.is_set():
            self._exit_lease_lost(step)
        with bad_input_ends_the_program(self.close):
            refuse_older_step(self.store, step)
            files = dict(_state_file(name, state) for name, state in states.items())
        if rng:
            files[RNG_FILE] = capture_rng()
        files[EXTRA_FILE] = extra or {}
        metadata = {
            "writer": "trainpod.Checkpointer",
            "versions": {"trainpod": trainpod.__version__, "torch": torch.__version__},
        }
        try:
            with volume_full_as_exit_5(self.store.root, f"checkpoint step-{step}"):
                committed = self.writer.commit(step, files, metadata, eval_loss)
        except VolumeFull as exc:
            self._exit_with(exc)
        except TemporaryError:
            if self.lease is not None and self.lease.lost.is_set():  # lost while its files were written
                self._exit_lease_lost(step)
            raise
        self.rank_rng.prune(step, lambda: {c.step for c in self.store.committed()})
        self.last_committed_step = step
        log.info("committed checkpoint step-%d in %.2f s", step, self.writer.last_commit_seconds)
        return committed

    def _exit_lease_lost(self, step: int) -> NoReturn:
        holder = (read_lease(self.lease.path) or {}).get("owner", {}) if self.lease is not None else {}
        self._exit_with(
            TemporaryError(
                f"another writer (pod {holder.get('pod_id') or '-'}, host {holder.get('host')}, pid "
                f"{holder.get('pid')}) took this run over: this process's lease at {self.run_dir / 'LEASE'} was "
                f"not renewed in time (a stalled volume or process); step {step} is not committed, and this "
                "process stops, leaving the run to that writer"
            )
        )

    def _exit_with(self, error: TrainpodError) -> NoReturn:
        end_the_program(error, self.close)

    # ------------------------------------------------------------------------ stop
    @property
    def stop_requested(self) -> bool:
        """SIGTERM (or SIGINT) arrived, or the lease was lost: commit if it fits, then exit."""
        return self.watch.requested or (self.lease is not None and self.lease.lost.is_set())

    def should_stop(self) -> bool:
        """`stop_requested`, agreed by every rank: under torch.distributed (torchrun) each rank calls it once
        per step, and one all-reduce makes all of them stop after the same step. A rank that read its own
        flag stopped a step before the others (the SIGTERM reaches each rank at its own moment, or one rank
        alone), and rank 0's next collective then failed or hung: its last commit was lost."""
        [agreed] = on_any_rank([self.stop_requested])
        if agreed and not self.watch.requested:
            self.watch.request("another rank's stop")  # starts this rank's clock: seconds_left, commit_fits
        return agreed

    def seconds_left(self) -> float:
        """Seconds until the platform's SIGKILL is expected (infinite when no signal came)."""
        return self.watch.seconds_left()

    def expected_commit_seconds(self) -> float:
        """The last commit's duration, else an estimate from the newest checkpoint's size. On a rank other than
        0 none: its commit writes its RNG state alone, which must come with every commit rank 0 makes (guessed
        from the checkpoint's size, rank 0's measured commit fitted where the guess did not, and the rank's
        state was left out of the stop's commit)."""
        if _rank() != 0:
            return 0.0
        if self.writer.last_commit_seconds is not None:
            return self.writer.last_commit_seconds
        newest = self.store.committed()
        size = newest[0].nbytes if newest else 0
        return 0.5 + size / ASSUMED_VOLUME_BYTES_PER_S

    def commit_fits(self) -> bool:
        """Whether a commit (timed x 1.5) ends before the SIGKILL the stop window promises."""
        return self.expected_commit_seconds() * COMMIT_MARGIN < self.seconds_left()

    def exit_preempted(self) -> None:
        """Release the lease and exit 143, the code the supervisor restarts on."""
        log.warning(
            "stopped by %s; newest checkpoint: step %s", self.watch.signal_name, self.last_committed_step
        )
        self.close()
        _leave_process_group()
        exit_without_last_collection(ExitCode.PREEMPTED)


@contextlib.contextmanager
def bad_input_ends_the_program(close: Callable[[], None] = lambda: None) -> Iterator[None]:
    """A call of this API refused before it writes anything (a commit's step that is no whole number or older than
    LATEST, a state that would not load back; a Checkpointer that cannot be made; a restore asked for a state not
    committed) ends the program with its line and exit 2, as the README's table says: raised, it was a traceback
    and exit 1, a crash retried and counted at every start into the same refusal. What is committed is
    untouched; `close` releases the lease."""
    try:
        yield
    except InputError as exc:
        end_the_program(exc, close)


def end_the_program(error: TrainpodError, close: Callable[[], None]) -> NoReturn:
    """End the program with `error`'s line and exit code, as the kit's own workloads end, after `close` (the
    lease's release): raised, the program's uncaught error was a traceback and exit 1, a crash retried and counted,
    where a lost lease is exit 75 (the pod that took the run over goes on), a full volume exit 5 (free space
    first) and bad input exit 2 (the fix is in the program)."""
    log.error("%s", error)
    log.error("exiting %d", error.exit_code)
    refusal.record(error)  # bad input: the kit's command workload does not start the program again
    close()
    _leave_process_group()
    exit_without_last_collection(error.exit_code)


def exit_without_last_collection(code: int) -> NoReturn:
    """sys.exit(code), the heap left to the OS: the interpreter's collection at exit traverses every object
    (torch, transformers, the model), 1.5 CPU-seconds in the HF example, 4-5 s on 2 busy cores, after the
    stop's commit and outside the window it was measured for; the kit's SIGKILL at the window's end came
    first, and the kit's own exit (status.json, the lease) after the platform's. atexit handlers still run."""
    gc.freeze()  # the permanent generation: no collection looks at what exists now
    sys.exit(int(code))


def _leave_process_group() -> None:
    """Under torch.distributed, this rank's group is closed before it exits: a rank that exited with its gloo
    group open was at times aborted in the interpreter's teardown ('terminate called without an active
    exception': SIGABRT, not 143, and torchrun then reports a failed worker)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _rank() -> int:
    return int(os.environ.get("RANK") or 0)


def on_any_rank(flags: list[bool]) -> list[bool]:
    """Each flag set on any rank (one small all-reduce under torch.distributed; as given alone)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flags
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    tensor = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def _state_file(name: str, state: Any) -> tuple[str, Any]:
    """The checkpoint file of one named state: tensors as safetensors bytes (tied ones stored once, the
    aliases in its metadata), anything else as a structure for torch.save (loadable with weights_only)."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    if isinstance(state, Mapping) and state and all(isinstance(v, torch.Tensor) for v in state.values()):
        tensors, aliases = stored_once(state)
        tensors = {key: tensor.to("cpu") for key, tensor in tensors.items()}
        return f"{name}.safetensors", safetensors.torch.save(
            tensors, metadata={ALIASES_KEY: json.dumps(aliases)}
        )
    if hasattr(state, "state_dict"):
        state = state.state_dict()
    _refuse_what_would_not_load_back(name, state)
    return f"{name}.pt", state


def _refuse_what_would_not_load_back(name: str, state: Any) -> None:
    """InputError (exit 2) when `<name>.pt` would not load with weights_only=True, as `Restored` loads it: a
    numpy value in it (a position counted in an array, np.random.get_state()) was committed without a word,
    and every later start failed to restore it. Checked on the structure alone, each tensor left out (tensors
    load; thousands of them made the check take seconds): the values around them are what it refuses."""
    buffer = io.BytesIO()
    torch.save(_without_tensor_data(state), buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = refused.group(1) if refused else str(exc).splitlines()[0]
        raise InputError(
            f"the state {name!r} would not load back: it holds {what}, which torch.load(weights_only=True) "
            "refuses, so no start could restore this checkpoint. Store plain values in it (int(x), float(x), "
            "x.tolist() for numpy's), or allow the type with torch.serialization.add_safe_globals before "
            "commit and restore"
        ) from None


def _without_tensor_data(value: Any) -> Any:
    """`value` as the commit writes it (containers rebuilt as checkpoint/writer.py's snapshot does), each
    tensor None."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, dict):
        return {k: _without_tensor_data(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple takes its fields one by one
        return type(value)(*(_without_tensor_data(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_without_tensor_data(v) for v in value)
    return value
