"""The life of one workload start, the same for every workload:

load and validate the config (exit 2, nothing written)  ->  check the volume (exit 2)
-> a DONE run exits 0 at once, changing nothing  ->  preflight inputs (exit 2, nothing written)
-> run folder, lease, resolved config.yaml  ->  the workload  ->  DONE, or the error's exit code.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainpod import atomic
from trainpod.checkpoint import Lease
from trainpod.config import dump_config, load_config
from trainpod.config.convert import ConvertConfig
from trainpod.config.datagen import DatagenConfig
from trainpod.config.finetune import FinetuneConfig
from trainpod.config.generate import GeneratorDatagenConfig
from trainpod.config.loader import ConfigT
from trainpod.config.pretrain import PretrainConfig
from trainpod.config.sft import SftDatagenConfig
from trainpod.diskspace import volume_full_as_exit_5
from trainpod.errors import ConfigError, ExitCode, TrainpodError, stop_reason
from trainpod.log import attach_log_file, setup_logging
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume
from trainpod.workloads.context import RunContext

log = logging.getLogger("trainpod")

CONFIG_TYPES = {
    "datagen": DatagenConfig,
    "pretrain": PretrainConfig,
    "finetune": FinetuneConfig,
    "convert": ConvertConfig,
}
TRAINING_WORKLOADS = ("pretrain", "finetune")
# datagen makes three kinds of dataset; the config's one distinctive top-level key says which.
DATAGEN_VARIANTS = {"sft": SftDatagenConfig, "generator": GeneratorDatagenConfig}


@dataclass
class RunRequest:
    """What the environment (or the CLI's flags, which win) asks for; DESIGN.md's env contract."""

    workload: str
    config_path: str | None
    overrides: list[str] = field(default_factory=list)
    run_name: str | None = None
    volume: Volume = field(default_factory=Volume.from_env)


def resolve_config_path(raw: str | None, volume: Volume) -> Path:
    """An absolute path, a path relative to here, on the volume, or in a synced checkout under repos/."""
    if not raw:
        raise ConfigError(
            [
                "TRAINPOD_CONFIG is not set; point it at a YAML config, "
                "e.g. TRAINPOD_CONFIG=configs/pretrain/tiny.yaml (or pass --config)"
            ]
        )
    path = Path(raw)
    if path.is_absolute():
        return path
    candidates = [Path.cwd() / path, volume.root / path]
    repos = volume.root / "repos"
    if repos.is_dir():
        candidates += [repo / path for repo in sorted(repos.iterdir())]
    return next((c for c in candidates if c.is_file()), candidates[0])


def config_class(workload: str, path: Path) -> type:
    """The config type of `workload`; for datagen, by the YAML's top-level keys (sft:, generator:)."""
    config_cls = CONFIG_TYPES.get(workload)
    if config_cls is None:
        raise ConfigError([f"unknown workload {workload!r}; use one of: {', '.join(CONFIG_TYPES)}"])
    if workload == "datagen":
        try:
            tree = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            tree = None  # load_config reports a missing or malformed file properly
        if isinstance(tree, dict):
            config_cls = next((cls for key, cls in DATAGEN_VARIANTS.items() if key in tree), config_cls)
    return config_cls


def load_workload_config(workload: str, config_path: Path, overrides: list[str]) -> ConfigT:
    return load_config(config_class(workload, config_path), config_path, overrides)


def execute(request: RunRequest) -> int:
    """Run one workload start to its end and return DESIGN.md's exit code."""
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
    if request.workload not in CONFIG_TYPES:
        raise ConfigError([f"unknown workload {request.workload!r}; use one of: {', '.join(CONFIG_TYPES)}"])
    config_path = resolve_config_path(request.config_path, request.volume)
    config = load_workload_config(request.workload, config_path, request.overrides)
    request.run_name = request.run_name or getattr(config, "name", None)  # where a crash is logged
    request.volume.check_writable()
    watch = PreemptionWatch(getattr(getattr(config, "checkpoint", None), "preemption_window_seconds", 5.0))
    watch.install()
    if request.workload in TRAINING_WORKLOADS:
        return _run_training(request, config, watch, rank)
    if request.workload == "convert":
        return _run_convert(request, config, watch)
    for output in _run_data_workload(config, request.volume, watch):
        log.info("%s ready at %s", request.workload, output)
    return ExitCode.DONE


def _run_data_workload(config: Any, volume: Volume, watch: PreemptionWatch) -> list[Path]:
    """datagen (token shards, SFT data, generated records) and convert: outputs, no training run."""
    if isinstance(config, SftDatagenConfig):
        from trainpod.sft import run_sft_datagen

        return [run_sft_datagen(config, volume, watch)]
    if isinstance(config, GeneratorDatagenConfig):
        from trainpod.data.generate import run_generator

        return [run_generator(config, volume, watch)]
    from trainpod.data.datagen import run_datagen

    return [run_datagen(config, volume, watch)]


def _run_convert(request: RunRequest, config: ConvertConfig, watch: PreemptionWatch) -> int:
    """Conversions write into runs/<run>/export/ under the run's lease, but never its DONE:
    the run they convert is finished already (and convert reruns skip what is done)."""
    from trainpod.convert import run_convert

    run = request.volume.run(request.run_name or config.name)
    run.export.mkdir(parents=True, exist_ok=True)
    lease = Lease(run.lease, 300.0)
    lease.acquire()
    try:
        outputs = run_convert(config.model_copy(update={"name": run.name}), request.volume, watch)
    finally:
        lease.release()
    for output in outputs:
        log.info("convert output ready at %s", output)
    return ExitCode.DONE


def _run_training(request: RunRequest, config: Any, watch: PreemptionWatch, rank: int) -> int:
    run = request.volume.run(request.run_name or config.name)
    if run.done.exists():
        log.info("run %s is already DONE (%s); nothing to do", run.name, run.done)
        return ExitCode.DONE
    ctx = RunContext(request.volume, run, watch)
    module = _workload_module(request.workload)
    module.preflight(ctx, config)  # fail before anything is written
    if rank == 0:
        run.create()
        ctx.lease = Lease(run.lease, config.checkpoint.lease_ttl_seconds)
        ctx.lease.acquire()
        if run.done.exists():  # another writer finished the run while this one started
            ctx.lease.release()
            log.info("run %s is already DONE (%s); nothing to do", run.name, run.done)
            return ExitCode.DONE
    setup_logging(
        run.logs / (f"{request.workload}.log" if rank == 0 else f"{request.workload}.rank{rank}.log"), rank
    )
    try:
        if rank == 0:
            _write_resolved_config(run.config, config)
        started = time.monotonic()
        with volume_full_as_exit_5(run.root, "the run's files"):
            summary = module.run(ctx, config)
        if rank == 0:
            summary["wall_s_this_start"] = time.monotonic() - started
            atomic.write_json(run.done, summary)
            _set_status_state(run.status, "done")
            log.info("run %s DONE: %s", run.name, json.dumps(summary))
        return ExitCode.DONE
    except TrainpodError as exc:
        if rank == 0:
            state = "preempted" if exc.exit_code == ExitCode.PREEMPTED else "stopped"
            _set_status_state(run.status, state, stop_reason(exc))
        raise
    except BaseException as exc:
        if rank == 0:
            _set_status_state(run.status, "failed", stop_reason(exc))
        raise
    finally:
        if ctx.lease is not None:
            ctx.lease.release()


def _workload_module(name: str) -> Any:
    return importlib.import_module(f"trainpod.workloads.{name}")


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
    except (FileNotFoundError, ValueError):
        status = {}
    status.update(state=state, updated_unix=time.time())
    status.pop("reason", None)
    if reason:
        status["reason"] = reason
    try:
        atomic.write_json(path, status)
    except OSError as exc:  # a full volume must not hide the error that ended the run
        log.warning("could not record state %r in %s: %s", state, path, exc)
