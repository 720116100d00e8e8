"""The `trainpod` command. Each verb is a function whose docstring is its help.

trainpod run pretrain --config configs/pretrain/tiny.yaml --set train.max_steps=50
trainpod run pretrain --nproc-per-node 2 ...     (one process per GPU, or gloo processes on CPU)
trainpod status RUN
trainpod deploy configs/deploy/pretrain-spot.yaml [--dry-run]   (RunPod: template, volume, pod)
trainpod supervise RUN --config configs/deploy/pretrain-spot.yaml [--once]
trainpod stop RUN [--terminate]
"""

from __future__ import annotations

import argparse
import inspect
import json
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
    from trainpod.workloads.lifecycle import RunRequest, execute

    if nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        from trainpod.launch import launch_local

        return launch_local(nproc_per_node, _strip_nproc(sys.argv[1:]))
    request = RunRequest.from_env(workload)
    request.config_path = config or request.config_path
    request.overrides += list(set or [])
    request.run_name = run_name or request.run_name
    request.volume = Volume(Path(volume)) if volume else request.volume
    return execute(request)


def status(run_name: str | None = None, volume: str | None = None) -> int:
    """Show a run's step, loss, tokens/s, ETA, cost and newest checkpoint (all runs when RUN is omitted)."""
    vol = Volume(Path(volume)) if volume else Volume.from_env()
    runs_root = vol.root / "runs"
    names = [run_name] if run_name else sorted(p.name for p in runs_root.glob("*") if p.is_dir())
    if not names:
        print(f"no runs under {runs_root}")
        return ExitCode.DONE
    for name in names:
        print(_status_line(vol, name))
    _print_pods(run_name, names)
    return ExitCode.DONE


def _print_pods(run_name: str | None, names: list[str]) -> None:
    """The runs' pods (id, status, GPU, cost/hr) when a RunPod key is at hand; silent without one."""
    from trainpod.runpod.client import RunPodAuthError, RunPodClient, RunPodError, api_key
    from trainpod.runpod.deploy import pod_line

    try:
        api_key()
    except RunPodAuthError:
        return
    try:
        pods = RunPodClient.from_env(max_attempts=2).list_pods()
    except RunPodError as exc:
        print(f"pods: not shown ({exc})")
        return
    for name in [run_name] if run_name else names:
        mine = [pod for pod in pods if pod.name.startswith(f"{name}-")]
        print(f"{name}: {len(mine)} pod(s) on RunPod")
        for pod in mine:
            print(pod_line(pod))


def _status_line(vol: Volume, name: str) -> str:
    run = vol.run(name)
    if not run.status.exists():
        return f"{name}: no status yet ({run.status} missing)"
    s = json.loads(run.status.read_text())
    state = "done" if run.done.exists() else s.get("state", "?")
    parts = [f"{name}: {state}", f"step {s.get('step')}/{s.get('max_steps')}"]
    if s.get("loss") is not None:
        parts.append(f"loss {s['loss']:.4f}")
    if s.get("tokens_per_s"):
        parts.append(f"{s['tokens_per_s']:,.0f} tok/s")
    if s.get("eta_s") is not None and state == "running":
        parts.append(f"ETA {s['eta_s'] / 60:.1f} min")
    if s.get("cost_usd") is not None:
        parts.append(f"cost ${s['cost_usd']:.2f}")
    evals = dict(s.get("eval_metrics") or {})
    if evals:
        at = evals.pop("step", None)
        parts.append(
            ", ".join(f"{k.removeprefix('eval_')} {v:.4f}" for k, v in evals.items()) + f" (step {at})"
        )
        predictions = run.root / "eval" / f"step-{at}.predictions.jsonl"
        if predictions.exists():
            parts.append(f"predictions {predictions}")
    checkpoint = s.get("latest_checkpoint")
    if checkpoint:
        parts.append(
            f"checkpoint step-{checkpoint['step']} ({time.time() - checkpoint['committed_unix']:.0f} s ago)"
        )
    parts.append(f"updated {time.time() - s.get('updated_unix', time.time()):.0f} s ago")
    return " | ".join(parts)


def deploy(
    config: str, dry_run: bool = False, spot: bool | None = None, secrets_from_env: bool = False
) -> int:
    """Create or reuse the run's RunPod template, network volume and pod `<run>-<workload>`.

    Idempotent: deploying again updates the template only when it changed, reuses the volume and
    a running pod, and starts an exited one again. --dry-run prints the requests and sends nothing.
    Secrets go to the pod as {{ RUNPOD_SECRET_<name> }} references unless --secrets-from-env.
    """
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
        if dry_run:
            shown = sorted(secrets.values(), key=len, reverse=True) if secrets else []
            deploying.deploy(DryRunClient(echo=lambda text: print(redact(text, shown))), cfg, secrets)
            return ExitCode.DONE
        done = deploying.deploy(RunPodClient.from_env(), cfg, secrets)
        print(f"pod {done.pod.name} ({done.pod.id}) {done.action}; supervise it with: "
              f"trainpod supervise {cfg.run} --config {config}")  # fmt: skip
        return ExitCode.DONE

    return _reported(act)


def supervise(run_name: str, config: str | None = None, once: bool = False, volume: str | None = None) -> int:
    """Bring the run's interrupted spot pod back until it is DONE, FAILED or over budget.

    Needs the run's deploy config (--config, else $TRAINPOD_CONFIG). Reads DONE, FAILED and
    status.json from the volume when it is mounted here (--volume, else $TRAINPOD_VOLUME), else
    works from the API alone. --once: one look and one decision (for cron or a CI schedule).
    """
    from trainpod.config import load_config
    from trainpod.config.deploy import DeployConfig
    from trainpod.errors import ConfigError
    from trainpod.runpod.supervise import supervise as supervise_run

    def act() -> int:
        path = config or os.environ.get("TRAINPOD_CONFIG")
        if not path:
            raise ConfigError(
                ["supervise needs the run's deploy config: pass --config configs/deploy/X.yaml"]
            )
        cfg = load_config(DeployConfig, path)
        cfg.run = run_name
        return supervise_run(cfg, Volume(Path(volume)) if volume else Volume.from_env(), once=once)

    return _reported(act)


def stop(run_name: str, terminate: bool = False) -> int:
    """Stop the run's pods (they keep their disk and can start again), or --terminate them."""
    from trainpod.runpod.client import RunPodClient
    from trainpod.runpod.deploy import stop_run

    return _reported(lambda: (stop_run(RunPodClient.from_env(), run_name, terminate), ExitCode.DONE)[1])


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
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes on this machine (one per GPU)")


def _status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_name", nargs="?", metavar="RUN")
    p.add_argument("--volume")


def _deploy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="deploy YAML, e.g. configs/deploy/pretrain-spot.yaml")
    p.add_argument("--dry-run", action="store_true", help="print the requests, send nothing")
    p.add_argument("--spot", dest="spot", action="store_true", default=None, help="an interruptible pod")
    p.add_argument("--on-demand", dest="spot", action="store_false", help="an on-demand pod")
    p.add_argument("--secrets-from-env", action="store_true", help="send this shell's secret values")


def _supervise_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_name", metavar="RUN")
    p.add_argument("--config", help="the run's deploy YAML (default: $TRAINPOD_CONFIG)")
    p.add_argument("--once", action="store_true", help="one look and one decision, then exit")
    p.add_argument("--volume", help="the volume when mounted here (default: $TRAINPOD_VOLUME)")


def _stop_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_name", metavar="RUN")
    p.add_argument("--terminate", action="store_true", help="terminate instead of stop (the pod is gone)")


# The verbs: the one table the parser and the dispatch are built from. A new verb is a function
# (its docstring is its help) and a line here, with the function that declares its arguments.
VERBS: dict[str, tuple[Callable[..., int], Callable[[argparse.ArgumentParser], None] | None]] = {
    "run": (run, _run_arguments),
    "boot": (boot, None),
    "status": (status, _status_arguments),
    "deploy": (deploy, _deploy_arguments),
    "supervise": (supervise, _supervise_arguments),
    "stop": (stop, _stop_arguments),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainpod", description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    for name, (function, arguments) in VERBS.items():
        p = verbs.add_parser(name, help=_summary(function), description=inspect.getdoc(function))
        if arguments is not None:
            arguments(p)
    return parser


def _summary(fn: object) -> str:
    return (inspect.getdoc(fn) or "").split("\n")[0]


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    function, _ = VERBS[args.pop("verb")]
    return int(function(**args))


if __name__ == "__main__":
    sys.exit(main())
