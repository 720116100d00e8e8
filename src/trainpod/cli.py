"""The `trainpod` command. Each verb is a function whose docstring is its help.

trainpod run pretrain --config configs/pretrain/tiny.yaml --set train.max_steps=50
trainpod run pretrain --nproc-per-node 2 ...     (one process per GPU, or gloo processes on CPU)
trainpod status RUN
trainpod deploy configs/deploy/pretrain-spot.yaml [--dry-run]   (RunPod: template, volume, pod)
trainpod supervise RUN --config configs/deploy/pretrain-spot.yaml [--once]
trainpod stop RUN [--terminate]
trainpod checkpoint latest|commit|verify RUN ...   (checkpoints for trainers in any language)
trainpod estimate configs/deploy/pretrain-spot.yaml [--gpu TYPE] [--spot]   (tokens, hours, memory, dollars)
trainpod generate RUN --prompt "..."  |  trainpod chat RUN                  (the run's export, streamed)
trainpod config fields finetune  |  trainpod --version
trainpod logs RUN [-f] [--tail N]                 (the pod's logs through RunPod's API, from a laptop)
trainpod push LOCAL_PATH datasets/NAME --s3-volume VOL --datacenter DC   (the volume through its S3 API)
trainpod pull RUN [export|checkpoint|all] [DEST] --s3-volume VOL --datacenter DC
trainpod ls [--volume DIR | --s3-volume VOL --datacenter DC | --config DEPLOY.yaml]
trainpod du [same flags as ls]                    (what takes the space, largest first)
trainpod rm ENTRY... [--yes] [same flags as ls]   (free it: never what a live run or a resume needs)
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from trainpod.errors import ExitCode
from trainpod.volume import Volume


def run(
    workload: str,
    config: str | None = None,
    set: list[str] | None = None,
    run_name: str | None = None,
    volume: str | None = None,
    nproc_per_node: int = 1,
) -> int:
    """Run a workload to its end (WORKLOAD: one of the list below); resumes from the newest checkpoint.

    Flags override the environment: --config over TRAINPOD_CONFIG, --run over TRAINPOD_RUN,
    --volume over TRAINPOD_VOLUME; --set assignments apply after TRAINPOD_SET.
    """
    from trainpod.config.loader import SET_FLAG
    from trainpod.errors import InputError, TrainpodError
    from trainpod.workloads import REGISTRY
    from trainpod.workloads.lifecycle import RunRequest, execute

    try:
        if nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
            from trainpod.launch import launch_local

            one_process = REGISTRY.get(workload)
            if one_process is not None and not one_process.kind.rank_per_gpu:
                # N copies of a program (or a datagen, a conversion) each doing the whole work, on one run's lease
                hint = (
                    "launch the ranks inside your command instead (command: [torchrun, --nproc-per-node, N, "
                    "train.py])"
                    if workload == "command"
                    else "it runs as one process"
                )
                raise InputError(
                    f"--nproc-per-node {nproc_per_node}: workload {workload} does not run one process per GPU; "
                    f"drop the flag: {hint}"
                )
            return launch_local(nproc_per_node, _strip_nproc(sys.argv[1:]))
        request = RunRequest.from_env(workload)
    except (
        TrainpodError
    ) as exc:  # the flag above, a malformed TRAINPOD_SET: one message and exit 2, no traceback
        from trainpod.log import setup_logging

        setup_logging(None)
        logging.getLogger("trainpod").error("%s", exc)
        return int(exc.exit_code)
    request.config_path = config or request.config_path
    request.overrides += list(set or [])
    request.override_route = SET_FLAG  # TRAINPOD_SET works here too, but the flag is this command's own way
    request.run_name = run_name or request.run_name
    request.volume = Volume(Path(volume)) if volume else request.volume
    return execute(request)


def status(
    run_name: str | None = None,
    volume: str | None = None,
    s3_volume: str | None = None,
    datacenter: str | None = None,
    config: str | None = None,
) -> int:
    """Show a run's step, loss, tokens/s, ETA, cost and newest checkpoint (all runs when RUN is omitted).

    Reads the volume mounted here (--volume, else $TRAINPOD_VOLUME), or from a laptop the network
    volume through RunPod's S3 API (--s3-volume and --datacenter, or --config DEPLOY.yaml, else
    $TRAINPOD_S3_VOLUME and $TRAINPOD_S3_DATACENTER). With neither, the run's pods from RunPod's API alone.
    """
    from trainpod.remote.s3 import s3_key_here

    if _wants_s3(volume, s3_volume, config):
        if not s3_key_here() and _api_key_here():  # a laptop with RUNPOD_API_KEY alone: its pods at least
            return _reported(lambda: _status_from_api(run_name, "no S3 API key here to read the volume with"))
        return _reported(lambda: _status_via_s3(run_name, s3_volume, datacenter, config))
    named = volume or os.environ.get("TRAINPOD_VOLUME")  # a named one that is not there is a typo: exit 2
    if not named and not Volume.from_env().root.is_dir() and _api_key_here():
        no_volume = f"no volume mounted here ({Volume.from_env().root}) and no S3 volume named"
        return _reported(lambda: _status_from_api(run_name, no_volume))  # a laptop with RUNPOD_API_KEY alone
    return _reported(lambda: _status_here(run_name, Volume(_mounted_root(volume))))


def _api_key_here() -> bool:
    from trainpod.runpod.client import RunPodAuthError, api_key

    try:
        return bool(api_key())
    except RunPodAuthError:
        return False


def _unknown_run(vol: Volume, name: str) -> bool:
    """No runs/<name>/ and no record of a deploy of it (runs/.<name>.DEPLOYED: deployed, its pod not started yet)."""
    from trainpod.runpod.supervise import deploy_record_key

    return not vol.run(name).root.exists() and not (vol.root / deploy_record_key(name)).exists()


def _status_from_api(run_name: str | None, unread: str) -> int:
    """The volume cannot be read (`unread` says why): the pods RunPod's API shows, and how to see the rest."""
    print(
        f"{unread}: the run's step, loss, ETA, cost and checkpoint are on the volume; export RunPod's S3 key "
        "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and pass --config DEPLOY.yaml (or --s3-volume and "
        "--datacenter), or --volume where it is mounted"
    )
    _print_pods(run_name, [], must_show=True)
    return ExitCode.DONE


def _status_here(run_name: str | None, vol: Volume, snapshot: bool = False) -> int:
    """`snapshot`: `vol` is a temporary copy of the S3 volume's small files, gone when the command ends, so
    the loss curve is named by its place on the volume, not by a path here."""
    from trainpod.remote.listing import _visible  # not a run: the folder of one `trainpod rm` is deleting

    runs_root = vol.root / "runs"
    names = (
        [run_name]
        if run_name
        else sorted(p.name for p in runs_root.glob("*") if p.is_dir() and _visible(p.name))
    )
    if not names:
        print(f"no runs under {runs_root}")
        return ExitCode.DONE
    if run_name and not snapshot and _unknown_run(vol, run_name):
        # A typo looked like a run about to start ("no status yet") and exited 0, as a script polling it took it.
        there = sorted(p.name for p in runs_root.glob("*") if p.is_dir() and _visible(p.name))
        print(f"{run_name}: no run of that name on the volume at {vol.root}, nor a deploy of one; runs there: "
              f"{', '.join(there) or 'none'}")  # fmt: skip
        # A pod of that name (made by hand, or deployed elsewhere) is a run about to start after all.
        return ExitCode.DONE if _print_pods(run_name, names) else ExitCode.BAD_INPUT
    for name in names:
        print(_status_line(vol, name))
        run = vol.run(name)
        if run.loss_plot.exists():
            where = f"{run.loss_plot.relative_to(vol.root)} on the volume" if snapshot else run.loss_plot
            print(f"  loss curve  {where}")
        if run.tensorboard.is_dir() and not snapshot:
            print(f"  tensorboard --logdir {run.tensorboard}")
        for push in run.hub_pushes():
            print(
                f"  on the hub  {push['repo_id']}@{push['revision']}: {push['source']}, commit "
                f"{str(push['commit'])[:12]} ({push['url']})"
            )
        then = run.then_outcome()  # a deploy's `then`: the conversion the pod ran after DONE
        if then is not None:
            how = (
                "done"
                if then["outcome"] == "done"
                else f"failed, exit {then.get('exit')}: {then.get('reason')}"
            )
            print(f"  after DONE  {then.get('workload')} {how} ({time.time() - then['unix']:.0f} s ago)")
    _print_pods(run_name, names)
    return ExitCode.DONE


def _status_via_s3(
    run_name: str | None, s3_volume: str | None, datacenter: str | None, config: str | None
) -> int:
    import tempfile

    from trainpod.remote.listing import snapshot_runs

    s3 = _volume_s3(s3_volume, datacenter, config)
    with tempfile.TemporaryDirectory(prefix="trainpod-status-") as snapshot:
        snapshot_runs(s3, [run_name] if run_name else None, Path(snapshot))
        print(f"volume {s3.bucket} ({s3.target.datacenter}) through S3:")
        return _status_here(run_name, Volume(Path(snapshot)), snapshot=True)


def _wants_s3(volume: str | None, s3_volume: str | None, config: str | None) -> bool:
    """S3 when a flag names it; a local --volume or $TRAINPOD_VOLUME wins over $TRAINPOD_S3_VOLUME."""
    from trainpod.remote.s3 import VOLUME_ENV

    if volume:
        return False
    return bool(s3_volume or config) or (
        not os.environ.get("TRAINPOD_VOLUME") and bool(os.environ.get(VOLUME_ENV))
    )


def _volume_s3(s3_volume: str | None, datacenter: str | None, config: str | None):
    """The network volume's S3 API from the flags, the deploy config (its volume found by name through
    RunPod's REST API), or $TRAINPOD_S3_VOLUME / $TRAINPOD_S3_DATACENTER."""
    from trainpod.remote.s3 import VolumeS3, target_from

    if config:
        from trainpod.config import load_config
        from trainpod.config.deploy import DeployConfig

        cfg = load_config(DeployConfig, config)
        datacenter = datacenter or cfg.volume.data_center
        s3_volume = s3_volume or _volume_id(cfg.volume.name, cfg.volume.data_center, config)
    return VolumeS3(target_from(s3_volume, datacenter))


def _volume_id(name: str, datacenter: str, config: str) -> str:
    from trainpod.errors import InputError
    from trainpod.runpod.client import RunPodClient

    for volume in RunPodClient.from_env().list_network_volumes():
        if volume.name == name and volume.data_center_id == datacenter:
            return volume.id
    raise InputError(
        f"{config}: no network volume named {name!r} in {datacenter} on RunPod; `trainpod deploy {config}` creates "
        "it, or pass --s3-volume VOLUME_ID"
    )


def push(
    local_path: str,
    destination: str,
    s3_volume: str | None = None,
    datacenter: str | None = None,
    config: str | None = None,
) -> int:
    """Upload a file or folder to the network volume (e.g. datasets/NAME) through RunPod's S3 API, no pod.

    Multipart and resumable (run it again after an interruption: the parts already sent are kept),
    each file checked by size and checksum, and published like datagen publishes: data files first,
    manifest.json / metadata.json last, so pretrain and finetune see the dataset only once it is
    whole. Nothing on the volume is ever replaced. Key: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.
    """
    from trainpod.remote.push import push as push_files

    def act() -> int:
        push_files(_volume_s3(s3_volume, datacenter, config), Path(local_path), destination)
        return ExitCode.DONE

    return _reported(act)


def pull(
    run_name: str,
    what: str = "export",
    destination: str | None = None,
    s3_volume: str | None = None,
    datacenter: str | None = None,
    config: str | None = None,
) -> int:
    """Download a run's export, newest checkpoint or whole folder from the network volume through S3.

    Into DEST (default ./RUN), resuming an interrupted download, every file checked against its
    manifest's sha256 (a checkpoint's 32 MiB pieces, an output's whole files) before it is renamed
    into place; manifests and checkpoints/LATEST are written last.
    """
    from trainpod.remote.pull import pull as pull_files

    def act() -> int:
        pull_files(_volume_s3(s3_volume, datacenter, config), run_name, what, Path(destination or run_name))
        return ExitCode.DONE

    return _reported(act)


def ls(
    volume: str | None = None,
    s3_volume: str | None = None,
    datacenter: str | None = None,
    config: str | None = None,
) -> int:
    """List the volume's datasets, tokenizers and runs (state, newest checkpoint, exports).

    The volume mounted here (--volume, else $TRAINPOD_VOLUME), or the network volume through
    RunPod's S3 API (--s3-volume and --datacenter, --config DEPLOY.yaml, or $TRAINPOD_S3_VOLUME).
    """
    from trainpod.remote.listing import LocalFiles, volume_lines

    def act() -> int:
        if _wants_s3(volume, s3_volume, config):
            files = _volume_s3(s3_volume, datacenter, config)
            where = f"volume {files.bucket} ({files.target.datacenter}) through S3"
        else:
            files = LocalFiles(_mounted_root(volume))
            where = str(files.root)
        lines = volume_lines(files)
        print(f"{where}:" + ("" if lines else " empty (no datasets, tokenizers or runs)"))
        for line in lines:
            print("  " + line)
        return ExitCode.DONE

    return _reported(act)


def du(
    volume: str | None = None,
    s3_volume: str | None = None,
    datacenter: str | None = None,
    config: str | None = None,
) -> int:
    """Show what takes the space on the volume: one line per entry, largest first, then the total.

    Datasets, tokenizers, runs (their checkpoints, export and the rest), cache/sft/<key> and cache/vlm/<key>
    (with the runs that pin them, DONE or not), other cache/ folders and repos/, each as `trainpod rm` takes
    it; where the volume is mounted, its free space. Same volume flags as `ls`; sizes come from the file
    listing (S3's), nothing large is read.
    """
    from trainpod.diskspace import free_bytes, size_text
    from trainpod.remote.listing import LocalFiles
    from trainpod.remote.space import du_lines

    def act() -> int:
        if _wants_s3(volume, s3_volume, config):
            files = _volume_s3(s3_volume, datacenter, config)
            where = f"volume {files.bucket} ({files.target.datacenter}) through S3"
            free = "free space: RunPod's console shows it (Storage); S3 does not tell"
        else:
            files = LocalFiles(_mounted_root(volume))
            where = str(files.root)
            free = f"{size_text(free_bytes(files.root))} free"
        lines, total = du_lines(files)
        print(f"{where}:" + ("" if lines else " empty"))
        for line in lines:
            print("  " + line)
        print(f"total {size_text(total)}; {free}")
        return ExitCode.DONE

    return _reported(act)


def rm(
    entries: list[str],
    yes: bool = False,
    volume: str | None = None,
    s3_volume: str | None = None,
    datacenter: str | None = None,
    config: str | None = None,
) -> int:
    """Delete entries of the volume that `trainpod du` lists, or a run's older checkpoints (same flags as `ls`).

    ENTRY: datasets/NAME, tokenizers/NAME, runs/RUN, runs/RUN/checkpoints/step-N, cache/sft/KEY, cache/vlm/KEY,
    cache/FOLDER, repos/X. Every ENTRY is checked first and nothing is deleted when one is refused: a live lease
    on it (exit 75: `trainpod stop RUN`, then wait for the lease to expire); the checkpoint LATEST names, or
    a cache key, dataset or tokenizer that a run not DONE pins or names (exit 2: rm the run too, or let it
    finish). Without --yes it prints what would go and asks on a terminal; elsewhere it is exit 2. A kill midway
    leaves nothing that looks complete; the same rm again finishes it.
    """
    from trainpod.errors import InputError
    from trainpod.remote.listing import LocalFiles
    from trainpod.remote.remove import Removal, delete_mounted, delete_s3

    def act() -> int:
        if _wants_s3(volume, s3_volume, config):
            files, delete = _volume_s3(s3_volume, datacenter, config), delete_s3
        else:
            files, delete = LocalFiles(_mounted_root(volume)), delete_mounted
        removal = Removal(files)
        targets = removal.targets(entries)
        print("to remove:")
        for line in removal.plan(targets):
            print("  " + line)
        if not yes:
            if not sys.stdin.isatty():
                raise InputError(
                    "nothing removed: add --yes to remove these (there is no terminal here to ask on)"
                )
            if input("remove them? [y/N] ").strip().lower() not in ("y", "yes"):
                print("nothing removed")
                return ExitCode.DONE
        for target in targets:
            delete(target, files)
            print(f"removed {target.path}")
        return ExitCode.DONE

    return _reported(act)


def _mounted_root(volume: str | None) -> Path:
    """The volume mounted here (--volume, else $TRAINPOD_VOLUME, else /workspace); exit 2 when it is not here:
    a mistyped path, or a laptop without the volume, where "empty" or "no runs" would mislead."""
    from trainpod.errors import InputError

    root = (Volume(Path(volume)) if volume else Volume.from_env()).root
    if not root.is_dir():
        raise InputError(
            f"volume {root} does not exist here; pass --volume where it is mounted, or reach the network "
            "volume through S3 (--s3-volume and --datacenter, or --config DEPLOY.yaml)"
        )
    return root


def _s3_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--s3-volume", metavar="VOLUME_ID", help="network volume id (default: $TRAINPOD_S3_VOLUME)"
    )
    p.add_argument(
        "--datacenter", metavar="DC", help="its data center, e.g. EU-RO-1 ($TRAINPOD_S3_DATACENTER)"
    )
    p.add_argument("--config", help="a deploy YAML: its volume and data center (the id looked up by name)")


def _print_pods(run_name: str | None, names: list[str], must_show: bool = False) -> int | None:
    """The runs' pods (id, status, GPU, cost/hr) when a RunPod key is at hand; silent without one.
    `must_show` (nothing else to show): every run with a pod when no `names`, and RunPod's errors raised.
    Returns how many pods and clusters it showed; None where it could not look."""
    from trainpod import workloads
    from trainpod.runpod.client import RunPodAuthError, RunPodClient, RunPodError, api_key
    from trainpod.runpod.cluster import cluster_line
    from trainpod.runpod.deploy import pod_line, run_unit_names

    try:
        api_key()
    except RunPodAuthError:
        return None
    try:
        client = RunPodClient.from_env(max_attempts=2)
        pods, clusters = client.list_pods(), client.list_clusters()
    except RunPodError as exc:
        if must_show:
            raise
        print(f"pods: not shown ({exc})")
        return None
    if must_show and not run_name and not names:
        names = _runs_of([unit.name for unit in [*pods, *clusters]], tuple(workloads.REGISTRY))
        if not names:
            print("no pods or clusters of a run (<run>-<workload>) on RunPod")
    shown = 0
    for name in [run_name] if run_name else names:
        units = run_unit_names(name, tuple(workloads.REGISTRY))  # never a prefix: `llama` is not `llama-v2`
        mine = [pod for pod in pods if pod.name in units]
        print(f"{name}: {len(mine)} pod(s) on RunPod")
        for pod in mine:
            print(pod_line(pod))
        its_clusters = [c for c in clusters if c.name in units]
        for cluster in its_clusters:
            print(cluster_line(cluster))
        shown += len(mine) + len(its_clusters)
    return shown


def _runs_of(unit_names: list[str], workload_names: tuple[str, ...]) -> list[str]:
    """The runs that pods or clusters named `<run>-<workload>` belong to."""
    runs = set()
    for unit in unit_names:
        runs.update(
            unit.removesuffix(f"-{w}") for w in workload_names if unit.endswith(f"-{w}") and unit != f"-{w}"
        )
    return sorted(runs)


def _status_line(vol: Volume, name: str) -> str:
    run = vol.run(name)
    if not run.status.exists():
        return f"{name}: no status yet ({run.status} missing)"
    s = json.loads(run.status.read_text())
    state = "done" if run.done.exists() else s.get("state", "?")
    # A command run's program decides its steps: its status has the newest checkpoint's step, no max, and
    # none before its first commit (shown as "step None" before).
    parts = [f"{name}: {state}"]
    if s.get("step") is not None:
        parts.append(f"step {s['step']}")
        if s.get("max_steps"):
            parts[-1] += f"/{s['max_steps']} ({s['step'] / s['max_steps']:.0%})"
    if s.get("loss") is not None:
        parts.append(f"loss {s['loss']:.4f}")
    if s.get("tokens_per_s"):
        parts.append(f"{s['tokens_per_s']:,.0f} tok/s")
    if s.get("eval_loss") is not None:
        parts.append(f"eval {s['eval_loss']:.4f}")
    if s.get("eta_s") is not None and state == "running":
        from trainpod.train.reporting import hours_minutes

        parts.append(f"ETA {hours_minutes(s['eta_s'])}")
    if s.get("cost_usd") is not None:
        parts.append(f"cost ${s['cost_usd']:.2f}")
    evals = dict(s.get("eval_metrics") or {})
    if evals:
        at = evals.pop("step", None)
        parts.append(
            ", ".join(f"{k.removeprefix('eval_')} {_eval_value(k, v)}" for k, v in evals.items())
            + f" (step {at})"
        )
        predictions = run.root / "eval" / f"step-{at}.predictions.jsonl"
        if predictions.exists():
            parts.append(f"predictions {predictions}")
    checkpoint = s.get("latest_checkpoint")
    if checkpoint:
        parts.append(
            f"checkpoint step-{checkpoint['step']} ({time.time() - checkpoint['committed_unix']:.0f} s ago)"
        )
    if s.get("last_log_line"):
        parts.append(f"last line: {s['last_log_line'][:80]}")
    parts.append(f"updated {time.time() - s.get('updated_unix', time.time()):.0f} s ago")
    if s.get("reason") and state not in ("running", "done"):
        parts.append(f"reason: {s['reason']}")
    return " | ".join(parts)


def deploy(
    config: str,
    dry_run: bool = False,
    spot: bool | None = None,
    secrets_from_env: bool = False,
    force: bool = False,
    then_supervise: bool = False,
) -> int:
    """Create or reuse the run's RunPod template, network volume and pod `<run>-<workload>`
    (or, with `nodes: N` > 1, its Instant Cluster of N nodes through REST v2).

    Idempotent: deploying again updates the template only when it changed, reuses the volume and
    a running pod, and starts an exited one again. First it checks the workload config, the image
    and the secrets, prints the cost estimate (refused over TRAINPOD_BUDGET_USD or budget.budget_usd
    unless --force) and the GPUs' live stock. --dry-run prints what it would create and sends nothing.
    Secrets go to the pod as {{ RUNPOD_SECRET_<name> }} references unless --secrets-from-env.
    --supervise then brings the pod back after interruptions until the run is DONE.
    """
    from trainpod import deploy_checks as checks
    from trainpod import workloads
    from trainpod.config import load_config
    from trainpod.config.deploy import DeployConfig
    from trainpod.log import redact
    from trainpod.runpod import deploy as deploying
    from trainpod.runpod.client import DryRunClient, RunPodClient

    def act() -> int:
        cfg = load_config(DeployConfig, config)
        workloads.deployable(cfg.workload)
        if spot is not None:
            cfg.pod.spot = spot
        secrets = deploying.secrets_from_shell(cfg, dict(os.environ)) if secrets_from_env else None
        deploying.pod_env(cfg, secrets)  # a config RunPod would refuse sends nothing, not even a read
        if dry_run:  # sends nothing, reads nothing: prices from TRAINPOD_GPU_HOURLY_USD / budget.hourly_usd
            checks.run_checks(cfg, config, secrets_from_env, [], force)
            shown = sorted(secrets.values(), key=len, reverse=True) if secrets else []
            deploy_log = logging.getLogger("trainpod.deploy")
            level = deploy_log.level
            deploy_log.setLevel(logging.WARNING)  # its "created" lines would mislead in a dry run
            try:
                deploying.deploy(DryRunClient(echo=lambda text: print(redact(text, shown))), cfg, secrets)
            finally:
                deploy_log.setLevel(level)
            return ExitCode.DONE
        client = RunPodClient.from_env()
        cuda = deploying.allowed_cuda_versions(cfg)
        catalog = _catalog(cfg, cuda_versions=cuda) if cfg.image.flavour == "cuda" else []
        checks.run_checks(cfg, config, secrets_from_env, catalog, force)
        lines, free = checks.stock_lines(cfg, catalog, cuda)
        for line in lines:
            print(line)
        if catalog and not free:
            logging.getLogger("trainpod.deploy").warning("%s", checks.no_stock_warning(cfg, cuda))
        from trainpod.errors import TrainpodError
        from trainpod.runpod.client import RunPodNoCapacity
        from trainpod.runpod.supervise import DeployRecord, mark_stopped, record_deployment, stop_not_cleared

        volume = Volume.from_env()
        mounted = volume if volume.root.is_dir() else None

        def resume() -> None:  # a supervisor that still saw STOPPED would end at once; a refusal keeps it
            # A first deploy's volume is not made yet and holds no STOPPED: looking it up by name for S3 would warn
            # that it does not exist and that `trainpod deploy` makes it, the very command running.
            volume_s3 = None
            if mounted is None and any(
                (v.name, v.data_center_id) == (cfg.volume.name, cfg.volume.data_center)
                for v in client.list_network_volumes()
            ):
                volume_s3 = _supervised_volume_s3(config)
            try:
                mark_stopped(cfg.run, mounted, False, volume_s3)
            except (TrainpodError, OSError) as exc:
                raise stop_not_cleared(cfg.run, mounted, volume_s3, cfg.volume.mount_path, exc) from None

        record = DeployRecord(bool(cfg.pod.spot), secrets is not None, time.time())
        try:
            done = deploying.deploy(client, cfg, secrets, deployed=record.to_json(), accepted=resume)
        except RunPodNoCapacity:
            if then_supervise:  # its pod is made as this deploy asked: spot or not, secrets as values or not
                record_deployment(cfg.run, mounted, bool(cfg.pod.spot), secrets is not None)
                waiting_for_capacity.append(True)
            raise
        if done.action != "reused":  # a running pod kept as it is may differ from this config: a look tells
            _record_deployment(cfg, mounted, done.volume.id, secrets is not None, spot is not None)
        print(f"{done.summary()}; supervise it with: "
              f"trainpod supervise {cfg.run} --config {config}")  # fmt: skip
        return ExitCode.DONE

    # --supervise, and RunPod had no machine free for the pod or cluster.
    waiting_for_capacity: list[bool] = []
    code = _reported(act)
    if (code == ExitCode.DONE or waiting_for_capacity) and then_supervise and not dry_run:
        cfg = load_config(DeployConfig, config)
        if waiting_for_capacity:
            # The user asked for a supervised run: ending here left nothing to make the pod once a machine is free.
            logging.getLogger("trainpod.deploy").warning(
                "handing over to the supervisor, which makes the %s once a machine is free (Ctrl-C ends it)",
                "cluster" if cfg.nodes > 1 else "pod",
            )
        # --spot/--on-demand hold for the supervisor too: its replacement pods are made from its config.
        return supervise(cfg.run, config, spot=spot)
    return code


def _record_deployment(
    cfg, mounted: Volume | None, volume_id: str, secrets_as_values: bool, spot_given: bool
) -> None:
    """Record what the deploy rented beside the run, on the volume mounted here or else through its S3 API (the
    volume exists now, on a first deploy too), for supervisors elsewhere whose first look finds no pod.
    Not reaching the volume fails nothing (the pod is rented, and records it when it boots: deploy.DEPLOYED_ENV):
    a warning says what such a supervisor will do."""
    from trainpod.errors import TrainpodError
    from trainpod.remote.s3 import VolumeS3, target_from
    from trainpod.runpod.supervise import deploy_record_key, record_deployment

    volume_s3, why = None, "RunPod's S3 key (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) is not exported"
    try:
        if (
            mounted is None
            and os.environ.get("AWS_ACCESS_KEY_ID")
            and os.environ.get("AWS_SECRET_ACCESS_KEY")
        ):
            volume_s3 = VolumeS3(target_from(volume_id, cfg.volume.data_center))
        if record_deployment(cfg.run, mounted, bool(cfg.pod.spot), secrets_as_values, volume_s3):
            return
    except (TrainpodError, OSError) as exc:  # S3 down after its retries, no S3 in its DC, a full volume
        why = str(exc)
    if spot_given or secrets_as_values:  # a supervisor elsewhere would go by the YAML: it matters only then
        logging.getLogger("trainpod.deploy").warning(
            "%s is not recorded on the volume (%s): a supervisor elsewhere (supervise.yml, another machine) that "
            "finds the pod gone at its first look%s makes the new one as the YAML (or an older deploy's record) "
            "says; this machine's supervisor knows. The next deploy that reaches the volume (mounted, "
            "or RunPod's S3 key exported) and rents a pod records it",
            deploy_record_key(cfg.run),
            why,
            "" if cfg.nodes > 1 else ", before the pod booted and recorded it there itself",
        )


def supervise(
    run_name: str,
    config: str | None = None,
    once: bool = False,
    volume: str | None = None,
    spot: bool | None = None,
) -> int:
    """Bring the run's interrupted spot pod back until it is DONE, FAILED or over budget.

    Needs the run's deploy config (--config, else $TRAINPOD_CONFIG, else the one YAML under
    configs/deploy/ whose `run:` is RUN). Reads DONE, FAILED and
    status.json from the volume when it is mounted here (--volume, else $TRAINPOD_VOLUME), else
    through the volume's S3 API when its key is exported (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY),
    else works from the API alone. --once: one look and one decision (for cron or a CI schedule).
    """
    from trainpod.config import load_config
    from trainpod.config.deploy import DeployConfig
    from trainpod.runpod.supervise import find_deploy_config
    from trainpod.runpod.supervise import supervise as supervise_run

    def act() -> int:
        path = config or os.environ.get("TRAINPOD_CONFIG") or find_deploy_config(run_name)
        cfg = load_config(DeployConfig, path)
        cfg.run = run_name
        if spot is not None:  # `deploy --spot/--on-demand --supervise`: what the deploy rented
            cfg.pod.spot = spot
        # A --volume named is one meant to be read: mistyped, the supervisor went on blind to DONE and FAILED and
        # started a finished run's pod again at each look.
        mounted = Volume(_mounted_root(volume)) if volume else Volume.from_env()
        volume_s3 = None if mounted.root.is_dir() else _supervised_volume_s3(path)
        return supervise_run(cfg, mounted, once=once, volume_s3=volume_s3)

    return _reported(act)


def _deploy_config_of(run_name: str) -> str | None:
    """The run's deploy config ($TRAINPOD_CONFIG, else the one under configs/deploy/), None when unknown."""
    from trainpod.errors import TrainpodError
    from trainpod.runpod.supervise import find_deploy_config

    try:
        return os.environ.get("TRAINPOD_CONFIG") or find_deploy_config(run_name)
    except TrainpodError:
        return None


def _supervised_volume_s3(deploy_config: str | None):
    """The deploy config's volume through S3 when the S3 API key is exported, so that a supervisor away
    from the volume still sees DONE and FAILED; None (the API alone) without a key, or for a volume in a
    data center RunPod serves no S3 in."""
    from trainpod.errors import InputError

    if deploy_config is None or not (
        os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")
    ):
        return None
    try:
        return _volume_s3(None, None, deploy_config)
    except InputError as exc:
        logging.getLogger("trainpod.supervise").warning("not reading the run's markers through S3: %s", exc)
        return None


def stop(run_name: str, terminate: bool = False) -> int:
    """Stop the run's pods (they keep their disk and can start again), or --terminate them; delete its clusters.

    The stop is recorded first, where supervisors look (runs/.RUN.STOPPED on the volume when it is mounted
    here, else through its S3 API when RunPod's S3 key is exported; and this machine's supervisor state), so
    they leave the run down until `trainpod deploy` clears it; then the pods stop, the supervisor's first (also
    when the record on the volume fails: a warning says so).
    """
    from trainpod import workloads
    from trainpod.errors import TrainpodError
    from trainpod.runpod.client import RunPodClient
    from trainpod.runpod.deploy import stop_run
    from trainpod.runpod.supervise import mark_stopped

    def act() -> int:
        client = RunPodClient.from_env()  # first: without a key nothing is recorded as stopped
        volume = Volume.from_env()
        mounted = volume if volume.root.is_dir() else None
        unrecorded, volume_s3 = None, None
        # The record's volume comes from the deploy config: one that does not load ($TRAINPOD_CONFIG left naming a
        # workload's YAML) or a volume lookup RunPod fails loses the record, never the stop of pods that bill.
        try:
            volume_s3 = None if mounted else _supervised_volume_s3(_deploy_config_of(run_name))
        except TrainpodError as exc:
            unrecorded = f"the run's deploy config, which names the volume, could not be used ({exc})"
        if unrecorded is None and mounted is None and volume_s3 is None:
            unrecorded = (
                f"it is not mounted here (TRAINPOD_VOLUME, {volume.root}) and RunPod's S3 key (AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY) with the run's deploy config is not at hand"
            )
        # Recorded before the pods stop: a supervisor looking in between would take them for interrupted
        # and start them again. A record that fails (S3 refusing its key or down, a full volume) stops nothing
        # less: the pods would bill on, where a supervisor elsewhere may start them again at worst.
        try:
            mark_stopped(run_name, mounted, volume_s3=volume_s3)
        except (TrainpodError, OSError) as exc:
            unrecorded = f"writing it failed ({exc})"
        stop_run(client, run_name, terminate, tuple(workloads.REGISTRY))
        if unrecorded is not None:
            logging.getLogger("trainpod.stop").warning(
                "runs/.%s.STOPPED is not recorded on the volume: %s; a supervisor elsewhere (supervise.yml, another "
                "machine) does not see this stop and starts the run again: stop again where the volume can be "
                "written (mounted, or RunPod's S3 key exported), or unset SUPERVISE_RUN",
                run_name,
                unrecorded,
            )
        return ExitCode.DONE

    return _reported(act)


def checkpoint(
    action: str,
    run_name: str,
    step: int | None = None,
    directory: str | None = None,
    volume: str | None = None,
    keep_source: bool = False,
    keep_last: int | None = None,
    keep_best: int | None = None,
    eval_loss: float | None = None,
) -> int:
    """Checkpoints for trainers in any language: latest, commit, verify (README, "Bring your own trainer").

    latest RUN: print the newest checkpoint that verifies (older ones are tried in turn), or nothing.
    commit RUN --step N DIR: publish DIR (moved into the store) as step-N atomically, with a manifest;
    retention keeps the last keep_last and the best keep_best by eval loss (--eval-loss gives this one's).
    verify RUN [STEP]: check LATEST (or step N) against its manifest; exit 2 when it does not match.
    RUN is a run name under the volume's runs/, or a run folder's path (e.g. "$TRAINPOD_RUN_DIR").
    Log lines go to stderr, so `$(trainpod checkpoint latest RUN)` holds only the path.
    """
    import logging
    import signal

    from trainpod import refusal
    from trainpod.checkpoint import CheckpointStore
    from trainpod.checkpoint.directory import commit_directory, verify_committed
    from trainpod.checkpoint.lease import foreign_writer, held_by_another
    from trainpod.diskspace import volume_full_as_exit_5
    from trainpod.errors import InputError, TemporaryError, TrainpodError
    from trainpod.log import RedactingFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(levelname)s [%(name)s] %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    try:
        run_dir = _run_folder(run_name, Volume(Path(volume)) if volume else Volume.from_env())
        store = CheckpointStore(
            run_dir / "checkpoints", keep_last=_keep_last(keep_last), keep_best=_keep_best(keep_best)
        )
        if action == "latest":
            # Beside a live writer (a shell on the pod while it trains) this only reads: what looks like a
            # leftover may be its commit in flight. The program the kit holds the lease for cleans up.
            clean = os.environ.get("TRAINPOD_LEASE_HELD") == "1" or not held_by_another(run_dir / "LEASE")
            latest = store.latest(clean) if store.root.parent.is_dir() else None
            if latest is not None:
                print(latest.path)
        elif action == "commit":
            # The program's whole group gets SIGTERM; the commit it is making is what the window is for.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if step is None or directory is None:
                raise InputError("checkpoint commit needs --step N and the DIR your program wrote")
            if not directory.strip():  # "$out" of an unset variable: "" would be the current folder, the code
                raise InputError("checkpoint commit: DIR is empty (an unset shell variable?); pass the folder your "
                                 "program wrote the checkpoint to")  # fmt: skip
            writer = (
                None if os.environ.get("TRAINPOD_LEASE_HELD") == "1" else foreign_writer(run_dir / "LEASE")
            )
            if writer is not None:  # its next commit would move LATEST and retention under this one, or back
                raise TemporaryError(
                    f"checkpoint commit: {run_dir} is leased by a live writer (host {writer.get('host')}, pid "
                    f"{writer.get('pid')}, pod {writer.get('pod_id') or '-'}), which commits its own checkpoints; "
                    "nothing was committed and DIR is left as it was. Commit from the program the kit runs for "
                    "this run (TRAINPOD_LEASE_HELD=1), or stop that writer first (trainpod stop RUN)"
                )
            with volume_full_as_exit_5(store.root, f"checkpoint step-{step}"):
                committed = commit_directory(store, step, Path(directory), {"writer": "trainpod checkpoint commit"},
                                             keep_source=keep_source, eval_loss=eval_loss)  # fmt: skip
            refusal.clear()  # a refusal the program went past (`|| true`) is no reason for its later failure
            print(committed.path)
        else:
            path, manifest = verify_committed(store, step)
            print(f"{path}: ok ({len(manifest['files'])} files verified)")
        return ExitCode.DONE
    except TrainpodError as exc:
        logging.getLogger("trainpod").error("%s", exc)
        if action == "commit":  # what the program asked is refused: the kit's command workload is told
            refusal.record(exc)
        return int(exc.exit_code)


def _keep_last(flag: int | None) -> int:
    """--keep-last, else TRAINPOD_KEEP_LAST, else 2: at least 2 (docs/design.md, "Checkpoints"), so a newest
    checkpoint that fails verification at the next start has an older one to fall back to."""
    return _retention_count(
        flag,
        "--keep-last",
        "TRAINPOD_KEEP_LAST",
        2,
        ": keep at least 2 checkpoints; set it to a whole number >= 2, e.g. 2",
    )


def _run_folder(run_name: str, vol: Volume) -> Path:
    """RUN of `trainpod checkpoint`: a run folder's path, else a run name under the volume's runs/."""
    from trainpod.checkpoint.directory import refuse_a_checkpoints_folder_for_a_run
    from trainpod.errors import InputError
    from trainpod.volume import is_run_name

    if "/" in run_name or run_name in (".", ".."):
        refuse_a_checkpoints_folder_for_a_run(Path(run_name), "RUN")
        return Path(run_name)
    if not is_run_name(run_name):  # '' would be runs/ itself, whose checkpoints/ is no run's
        raise InputError(
            f"RUN {run_name!r} is neither a run folder's path nor a run name (letters, digits, '.', '_', '-'); an "
            "empty one is an unset shell variable, like $TRAINPOD_RUN_DIR outside the command workload: run under "
            "it, or pass the run folder's path"
        )
    return vol.run(run_name).root


def _keep_best(flag: int | None) -> int:
    """--keep-best, else TRAINPOD_KEEP_BEST (the command config's checkpoint.keep_best), else 0, as the
    Checkpointer and the HF callback read it: a commit here must not delete the best checkpoints they keep."""
    return _retention_count(
        flag,
        "--keep-best",
        "TRAINPOD_KEEP_BEST",
        0,
        " is not a whole number >= 0; set it like 1 (0 keeps no best)",
    )


def _retention_count(flag: int | None, option: str, variable: str, least: int, problem: str) -> int:
    """The flag, else the environment variable, else `least`: a whole number >= `least`, else exit 2 naming
    where it came from, its value and `problem`."""
    from trainpod.errors import InputError, is_whole_number

    raw = str(flag) if flag is not None else os.environ.get(variable) or str(least)
    if not is_whole_number(raw) or int(raw) < least:
        raise InputError(f"{option if flag is not None else variable}={raw!r}{problem}")
    return int(raw)


def logs(run_name: str, follow: bool = False, tail: int = 100) -> int:
    """Print the last lines of the run's pod logs (-f: and follow them until Ctrl-C), secrets masked.

    Reads RunPod's REST v2 log stream of the pod `<run>-<workload>` (RUNPOD_API_KEY); a dropped
    connection is resumed from the last line printed, none lost or repeated. No SSH needed. -f goes on
    with the run's new pod when the supervisor replaced the one followed, and ends when the run has none.
    """
    from trainpod import workloads
    from trainpod.errors import ConfigError
    from trainpod.runpod.client import RunPodClient
    from trainpod.runpod.logs import MAX_TAIL, pod_for_logs, stream_logs

    def act() -> int:
        if not 0 <= tail <= MAX_TAIL:
            raise ConfigError(
                [f"--tail {tail}: RunPod backfills 0 to {MAX_TAIL} lines; pick one in that range"]
            )
        _notes_to_stderr()  # stdout carries the pod's lines alone, e.g. into a file
        client = RunPodClient.from_env()
        pod = pod_for_logs(client, run_name, tuple(workloads.REGISTRY))
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how -f ends
            stream_logs(
                client,
                pod,
                tail,
                follow,
                emit=lambda line: print(line, flush=True),
                find_pod=lambda: pod_for_logs(client, run_name, tuple(workloads.REGISTRY)),
            )
        return ExitCode.DONE

    return _reported(act)


def _notes_to_stderr() -> None:
    import logging

    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _reported(act) -> int:
    """Run a RunPod verb: its log lines on stdout (secrets masked), an error as one message + exit code."""
    from trainpod.errors import TrainpodError
    from trainpod.log import setup_logging

    setup_logging(None)
    try:
        return int(act())
    except TrainpodError as exc:
        import logging

        logging.getLogger("trainpod").error("%s", exc)
        return int(exc.exit_code)
    except KeyboardInterrupt:  # Ctrl-C: how a user ends a supervise loop or a long push, not a crash
        import logging

        logging.getLogger("trainpod").warning(
            "interrupted (Ctrl-C); what was done is kept: run the same command again to go on"
        )
        return int(ExitCode.INTERRUPTED)


def estimate(
    config: str,
    gpu: str | None = None,
    spot: bool | None = None,
    mfu: float | None = None,
    set: list[str] | None = None,
    volume: str | None = None,
) -> int:
    """Estimate a training run before paying for it: tokens, FLOPs, hours, GPU memory, checkpoint, dollars.

    CONFIG is a pretrain, finetune or finetune-vlm config, or a deploy config (its workload config is read
    from the repo). The price is a deploy config's budget.hourly_usd (what its pod counts its cost with),
    else RunPod's catalog when RUNPOD_API_KEY is set (on-demand list prices: a spot estimate takes
    TRAINPOD_GPU_HOURLY_USD first), else TRAINPOD_GPU_HOURLY_USD. The MFU is the one the run last measured
    (--volume), else an assumption.
    """
    from trainpod import estimate as estimating
    from trainpod.config.loader import SET_FLAG
    from trainpod.errors import InputError

    def act() -> int:
        workload_config, deploy_config = estimating.load_target(config, list(set or []), SET_FLAG)
        # --volume, else $TRAINPOD_VOLUME, as every other command reads the volume mounted here
        named, given_as = (
            (volume, "--volume") if volume else (os.environ.get("TRAINPOD_VOLUME"), "TRAINPOD_VOLUME")
        )
        vol = Volume(Path(named)) if named else None
        if (
            vol is not None and not vol.root.is_dir()
        ):  # it was read as an empty one: vocabulary, data, MFU assumed
            raise InputError(
                f"{given_as} {vol.root} does not exist here; pass the folder that holds the run's datasets/ and runs/, "
                f"or leave {given_as} out to estimate from the config alone"
            )
        est = estimating.estimate(
            workload_config, deploy_config, gpu, spot, mfu, _catalog(deploy_config), vol, SET_FLAG
        )
        print("\n".join(estimating.report(est)))
        return ExitCode.DONE

    return _reported(act)


def _catalog(deploy_config, cuda_versions: list[str] | None = None) -> list:
    """RunPod's GPU catalog (prices, stock) when a key is at hand; [] without one or when unreachable."""
    from trainpod.runpod.client import RunPodAuthError, RunPodClient, RunPodError, api_key

    try:
        api_key()
    except RunPodAuthError:
        return []
    count = deploy_config.pod.gpu_count if deploy_config else 1
    cloud = deploy_config.pod.cloud if deploy_config else "SECURE"
    try:
        return RunPodClient.from_env(max_attempts=2).catalog_gpus(count, cloud, cuda_versions)
    except RunPodError as exc:
        print(f"RunPod's catalog not read ({exc}); prices from TRAINPOD_GPU_HOURLY_USD")
        return []


def generate(
    run_name: str,
    prompt: str,
    volume: str | None = None,
    export: str = "auto",
    system: str | None = None,
    max_new_tokens: int = 200,
    temperature: float = 0.7,
    seed: int = 0,
) -> int:
    """Answer one prompt with the run's export, streaming tokens (the chat template it trained with).

    Loads export/merged, export/hf or base + export/adapter (--export picks one) from the volume
    (--volume, else $TRAINPOD_VOLUME). --temperature 0 is greedy.
    """
    from trainpod import chat as chatting

    def act() -> int:
        _notes_to_stderr()  # stdout carries the answer alone (a library's warning went into it)
        vol = Volume(Path(volume)) if volume else Volume.from_env()
        found = chatting.find_export(vol, run_name, export)
        print(f"[{chatting.describe(found)}]", file=sys.stderr)
        model, tokenizer = chatting.load(found)
        conversation = chatting.Conversation(tokenizer, found.template, system)
        chatting.stream_reply(
            model, tokenizer, conversation, prompt, _write, max_new_tokens, temperature, seed
        )
        print()
        return ExitCode.DONE

    return _reported(act)


def chat(
    run_name: str,
    volume: str | None = None,
    export: str = "auto",
    system: str | None = None,
    max_new_tokens: int = 200,
    temperature: float = 0.7,
    seed: int = 0,
) -> int:
    """Chat with the run's export on stdin: one reply per line, streamed; an empty line or EOF ends.

    The conversation so far is sent each turn, rendered with the template the run trained with.
    """
    from trainpod import chat as chatting

    def act() -> int:
        _notes_to_stderr()  # stdout carries the replies alone
        vol = Volume(Path(volume)) if volume else Volume.from_env()
        found = chatting.find_export(vol, run_name, export)
        print(f"[{chatting.describe(found)}; an empty line ends]", file=sys.stderr)
        model, tokenizer = chatting.load(found)
        conversation = chatting.Conversation(tokenizer, found.template, system)
        generation = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
        chatting.chat_loop(model, tokenizer, conversation, sys.stdin, _write, **generation)
        return ExitCode.DONE

    return _reported(act)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def config_fields(what: str, workload: str) -> int:
    """`config fields WORKLOAD`: every field of its config, with dotted path, type, default and description."""
    from trainpod.config.fields import field_rows, format_rows

    types = _config_types()
    if workload not in types:
        print(f"no config type {workload!r}; use one of: {', '.join(sorted(types))}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    print(format_rows(field_rows(types[workload])))
    return ExitCode.DONE


def _config_types() -> dict[str, type]:
    """Config types by name, from the workload registry: datagen's kinds as datagen-<kind>, and deploy's."""
    from trainpod import workloads
    from trainpod.config.deploy import DeployConfig
    from trainpod.workloads import datagen

    types: dict[str, type] = {}
    for name, workload in workloads.REGISTRY.items():
        if name == "datagen":
            types |= {
                "datagen" if kind == "tokens" else f"datagen-{kind}": cls
                for kind, cls in datagen.KINDS.items()
            }
        else:
            types[name] = workload.config_type({})
    return types | {"deploy": DeployConfig}


def boot() -> int:
    """Run the workload the pod's environment names (TRAINPOD_WORKLOAD, TRAINPOD_CONFIG, ...)."""
    from trainpod.boot import boot as boot_from_env

    return boot_from_env()


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def _run_arguments(p: argparse.ArgumentParser) -> None:
    from trainpod import workloads

    p.add_argument(
        "workload",
        choices=list(workloads.REGISTRY),
        help="; ".join(f"{w.name}: {w.summary}" for w in workloads.REGISTRY.values()),
    )
    p.add_argument("--config", help="YAML config (default: $TRAINPOD_CONFIG)")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="config override (repeatable)")
    p.add_argument("--run", dest="run_name", help="run name (default: $TRAINPOD_RUN, else the config's name)")
    p.add_argument("--volume", help="volume root (default: $TRAINPOD_VOLUME, else /workspace)")
    p.add_argument(  # 0 or less ran one process as if nothing were wrong
        "--nproc-per-node", type=_positive_int, default=1, help="processes on this machine (one per GPU)"
    )


def _status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_name", nargs="?", metavar="RUN")
    p.add_argument("--volume")
    _s3_flags(p)


def _deploy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="deploy YAML, e.g. configs/deploy/pretrain-spot.yaml")
    p.add_argument("--dry-run", action="store_true", help="print the requests, send nothing")
    p.add_argument("--spot", dest="spot", action="store_true", default=None, help="an interruptible pod")
    p.add_argument("--on-demand", dest="spot", action="store_false", help="an on-demand pod")
    p.add_argument("--secrets-from-env", action="store_true", help="send this shell's secret values")
    p.add_argument("--force", action="store_true", help="deploy even when the estimate exceeds the budget")
    p.add_argument(
        "--supervise", dest="then_supervise", action="store_true", help="then supervise the run until DONE"
    )


def _estimate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="pretrain, finetune, finetune-vlm or deploy YAML")
    p.add_argument("--gpu", help="RunPod GPU type id (default: the deploy config's first, else an H100)")
    p.add_argument("--spot", dest="spot", action="store_true", default=None, help="price a spot pod")
    p.add_argument("--on-demand", dest="spot", action="store_false", help="price an on-demand pod")
    p.add_argument("--mfu", type=float, help="model FLOPs utilisation to assume, e.g. 0.4")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="workload config override")
    p.add_argument(
        "--volume",
        help="a volume holding runs/<run>/status.json (measured MFU) and datasets (default: $TRAINPOD_VOLUME)",
    )


def _eval_value(name: str, value: float) -> str:
    """An eval metric as the log shows it: a share (a preference objective's rewards_accuracy) in percent."""
    return f"{value:.1%}" if name.endswith("accuracy") else f"{value:.4f}"


def _positive_int(raw: str) -> int:
    """An argparse type for counts: --max-new-tokens (transformers' generate refuses 0 and below, after the model
    has loaded) and --nproc-per-node."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw} is not 1 or more")
    return value


def _temperature(raw: str) -> float:
    """An argparse type for --temperature: 0 (greedy) or more. A negative or nan one was greedy decoding
    without a word (chat samples only above 0), where the user asked for something else."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{raw} is not 0 (greedy) or more, e.g. 0.7")
    return value


def _chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_name", metavar="RUN")
    p.add_argument("--volume", help="volume root (default: $TRAINPOD_VOLUME, else /workspace)")
    p.add_argument(
        "--export",
        default="auto",
        metavar="FOLDER",
        help="auto (merged, else hf, else adapter), or a folder of the run's export/: merged, hf, adapter, or a "
        "converted checkpoint's hf-step-<N>",
    )
    p.add_argument("--system", help="a system message, for templates that have one")
    p.add_argument("--max-new-tokens", type=_positive_int, default=200)
    p.add_argument("--temperature", type=_temperature, default=0.7, help="0: greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed, the same answer)")


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    _chat_arguments(p)
    p.add_argument("--prompt", required=True, help="the user message (or text to continue)")


def _config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["fields"], help="fields: every field of WORKLOAD's config")
    p.add_argument("workload", metavar="WORKLOAD", help="pretrain, finetune, datagen-sft, deploy, ...")


def _supervise_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_name", metavar="RUN")
    p.add_argument(
        "--config",
        help="the run's deploy YAML (default: $TRAINPOD_CONFIG, else found by RUN in configs/deploy/)",
    )
    p.add_argument("--once", action="store_true", help="one look and one decision, then exit")
    p.add_argument("--volume", help="the volume when mounted here (default: $TRAINPOD_VOLUME)")


def _stop_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_name", metavar="RUN")
    p.add_argument("--terminate", action="store_true", help="terminate instead of stop (the pod is gone)")


def _checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    actions = p.add_subparsers(dest="action", required=True)
    for action, action_help in (
        ("latest", "print the newest valid checkpoint's path, or nothing"),
        ("commit", "publish DIR as step N: moved into the store, hashed, manifest, LATEST"),
        ("verify", "check LATEST (or STEP) against its manifest; exit 2 when it does not match"),
    ):
        a = actions.add_parser(action, help=action_help, description=action_help)
        a.add_argument("run_name", metavar="RUN", help="run name under the volume, or a run folder's path")
        if action == "commit":
            a.add_argument("directory", metavar="DIR", help="the folder your program wrote the checkpoint to")
            a.add_argument("--step", type=int, required=True, help="the training step DIR holds")
            a.add_argument("--keep-source", action="store_true", help="copy DIR instead of moving it")
            a.add_argument(
                "--keep-last", type=int, help="checkpoints kept (default: $TRAINPOD_KEEP_LAST, else 2)"
            )
            a.add_argument(
                "--keep-best",
                type=int,
                help="best checkpoints by eval loss kept besides (default: $TRAINPOD_KEEP_BEST, else 0)",
            )
            a.add_argument(
                "--eval-loss", type=float, help="this checkpoint's eval loss, which keep_best ranks by"
            )
        if action == "verify":
            a.add_argument("step", nargs="?", type=int, metavar="STEP", help="a step other than LATEST's")
        a.add_argument("--volume", help="volume root (default: $TRAINPOD_VOLUME, else /workspace)")


def _logs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_name", metavar="RUN")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    p.add_argument("--tail", type=int, default=100, metavar="N", help="lines of history first (0-5000)")


def _push_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("local_path", metavar="LOCAL_PATH")
    p.add_argument("destination", metavar="DEST", help="folder on the volume, e.g. datasets/NAME")
    _s3_flags(p)


def _pull_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_name", metavar="RUN")
    p.add_argument("what", nargs="?", default="export", choices=["export", "checkpoint", "all"])
    p.add_argument("destination", nargs="?", metavar="DEST", help="local folder (default: ./RUN)")
    _s3_flags(p)


def _rm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "entries", nargs="+", metavar="ENTRY", help="e.g. runs/old-run, runs/r/checkpoints/step-100"
    )
    p.add_argument("--yes", action="store_true", help="remove without asking")
    _ls_arguments(p)


def _ls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--volume", help="a volume mounted here (default: $TRAINPOD_VOLUME)")
    _s3_flags(p)


# The verbs: the one table the parser and the dispatch are built from. A new verb is a function
# (its docstring is its help) and a line here, with the function that declares its arguments.
VERBS: dict[str, tuple[Callable[..., int], Callable[[argparse.ArgumentParser], None] | None]] = {
    "run": (run, _run_arguments),
    "boot": (boot, None),
    "status": (status, _status_arguments),
    "deploy": (deploy, _deploy_arguments),
    "supervise": (supervise, _supervise_arguments),
    "stop": (stop, _stop_arguments),
    "checkpoint": (checkpoint, _checkpoint_arguments),
    "estimate": (estimate, _estimate_arguments),
    "generate": (generate, _generate_arguments),
    "chat": (chat, _chat_arguments),
    "config": (config_fields, _config_arguments),
    "logs": (logs, _logs_arguments),
    "push": (push, _push_arguments),
    "pull": (pull, _pull_arguments),
    "ls": (ls, _ls_arguments),
    "du": (du, _ls_arguments),
    "rm": (rm, _rm_arguments),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainpod", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"trainpod {_version()}")
    verbs = parser.add_subparsers(dest="verb", required=True)
    for name, (function, arguments) in VERBS.items():
        p = verbs.add_parser(name, help=_summary(function), description=inspect.getdoc(function))
        if arguments is not None:
            arguments(p)
    return parser


def _version() -> str:
    import trainpod

    return trainpod.__version__


def _summary(fn: object) -> str:
    """The docstring's first paragraph, which may wrap over several lines (deploy's does)."""
    return " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split())


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    function, _ = VERBS[args.pop("verb")]
    return int(function(**args))


if __name__ == "__main__":
    sys.exit(main())
