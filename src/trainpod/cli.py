"""The `trainpod` command. Each verb is a function whose docstring is its help.

trainpod run pretrain --config configs/pretrain/tiny.yaml --set train.max_steps=50
trainpod run pretrain --nproc-per-node 2 ...     (one process per GPU, or gloo processes on CPU)
trainpod status RUN
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

from trainpod.config import parse_overrides
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
    """Run a workload (datagen, pretrain) to its end; resumes from the newest checkpoint.

    Flags override the environment: --config over TRAINPOD_CONFIG, --run over TRAINPOD_RUN,
    --volume over TRAINPOD_VOLUME; --set assignments apply after TRAINPOD_SET.
    """
    from trainpod.workloads.lifecycle import RunRequest, execute

    if nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        from trainpod.launch import launch_local

        return launch_local(nproc_per_node, _strip_nproc(sys.argv[1:]))
    request = RunRequest(
        workload=workload,
        config_path=config or os.environ.get("TRAINPOD_CONFIG"),
        overrides=parse_overrides(os.environ.get("TRAINPOD_SET")) + list(set or []),
        run_name=run_name or os.environ.get("TRAINPOD_RUN") or None,
        volume=Volume(Path(volume)) if volume else Volume.from_env(),
    )
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
    return ExitCode.DONE


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
    checkpoint = s.get("latest_checkpoint")
    if checkpoint:
        parts.append(
            f"checkpoint step-{checkpoint['step']} ({time.time() - checkpoint['committed_unix']:.0f} s ago)"
        )
    parts.append(f"updated {time.time() - s.get('updated_unix', time.time()):.0f} s ago")
    return " | ".join(parts)


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainpod", description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("run", help=_summary(run), description=inspect.getdoc(run))
    p.add_argument("workload", choices=["datagen", "pretrain"])
    p.add_argument("--config", help="YAML config (default: $TRAINPOD_CONFIG)")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="config override (repeatable)")
    p.add_argument("--run", dest="run_name", help="run name (default: $TRAINPOD_RUN, else the config's name)")
    p.add_argument("--volume", help="volume root (default: $TRAINPOD_VOLUME, else /workspace)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes on this machine (one per GPU)")
    verbs.add_parser("boot", help=_summary(boot), description=inspect.getdoc(boot))
    p = verbs.add_parser("status", help=_summary(status), description=inspect.getdoc(status))
    p.add_argument("run_name", nargs="?", metavar="RUN")
    p.add_argument("--volume")
    return parser


def _summary(fn: object) -> str:
    return (inspect.getdoc(fn) or "").split("\n")[0]


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    verb = {"run": run, "status": status, "boot": boot}[args.pop("verb")]
    return int(verb(**args))


if __name__ == "__main__":
    sys.exit(main())
