"""What the supervisor (supervise.py) watches and brings back as one: the run's pod, or its Instant Cluster.

    unit = build_unit(client, config)     # PodUnit for nodes: 1, ClusterUnit for nodes > 1
    seen = unit.look(state, unfit_pod)    # up or down, why, what bills now
    unit.bring_back(seen.unfit, fresh_env)   # "started pod X", "created cluster Y (2 nodes)"

A pod is started again, or replaced by a new one on the same volume (deploy.bring_back). A cluster
cannot be started again (REST v2 has no stop or start for clusters, and its member pods are out of
reach of the pod endpoints): any node EXITED, ERROR, TERMINATED, gone, or named by a MACHINE_UNFIT
marker makes the whole cluster down, and it is deleted and created again (cluster.recreate).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from trainpod.config.deploy import DeployConfig
from trainpod.runpod import cluster as clusters
from trainpod.runpod.client import Pod, RunPodClient, RunPodUnavailable
from trainpod.runpod.deploy import bring_back, refuse_beside_a_cluster, secrets_sent_as_values, stop_pod

if TYPE_CHECKING:
    from trainpod.runpod.supervise import SupervisorState

log = logging.getLogger("trainpod.supervise")

UNFIT = "on a machine that cannot run the image (exit 4)"


@dataclass(frozen=True)
class Look:
    up: str | None  # what works, e.g. "pod X is RUNNING"; None when down
    down: str  # why it is down: "EXITED", "gone", "node 1 (pod7) EXITED"
    hourly_usd: float  # what bills now
    unfit: bool = False  # down because a machine cannot run the image: replace, never start again
    secrets_as_values: bool | None = None  # the pods' env holds the secrets' values (None: no pod to tell)
    spot: bool | None = None  # the run's pods are interruptible, as deployed (None: no pod to tell)
    # The run's pod converts after DONE (TRAINPOD_THEN_CONFIG in its env, a deploy's `then`); None: no pod to tell
    converts_after_done: bool | None = None


class Unit(Protocol):
    noun: str  # "pod" or "cluster", for the supervisor's log lines

    def look(self, state: SupervisorState, unfit_pod: str | None) -> Look: ...

    def stop(self, why: str) -> list[str]: ...

    def delete(self, why: str) -> list[str]:
        """Terminate the pods (delete the cluster) seen at the look, for good; the network volume keeps the run."""
        ...

    def bring_back(self, replace: bool, fresh_env: Callable[[], dict[str, str]]) -> str:
        """Start or replace the unit; `fresh_env()` is the env of one made with no old one to copy."""
        ...


def build_unit(client: RunPodClient, config: DeployConfig) -> Unit:
    return ClusterUnit(client, config) if config.nodes > 1 else PodUnit(client, config)


def _price(pod: Pod, config: DeployConfig) -> float:
    return pod.cost_per_hr if pod.cost_per_hr is not None else config.budget.hourly_usd or 0.0


class PodUnit:
    """The pod `<run>-<workload>`: started again when EXITED, a new one when gone or unfit."""

    noun = "pod"

    def __init__(self, client: RunPodClient, config: DeployConfig):
        self.client, self.config = client, config
        self._running: list[Pod] = []
        self._exited: Pod | None = None

    def look(self, state: SupervisorState, unfit_pod: str | None) -> Look:
        pods = self.client.list_pods(name=self.config.pod_name)
        self._running = [p for p in pods if p.desired_status == "RUNNING"]
        self._exited = next((p for p in pods if p.desired_status == "EXITED"), None)
        hourly = sum(_price(p, self.config) for p in self._running)
        as_values = next(
            (v for p in pods if (v := secrets_sent_as_values(self.config, p.env)) is not None), None
        )
        spot = pods[0].interruptible if pods else None
        # An env RunPod did not give ({}) tells nothing.
        converts = bool(pods[0].env.get("TRAINPOD_THEN_CONFIG")) if pods and pods[0].env else None
        if self._running:
            return Look(f"pod {self._running[0].id} is RUNNING", "", hourly, False, as_values, spot, converts)
        unfit = self._exited is not None and self._exited.id == unfit_pod
        down = UNFIT if unfit else "EXITED" if self._exited else "gone"
        return Look(None, down, hourly, unfit, as_values, spot, converts)

    def stop(self, why: str) -> list[str]:
        # A pod gone since the look (it terminated itself at DONE) needs no stop, and ends nothing.
        return [f"stopped pod {pod.id}: {why}" for pod in self._running if stop_pod(self.client, pod)]

    def delete(self, why: str) -> list[str]:
        pods = [*self._running, *([self._exited] if self._exited is not None else [])]
        return [
            f"terminated pod {pod.id}: {why}" for pod in pods if stop_pod(self.client, pod, terminate=True)
        ]

    def bring_back(self, replace: bool, fresh_env: Callable[[], dict[str, str]]) -> str:
        # A YAML changed to nodes: 1 while the run's cluster trains: a pod beside it would train the same run.
        try:
            refuse_beside_a_cluster(self.client, self.config)
        except RunPodUnavailable as exc:
            # v2 (beta, clusters alone) down must not keep a spot pod down: a pod made beside a cluster after all
            # finds the run's lease held, exits 75 as a duplicate and stops itself.
            log.warning(
                "could not look for a cluster of run %s (%s); bringing the pod back", self.config.run, exc
            )
        env = fresh_env() if self._exited is None else None  # else the old pod's env, secrets and all
        pod, action = bring_back(self.client, self.config, self._exited, env=env, replace=replace)
        return f"{action} pod {pod.id}"


class ClusterUnit:
    """The cluster `<run>-<workload>`: whole, coming up, or down and then deleted and created again."""

    noun = "cluster"

    def __init__(self, client: RunPodClient, config: DeployConfig):
        self.client, self.config = client, config
        self._seen = clusters.ClusterLook(None, [], "gone")

    def look(self, state: SupervisorState, unfit_pod: str | None) -> Look:
        seen = self._seen = clusters.look(self.client, self.config, state.whole_cluster)
        as_values = secrets_sent_as_values(self.config, clusters.node_env(seen.nodes))
        return replace(self._look(seen, state, unfit_pod), secrets_as_values=as_values)

    def _look(self, seen: clusters.ClusterLook, state: SupervisorState, unfit_pod: str | None) -> Look:
        # RunPod bills a node from its placement (v2's cost is 0.0 only once EXITED or TERMINATED): one still
        # PROVISIONING or STARTING (pulling the image, maybe for good) counts, as a v1 pod RUNNING while it pulls.
        hourly = sum(
            _price(node, self.config) for node in seen.nodes if node.desired_status in clusters.ALIVE
        )
        if seen.all_running:
            state.whole_cluster = seen.cluster.id  # from now on a missing node means a lost node
        unfit_node = next((n for n in seen.nodes if n.id == unfit_pod), None)
        if unfit_node is not None:
            return Look(None, f"node {clusters.node_label(unfit_node)} {UNFIT}", hourly, unfit=True)
        if seen.cluster is None:
            return Look(
                None, "gone" + (" after a node's exit 4" if unfit_pod else ""), hourly, bool(unfit_pod)
            )
        if seen.broken:
            return Look(None, seen.broken, hourly)
        count = seen.cluster.node_count
        return Look(f"cluster {seen.cluster.id} has {len(seen.running)}/{count} nodes RUNNING", "", hourly)

    def stop(self, why: str) -> list[str]:
        if self._seen.cluster is None:
            return []
        clusters.delete(self.client, self._seen.cluster, why)
        return [f"deleted cluster {self._seen.cluster.id} (every node): {why}"]

    def delete(self, why: str) -> list[str]:
        return self.stop(why)  # v2 has no stop for clusters: stopping one is deleting it

    def bring_back(self, replace: bool, fresh_env: Callable[[], dict[str, str]]) -> str:
        # A YAML changed to nodes > 1 while the run's single pod trains: a cluster beside it would train the same
        # run, its node 0 refused the lease (exit 75) and the cluster made again at every look, as deploy refuses.
        clusters.refuse_beside_a_running_pod(self.client, self.config)
        new = clusters.recreate(self.client, self.config, self._seen, fresh_env)
        old = f"deleted {self._seen.cluster.id} and " if self._seen.cluster is not None else ""
        return f"{old}created cluster {new.id} ({self.config.nodes} nodes)"
