"""`trainpod boot`: what a pod runs. The images' entrypoints call it; everything comes from the env.

    TRAINPOD_WORKLOAD=pretrain TRAINPOD_CONFIG=configs/pretrain/tiny.yaml trainpod boot

1. read the env contract (README, "The pod's environment");
2. sync TRAINPOD_GIT_REPO at TRAINPOD_GIT_REF under repos/ (exit 75 when it keeps failing, 2 for a ref
   the repo does not have);
3. preflight, each failure one line and exit 2 with nothing written: volume writable, config
   valid, a GPU when the config needs one, pretraining's estimated peak GPU memory within the GPU's
   (logged always); free space for the checkpoints (exit 5); a GPU pod whose host cannot run the
   image's CUDA (trainpod.host) exits 4: the supervisor replaces the pod;
4. create the volume's folders (datasets, tokenizers, runs, repos, cache) and point caches there;
5. launch: one process, one per GPU (RUNPOD_GPU_COUNT or what torch sees), or torchrun across the
   nodes of a RunPod Instant Cluster (NUM_NODES, NODE_RANK, NUM_TRAINERS, PRIMARY_ADDR/PORT);
   the exit code is the workload's;
6. SSH: with PUBLIC_KEY set, a key-only sshd in the background from the start (trainpod.sshd);
7. then (TRAINPOD_THEN_WORKLOAD, TRAINPOD_THEN_CONFIG, a deploy's `then`): once the run is DONE, the
   conversion it names runs in this pod under the run's name (its config checked at step 3, before any
   training), and the pod finishes after it;
8. finish (runpod/finish.py): after DONE the pod stops itself (TRAINPOD_ON_FINISH); failed starts
   are counted on the volume and after TRAINPOD_MAX_FAILED_STARTS in a row the run is FAILED and
   the pod stopped. The `supervise` workload runs the spot supervisor with the volume in view.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from trainpod import atomic, cost, workloads
from trainpod.checkpoint.lease import sibling_lease
from trainpod.errors import ConfigError, ExitCode, InputError, TemporaryError, TrainpodError, VolumeFull
from trainpod.log import attach_log_file, setup_logging
from trainpod.preemption import exit_now_when_preempted, signals_seen
from trainpod.runpod.finish import (
    after_workload,
    begin_start,
    committed_since,
    latest_checkpoint,
    record_then,
    then_runs,
)
from trainpod.runpod.finish import check_environment as check_finish_environment
from trainpod.sshd import start_sshd
from trainpod.volume import RunDir, Volume, check_run_name, is_run_name
from trainpod.workloads import Kind, Workload

log = logging.getLogger("trainpod.boot")

VOLUME_FOLDERS = ("datasets", "tokenizers", "runs", "repos", "cache")
# A deploy's `then` (config/deploy.py ThenSettings): the conversion this pod runs once the run is DONE.
THEN_WORKLOAD_ENV, THEN_CONFIG_ENV = "TRAINPOD_THEN_WORKLOAD", "TRAINPOD_THEN_CONFIG"


def boot(environ: dict[str, str] | None = None) -> int:
    """Run the workload the environment names (TRAINPOD_WORKLOAD, TRAINPOD_CONFIG, ...), then finish.

    Finishing (runpod/finish.py) acts on the exit code: after DONE the pod stops itself
    (TRAINPOD_ON_FINISH), failed starts are counted on the volume and a crash loop stops the pod.
    """
    environ = os.environ if environ is None else environ
    setup_logging(None, int(environ.get("RANK", "0")))
    start_sshd(environ)  # only with PUBLIC_KEY: key-only, in the background; the workload stays this process
    workload_name, volume, config = environ.get("TRAINPOD_WORKLOAD", ""), Volume.from_env(environ), None
    new_run = None  # the run folder this start made for its START marker, before the workload's preflight
    # What LATEST named when this start began; progressed: the start committed a newer checkpoint (finish.py)
    run, latest_at_start, progressed = None, None, False
    stops_before = signals_seen()  # a stop signal since: no conversion after DONE begins (_run_then)
    # The conversion after DONE (TRAINPOD_THEN_WORKLOAD, TRAINPOD_THEN_CONFIG), and the synced checkout
    then, synced = None, None
    try:
        workload = _workload(environ)
        # Before the git sync, which can take minutes (a large repo, three tries against an outage): a typo in
        # TRAINPOD_ON_FINISH is exit 2 at once, not after it.
        check_finish_environment(environ)
        volume.check_writable()
        _keep_deploy_record(volume, environ)  # the deploy's, whatever this start makes of its config
        if environ.get("TRAINPOD_GIT_REPO"):  # first: the config may live in the synced repo
            from trainpod.gitsync import note_commit, sync

            synced = sync(
                environ["TRAINPOD_GIT_REPO"], environ.get("TRAINPOD_GIT_REF"), volume.root / "repos"
            )
        # Before hours of training, not after; and before the training config, whose refusal (a DONE run's config
        # edited since) still lets a DONE run's pod convert.
        then = _then(workload, volume, environ, synced and synced.path)
        config = _preflight(workload, volume, environ, synced and synced.path)
        _prepare_volume(volume, environ)  # only after preflight: bad input leaves the volume untouched
        ended = None
        if workload.kind.owns_run_folder:  # training and your own code: a run folder that is theirs to mark
            run = _run_dir(volume, config, environ)
            new_run = None if run is None or run.root.exists() else run
            latest_at_start = latest_checkpoint(run)
            ended = begin_start(run, environ, workload.name)
            # A DONE run's record stays the commit that finished it: its pod booted again runs nothing of it.
            if ended is None and run is not None and synced is not None and not run.done.exists():
                note_commit(synced, environ.get("TRAINPOD_GIT_REF"), run.root)
        elif workload.kind is Kind.CONVERSION:  # a convert pod of a run: its own START-<workload> and count
            converted = _run_dir(volume, config, environ)
            # Never a run folder made for the marker alone.
            if converted is not None and converted.root.is_dir():
                ended = begin_start(converted, environ, workload.name, owns_run=False)
        if ended is not None:  # the starts before this one all died without a word: FAILED, pod stopped
            return ended
        code = _launch(workload, environ)
        progressed = committed_since(run, latest_at_start)
    except TrainpodError as exc:
        log.error("%s", exc)
        code = int(exc.exit_code)
    except Exception:  # a crash still counts as a failed start, or a crash loop would never end
        _log_to_run(_run_dir(volume, config, environ))
        log.exception("the %s workload crashed", workload_name or "?")
        code = 1
    if code == ExitCode.BAD_INPUT and new_run is not None:
        _remove_unstarted(new_run)  # bad input leaves the volume as it was: no run folder, so no FAILED
    known = workloads.REGISTRY.get(workload_name)  # unknown: boot failed before naming it
    owns_run = known is None or known.kind.owns_run_folder
    finishing = _run_dir(volume, config, environ)
    code = after_workload(
        code,
        finishing,
        environ,
        workload_name,
        owns_run=owns_run,
        lease=_dataset_lease(volume, config) if known is not None and known.kind is Kind.DATA else None,
        progressed=progressed,
        then_follows=then is not None,
    )
    if then is not None and then_runs(code, finishing):
        code = _run_then(then, volume, finishing, environ, synced and synced.path, stops_before)
    if environ is os.environ:  # the pod's own boot, not a test's call with its own environment
        exit_now_when_preempted(code)
    return code


@dataclass(frozen=True)
class Then:
    """The conversion a deploy's `then` runs after DONE (TRAINPOD_THEN_WORKLOAD, TRAINPOD_THEN_CONFIG): its
    workload and its config's file, checked at boot."""

    workload: Workload
    config_path: Path


def _then(workload: Workload, volume: Volume, environ: dict[str, str], synced: Path | None) -> Then | None:
    """TRAINPOD_THEN_WORKLOAD and TRAINPOD_THEN_CONFIG checked at boot (exit 2 naming them), with what the
    conversion can check before the run it converts exists (a workload's optional `check_ahead`: a hub task's
    HF_TOKEN): a typo found after ten hours of training stopped the pod with the run DONE and nothing converted."""
    from trainpod.workloads.lifecycle import load_workload_config, resolve_config_path

    name, config = environ.get(THEN_WORKLOAD_ENV, ""), environ.get(THEN_CONFIG_ENV, "")
    if not (name or config):
        return None
    conversions = workloads.conversions()
    problems = []
    if not workload.kind.owns_run_folder:
        problems.append(f"{THEN_CONFIG_ENV}={config!r} with TRAINPOD_WORKLOAD={workload.name}: a conversion "
                        f"follows a run that ends DONE (a training or command workload); unset {THEN_CONFIG_ENV}, "
                        "or run the conversion as this pod's workload")  # fmt: skip
    if name and name not in conversions:
        problems.append(f"{THEN_WORKLOAD_ENV}={name!r} is no conversion workload; set it to one of: "
                        f"{', '.join(conversions)}, or leave it unset ({conversions[0]})")  # fmt: skip
    if not config:
        problems.append(f"{THEN_WORKLOAD_ENV}={name!r} without {THEN_CONFIG_ENV}: set {THEN_CONFIG_ENV} to its "
                        "YAML (a deploy config's then.config)")  # fmt: skip
    if int(environ.get("NUM_NODES") or 1) > 1:
        problems.append(f"{THEN_CONFIG_ENV} on a cluster of {environ['NUM_NODES']} nodes: every other node would "
                        "wait, billed, while node 0 converted; unset it and run the conversion as its own pod")  # fmt: skip
    if problems:
        raise ConfigError(problems)
    then_workload = workloads.get(name or conversions[0])
    try:
        path = resolve_config_path(config, volume, synced).absolute()
        then_config = load_workload_config(then_workload, path, [], None)
        check_ahead = getattr(then_workload.module(), "check_ahead", None)  # optional (workloads/__init__)
        if check_ahead is not None:
            check_ahead(then_config, environ)
    except TrainpodError as exc:
        # A DONE run's supervisor waits for the conversion's end: without it, it would start this pod again
        # and again into the same refusal, up to supervise.max_restarts.
        run = _run_dir(volume, None, environ)
        if run is not None and run.done.exists():
            record_then(run, then_workload.name, int(exc.exit_code), f"{THEN_CONFIG_ENV}={config!r}: {exc}")
        raise
    log.info("once the run is DONE: %s with %s, in this pod", then_workload.name, path)
    return Then(then_workload, path)


def _run_then(
    then: Then, volume: Volume, run: RunDir, environ: dict[str, str], synced: Path | None, stops_before: int
) -> int:
    """The conversion after DONE, under the run's name, in the environment the training had but TRAINPOD_SET
    (its overrides are the training config's), finished as a convert pod's start is (its own failed-start count,
    never the run's FAILED) and recorded in the run's then.json for supervisors (runpod/finish.py).

    `stops_before`: preemption.signals_seen() at boot. A stop signal since (a spot stop as the run became DONE,
    which the training start's handler only noted) ends it as exit 143 before the conversion begins: begun, it
    ran into the SIGKILL 5 s later holding the run's lease, which a replacement pod then waited out (300 s)."""
    log.info("run %s is DONE: %s with %s", run.name, then.workload.name, then.config_path)
    atomic.remove(run.then_record)  # an earlier end's: from here a supervisor waits for this one's
    # The previous conversion's death without a word (the OOM killer in a merge) is counted, and may end this one.
    ended = begin_start(run, environ, then.workload.name, owns_run=False, then_step=True)
    if ended is not None:
        return ended
    # The volume's folders and caches (HF_HOME on it), where the training's own start was refused before it made
    # them: a DONE run's config edited since.
    _prepare_volume(volume, environ)
    environ = {key: value for key, value in environ.items() if key != "TRAINPOD_SET"}
    # TRAINPOD_RUN: the DONE run, not the conversion config's `name` (a pod made by hand has no TRAINPOD_RUN).
    environ.update(
        TRAINPOD_WORKLOAD=then.workload.name, TRAINPOD_CONFIG=str(then.config_path), TRAINPOD_RUN=run.name
    )
    # then.json says why, where a refusal in the conversion's preflight left no log on the volume
    last_error = _LastError()
    logging.getLogger("trainpod").addHandler(last_error)  # not the root's, which each start's logging resets
    try:
        _preflight(then.workload, volume, environ, synced)
        # Looked at after the preflight, which holds no lease and writes nothing a stop would leave half made.
        if signals_seen() != stops_before:
            log.warning("a stop signal came before the %s after DONE began: the pod started again runs it",
                        then.workload.name)  # fmt: skip
            code = ExitCode.PREEMPTED
        else:
            code = _launch(then.workload, environ)
    except TrainpodError as exc:
        log.error("%s", exc)
        code = int(exc.exit_code)
    except Exception:  # counted, as a convert pod's crash is
        log.exception("the %s workload after DONE crashed", then.workload.name)
        code = 1
    finally:
        logging.getLogger("trainpod").removeHandler(last_error)
    return after_workload(
        code, run, environ, then.workload.name, owns_run=False, then_step=True, error=last_error.message
    )


class _LastError(logging.Handler):
    """The last ERROR line of the kit's loggers: the conversion's reason to fail, for the run's then.json."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.message: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.message = message.splitlines()[0] if message else None


def _keep_deploy_record(volume: Volume, environ: dict[str, str]) -> None:
    """The record of the deploy that made this pod (runpod/deploy.py, DEPLOYED_ENV) beside the run, when newer than
    the one there: for supervisors elsewhere, whose first look may find the pod gone. A cluster's nodes have none."""
    from trainpod.runpod.deploy import DEPLOYED_ENV

    raw, run = environ.get(DEPLOYED_ENV), environ.get("TRAINPOD_RUN", "")
    if not raw or not is_run_name(run) or int(environ.get("NODE_RANK") or 0):
        return
    from trainpod.runpod.supervise import keep_pods_deploy_record

    try:
        if keep_pods_deploy_record(volume, run, raw):
            log.info("recorded what the deploy rented beside the run (%s)", DEPLOYED_ENV)
    except OSError as exc:  # a full volume: the workload's own checks say so; the record is no reason to stop
        log.warning("could not record what the deploy rented beside the run: %s", exc)


def _dataset_lease(volume: Volume, config) -> Path | None:
    """The lease a datagen holds while it builds its dataset (checkpoint/lease.one_writer): a duplicate datagen
    pod's exit 75 came from it, not from the run's."""
    name = getattr(config, "name", None)
    return sibling_lease(volume.dataset(name)) if name else None


def _remove_unstarted(run: RunDir) -> None:
    """The run folder this start made holds nothing but its START marker (and code.json): the workload's
    preflight refused (exit 2) before the lifecycle created anything, so the folder goes again."""
    from trainpod.gitsync import CODE_FILE
    from trainpod.runpod.finish import START_MARKER

    made = {START_MARKER, CODE_FILE}
    if run.root.is_dir() and {p.name for p in run.root.iterdir()} <= made:
        for name in made:
            atomic.remove(run.root / name)
        run.root.rmdir()


def _log_to_run(run: RunDir | None) -> None:
    """Boot's log lines (a crash's traceback) go to runs/<run>/logs/boot.log too, when the run folder exists."""
    if run is not None and run.root.is_dir():
        attach_log_file(run.logs / "boot.log")


def _run_dir(volume: Volume, config, environ: dict[str, str]) -> RunDir | None:
    """Where this start is counted: runs/<TRAINPOD_RUN or the config's name>/, when either is known."""
    name = environ.get("TRAINPOD_RUN") or getattr(config, "run", None) or getattr(config, "name", None)
    # A malformed TRAINPOD_RUN (exit 2 in _preflight) marks nothing: runs/<it>/ is not a run folder.
    return volume.run(name) if name and is_run_name(name) else None


def _workload(environ: dict[str, str]) -> Workload:
    name = environ.get("TRAINPOD_WORKLOAD", "")
    if name not in workloads.REGISTRY:
        shown = repr(name) if name else "unset"
        raise ConfigError(
            [f"TRAINPOD_WORKLOAD is {shown}; set it to one of: {', '.join(workloads.REGISTRY)}"]
        )
    return workloads.get(name)


def _prepare_volume(volume: Volume, environ: dict[str, str]) -> None:
    for folder in VOLUME_FOLDERS:
        (volume.root / folder).mkdir(exist_ok=True)
    cache = volume.cache()
    # Downloads and compiled kernels survive a pod restart on the volume, not on the wiped container disk.
    defaults = {
        "HF_HOME": cache / "hf",
        "TORCHINDUCTOR_CACHE_DIR": cache / "inductor",
        "TRITON_CACHE_DIR": cache / "triton",
    }
    for name, path in defaults.items():
        environ.setdefault(name, str(path))


def _learn_the_pods_price(workload: Workload, environ: dict[str, str]) -> None:
    """A budget is counted as hours x TRAINPOD_GPU_HOURLY_USD (cost.py). A single pod given a budget and no
    price reads its own from RunPod with its pod-scoped key: what RunPod bills for the GPU type it placed
    the pod on, where a price written in a config can only guess which of the allowed types that is. The
    ranks inherit it. A cluster's price is all its nodes' (deploy sets it), so a cluster is not asked."""
    wanted = workload.kind.owns_run_folder and environ.get("TRAINPOD_BUDGET_USD")
    if not wanted or environ.get("TRAINPOD_GPU_HOURLY_USD") or int(environ.get("NUM_NODES") or 1) > 1:
        return
    if not (environ.get("RUNPOD_POD_ID") and environ.get("RUNPOD_API_KEY")):
        return  # not a pod: cost.check_environment says what to set
    from trainpod.runpod.client import RunPodClient, RunPodError

    try:
        pod = RunPodClient.from_env(environ).get_pod(environ["RUNPOD_POD_ID"])
    except RunPodError as exc:
        raise TemporaryError(
            f"could not read this pod's price from RunPod for TRAINPOD_BUDGET_USD ({exc}); the next start asks "
            "again, or set TRAINPOD_GPU_HOURLY_USD"
        ) from None
    if pod is None or not pod.cost_per_hr:
        log.warning(
            "RunPod gives no price for pod %s: the budget cannot be counted", environ["RUNPOD_POD_ID"]
        )
        return
    environ["TRAINPOD_GPU_HOURLY_USD"] = f"{pod.cost_per_hr:g}"
    log.info("this pod's price, from RunPod: $%g/h (TRAINPOD_GPU_HOURLY_USD was not set)", pod.cost_per_hr)


def _preflight(workload: Workload, volume: Volume, environ: dict[str, str], synced=None):
    from trainpod.config import parse_overrides
    from trainpod.config.loader import POD_SET_VARIABLE
    from trainpod.workloads.lifecycle import load_workload_config, resolve_config_path

    _learn_the_pods_price(workload, environ)
    cost.check_environment(counts_cost=workload.kind.owns_run_folder, environ=environ)
    if environ.get("TRAINPOD_RUN"):
        check_run_name(environ["TRAINPOD_RUN"])
    config_path = resolve_config_path(environ.get("TRAINPOD_CONFIG"), volume, synced)
    overrides = parse_overrides(environ.get("TRAINPOD_SET"))  # a pod's only way to override: its fix names it
    config = load_workload_config(workload, config_path, overrides, POD_SET_VARIABLE)
    # The workload (and each rank launched for it) reads the file checked here, not its own search.
    environ["TRAINPOD_CONFIG"] = str(config_path.absolute())
    if workload.kind.owns_run_folder:  # training, and your own trainer, which is "as training"
        from trainpod.host import check_host

        check_host(environ)  # a GPU pod whose host cannot run the image's CUDA: exit 4, replace the pod
    if workload.kind.rank_per_gpu:
        _check_gpu(config, environ)
    check_gpu_memory = getattr(workload.module(), "check_gpu_memory", None)  # optional (workloads/__init__)
    if check_gpu_memory is not None:
        check_gpu_memory(config, volume, _gpu_count(environ) * int(environ.get("NUM_NODES") or 1))
    _check_free_space(workload.module().disk_estimate(config), volume, _run_dir(volume, config, environ))
    return config


def _check_gpu(config, environ: dict[str, str]) -> None:
    import torch

    if config.train.precision == "bf16" and not torch.cuda.is_available():
        raise InputError(
            "train.precision=bf16 needs a GPU and none is visible; use a GPU pod or precision=auto"
        )


def _check_free_space(needed: int | None, volume: Volume, run: RunDir | None = None) -> None:
    """The workload's own estimate (workloads/<name>.py disk_estimate) against the volume's free bytes.

    The estimate is the run's whole footprint (its kept checkpoints and export): what a resumed run's
    folder holds of it is on the volume already, not still to come. Counted as free space still needed,
    the first spot restart after the checkpoints accumulated exited 5 on a volume with room to finish."""
    free = shutil.disk_usage(volume.root).free
    if needed is not None and run is not None:
        needed -= sum(_bytes_under(folder) for folder in (run.checkpoints, run.export))
    if needed is not None and free < needed:
        raise VolumeFull(
            f"the volume at {volume.root} has {free / 2**30:.1f} GiB free; this run needs about "
            f"{needed / 2**30:.1f} GiB (its checkpoints and export); grow the network volume or lower "
            "checkpoint.keep_last/keep_best"
        )


def _bytes_under(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder.is_dir() else 0


def _launch(workload: Workload, environ: dict[str, str]) -> int:
    from trainpod.workloads.lifecycle import RunRequest, execute

    nodes = int(environ.get("NUM_NODES") or 1)
    if workload.kind.rank_per_gpu and nodes > 1:
        return _torchrun_cluster(workload.name, environ)
    gpus = _gpu_count(environ) if workload.kind.rank_per_gpu else 1
    if gpus > 1:
        log.info("launching %d ranks, one per GPU", gpus)
        from trainpod.launch import launch_local

        return launch_local(gpus, ["run", workload.name])
    return execute(RunRequest.from_env(workload.name, environ))


def _gpu_count(environ: dict[str, str]) -> int:
    if environ.get("RUNPOD_GPU_COUNT"):
        return int(environ["RUNPOD_GPU_COUNT"])
    import torch

    return torch.cuda.device_count()


def _torchrun_cluster(workload: str, environ: dict[str, str]) -> int:
    """RunPod Instant Cluster: torchrun with the cluster's own variables, as a child (trainpod.launch)."""
    from trainpod.launch import launch_cluster

    addr = environ.get("PRIMARY_ADDR") or environ.get("MASTER_ADDR")
    port = environ.get("PRIMARY_PORT") or environ.get("MASTER_PORT") or "29500"
    missing = [
        name for name, value in (("NODE_RANK", environ.get("NODE_RANK")), ("PRIMARY_ADDR", addr)) if not value
    ]
    if missing:
        raise ConfigError(
            [
                f"NUM_NODES>1 but {', '.join(missing)} is unset; these come from RunPod's Instant "
                "Cluster (or set them as torchrun's MASTER_ADDR/NODE_RANK)"
            ]
        )
    per_node = int(environ.get("NUM_TRAINERS") or _gpu_count(environ) or 1)
    nodes, node_rank = int(environ["NUM_NODES"]), int(environ["NODE_RANK"])
    log.info(
        "node %d of %d: torchrun with %d rank(s) per node, primary %s:%s",
        node_rank,
        nodes,
        per_node,
        addr,
        port,
    )
    return launch_cluster(nodes, node_rank, per_node, f"{addr}:{port}", ["run", workload])
