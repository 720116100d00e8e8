"""Several nodes from one deploy: `nodes: N` > 1 is a RunPod Instant Cluster through REST v2, against
the fake RunPod API (the mock of RunPod; every v2 request body is validated against RunPod's v2
OpenAPI description). Deploy, its dry run, bad cluster configs (exit 2), `trainpod stop`, and the
pod's own finish hook on node 0 and on node k > 0."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from trainpod import atomic, cli
from trainpod.config import load_config
from trainpod.config.deploy import DeployConfig
from trainpod.errors import ConfigError
from trainpod.runpod.client import RunPodUnavailable
from trainpod.runpod.cluster import cluster_body
from trainpod.runpod.deploy import deploy, pod_env
from trainpod.runpod.finish import FAILED_MARKER, after_workload
from trainpod.volume import Volume

from fake_runpod import SCHEMA_V2_FILE, FakeRunPodServer, api_env, client_for

GPUS = ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
SHIPPED = Path(__file__).resolve().parents[1] / "configs/deploy"


@pytest.fixture
def fake(monkeypatch, tmp_path):
    with FakeRunPodServer() as fake:
        for name, value in api_env(fake).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("HOME", str(tmp_path))  # no user's ~/.runpod here
        yield fake
    assert not fake.violations, f"requests RunPod would refuse: {fake.violations}"


def cluster_tree(**changes) -> dict:
    tree = {
        "run": "big",
        "workload": "pretrain",
        "config": "configs/pretrain/tiny.yaml",
        "nodes": 2,
        "image": {"name": "ghcr.io/org/trainpod:0.1.0"},
        "pod": {"gpu_types": GPUS, "gpu_count": 8, "spot": False},
        "volume": {"name": "vol", "size_gb": 500, "data_center": "EU-RO-1"},
        "budget": {"hourly_usd": 20.0},
    }
    for key, value in changes.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def write_config(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(cluster_tree(**changes)))
    return path


def config(tmp_path: Path, **changes) -> DeployConfig:
    return load_config(DeployConfig, write_config(tmp_path, **changes))


def create_request(fake) -> dict:
    (_, _, body) = fake.calls("POST", "/v2/clusters")[-1]
    return body


def test_a_cluster_deploy_sends_one_create_request_that_runpods_v2_schema_accepts(fake, tmp_path):
    done = deploy(client_for(fake), config(tmp_path))
    (volume,) = fake.volumes.values()
    body = create_request(fake)
    schema = json.loads(SCHEMA_V2_FILE.read_text())["operations"]["POST /v2/clusters"]["body"]
    assert not list(jsonschema.Draft202012Validator(schema).iter_errors(body))
    assert body["compute"] == {"gpuTypeId": GPUS[0], "gpuCountPerPod": 8, "podCount": 2}
    assert body["type"] == "TRAINING" and body["dataCenterIds"] == ["EU-RO-1"]
    assert body["mounts"] == {"network": [{"volumeId": volume["id"], "path": "/workspace"}]}
    assert (
        body["image"] == "ghcr.io/org/trainpod:0.1.0" and body["args"] == "/opt/trainpod/entrypoints/pretrain"
    )
    assert body["env"]["TRAINPOD_WORKLOAD"] == "pretrain" and body["env"]["TRAINPOD_RUN"] == "big"
    assert body["env"]["HF_TOKEN"] == "{{ RUNPOD_SECRET_HF_TOKEN }}", "secrets stay references"
    assert body["env"]["TRAINPOD_GPU_HOURLY_USD"] == "40", "node 0 counts the run's price: 2 nodes x $20"
    assert body["startSsh"] is True, "22/tcp is exposed: every node gets PUBLIC_KEY for boot's sshd"
    assert done.action == "created" and done.cluster.node_count == 2
    nodes = fake.nodes_of(done.cluster.id)
    assert [n["cluster"]["rank"] for n in nodes] == [0, 1]
    assert all(n["mounts"] == body["mounts"] and n["env"] == body["env"] for n in nodes), (
        "same volume and env"
    )
    assert not fake.calls("POST", "/pods") and not fake.templates, "no single pod, no template"


def test_deploying_again_reuses_a_whole_cluster_and_recreates_a_broken_one(fake, tmp_path):
    cfg = config(tmp_path)
    first = deploy(client_for(fake), cfg)
    again = deploy(client_for(fake), cfg)
    assert again.action == "reused" and again.cluster.id == first.cluster.id
    assert len(fake.calls("POST", "/v2/clusters")) == 1
    fake.interrupt_node(first.cluster.id, 1)
    third = deploy(client_for(fake), cfg)
    assert third.action == "recreated" and list(fake.clusters) == [third.cluster.id]
    assert fake.calls("DELETE", f"/v2/clusters/{first.cluster.id}")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"image.name": "ghcr.io/org/trainpod:0.1.1"}, "image"),
        ({"env.set": "train.max_steps=20"}, "env"),
        ({"nodes": 4}, "node count"),
        ({"pod.gpu_count": 4}, "GPU count"),
        ({"pod.gpu_types": ["NVIDIA H200"]}, "GPU type"),
    ],
)
def test_deploying_a_changed_config_while_the_cluster_runs_says_the_old_one_goes_on_and_how_to_switch(
    fake, tmp_path, caplog, change, named
):
    """A fixed image pushed and deployed (or more nodes asked for): 'reusing it' alone left every node
    training and billing on the old config, as a single pod's deploy no longer does."""
    secret = {"env.extra": {"MY_TOKEN": "{{ RUNPOD_SECRET_X }}"}}
    first = deploy(client_for(fake), config(tmp_path, **secret))
    caplog.set_level("INFO", "trainpod")
    again = deploy(client_for(fake), config(tmp_path, **secret, **change))
    assert again.action == "reused" and again.cluster.id == first.cluster.id, (
        "a whole cluster is never replaced"
    )
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert named in re.search(r"its (.*) differ", warning).group(1).split(", "), warning
    assert "trainpod stop big" in warning, "how to run the new config"
    assert "RUNPOD_SECRET" not in warning and "max_steps" not in warning, "names only, never values"


def test_deploying_the_same_config_again_reuses_the_cluster_without_a_warning(fake, tmp_path, caplog):
    deploy(client_for(fake), config(tmp_path))
    caplog.set_level("INFO", "trainpod")
    assert deploy(client_for(fake), config(tmp_path)).action == "reused"
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_gpu_types_are_tried_in_the_configs_order_one_cluster_at_a_time(fake, tmp_path):
    fake.no_capacity.add(GPUS[0])
    done = deploy(client_for(fake), config(tmp_path))
    assert done.cluster.gpu_type_id == GPUS[1] and len(fake.clusters) == 1


def test_a_cluster_create_whose_answer_was_lost_is_not_followed_by_one_of_the_next_gpu_type(fake, tmp_path):
    """RunPod made the cluster but its answer came after the timeout: asking for the next GPU type
    would rent a second cluster of every node beside it."""
    import time

    handle = fake.handle

    def late(method, raw_path, headers, raw_body):
        answer = handle(method, raw_path, headers, raw_body)
        if method == "POST" and raw_path.endswith("/v2/clusters"):
            time.sleep(0.5)
        return answer

    fake.handle = late
    with pytest.raises(RunPodUnavailable, match="not sent again"):
        deploy(client_for(fake, timeout_s=0.2), config(tmp_path))
    time.sleep(0.6)
    assert len(fake.calls("POST", "/v2/clusters")) == 1 and len(fake.clusters_named("big-pretrain")) == 1


def test_dry_run_shows_the_v2_cluster_request_with_secrets_masked_and_sends_nothing(
    fake, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("HF_TOKEN", "hf_realsecretvalue123")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_realsecret456")
    code = cli.main(["deploy", str(write_config(tmp_path)), "--dry-run", "--secrets-from-env"])
    out = capsys.readouterr().out
    assert code == 0 and fake.requests == []
    assert "would create cluster big-pretrain: POST /v2/clusters" in out
    assert '"podCount": 2' in out and '"volumeId": "<new networkvolume id>"' in out
    assert "hf_realsecretvalue123" not in out and '"HF_TOKEN": "***"' in out
    assert "POST /pods" not in out and "POST /templates" not in out


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"pod.spot": True}, "nodes=2 with pod.spot=true: RunPod's Instant Clusters have no spot option"),
        (
            {"image.flavour": "cpu"},
            "nodes=2 with image.flavour='cpu': an Instant Cluster's nodes are GPU pods",
        ),
        ({"pod.cloud": "COMMUNITY"}, "nodes=2 with pod.cloud='COMMUNITY': POST /v2/clusters has no cloud"),
        ({"volume.data_center": " "}, "a cluster lives in one data center, the network volume's"),
        ({"nodes": 251}, "nodes = 251"),
        ({"nodes": 0}, "nodes = 0"),
        ({"workload": "datagen"}, "nodes=2 with workload='datagen': every node would run it on its own"),
        ({"budget": {"budget_usd": 100.0}}, "budget.budget_usd=100.0 without budget.hourly_usd on a cluster"),
    ],
    ids=[
        "spot",
        "cpu",
        "community",
        "no-data-center",
        "too-many-nodes",
        "no-nodes",
        "datagen",
        "budget-no-price",
    ],
)
def test_a_bad_cluster_config_exits_2_naming_the_field_the_value_and_the_fix(
    fake, tmp_path, capsys, change, expected
):
    assert cli.main(["deploy", str(write_config(tmp_path, **change)), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert expected in out and "Traceback" not in out
    assert fake.requests == []


def test_the_spot_flag_on_a_cluster_config_is_refused_before_anything_is_sent(fake, tmp_path, capsys):
    assert cli.main(["deploy", str(write_config(tmp_path)), "--spot"]) == 2
    assert "set pod.spot: false" in capsys.readouterr().out
    assert not fake.calls("POST")


def test_a_cluster_node_gets_the_budget_only_with_the_price_node_0_counts_it_with(tmp_path):
    """A node cannot read the cluster's price (all its nodes'): given a budget alone it refuses to start (exit 2).
    A supervisor replacing a cluster deployed before deploy refused that must not make nodes that refuse to run;
    the supervisor caps such a run from RunPod's own cost."""
    env = pod_env(config(tmp_path, budget={"budget_usd": 40}))
    assert "TRAINPOD_BUDGET_USD" not in env and "TRAINPOD_GPU_HOURLY_USD" not in env
    env = pod_env(config(tmp_path, budget={"hourly_usd": 2.5, "budget_usd": 40}))
    assert (env["TRAINPOD_GPU_HOURLY_USD"], env["TRAINPOD_BUDGET_USD"]) == ("5", "40")


def test_one_node_keeps_the_single_pod_path(fake, tmp_path):
    deploy(client_for(fake), config(tmp_path, nodes=1))
    assert len(fake.pods) == 1 and not fake.clusters and not fake.calls("POST", "/v2/clusters")
    assert pod_env(config(tmp_path, nodes=1))["TRAINPOD_GPU_HOURLY_USD"] == "20"


def test_a_cluster_is_not_made_beside_the_runs_running_pod(fake, tmp_path):
    """nodes: 1 -> 2 deployed while the pod trains: the cluster was made beside it, its node 0 found the run's
    lease held (exit 75, a duplicate) and deleted it, and a supervisor made it again at every look (the pod's
    steps reset its restart count), 16 GPUs pulling the image over and over."""
    pod = deploy(client_for(fake), config(tmp_path, nodes=1)).pod
    with pytest.raises(ConfigError) as refused:
        deploy(client_for(fake), config(tmp_path))
    assert not fake.calls("POST", "/v2/clusters") and not fake.clusters, "nothing made"
    assert f"pod big-pretrain ({pod.id})" in str(refused.value) and "trainpod stop big" in str(refused.value)
    fake.interrupt(pod.id)  # stopped: the cluster takes the run over from its checkpoints
    assert deploy(client_for(fake), config(tmp_path)).action == "created"


def test_a_pod_is_not_made_beside_the_runs_cluster(fake, tmp_path):
    cluster = deploy(client_for(fake), config(tmp_path)).cluster
    with pytest.raises(ConfigError) as refused:
        deploy(client_for(fake), config(tmp_path, nodes=1))
    assert not fake.calls("POST", "/pods") and not fake.pods, "nothing made"
    assert f"Instant Cluster big-pretrain ({cluster.id}, 2 nodes)" in str(refused.value)
    assert "trainpod stop big" in str(refused.value)


def test_stop_deletes_the_runs_cluster_and_leaves_other_runs_alone(fake, tmp_path, capsys):
    mine = deploy(client_for(fake), config(tmp_path)).cluster
    other = deploy(client_for(fake), config(tmp_path, run="other")).cluster
    assert cli.main(["stop", "big"]) == 0
    assert list(fake.clusters) == [other.id] and not fake.nodes_of(mine.id)
    assert f"cluster big-pretrain ({mine.id}) deleted" in capsys.readouterr().out


def test_stop_goes_on_past_a_cluster_node_0_deleted_meanwhile(fake, tmp_path, monkeypatch):
    """Node 0 deletes its cluster at DONE between the listing and the delete: the stop must still
    end well and mark the run stopped, or a supervisor creates the whole cluster again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TRAINPOD_VOLUME", str(tmp_path / "not-mounted"))
    cluster_id = deploy(client_for(fake), config(tmp_path)).cluster.id
    handle = fake.handle

    def deleted_meanwhile(method, raw_path, headers, raw_body):
        answer = handle(method, raw_path, headers, raw_body)
        if method == "GET" and raw_path == "/v2/clusters" and cluster_id in fake.clusters:
            fake._deleteCluster({}, {}, None, id=cluster_id)
        return answer

    fake.handle = deleted_meanwhile
    assert cli.main(["stop", "big"]) == 0
    from trainpod.runpod.supervise import SupervisorState, state_path

    assert SupervisorState.load(state_path(None, "big")).stopped_unix is not None


def test_logs_of_a_cluster_run_are_node_0s(fake, tmp_path, capsys):
    cluster = deploy(client_for(fake), config(tmp_path)).cluster
    node_0, node_1 = fake.nodes_of(cluster.id)
    fake.add_logs(node_0["id"], "step 10/100 | loss 3.2 (rank 0)")
    fake.add_logs(node_1["id"], "a line of node 1")
    assert cli.main(["logs", "big", "--tail", "10"]) == 0
    out = capsys.readouterr().out
    assert "step 10/100 | loss 3.2 (rank 0)" in out and "a line of node 1" not in out


def test_following_a_cluster_run_ends_quietly_when_node_0_deletes_the_cluster_while_it_looks(
    fake, tmp_path, monkeypatch
):
    """At DONE node 0 deletes its cluster; the follow, its stream gone, looks for the run's pod, and the cluster
    (listed a moment before) answers 404 for its nodes: that is no pod left, exit 0, not exit 2 naming a 404."""
    cluster = deploy(client_for(fake), config(tmp_path)).cluster
    node_0 = fake.nodes_of(cluster.id)[0]["id"]
    fake.add_logs(node_0, "DONE")
    handle, printed = fake.handle, []

    def deleted_while_listed(method, raw_path, headers, raw_body):
        answer = handle(method, raw_path, headers, raw_body)
        if method == "GET" and raw_path == "/v2/clusters" and cluster.id in fake.clusters and printed:
            fake._deleteCluster({}, {}, None, id=cluster.id)  # node 0's DELETE lands between the two reads
        return answer

    def on_line(line: str) -> None:
        printed.append(line)
        fake.logs.pop(node_0)
        del fake.nodes[node_0]  # node 0 is being terminated: its stream answers 404

    fake.handle = deleted_while_listed

    monkeypatch.setattr(cli, "print", lambda line, **_: on_line(line), raising=False)
    assert cli.main(["logs", "big", "-f", "--tail", "10"]) == 0
    assert printed == ["DONE"]


def test_status_shows_the_runs_cluster_and_its_nodes_states(fake, tmp_path, capsys):
    cluster = deploy(client_for(fake), config(tmp_path)).cluster
    fake.interrupt_node(cluster.id, 1)
    assert cli.main(["status", "big", "--volume", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        f"cluster big-pretrain ({cluster.id}): 2 nodes x 8 x NVIDIA H100 80GB HBM3 | nodes 1 EXITED, 1 RUNNING"
        in out
    )


@pytest.mark.parametrize("path", sorted(SHIPPED.glob("*cluster*.yaml")), ids=lambda p: p.name)
def test_shipped_cluster_configs_build_a_request_runpods_v2_schema_accepts(path):
    cfg = load_config(DeployConfig, path)
    assert cfg.nodes > 1, f"{path.name}: a *-cluster.yaml deploys several nodes"
    schema = json.loads(SCHEMA_V2_FILE.read_text())["operations"]["POST /v2/clusters"]["body"]
    body = cluster_body(cfg, "vol1", cfg.pod.gpu_types[0], pod_env(cfg))
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(body)]
    assert not errors, f"{path.name}: the CreateClusterRequest it builds is refused: {errors}"


def test_the_estimate_of_a_cluster_counts_every_nodes_gpus_and_price(monkeypatch, tmp_path):
    from trainpod.estimate import estimate, load_target

    monkeypatch.delenv("TRAINPOD_GPU_HOURLY_USD", raising=False)
    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(cluster_tree(config=str(SHIPPED.parent / "pretrain/125m.yaml"), nodes=3)))
    workload_config, deploy_config = load_target(str(path))
    one = estimate(workload_config, deploy_config.model_copy(update={"nodes": 1}))
    three = estimate(workload_config, deploy_config)
    assert (one.gpu_count, three.gpu_count) == (8, 24)
    assert (one.hourly_usd, three.hourly_usd) == (20.0, 60.0), "budget.hourly_usd is per node"
    assert three.sizing.tokens == 3 * one.sizing.tokens, "the same steps, three times the ranks"


# ---------------------------------------------------------------- the finish hook on the cluster's nodes
def node_env(fake, cluster_id: str, rank: int, **extra) -> dict[str, str]:
    """What RunPod gives a node of an Instant Cluster (runpod-platform.md), plus the pod's own key."""
    node = fake.nodes_of(cluster_id)[rank]
    return {**api_env(fake), "RUNPOD_POD_ID": node["id"], "NUM_NODES": "2", "NODE_RANK": str(rank),
            "NUM_TRAINERS": "8", "PRIMARY_ADDR": "10.65.0.2", "PRIMARY_PORT": "29500", **extra}  # fmt: skip


@pytest.fixture
def run(tmp_path):
    run = Volume(tmp_path / "volume").run("big")
    run.create()
    return run


@pytest.mark.parametrize("on_finish", ["stop", "terminate"])
def test_node_0_deletes_the_whole_cluster_after_done(fake, tmp_path, run, caplog, on_finish):
    cluster = deploy(client_for(fake), config(tmp_path)).cluster
    caplog.set_level(logging.INFO, "trainpod")
    env = node_env(fake, cluster.id, 0, TRAINPOD_ON_FINISH=on_finish)
    assert after_workload(0, run, env, "pretrain") == 0
    assert not fake.clusters and not fake.nodes, "no node is left billing"
    assert f"asked RunPod to delete this pod's cluster {cluster.id}" in caplog.text
    assert not fake.calls("POST", "/pods/"), "member pods are out of reach of the pod endpoints"


def test_node_1_leaves_the_cluster_to_node_0(fake, tmp_path, run):
    cluster = deploy(client_for(fake), config(tmp_path))
    fake.requests.clear()
    assert after_workload(0, run, node_env(fake, cluster.cluster.id, 1), "pretrain") == 0
    assert after_workload(2, run, node_env(fake, cluster.cluster.id, 1), "pretrain") == 2
    assert list(fake.clusters) == [cluster.cluster.id] and fake.requests == []
    assert not (run.root / FAILED_MARKER).exists(), "node 0 alone marks the run"


def test_node_0_finds_its_cluster_by_name_when_v2_does_not_know_its_pod(fake, tmp_path, run):
    cluster = deploy(client_for(fake), config(tmp_path)).cluster
    env = node_env(fake, cluster.id, 0, RUNPOD_POD_ID="pod-unknown-to-v2")
    assert after_workload(2, run, env, "pretrain") == 2
    assert not fake.clusters, "bad input on node 0 deletes the cluster: a restart cannot help"
    assert "bad config or input (exit 2)" in atomic.read_json(run.root / FAILED_MARKER)["reason"]


def test_node_0_idle_leaves_the_cluster_running(fake, tmp_path, run):
    cluster = deploy(client_for(fake), config(tmp_path)).cluster
    assert after_workload(0, run, node_env(fake, cluster.id, 0, TRAINPOD_ON_FINISH="idle"), "pretrain") == 0
    assert list(fake.clusters) == [cluster.id]


def test_a_refused_cluster_deletion_keeps_the_exit_code_and_says_who_deletes_it(fake, tmp_path, run, caplog):
    cluster = deploy(client_for(fake), config(tmp_path)).cluster
    env = node_env(fake, cluster.id, 0)
    fake.key = "fake-account-key-the-pod-key-is-not"  # RunPod refuses the pod's key for the cluster (401)
    caplog.set_level(logging.INFO, "trainpod")
    assert after_workload(0, run, env, "pretrain") == 0
    assert list(fake.clusters) == [cluster.id]
    assert "could not delete this pod's cluster" in caplog.text and "trainpod stop RUN" in caplog.text


def test_deploying_a_cluster_after_its_volume_moved_is_refused_before_anything_is_rented(fake, tmp_path):
    """A whole cluster was reused on its old volume beside a new, unused one; a broken one was made again on
    the new, empty volume, starting the run over."""
    from trainpod.errors import ConfigError

    first = deploy(client_for(fake), config(tmp_path))
    fake.interrupt_node(first.cluster.id, 1)
    with pytest.raises(ConfigError, match=r"on network volume 'vol' .* in EU-RO-1.*trainpod stop"):
        deploy(client_for(fake), config(tmp_path, **{"volume.data_center": "US-KS-2"}))
    assert list(fake.clusters) == [first.cluster.id] and len(fake.volumes) == 1


def test_no_machines_free_for_any_gpu_type_is_exit_75_saying_the_config_is_fine_and_what_to_do(
    fake, tmp_path, capsys
):
    """v2 answers a cluster it cannot place with a 400 whose `detail` alone says so: the last GPU type's refusal
    read as 'the request does not fit RunPod's API; check the deploy config's values' (exit 2)."""
    fake.no_capacity.update(GPUS)
    assert cli.main(["deploy", str(write_config(tmp_path))]) == 75
    out = capsys.readouterr().out
    assert "no capacity" in out and "2 nodes" in out and all(gpu in out for gpu in GPUS), out
    assert "the config is fine" in out and "trainpod supervise big" in out and "pod.gpu_types" in out
    assert "does not fit RunPod's API" not in out
    assert len(fake.calls("POST", "/v2/clusters")) == len(GPUS) and not fake.clusters


def test_an_account_without_funds_is_told_so_not_sent_to_its_config_nor_asked_of_every_gpu_type(
    fake, tmp_path, capsys
):
    """v2 answers a create the account's balance cannot pay for with 402 ('Stop; no candidate will succeed'): it
    read as 'the request does not fit RunPod's API; check the deploy config's values', after a create of every GPU
    type of the config, each refused the same way."""
    fake.out_of_funds = True
    assert cli.main(["deploy", str(write_config(tmp_path))]) == 2
    out = capsys.readouterr().out
    assert "402" in out and "balance" in out and "console.runpod.io/user/billing" in out, out
    assert "does not fit RunPod's API" not in out
    assert len(fake.calls("POST", "/v2/clusters")) == 1, "no other GPU type asked for: none would be paid for"
