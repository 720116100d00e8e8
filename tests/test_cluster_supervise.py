"""The supervisor treats a run's Instant Cluster as one unit, against the fake RunPod API (the mock of
RunPod, serving and validating REST v2 clusters). The nodes' work is simulated by writing what the
workload writes (DONE, status.json, FAILED, MACHINE_UNFIT) into a tmp volume; an injected clock makes
backoff and cost instant: no test sleeps."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trainpod import atomic
from trainpod.config.deploy import DeployConfig
from trainpod.errors import ConfigError
from trainpod.runpod.deploy import deploy
from trainpod.runpod.finish import FAILED_MARKER, UNFIT_MARKER, after_workload
from trainpod.runpod.supervise import Supervisor, SupervisorState
from trainpod.volume import Volume

from fake_runpod import api_env, client_for

GPUS = ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
NAME = "big-pretrain"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def cluster_config(**supervise) -> DeployConfig:
    return DeployConfig.model_validate(
        {
            "run": "big",
            "workload": "pretrain",
            "config": "configs/pretrain/tiny.yaml",
            "nodes": 2,
            "image": {"name": "ghcr.io/org/trainpod:0.1.0"},
            "pod": {"gpu_types": GPUS, "gpu_count": 8, "spot": False},
            "volume": {"name": "vol", "data_center": "EU-RO-1"},
            "budget": {"budget_usd": 100},
            "supervise": {"backoff_s": 30, "max_failed_starts": 3, **supervise},
        }
    )


@pytest.fixture
def volume(tmp_path: Path) -> Volume:
    vol = Volume(tmp_path / "volume")
    vol.run("big").create()
    return vol


def supervisor(fake, volume, clock=None, **policy) -> Supervisor:
    state = volume.run("big").root / "supervise.json"
    return Supervisor(
        client_for(fake),
        cluster_config(**policy),
        volume,
        state,
        clock=clock or Clock(),
        sleep=lambda s: None,
    )


def the_cluster(fake) -> dict:
    (cluster,) = fake.clusters_named(NAME)
    return cluster


def test_a_whole_cluster_is_left_alone_and_deleted_at_done(fake, volume, caplog):
    deploy(client_for(fake), cluster_config())
    cluster_id = the_cluster(fake)["id"]
    sup = supervisor(fake, volume)
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() is None
    assert f"cluster {cluster_id} has 2/2 nodes RUNNING (spent $0.00); nothing to do" in caplog.text
    atomic.write_json(volume.run("big").done, {"step": 40})
    assert sup.step() == 0
    assert not fake.clusters and not fake.nodes, "DONE deletes the cluster: every node stops billing"
    assert fake.calls("DELETE", f"/v2/clusters/{cluster_id}")
    assert "run is DONE; supervising ends" in caplog.text


def test_a_node_exited_recreates_the_whole_cluster_on_the_same_volume_with_the_same_env(fake, volume, caplog):
    secrets = {"HF_TOKEN": "hf_shellvalue1", "WANDB_API_KEY": "wandb_shellvalue2"}
    deploy(client_for(fake), cluster_config(), secret_values=secrets)  # --secrets-from-env: values, not refs
    first = the_cluster(fake)
    (old_node, old_node_1) = fake.nodes_of(first["id"])
    sup = supervisor(fake, volume)
    assert sup.step() is None
    fake.interrupt_node(first["id"], 1)
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() is None
    new = the_cluster(fake)
    assert new["id"] != first["id"] and first["id"] not in fake.clusters, "the broken cluster is deleted"
    assert len(fake.nodes_of(new["id"])) == 2 and len(fake.nodes) == 2, "no node of the old cluster is left"
    for node in fake.nodes_of(new["id"]):
        assert node["mounts"] == old_node["mounts"], "the same network volume on every node"
        assert node["env"] == old_node["env"] and node["env"]["HF_TOKEN"] == "hf_shellvalue1"
    assert new["compute"] == first["compute"]
    assert f"cluster node 1 ({old_node_1['id']}) EXITED and the run not DONE" in caplog.text
    assert f"deleted {first['id']} and created cluster {new['id']} (2 nodes) (restart 1/50)" in caplog.text


def test_a_node_lost_after_the_cluster_was_whole_is_an_interruption(fake, volume, caplog):
    deploy(client_for(fake), cluster_config())
    first = the_cluster(fake)["id"]
    sup = supervisor(fake, volume)
    assert sup.step() is None  # seen whole: every node RUNNING
    fake.lose_node(first, 1)
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() is None
    assert the_cluster(fake)["id"] != first and "1 of 2 nodes gone" in caplog.text


def test_a_cluster_still_coming_up_with_a_node_missing_is_waited_for(fake, volume, caplog):
    deploy(client_for(fake), cluster_config())
    first = the_cluster(fake)["id"]
    fake.lose_node(first, 1)  # never seen whole: RunPod may still be placing it
    caplog.set_level(logging.INFO, "trainpod")
    assert supervisor(fake, volume).step() is None
    assert the_cluster(fake)["id"] == first and not fake.calls("DELETE")
    assert f"cluster {first} has 1/2 nodes RUNNING" in caplog.text


def test_a_gone_cluster_is_created_again(fake, volume):
    deploy(client_for(fake), cluster_config())
    client_for(fake).delete_cluster(the_cluster(fake)["id"])
    assert supervisor(fake, volume).step() is None
    assert len(fake.nodes_of(the_cluster(fake)["id"])) == 2


def test_a_cluster_deleted_between_its_listing_and_its_nodes_is_gone_not_the_end_of_supervising(
    fake, volume, caplog
):
    """Node 0 exits 4 and deletes its cluster while the supervisor looks: the cluster is in the list,
    its nodes are a 404 a moment later. The supervisor goes on and replaces it."""
    deploy(client_for(fake), cluster_config())
    cluster_id = the_cluster(fake)["id"]
    node_0 = fake.nodes_of(cluster_id)[0]["id"]
    atomic.write_json(volume.run("big").root / UNFIT_MARKER, {"pod_id": node_0, "unix": 1.0})
    handle = fake.handle

    def node_0_deletes_it_meanwhile(method, raw_path, headers, raw_body):
        answer = handle(method, raw_path, headers, raw_body)
        if method == "GET" and raw_path == "/v2/clusters" and cluster_id in fake.clusters:
            fake._deleteCluster({}, {}, None, id=cluster_id)
        return answer

    fake.handle = node_0_deletes_it_meanwhile
    caplog.set_level(logging.INFO, "trainpod")
    assert supervisor(fake, volume).step() is None
    assert "gone after a node's exit 4" in caplog.text
    assert the_cluster(fake)["id"] != cluster_id, "replaced by a new cluster"


def test_recreations_are_bounded_by_max_restarts(fake, volume, caplog):
    deploy(client_for(fake), cluster_config())
    sup = supervisor(fake, volume, max_restarts=2)
    for _ in range(2):
        fake.interrupt_node(the_cluster(fake)["id"], 0, status="ERROR")
        assert sup.step() is None
    fake.interrupt_node(the_cluster(fake)["id"], 0, status="ERROR")
    creates = len(fake.calls("POST", "/v2/clusters"))
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() == 2
    assert len(fake.calls("POST", "/v2/clusters")) == creates, "no third recreation"
    assert "2 restarts reached supervise.max_restarts" in caplog.text


def test_failed_creations_try_every_gpu_type_back_off_and_end_with_75(fake, volume, caplog):
    deploy(client_for(fake), cluster_config())
    fake.create_outage = True  # RunPod having trouble; a shortage is waited out (the next test)
    fake.interrupt_node(the_cluster(fake)["id"], 1)
    clock = Clock()
    sup = supervisor(fake, volume, clock)
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() is None and "cluster node 1" in caplog.text and "next attempt in 30 s" in caplog.text
    bodies = [body for (_, _, body) in fake.calls("POST", "/v2/clusters")[1:]]
    assert {b["compute"]["gpuTypeId"] for b in bodies} == set(GPUS), "each GPU type in the config's order"
    assert not fake.clusters, "the broken cluster was deleted before the new one was asked for"
    clock.now += 10
    assert sup.step() is None and "no cluster running; next start attempt in 20 s" in caplog.text
    clock.now += 20
    assert sup.step() is None and "cluster gone and no start possible" in caplog.text
    clock.now += 60
    assert sup.step() == 75 and "3 failed starts in a row" in caplog.text


def test_no_free_machine_for_any_gpu_type_is_waited_out_not_an_end(fake, volume, caplog):
    """A shortage of every GPU type ended supervising after max_failed_starts (exit 75), leaving the run down."""
    deploy(client_for(fake), cluster_config())
    fake.no_capacity.update(GPUS)
    fake.interrupt_node(the_cluster(fake)["id"], 1)
    clock = Clock()
    sup = supervisor(fake, volume, clock)
    caplog.set_level(logging.INFO, "trainpod")
    attempts = 0
    for _ in range(6):
        caplog.clear()
        assert sup.step() is None, caplog.text
        assert "no machine free" in caplog.text and "as long as it takes" in caplog.text, caplog.text
        attempts += 1
        clock.now += int(caplog.text.split("next attempt in ")[1].split(" s")[0])
    assert attempts > 3, "more than max_failed_starts"
    fake.no_capacity.clear()
    clock.now += 3600
    caplog.clear()
    assert sup.step() is None and fake.clusters, caplog.text


def test_the_budget_counts_every_node_and_deletes_the_cluster_when_spent(fake, volume):
    deploy(client_for(fake), cluster_config())
    clock = Clock()
    sup = supervisor(fake, volume, clock)
    assert sup.step() is None
    clock.now += 3 * 3600  # 2 nodes x 8 GPUs x $2.00 = $32/h: $96 of $100
    assert sup.step() is None
    clock.now += 600
    assert sup.step() == 3
    assert not fake.clusters


def test_nodes_still_coming_up_bill_and_count_against_the_budget(fake, volume, caplog):
    """RunPod bills a node from the moment it is placed (v2's Pod.cost is 0.0 only when EXITED or
    TERMINATED): a cluster whose nodes stay STARTING (an image pull that never ends) spends the budget too."""
    deploy(client_for(fake), cluster_config())
    cluster_id = the_cluster(fake)["id"]
    for node in fake.nodes_of(cluster_id):
        node["status"] = "STARTING"  # pulling the image; RunPod's cost stays $16/h a node
    clock = Clock()
    sup = supervisor(fake, volume, clock)
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() is None and f"cluster {cluster_id} has 0/2 nodes RUNNING" in caplog.text
    clock.now += 4 * 3600  # 2 nodes x 8 GPUs x $2.00 = $32/h: $128 of $100
    assert sup.step() == 3, "the nodes billed for four hours: the budget is spent"
    assert not fake.clusters, "the cluster is deleted: no node goes on billing"


def test_a_failed_run_deletes_the_cluster_and_is_not_restarted(fake, volume):
    deploy(client_for(fake), cluster_config())
    atomic.write_json(volume.run("big").root / FAILED_MARKER, {"reason": "bad config or input (exit 2)"})
    assert supervisor(fake, volume).step() == 2
    assert not fake.clusters and len(fake.calls("POST", "/v2/clusters")) == 1


def node_exits_4(fake, volume, rank: int) -> None:
    """What `trainpod boot` on that node does after its host check exits 4: the in-pod finish hook."""
    cluster_id = the_cluster(fake)["id"]
    node = fake.nodes_of(cluster_id)[rank]
    env = {**api_env(fake), "RUNPOD_POD_ID": node["id"], "NUM_NODES": "2", "NODE_RANK": str(rank)}
    assert after_workload(4, volume.run("big"), env, "pretrain") == 4


def test_exit_4_on_a_node_recreates_the_cluster_and_replacements_in_a_row_are_bounded(fake, volume, caplog):
    deploy(client_for(fake), cluster_config())
    sup = supervisor(fake, volume, max_replacements=1)
    first = the_cluster(fake)["id"]
    node_exits_4(fake, volume, 1)
    assert list(fake.clusters) == [first], "node 1 leaves the cluster to node 0 and the supervisor"
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() is None
    assert (
        the_cluster(fake)["id"] != first and "on a machine that cannot run the image (exit 4)" in caplog.text
    )
    assert not (volume.run("big").root / UNFIT_MARKER).exists(), (
        "the marker named the replaced cluster's node"
    )
    node_exits_4(fake, volume, 0)  # node 0 of the new cluster: it deletes the whole cluster itself
    assert not fake.clusters
    creates = len(fake.calls("POST", "/v2/clusters"))
    assert sup.step() == 4
    assert len(fake.calls("POST", "/v2/clusters")) == creates
    assert "1 new clusters in a row landed on machines that cannot run the image" in caplog.text


def test_a_cluster_node_0_deleted_between_the_supervisors_look_and_its_delete_is_no_error(fake, volume):
    deploy(client_for(fake), cluster_config())
    sup = supervisor(fake, volume)
    cluster_id = the_cluster(fake)["id"]
    assert sup.unit.look(SupervisorState(), None).up, "the supervisor sees the cluster ..."
    client_for(fake).delete_cluster(cluster_id)  # ... and node 0 deletes it at DONE
    assert sup.unit.stop("the run is DONE") == [f"deleted cluster {cluster_id} (every node): the run is DONE"]
    atomic.write_json(volume.run("big").done, {"step": 40})
    assert sup.step() == 0


def test_a_gone_cluster_deployed_with_secret_values_is_created_again_with_them(fake, volume, monkeypatch):
    secrets = {"HF_TOKEN": "hf_shellvalue1", "WANDB_API_KEY": "wandb_shellvalue2"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)  # the supervisor's own environment: where the values come from
    deploy(client_for(fake), cluster_config(), secret_values=secrets)
    sup = supervisor(fake, volume)
    assert sup.step() is None
    client_for(fake).delete_cluster(the_cluster(fake)["id"])  # every node gone: no env to copy
    assert sup.step() is None
    for node in fake.nodes_of(the_cluster(fake)["id"]):
        assert {n: node["env"][n] for n in secrets} == secrets, "the new cluster lost the secrets' values"


def test_a_supervisor_of_the_cluster_config_makes_no_cluster_beside_the_runs_running_pod(fake, volume):
    """nodes changed to 2 in the YAML a supervisor reads while the run's single pod trains (deploy refuses it, a
    supervisor did not): its look found no cluster and made one beside the pod, two trainers on one run, every
    node refused the run's lease (exit 75, a duplicate) and billed while it pulled the image, made again at each
    look. It is now refused as deploy refuses it: exit 2 naming the pod, nothing made."""
    single = cluster_config()
    single.nodes = 1
    pod = deploy(client_for(fake), single).pod
    with pytest.raises(ConfigError) as refused:
        supervisor(fake, volume).step()
    assert refused.value.exit_code == 2
    assert not fake.calls("POST", "/v2/clusters") and not fake.clusters, "no cluster made beside the pod"
    assert f"pod {NAME} ({pod.id})" in str(refused.value) and "trainpod stop big" in str(refused.value)
    fake.interrupt(pod.id)  # stopped: a cluster may take the run over from its checkpoints
    assert supervisor(fake, volume).step() is None and len(fake.clusters_named(NAME)) == 1


def test_a_supervisor_of_the_single_pod_config_makes_no_pod_beside_the_runs_cluster(fake, volume):
    """The other way round: nodes back to 1 while the run's cluster trains; a pod beside it would train the run."""
    cluster = deploy(client_for(fake), cluster_config()).cluster
    single = cluster_config()
    single.nodes = 1
    sup = Supervisor(client_for(fake), single, volume, volume.run("big").root / "supervise.json",
                     clock=Clock(), sleep=lambda s: None)  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        sup.step()
    assert not fake.calls("POST", "/pods") and not fake.pods, "no pod made beside the cluster"
    assert f"Instant Cluster {NAME} ({cluster.id}, 2 nodes)" in str(refused.value)


def test_v2_down_does_not_keep_the_runs_single_pod_down(fake, volume, caplog):
    """The look for a cluster beside the pod goes to v2 (beta, clusters alone): its outage must not keep a spot
    pod down; a pod made beside a cluster after all finds the run's lease held and stops itself (exit 75)."""
    single = cluster_config()
    single.nodes = 1
    pod = deploy(client_for(fake), single).pod
    fake.interrupt(pod.id)
    handle = fake.handle

    def v2_down(method, raw_path, headers, raw_body):
        if raw_path.startswith("/v2/"):
            return 503, {"title": "Service Unavailable", "status": 503, "detail": "down"}, {}
        return handle(method, raw_path, headers, raw_body)

    fake.handle = v2_down
    sup = Supervisor(client_for(fake), single, volume, volume.run("big").root / "supervise.json",
                     clock=Clock(), sleep=lambda s: None)  # fmt: skip
    caplog.set_level(logging.INFO, "trainpod")
    assert sup.step() is None
    assert fake.pods[pod.id]["desiredStatus"] == "RUNNING", "started again"
    assert "could not look for a cluster of run big" in caplog.text
