"""Launchers that keep the two guarantees the pod contract needs: signals reach every rank, and the
exit code is the table's (143 preempted, 75 retry, 2 bad input, 3 budget, 4 machine unfit).

torchrun's agent turns a worker's exit code into its own failure code, but the supervisor acts on
the exact code.
- `launch_local`: one process per GPU on this machine, with torchrun's environment (RANK,
  LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT); SIGTERM and SIGINT go to every rank; the ranks' own code.
- `launch_cluster`: one node of a RunPod Instant Cluster. torchrun runs as a CHILD (not exec'd), so
  this process forwards SIGTERM/SIGINT to it, maps the outcome back to the table and `trainpod boot`
  still runs its finish hook. Each rank reports its exit code into a folder of this node
  (TRAINPOD_RANK_EXIT_DIR, written by `python -m trainpod.rank`); `cluster_outcome` reads them.

    python -m trainpod boot      # with NUM_NODES, NODE_RANK, NUM_TRAINERS, PRIMARY_ADDR, PRIMARY_PORT
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from trainpod.preemption import first_signal_seen

log = logging.getLogger(__name__)

RANK_EXIT_DIR_ENV = "TRAINPOD_RANK_EXIT_DIR"
# When ranks disagree, the code the node exits with: a preemption anywhere means "start again"
# (every rank committed or had nothing new), then the verdicts that stop a run, in this order.
# Anything else (a crash, 75, a rank that never reported) is the failed-start path.
CLUSTER_PRIORITY = (143, 3, 2, 4, 5)

# If one rank fails, the others are blocked in a collective: give them this long to notice, then kill.
_PEER_GRACE_S = 10.0
# A RunPod Instant Cluster carries inter-node traffic on ens1-ens8 and the management traffic on eth0, which
# must not carry it (docs.runpod.io/instant-clusters/configuration). NCCL picks an interface by its own
# rules and gloo (the groups of async sharded commits and of rank 0's solo work) the one the host name
# resolves to: both are pointed at the interface holding NODE_ADDR, this node's address on the cluster
# network, unless the pod's environment names one.
SOCKET_INTERFACE_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(nproc: int, argv: list[str]) -> int:
    port = str(_free_port())
    procs = []
    for rank in range(nproc):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "trainpod", *argv], env=env))

    def forward(signum: int, _frame: object) -> None:
        first_signal_seen()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    return _wait(procs)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _wait(procs: list[subprocess.Popen]) -> int:
    first_failure: int | None = None
    failed_at = 0.0
    while any(p.poll() is None for p in procs):
        for proc in procs:
            code = proc.poll()
            if code not in (None, 0) and first_failure is None:
                first_failure, failed_at = _exit_code(code), time.monotonic()
        if first_failure is not None and time.monotonic() - failed_at > _PEER_GRACE_S:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        time.sleep(0.05)
    codes = [_exit_code(p.returncode) for p in procs]
    # A verdict of the table before the first failure in time: a rank 0 that raised (exit 5, a full volume)
    # closes its connections as it leaves, and the rank waiting on it may crash on that (exit 1) first.
    verdict = table_verdict(codes)
    if verdict is not None:
        return verdict
    if first_failure is None:
        first_failure = next((c for c in codes if c != 0), 0)
    return first_failure


def table_verdict(codes: list[int]) -> int | None:
    """The first code of CLUSTER_PRIORITY that one of the ranks exited with, or None."""
    return next((code for code in CLUSTER_PRIORITY if code in codes), None)


def interface_with_address(address: str) -> str | None:
    """The name of this machine's network interface whose IPv4 address is `address`, or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                request = struct.pack("256s", name[:15].encode())
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(answer[20:24]) == address:
            return name
    return None


def cluster_network_env(environ: Mapping[str, str]) -> dict[str, str]:
    """NCCL's and gloo's interface for inter-node traffic: the one holding NODE_ADDR (see
    SOCKET_INTERFACE_VARIABLES), for each of the two the environment does not already name."""
    address = environ.get("NODE_ADDR")
    unset = [name for name in SOCKET_INTERFACE_VARIABLES if not environ.get(name)]
    if not address or not unset:
        return {}
    interface = interface_with_address(address)
    if interface is None:
        log.warning(
            "NODE_ADDR %s is on no network interface of this node: NCCL and gloo choose their own (set "
            "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME to the cluster network's interface, ens1 on RunPod)",
            address,
        )
        return {}
    log.info("inter-node traffic on %s (NODE_ADDR %s): %s", interface, address, ", ".join(unset))
    return dict.fromkeys(unset, interface)


def launch_cluster(nnodes: int, node_rank: int, nproc_per_node: int, master: str, argv: list[str]) -> int:
    """This node's torchrun, as a child: signals forwarded, the ranks' codes mapped to one exit code.

    Static rendezvous (torchrun's default backend): node_rank is honoured, so node 0 holds global
    rank 0, the run's only checkpoint writer, and runs the finish hook. `master` is host:port.
    """
    with tempfile.TemporaryDirectory(prefix="trainpod-ranks-") as exit_dir:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes), "--node_rank", str(node_rank), "--nproc_per_node", str(nproc_per_node),
            "--rdzv_endpoint", master,
            "-m", "trainpod.rank", *argv,
        ]  # fmt: skip
        env = dict(os.environ, **cluster_network_env(os.environ), **{RANK_EXIT_DIR_ENV: exit_dir})
        # In a session of its own, and told of a stop once: torchrun answers its first SIGTERM by stopping its
        # ranks and waiting for them, and a second (tini -g signals boot's whole group, boot forwarded one more)
        # ended that wait with a traceback: boot exited before the ranks had committed, and with PID 1 gone
        # the container's ranks were SIGKILLed mid-commit.
        torchrun = subprocess.Popen(cmd, env=env, start_new_session=True)
        signalled: list[int] = []

        def forward(signum: int, _frame: object) -> None:
            first_signal_seen()
            signalled.append(signum)
            if len(signalled) == 1 and torchrun.poll() is None:
                torchrun.send_signal(signum)  # torchrun passes it on to its ranks

        previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            returncode = _wait_child(torchrun)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        codes = rank_codes(Path(exit_dir))
    return cluster_outcome(codes, nproc_per_node, _exit_code(returncode), preempted=bool(signalled))


def _wait_child(proc: subprocess.Popen) -> int:
    while True:
        try:
            return proc.wait()
        except InterruptedError:  # a forwarded signal interrupted the wait: keep waiting
            continue


def report_rank_exit(code: int, environ: dict[str, str] | None = None) -> None:
    """Called by each rank as it exits (trainpod.rank): its code, for its node's launcher."""
    environ = os.environ if environ is None else environ
    folder = environ.get(RANK_EXIT_DIR_ENV)
    if not folder:
        return
    rank = environ.get("RANK", "0")
    path = Path(folder) / f"rank-{rank}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"rank": int(rank), "code": int(code)}))
    partial.replace(path)  # the launcher reads whole reports or none (a local temp folder, not the volume)


def rank_codes(folder: Path) -> list[int]:
    codes = []
    for path in sorted(folder.glob("rank-*.json")):
        try:
            codes.append(int(json.loads(path.read_text())["code"]))
        except (OSError, ValueError, KeyError):
            continue
    return codes


def cluster_outcome(codes: list[int], expected: int, torchrun_code: int, preempted: bool = False) -> int:
    """One exit code for this node from its ranks' reported codes (see CLUSTER_PRIORITY)."""
    verdict = table_verdict(codes)
    if verdict is not None:
        return verdict
    if len(codes) == expected and all(code == 0 for code in codes):
        return 0
    if preempted:  # SIGTERM reached us and no rank said otherwise: ranks died before their handler
        return 143
    failures = [code for code in codes if code != 0]
    return failures[0] if failures else (torchrun_code or 1)
