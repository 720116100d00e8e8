"""A run on several nodes: one RunPod Instant Cluster (REST v2), created, judged and replaced as one unit.

    trainpod deploy configs/deploy/pretrain-cluster.yaml --dry-run    # prints POST /v2/clusters, sends nothing

A deploy config with `nodes: N` (N > 1) becomes `POST /v2/clusters`: N identical on-demand pods of
`pod.gpu_count` GPUs (`pod.gpu_types` tried in order, one type per cluster), placed in the volume's
data center with the network volume mounted on every node, the same image, entrypoint and env. RunPod
adds the cluster's variables (NUM_NODES, NODE_RANK, NUM_TRAINERS, PRIMARY_ADDR, PRIMARY_PORT, ...)
and every node's `trainpod boot` starts torchrun from them (boot.py).

v2 can neither stop nor restart a cluster, nor touch its member pods through the pod endpoints: a
cluster is whole (every node PROVISIONING, STARTING or RUNNING) or broken (a node EXITED, ERROR,
TERMINATED, or missing after the cluster was seen whole), and a broken one is deleted and created again
on the same volume with its nodes' env. This module speaks in clusters; HTTP lives in client.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainpod.config.deploy import DeployConfig, cluster_problems
from trainpod.errors import ConfigError
from trainpod.runpod.client import (
    Cluster,
    NetworkVolume,
    Pod,
    RunPodAuthError,
    RunPodClient,
    RunPodError,
    RunPodNoCapacity,
    RunPodNotFound,
    RunPodUnavailable,
)

log = logging.getLogger("trainpod.deploy")

GATEWAY_ERRORS = (502, 504)  # a proxy in front of RunPod answered: what RunPod did behind it is unknown
ALIVE = ("PROVISIONING", "STARTING", "RUNNING")  # v2 PodStatus values of a node that is coming or working
# What RunPod itself puts into a node's environment (docs/runpod/runpod-platform.md): a recreated
# cluster gets its own, so these never travel from an old node's env into the new cluster's request.
PLATFORM_VARIABLES = frozenset(
    {
        "PRIMARY_ADDR", "MASTER_ADDR", "PRIMARY_PORT", "MASTER_PORT", "NODE_ADDR", "NODE_RANK", "NUM_NODES",
        "NUM_TRAINERS", "WORLD_SIZE", "PUBLIC_KEY", "CUDA_VERSION", "PYTORCH_VERSION",
    }
)  # fmt: skip


@dataclass(frozen=True)
class ClusterDeployment:
    volume: NetworkVolume
    cluster: Cluster
    action: str  # created, recreated or reused

    def summary(self) -> str:
        return (
            f"cluster {self.cluster.name} ({self.cluster.id}, {self.cluster.node_count} nodes) {self.action}"
        )


@dataclass(frozen=True)
class ClusterLook:
    """One look at the run's cluster: the cluster (None when gone), its nodes, and why it is broken."""

    cluster: Cluster | None
    nodes: list[Pod]
    broken: str | None  # None: whole (or still coming up)

    @property
    def whole(self) -> bool:
        return self.cluster is not None and self.broken is None

    @property
    def running(self) -> list[Pod]:
        return [node for node in self.nodes if node.desired_status == "RUNNING"]

    @property
    def all_running(self) -> bool:
        return self.whole and len(self.running) == self.cluster.node_count


def cluster_body(config: DeployConfig, volume_id: str, gpu_type: str, env: dict[str, str]) -> dict[str, Any]:
    """A CreateClusterRequest: `config.nodes` nodes of `gpu_type` on the network volume, one data center."""
    from trainpod.runpod.deploy import IMAGE_ROOT

    return {
        "name": config.pod_name,
        "type": "TRAINING",
        "compute": {"gpuTypeId": gpu_type, "gpuCountPerPod": config.pod.gpu_count, "podCount": config.nodes},
        "dataCenterIds": [config.volume.data_center],  # the volume attaches only in its data center
        "mounts": {"network": [{"volumeId": volume_id, "path": config.volume.mount_path}]},
        "image": config.image.name,
        "args": f"{IMAGE_ROOT}/entrypoints/{config.workload}",  # the image's tini runs it, as dockerStartCmd does
        "disk": config.pod.container_disk_gb,
        "ports": list(config.pod.ports),
        "startSsh": "22/tcp" in config.pod.ports,  # PUBLIC_KEY on every node: boot's key-only sshd
        "env": env,
    }


def check_cluster_config(config: DeployConfig) -> None:
    """ConfigError (exit 2) for what a cluster cannot do; again here because --spot changes the config."""
    problems = cluster_problems(config)
    if problems:
        raise ConfigError(problems)


def look(client: RunPodClient, config: DeployConfig, whole_before: str | None = None) -> ClusterLook:
    """The run's cluster `<run>-<workload>` and its nodes. A node missing from a cluster seen whole
    before (`whole_before` is its id) makes it broken; while it was never whole, it is still coming up."""
    clusters = client.list_clusters(name=config.pod_name)
    if not clusters:
        return ClusterLook(None, [], "gone")
    cluster = clusters[0]
    seen_whole = whole_before == cluster.id
    try:
        members = client.cluster_pods(cluster.id)
    except RunPodNotFound:  # deleted since it was listed (node 0 deletes its cluster at DONE or exit 4)
        return ClusterLook(None, [], "gone")
    nodes = sorted(members, key=lambda p: (p.node_rank is None, p.node_rank or 0))
    dead = [p for p in nodes if p.desired_status not in ALIVE]
    if dead:
        return ClusterLook(cluster, nodes, f"node {node_label(dead[0])} {dead[0].desired_status}")
    if len(nodes) < cluster.node_count and seen_whole:
        return ClusterLook(
            cluster, nodes, f"{cluster.node_count - len(nodes)} of {cluster.node_count} nodes gone"
        )
    return ClusterLook(cluster, nodes, None)


def node_label(node: Pod) -> str:
    """`1 (pod0007)`: its NODE_RANK and pod id."""
    return f"{'?' if node.node_rank is None else node.node_rank} ({node.id})"


def node_env(nodes: list[Pod]) -> dict[str, str] | None:
    """The env the nodes were created with (a node's, less RunPod's own variables), or None without nodes."""
    for node in nodes:
        if node.env:
            return {
                k: v
                for k, v in node.env.items()
                if k not in PLATFORM_VARIABLES and not k.startswith("RUNPOD_")
            }
    return None


def create(client: RunPodClient, config: DeployConfig, volume_id: str, env: dict[str, str]) -> Cluster:
    """Create the cluster with the first GPU type RunPod accepts, in the config's order."""
    refusals = []
    for gpu_type in config.pod.gpu_types:
        try:
            return client.create_cluster(cluster_body(config, volume_id, gpu_type, env))
        except RunPodAuthError:
            raise
        except RunPodError as exc:
            if _outcome_unknown(exc):
                # RunPod may have made this one: asking for the next GPU type would rent a second cluster
                # beside it. The caller's next look by name finds it (or finds nothing and creates it).
                raise
            refusals.append(exc)
            log.info(
                "cluster of %d x %s refused (%s); trying the next GPU type",
                config.nodes,
                gpu_type,
                exc.status,
            )
    # A refusal for the request itself (a rule one GPU type breaks) is the user's to fix; else no machines are free.
    raise next((r for r in refusals if not isinstance(r, RunPodNoCapacity)), None) or no_capacity(
        config, refusals[-1]
    )


def no_capacity(config: DeployConfig, exc: RunPodError) -> RunPodNoCapacity:
    """No GPU type of `config` had `config.nodes` machines free: exit 75 saying so and the ways on."""
    return RunPodNoCapacity(
        f"no capacity: RunPod has no {config.nodes} nodes free now for an Instant Cluster of {config.nodes} nodes x "
        f"{config.pod.gpu_count} x any of pod.gpu_types {list(config.pod.gpu_types)} in {config.volume.data_center} "
        f"(the network volume's data center) ({exc.status} to POST /v2/clusters, each type: no instances "
        "available). Nothing of the cluster was made and the config is fine: deploy again later, or `trainpod "
        f"supervise {config.run} --config ...`, which tries again with backoff; or widen the choice: more GPU types "
        "in pod.gpu_types, fewer nodes or GPUs per node, or a volume in another data center (volume.name and "
        "volume.data_center: a new volume there; the run's checkpoints stay on this one)",
        exc.status,
    )


def _outcome_unknown(exc: RunPodError) -> bool:
    """No answer from RunPod itself (a timeout, a dropped connection, a gateway's 502 or 504): the
    create may have been done. A 500 with RunPod's own answer (no capacity) is a refusal."""
    return isinstance(exc, RunPodUnavailable) and exc.status in (None, *GATEWAY_ERRORS)


def delete(client: RunPodClient, cluster: Cluster, why: str) -> None:
    """Delete it; one already gone is fine (node 0 deletes its cluster at DONE while the supervisor looks)."""
    try:
        client.delete_cluster(cluster.id)
    except RunPodNotFound:
        log.info("cluster %s (%s) was already deleted", cluster.name, cluster.id)
        return
    log.info("deleted cluster %s (%s, every node terminated; the volume keeps the run): %s", cluster.name,
             cluster.id, why)  # fmt: skip


def recreate(
    client: RunPodClient, config: DeployConfig, seen: ClusterLook, fresh_env: Callable[[], dict[str, str]]
) -> Cluster:
    """Delete the broken cluster (if any) and create it again: same volume, the old nodes' env (else
    `fresh_env()`: the config's, with the secrets as the run's pods had them)."""
    from trainpod.runpod.deploy import ensure_volume

    old_volume = next((n.network_volume_id for n in seen.nodes if n.network_volume_id), None)
    volume_id = old_volume or ensure_volume(client, config).id
    env = node_env(seen.nodes) or fresh_env()
    if seen.cluster is not None:
        delete(client, seen.cluster, seen.broken or "replaced")
    return create(client, config, volume_id, env)


def deploy_cluster(
    client: RunPodClient,
    config: DeployConfig,
    secret_values: dict[str, str] | None = None,
    accepted: Callable[[], None] = lambda: None,
) -> ClusterDeployment:
    """Volume and cluster of `config`: a whole cluster of that name is reused (what of it differs from `config`
    said in a warning), a broken one recreated.
    `accepted`: called once nothing refuses the deploy any more, before anything is made (deploy.deploy)."""
    from trainpod.runpod.deploy import ensure_volume, pod_env, refuse_another_volume

    check_cluster_config(config)
    env = pod_env(config, secret_values)  # first: a config with too many variables sends nothing
    seen = look(client, config)
    # Before a new volume is made, or a broken cluster made again there (the run over, from nothing).
    refuse_another_volume(client, config, seen.nodes)
    refuse_beside_a_running_pod(client, config)
    accepted()
    volume = ensure_volume(client, config)
    if seen.whole:
        log.info("cluster %s (%s) is up: reusing it", seen.cluster.name, seen.cluster.id)
        changes = differences(seen, config, env)
        if changes:  # never replaced while it trains; but the user must know the new config is not running
            log.warning("cluster %s (%s) was made from another config (its %s differ): it goes on as it is; to run "
                        "this config, `trainpod stop %s` (which deletes the cluster; the volume keeps the run) and "
                        "deploy again (it resumes from the last checkpoint)", seen.cluster.name, seen.cluster.id,
                        ", ".join(changes), config.run)  # fmt: skip
        return ClusterDeployment(volume, seen.cluster, "reused")
    action = "created" if seen.cluster is None else "recreated"
    if seen.cluster is not None:
        delete(client, seen.cluster, seen.broken or "broken")
    cluster = create(client, config, volume.id, env)
    log.info("cluster %s (%s, %d nodes) %s", cluster.name, cluster.id, config.nodes, action)
    return ClusterDeployment(volume, cluster, action)


def refuse_beside_a_running_pod(client: RunPodClient, config: DeployConfig) -> None:
    """ConfigError (exit 2) while the run's single pod (deployed with nodes: 1) is RUNNING: a cluster beside it
    would train the same run, its node 0 refused the run's lease (exit 75, a duplicate) and the cluster deleted,
    then made again by a supervisor at every look (the pod's steps are progress), every node pulling the image."""
    pod = next((p for p in client.list_pods(name=config.pod_name) if p.desired_status == "RUNNING"), None)
    if pod is None:
        return
    raise ConfigError(
        [
            f"nodes={config.nodes}: pod {pod.name} ({pod.id}) is training run {config.run} (deployed with nodes: 1) "
            f"and a cluster beside it would train the same run; `trainpod stop {config.run}` first, then deploy "
            "again: the cluster resumes from the last checkpoint"
        ]
    )


def differences(seen: ClusterLook, config: DeployConfig, env: dict[str, str]) -> list[str]:
    """What the cluster runs otherwise than `config` (with the nodes' `env`) asks for, by name only (an env may
    hold secrets' values); what RunPod does not say (0, empty) is no difference."""
    cluster, nodes_env = seen.cluster, node_env(seen.nodes)
    images = {node.image for node in seen.nodes if node.image}
    differs = {
        "image": bool(images) and images != {config.image.name},
        "env": nodes_env is not None and nodes_env != env,
        "node count": bool(cluster.node_count) and cluster.node_count != config.nodes,
        "GPU count": bool(cluster.gpu_count_per_pod) and cluster.gpu_count_per_pod != config.pod.gpu_count,
        "GPU type": bool(cluster.gpu_type_id) and cluster.gpu_type_id not in config.pod.gpu_types,
    }
    return [name for name, different in differs.items() if different]


def cluster_line(cluster: Cluster) -> str:
    """`trainpod status`: the cluster, its shape and its nodes' states."""
    states = ", ".join(f"{count} {status}" for status, count in sorted(cluster.members_by_status.items()))
    return (f"  cluster {cluster.name} ({cluster.id}): {cluster.node_count} nodes x {cluster.gpu_count_per_pod} x "
            f"{cluster.gpu_type_id} | nodes {states or 'none yet'}")  # fmt: skip


def delete_run_clusters(client: RunPodClient, names: set[str]) -> list[Cluster]:
    """Delete every cluster of a run (its `<run>-<workload>` names): `trainpod stop` (a cluster cannot be
    stopped, only deleted)."""
    clusters = [c for c in client.list_clusters() if c.name in names]
    for cluster in clusters:
        delete(client, cluster, "trainpod stop")  # one node 0 deleted meanwhile (at DONE) is no error
    return clusters
