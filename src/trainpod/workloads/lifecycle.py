"""The life of one workload start, the same for every workload of a kind (docs/design.md, "Workloads"):

load and validate the config (exit 2, nothing written)  ->  check the volume (exit 2)
-> a DONE run exits 0 at once, changing nothing  ->  preflight inputs (exit 2, nothing written)
-> run folder, lease, resolved config.yaml  ->  the workload  ->  DONE, or the error's exit code.

Data workloads (datagen) get no run folder: they resume from their own progress under datasets/.
Conversions write into a finished run's export/ under its lease, never its DONE. The supervisor
runs with the volume in view and returns its own exit code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainpod import atomic, cost, workloads
from trainpod.checkpoint import Lease
from trainpod.config import dump_config, parse_overrides
from trainpod.config.loader import POD_SET_VARIABLE, OverrideRoute, load_tree, validate_tree
from trainpod.context import RunContext
from trainpod.diskspace import volume_full_as_exit_5
from trainpod.errors import ConfigError, ExitCode, GpuOutOfMemory, Preempted, TrainpodError, stop_reason
from trainpod.gitsync import other_checkouts
from trainpod.log import attach_log_file, setup_logging
from trainpod.preemption import PreemptionWatch, exit_now_when_preempted
from trainpod.volume import RunDir, Volume, check_run_name
from trainpod.workloads import Kind, Workload

log = logging.getLogger("trainpod")

CONVERSION_LEASE_TTL_S = 300.0
DEFAULT_LEASE_TTL_S = 90.0


@dataclass
class RunRequest:
    """What the environment (or the CLI's flags, which win) asks for; docs/design.md, "The pod's environment"."""

    workload: str
    config_path: str | None
    overrides: list[str] = field(default_factory=list)
    run_name: str | None = None
    volume: Volume = field(default_factory=Volume.from_env)
    # The fix a config error names: the environment's TRAINPOD_SET; `trainpod run` names its --set instead.
    override_route: OverrideRoute = POD_SET_VARIABLE

    @classmethod
    def from_env(cls, workload: str, environ: dict[str, str] | None = None) -> RunRequest:
        """The request the pod's environment makes (docs/design.md, "The pod's environment")."""
        environ = os.environ if environ is None else environ
        return cls(
            workload=workload,
            config_path=environ.get("TRAINPOD_CONFIG"),
            overrides=parse_overrides(environ.get("TRAINPOD_SET")),
            run_name=environ.get("TRAINPOD_RUN") or None,
            volume=Volume.from_env(environ),
        )


def resolve_config_path(raw: str | None, volume: Volume, synced: Path | None = None) -> Path:
    """An absolute path; else the first that exists of: in `synced` (TRAINPOD_GIT_REPO's checkout, which boot
    just synced: the user's edit of a config must not be shadowed by the image's shipped one at the same
    path), relative to here (the image's /opt/trainpod), on the volume, in the other checkouts under repos/ (not
    the synced repo's at other refs: gitsync.other_checkouts). Nothing at any of them: ConfigError (exit 2) naming
    where it looked."""
    if not raw:
        raise ConfigError(
            [
                "TRAINPOD_CONFIG is not set; point it at a YAML config, "
                "e.g. TRAINPOD_CONFIG=configs/pretrain/tiny.yaml (or pass --config)"
            ]
        )
    path = Path(raw)
    candidates = [path]
    if not path.is_absolute():
        candidates = ([synced / path] if synced is not None else []) + [Path.cwd() / path, volume.root / path]
        candidates += [repo / path for repo in other_checkouts(volume.root / "repos", synced)]
    if not any(c.exists() for c in candidates):  # a folder is the loader's to name: "is a folder, not a file"
        raise ConfigError(
            [
                f"config {raw}: no such file (looked for {', '.join(map(str, candidates))}); point TRAINPOD_CONFIG "
                "(or --config) at an existing YAML file: an absolute path, a path in the synced git checkout, or "
                "a path on the volume"
            ]
        )
    return next((c for c in candidates if c.is_file()), candidates[0])


def load_workload_config(
    workload: Workload, config_path: Path, overrides: list[str], route: OverrideRoute
) -> Any:
    """The workload's typed config: the YAML and overrides, validated as the class its registry line names; a
    problem's fix names `route`, the way the caller's user overrides a field (config.loader.OverrideRoute).

    A config that is another workload's (configs/finetune/ holds finetune-vlm ones too) is refused with one
    line naming that workload, not with a line per key its sections do not share."""
    tree, source = load_tree(config_path, overrides)
    try:
        return validate_tree(workload.config_type(tree), tree, source, route)
    except ConfigError:
        others = [
            name for name, other in workloads.REGISTRY.items() if other is not workload and _fits(other, tree)
        ]
        if not others:
            raise
        raise ConfigError([_another_workloads_config(workload.name, others, source)], source) from None


def _fits(workload: Workload, tree: dict[str, Any]) -> bool:
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)  # datagen's guess of a kind by the keys warns: not for a config tried on
    try:
        validate_tree(workload.config_type(tree), tree)
    except TrainpodError:  # ConfigError, or a datagen config_type refusing a kind it does not know
        return False
    finally:
        logging.disable(disabled)
    return True


def _another_workloads_config(name: str, others: list[str], source: str) -> str:
    if others == ["supervise"]:  # its config is a run's deploy config
        return (
            f"this is a deploy config (it validates as one), not a {name} config: `trainpod deploy {source}` rents "
            f"the pod that runs its workload; give `trainpod run {name}` the workload's own config (the deploy "
            "config's `config:`)"
        )
    return (
        f"this is a {' or '.join(others)} config (it validates as one), not a {name} config: run "
        f"`trainpod run {others[0]}` with it (in a pod TRAINPOD_WORKLOAD={others[0]}, in a deploy config "
        f"`workload: {others[0]}`), or give {name} its own config"
    )


def run_name(request: RunRequest, config: Any) -> str:
    """TRAINPOD_RUN (or --run), else the config's name (a deploy config's `run`)."""
    if request.run_name:
        return check_run_name(request.run_name)
    return getattr(config, "name", None) or config.run


def execute(request: RunRequest) -> int:
    """Run one workload start to its end and return its exit code (docs/design.md, "Exit codes")."""
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(None, rank)
    try:
        with volume_full_as_exit_5(request.volume.root):
            return _execute(request, rank)
    except TrainpodError as exc:
        if exc.exit_code == ExitCode.PREEMPTED:
            log.warning("%s", exc)  # a stop the supervisor expects, not an error
        else:
            log.error("%s", exc)
        return int(exc.exit_code)
    except Exception:  # a crash: its traceback goes to the run's log too, not only the console
        return _log_crash(request, rank)


CRASHED = 1  # what Python exits with on an uncaught exception; finish.py counts it as a failed start


def _log_crash(request: RunRequest, rank: int) -> int:
    run = request.volume.run(request.run_name) if request.run_name else None
    if run is not None and run.root.is_dir():
        suffix = "" if rank == 0 else f".rank{rank}"
        attach_log_file(run.logs / f"{request.workload}{suffix}.log")
    log.exception("the %s workload crashed", request.workload)
    return CRASHED


def _execute(request: RunRequest, rank: int) -> int:
    workload = workloads.get(request.workload)
    # A malformed price, or a budget a run could never spend (no price): exit 2 before anything is written.
    cost.check_environment(counts_cost=workload.kind.owns_run_folder)
    config_path = resolve_config_path(request.config_path, request.volume)
    config = load_workload_config(workload, config_path, request.overrides, request.override_route)
    request.run_name = run_name(request, config)  # where a crash is logged
    request.volume.check_writable()
    watch = PreemptionWatch(getattr(getattr(config, "checkpoint", None), "preemption_window_seconds", 5.0))
    watch.install()
    ctx = RunContext(request.volume, request.volume.run(run_name(request, config)), watch)
    if workload.kind.owns_run_folder:
        return _run_in_run_folder(workload, ctx, config, rank)
    if workload.kind is Kind.CONVERSION:
        return _run_conversion(workload, ctx, config)
    if workload.kind is Kind.SERVICE:
        return int(workload.module().run(ctx, config))
    workload.module().preflight(ctx, config)
    for output in workload.module().run(ctx, config):
        log.info("%s ready at %s", workload.name, output)
    return ExitCode.DONE


def _run_conversion(workload: Workload, ctx: RunContext, config: Any) -> int:
    """Conversions write into runs/<run>/export/ under the run's lease, but never its DONE:
    the run they convert is finished already (and convert reruns skip what is done)."""
    module = workload.module()
    module.preflight(ctx, config)  # its refusal writes nothing, a log neither
    ctx.run.export.mkdir(parents=True, exist_ok=True)
    attach_log_file(ctx.run.logs / f"{workload.name}.log")  # the log a deploy's `then` that failed points at
    ctx.lease = Lease(ctx.run.lease, CONVERSION_LEASE_TTL_S)
    ctx.lease.acquire()
    # Every output's, not only those this config makes: a task stopped midway and then dropped from the
    # config left its temp folder (a merged model's gigabytes) for good.
    _remove_leftovers(ctx.run)
    # A task stopped in one long write (the signal's handler waits for it) releases the lease from a thread
    # and exits 143 before the SIGKILL: its temp folder goes at the next start, as after a kill.
    ctx.watch.last_resort = lambda: _release_and_exit_preempted(
        ctx.lease, "stopped by a signal in one long write"
    )
    try:
        outputs = module.run(ctx, config)
    finally:
        ctx.watch.last_resort = None
        ctx.lease.release()
    for output in outputs:
        log.info("%s output ready at %s", workload.name, output)
    return ExitCode.DONE


def _release_and_exit_preempted(lease: Lease, why: str, status: Path | None = None) -> None:
    _release_preempted(lease, why, status)
    log.warning("exiting %d", ExitCode.PREEMPTED)
    exit_now_when_preempted(ExitCode.PREEMPTED)


def _release_preempted(lease: Lease, why: str, status: Path | None = None) -> None:
    """Let the run's lease go at a stop, from any thread: nothing of the run is published after it
    (Lease.publishing). `status`: a run's, which `trainpod status` then says preempted, as after a stop at a step."""
    if lease.released.is_set():
        return
    if status is not None:
        stopped = Preempted(f"{why}; the next start makes it again")
        _set_status_state(status, "preempted", stop_reason(stopped))
    lease.release()
    log.warning("%s: released the run's lease", why)


def _run_in_run_folder(workload: Workload, ctx: RunContext, config: Any, rank: int) -> int:
    run = ctx.run
    if run.done.exists():
        log.info("run %s is already DONE (%s); nothing to do", run.name, run.done)
        return ExitCode.DONE
    module = workload.module()
    module.preflight(ctx, config)  # fail before anything is written
    if rank == 0:
        run.create()
        checkpoint = getattr(config, "checkpoint", None)
        ctx.lease = Lease(run.lease, getattr(checkpoint, "lease_ttl_seconds", DEFAULT_LEASE_TTL_S))
        ctx.lease.acquire()
        if run.done.exists():  # another writer finished the run while this one started
            ctx.lease.release()
            log.info("run %s is already DONE (%s); nothing to do", run.name, run.done)
            return ExitCode.DONE
        _remove_leftovers(run)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            # The setup or the final export stopped in one long C call (Trainer.abandoning_setup, abandoning_export;
            # the signal's handler waits for it) ends as a conversion's task does: the lease released from a
            # thread and exit 143.
            ctx.watch.last_resort = lambda: _release_and_exit_preempted(
                ctx.lease, "stopped by a signal in one long call of the setup or the export", run.status
            )
        else:
            # Under several ranks the export is a collective that runs on to its end after a stop: the lease
            # goes at the signal (train_and_export), and the ranks exit 143 together once it ends.
            ctx.watch.release_at_stop = lambda: _release_preempted(
                ctx.lease, "stopped by a signal during the export of several ranks", run.status
            )
    setup_logging(
        run.logs / (f"{workload.name}.log" if rank == 0 else f"{workload.name}.rank{rank}.log"), rank
    )
    try:
        if rank == 0:
            _write_resolved_config(run.config, config)
        started = time.monotonic()
        with (
            volume_full_as_exit_5(run.root, "the run's files"),
            gpu_out_of_memory_as_exit_2(workload.name, config),
        ):
            summary = module.run(ctx, config)
        if rank == 0:
            summary["wall_s_this_start"] = time.monotonic() - started
            atomic.write_json(run.done, summary)
            _set_status_state(run.status, "done")
            log.info("%s", done_line(run.name, summary, run.done))
        return ExitCode.DONE
    except TrainpodError as exc:
        if rank == 0 and not ctx.lease_released():  # released: its status is said, the run may be another's
            state = "preempted" if exc.exit_code == ExitCode.PREEMPTED else "stopped"
            _set_status_state(run.status, state, stop_reason(exc))
        raise
    except BaseException as exc:
        if rank == 0 and not ctx.lease_released():
            _set_status_state(run.status, "failed", stop_reason(exc))
        raise
    finally:
        ctx.watch.last_resort = ctx.watch.release_at_stop = None
        if ctx.lease is not None:
            ctx.lease.release()


@contextlib.contextmanager
def gpu_out_of_memory_as_exit_2(workload: str, config: Any) -> Iterator[None]:
    """Turn the GPU running out of memory inside the block into GpuOutOfMemory (exit 2), naming the config's
    fields that lower the peak. As a crash (exit 1) it was started again up to TRAINPOD_MAX_FAILED_STARTS times,
    each start loading the model and replaying the same batches into the same peak, paid for, before FAILED."""
    try:
        yield
    except TrainpodError:
        raise
    except Exception as exc:
        found = _gpu_out_of_memory(exc)
        if found is None:
            raise
        raise GpuOutOfMemory(
            f"the GPU ran out of memory in the {workload} ({_first_sentences(str(found))}): this config does not fit this GPU, and a "
            f"restart would run out the same way; {'; '.join(_memory_fixes(config))}; or deploy on a GPU with "
            "more memory (`trainpod estimate CONFIG --gpu TYPE` sizes a config before renting one)"
        ) from exc


# What the GPU running out of memory raises: torch's OutOfMemoryError, or where a library or a compiled graph
# wrapped it (torch.compile's BackendCompilerFailed, a cuBLAS workspace), its text.
_GPU_OOM_TEXT = ("CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation")


def _gpu_out_of_memory(exc: BaseException | None) -> BaseException | None:
    """The GPU's out-of-memory error among `exc` and its causes, else None."""
    torch = sys.modules.get("torch")  # not loaded: nothing ran on a GPU
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and torch is not None:
        seen.add(id(exc))
        if isinstance(exc, torch.OutOfMemoryError) or any(text in str(exc) for text in _GPU_OOM_TEXT):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _first_sentences(message: str) -> str:
    """torch's "CUDA out of memory. Tried to allocate 2.00 GiB." without the allocator's statistics after it."""
    said = " ".join(message.split())
    end = said.find(". ", said.find("Tried to allocate"))
    return (said[: end + 1] if "Tried to allocate" in said and end >= 0 else said)[:300]


def _memory_fixes(config: Any) -> list[str]:
    """What lowers the peak, as the config's own fields and values (pretrain, finetune and finetune-vlm)."""
    train = getattr(config, "train", None)
    data = getattr(config, "data", None)
    fixes = []
    if getattr(train, "micro_batch_size", 1) > 1:
        fixes.append(
            f"lower train.micro_batch_size (now {train.micro_batch_size}) and raise train.grad_accum_steps "
            f"(now {train.grad_accum_steps}) to keep the batch"
        )
    for field_name, value in (
        ("train.seq_len", getattr(train, "seq_len", None)),
        ("data.sft.cutoff_len", getattr(getattr(data, "sft", None), "cutoff_len", None)),
        ("data.cutoff_len", getattr(data, "cutoff_len", None)),
    ):
        if isinstance(value, int):
            fixes.append(f"shorten {field_name} (now {value})")
    if getattr(train, "gradient_checkpointing", True) is False:
        fixes.append(
            "set train.gradient_checkpointing: true (recomputes activations: about a third more compute)"
        )
    if getattr(config, "method", None) == "full":
        fixes.append("finetune with method: lora or qlora")
    elif getattr(config, "method", None) == "lora":
        fixes.append("finetune with method: qlora (4-bit base weights)")
    return fixes or ["lower the batch or the sequence length"]


# Top-level files of a run written only under its lease (by the lifecycle and the workloads); a supervisor's
# state and `trainpod stop`'s marker lie beside the run folder (older kits: in it, supervise.json and STOPPED),
# written without the lease, so theirs are never touched.
LEASED_FILES = (
    "config.yaml",
    "status.json",
    "DONE",
    "loss.png",
    "base_model.json",
    "sft_data.json",
    "vlm_data.json",
    "tokenizer",  # a folder: a pretrain run's tokenizer (RunContext.carry_tokenizer)
)


def _remove_leftovers(run: RunDir) -> None:
    """What a kill left half-written (docs/design.md, "Crash-safe writes"): export/ is written under the
    run's lease alone (the final model, conversions), so every temp folder there is a leftover; an
    interrupted export of a large model left gigabytes there that no later start removed."""
    leftovers = [
        *run.export.glob("*.tmp-*"),
        *(p for name in LEASED_FILES for p in run.root.glob(f"{name}.tmp-*")),
    ]
    for path in leftovers:
        log.info("removing %s, left by an interrupted start", path.relative_to(run.root))
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def done_line(name: str, summary: dict[str, Any], done_file: Path) -> str:
    """`run x DONE: step 60, loss 2.3100 (eval 2.4012), 12m this start; export ...`; the JSON is in DONE."""
    from trainpod.train.reporting import hours_minutes

    # A command run that committed no checkpoint has no step: its line was "DONE: step None, ...".
    parts = [f"step {summary['step']}"] if summary.get("step") is not None else []
    if summary.get("loss") is not None:
        evaluated = summary.get("eval_loss")
        parts.append(
            f"loss {summary['loss']:.4f}" + (f" (eval {evaluated:.4f})" if evaluated is not None else "")
        )
    parts.append(f"{hours_minutes(summary.get('wall_s_this_start', 0.0))} this start")
    if summary.get("export"):
        parts.append(f"export {summary['export']}")
    return f"run {name} DONE: {', '.join(parts)}; summary in {done_file}"


def _write_resolved_config(path: Path, config: Any) -> None:
    text = dump_config(config)
    if not path.exists():
        atomic.write_text(path, text)
    elif path.read_text() != text:
        log.warning(
            "the config differs from %s, which the run started with; continuing with the new one "
            "(the original stays there)",
            path,
        )


def _set_status_state(path: Path, state: str, reason: str | None = None) -> None:
    """The run's state in status.json, with the reason behind a stop or failure (`trainpod status`)."""
    try:
        status = atomic.read_json(path)
    except (OSError, ValueError):  # none yet, or unreadable (an I/O error): the state is still worth writing
        status = {}
    status.update(state=state, updated_unix=time.time())
    status.pop("reason", None)
    if reason:
        status["reason"] = reason
    try:
        atomic.write_json(path, status)
    except OSError as exc:  # a full volume must not hide the error that ended the run
        log.warning("could not record state %r in %s: %s", state, path, exc)
