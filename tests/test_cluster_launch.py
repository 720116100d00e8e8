"""Multi-node boot: torchrun runs as a child of `trainpod boot` (trainpod.launch.launch_cluster), so
signals are forwarded, the exit code is the table's and node 0 runs the finish hook.

Two "nodes" are two real `trainpod boot` processes on 127.0.0.1 with RunPod's Instant Cluster
variables (NUM_NODES, NODE_RANK, NUM_TRAINERS, PRIMARY_ADDR/PORT), gloo on CPU, one shared volume,
a tiny pretrain. RunPod itself is the fake API (the mock of RunPod).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainpod.launch import cluster_network_env, cluster_outcome

from fake_runpod import api_env, client_for
from support import RUN, TINY_PRETRAIN, child_env, status_step

SHORT = "train.max_steps=16 train.log_every=1 checkpoint.every_steps=4 train.eval_every=8"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(volume: Path, rank: int, port: int, pod_id: str, extra: dict[str, str]) -> subprocess.Popen:
    env = child_env(
        {
            "TRAINPOD_WORKLOAD": "pretrain",
            "TRAINPOD_CONFIG": str(TINY_PRETRAIN),
            "TRAINPOD_VOLUME": str(volume),
            "TRAINPOD_SET": SHORT,
            "NUM_NODES": "2",
            "NODE_RANK": str(rank),
            "NUM_TRAINERS": "1",
            "PRIMARY_ADDR": "127.0.0.1",
            "PRIMARY_PORT": str(port),
            "NODE_ADDR": "127.0.0.1",  # this node's address on the cluster network (here, loopback)
            "RUNPOD_POD_ID": pod_id,
            **extra,
        }
    )
    return subprocess.Popen(
        [sys.executable, "-m", "trainpod", "boot"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def cluster_pods(fake) -> tuple[str, list[str]]:
    """An Instant Cluster of 2 nodes in the fake: its id and its nodes' pod ids by NODE_RANK."""
    body = {"name": f"{RUN}-pretrain", "type": "TRAINING",
            "compute": {"gpuTypeId": "NVIDIA H100 80GB HBM3", "gpuCountPerPod": 1, "podCount": 2}}  # fmt: skip
    cluster = client_for(fake).create_cluster(body)
    fake.requests.clear()
    return cluster.id, [node["id"] for node in fake.nodes_of(cluster.id)]


def test_two_nodes_finish_and_only_node_0_runs_the_finish_hook(volume, fake):
    cluster_id, pods = cluster_pods(fake)
    port = free_port()
    nodes = [start_node(volume, rank, port, pods[rank], api_env(fake)) for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n\n".join(outputs)
    assert (volume / "runs" / RUN / "DONE").is_file()
    assert "2 rank(s)" in outputs[0] + outputs[1], "both nodes joined one world of 2 ranks"
    for output in outputs:  # and met on the interface of NODE_ADDR, not on eth0
        assert (
            "inter-node traffic on lo (NODE_ADDR 127.0.0.1): NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME" in output
        )
    assert not fake.clusters, "node 0 deletes the whole cluster after DONE: no node is left billing"
    assert [r[1] for r in fake.calls("DELETE")] == [f"/v2/clusters/{cluster_id}"], "once, by node 0"
    assert f"asked RunPod to delete this pod's cluster {cluster_id}" in outputs[0]


def test_sigterm_to_both_nodes_commits_and_each_exits_143(volume):
    port = free_port()
    nodes = [start_node(volume, rank, port, f"pod-{rank}", {}) for rank in (0, 1)]
    deadline = time.monotonic() + 240
    while status_step(volume) < 5 and all(node.poll() is None for node in nodes):
        assert time.monotonic() < deadline, "the cluster never reached step 5"
        time.sleep(0.05)
    for node in nodes:  # RunPod stops every pod of an interrupted cluster, each with SIGTERM
        node.send_signal(signal.SIGTERM)
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [143, 143], "\n\n".join(outputs)
    assert (volume / "runs" / RUN / "checkpoints" / "LATEST").is_file(), outputs[0]
    assert not (volume / "runs" / RUN / "DONE").exists()


@pytest.mark.parametrize(
    ("codes", "expected", "torchrun", "preempted", "outcome", "why"),
    [
        ([0, 0], 2, 0, False, 0, "every rank finished"),
        ([143, 1], 2, 1, True, 143, "any rank's 143: start again"),
        ([0, 3], 2, 1, False, 3, "budget spent"),
        ([2, 2], 2, 1, False, 2, "bad config"),
        ([75, 0], 2, 1, False, 75, "a temporary failure: the failed-start path"),
        ([], 2, 1, False, 1, "no rank reported (rendezvous failed): the failed-start path"),
        ([0], 2, 0, False, 1, "a rank died without a report"),
        ([], 2, 1, True, 143, "SIGTERM before any rank had a handler"),
    ],
)
def test_the_nodes_exit_code_follows_the_table(codes, expected, torchrun, preempted, outcome, why):
    assert cluster_outcome(codes, expected, torchrun, preempted=preempted) == outcome, why


def test_one_machines_ranks_exit_with_the_tables_verdict_not_with_the_first_crash() -> None:
    """Rank 0 raises (a full volume, exit 5) and closes its connections as it leaves; rank 1, waiting on it,
    crashes on the closed connection (exit 1) before rank 0 has exited. The run's code is rank 0's 5 (FAILED,
    the pod stopped), not the 1 of a failed start that the supervisor retries on the same full volume."""
    from trainpod.launch import _wait

    crash_first = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    verdict_later = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(1); raise SystemExit(5)"]
    )
    assert _wait([verdict_later, crash_first]) == 5
    crash_only = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    assert _wait([crash_only, subprocess.Popen([sys.executable, "-c", "pass"])]) == 1


def test_nccl_and_gloo_are_pointed_at_the_interface_of_node_addr_unless_the_pod_names_one():
    """RunPod's cluster network is on ens1-ens8, eth0 must not carry inter-node traffic, and gloo would take
    the interface its host name resolves to. Here the machine's own loopback stands in for ens1."""
    both = {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    assert cluster_network_env({"NODE_ADDR": "127.0.0.1"}) == both
    assert cluster_network_env({"NODE_ADDR": "127.0.0.1", "NCCL_SOCKET_IFNAME": "ens2"}) == {
        "GLOO_SOCKET_IFNAME": "lo"
    }, "a choice of the pod's environment stands"
    assert cluster_network_env({"NODE_ADDR": "192.0.2.1"}) == {}, (
        "an address on no interface: their own choice"
    )
    assert cluster_network_env({}) == {}, "no cluster network named"


# Stands in for torchrun: counts the SIGTERMs it gets. The real one answers its first by stopping its workers
# and waiting for them; a second breaks off that wait (torch's handler raises again), so it exits before them.
_COUNTING_TORCHRUN = """
import os, signal, sys, time
received = []
signal.signal(signal.SIGTERM, lambda *_: received.append(1))
mask = lambda: int(next(l for l in open(f"/proc/{os.getppid()}/status") if l.startswith("SigCgt:")).split()[1], 16)
while not mask() & (1 << (signal.SIGTERM - 1)):  # until the launcher handles SIGTERM: the test's cue
    time.sleep(0.01)
open(sys.argv[1] + ".ready", "w").close()
while not received:
    time.sleep(0.01)
time.sleep(2)  # a second SIGTERM, forwarded by the launcher, comes within milliseconds
open(sys.argv[1], "w").write(str(len(received)))
"""
_LAUNCHER = """
import subprocess, sys
from trainpod import launch
popen = subprocess.Popen
launch.subprocess.Popen = lambda cmd, **kw: popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], **kw)
print("exit", launch.launch_cluster(2, 0, 1, "127.0.0.1:29500", ["run", "pretrain"]))
"""


def test_a_stops_sigterm_to_boots_process_group_reaches_torchrun_once(tmp_path):
    """The image's PID 1 is `tini -g`: a stop's SIGTERM reaches boot's whole process group. torchrun, in that
    group, got it from tini and once more from boot's forward, and the second one ended torchrun before its
    ranks had committed; boot then exited, and with PID 1 gone the container's ranks were SIGKILLed."""
    count = tmp_path / "sigterms"
    node = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, _COUNTING_TORCHRUN, str(count)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a group of its own, as boot's under tini
    )
    deadline = time.monotonic() + 60
    while not Path(f"{count}.ready").exists():
        assert node.poll() is None and time.monotonic() < deadline, node.communicate()[0]
        time.sleep(0.01)
    os.killpg(node.pid, signal.SIGTERM)  # as tini -g passes RunPod's SIGTERM on
    output = node.communicate(timeout=60)[0]
    assert "exit 143" in output, output
    assert count.read_text() == "1", "torchrun got the stop's SIGTERM more than once"


@pytest.mark.parametrize(("exit_with", "code"), [("None", 0), ("3", 3), ("'a message'", 1)])
def test_a_rank_that_calls_sys_exit_reports_the_code_python_exits_with(tmp_path, exit_with, code):
    """A rank's sys.exit() (a library ending a finished run so) was reported as 2, bad input: the node's
    launcher marked a run that had succeeded FAILED. It is reported as Python exits: 0, the int, or 1."""
    program = (
        "import runpy, trainpod.cli as cli\n"
        f"def main(argv): raise SystemExit({exit_with})\n"
        "cli.main = main\n"
        "runpy.run_module('trainpod.rank', run_name='__main__')\n"
    )
    env = child_env({"TRAINPOD_RANK_EXIT_DIR": str(tmp_path), "RANK": "1"})
    ran = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == code, ran.stderr
    assert json.loads((tmp_path / "rank-1.json").read_text()) == {"rank": 1, "code": code}
