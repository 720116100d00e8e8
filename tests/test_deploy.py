"""`trainpod deploy/stop/status` against the fake RunPod API (the mock of RunPod; every request is
validated against RunPod's schema): template + volume + pod with the right bodies, idempotent,
--dry-run sends nothing, at most 50 env variables, secrets as references."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainpod import cli
from trainpod.config import load_config
from trainpod.config.deploy import DeployConfig
from trainpod.errors import ConfigError
from trainpod.runpod.deploy import deploy, pod_env

from fake_runpod import FakeRunPodServer, api_env, client_for

SHIPPED = Path(__file__).resolve().parents[1] / "configs/deploy"
GPUS = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]


@pytest.fixture
def fake(monkeypatch, tmp_path):
    with FakeRunPodServer() as fake:
        for name, value in api_env(fake).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("HOME", str(tmp_path))  # no user's ~/.runpod here
        yield fake
    assert not fake.violations, f"requests RunPod would refuse: {fake.violations}"


def write_config(tmp_path: Path, **changes) -> Path:
    tree = {
        "run": "tiny",
        "workload": "pretrain",
        "config": "configs/pretrain/tiny.yaml",
        "image": {"name": "ghcr.io/org/trainpod:0.1.0", "cuda_version": "12.8"},
        "pod": {"gpu_types": GPUS, "spot": True},
        "volume": {"name": "vol", "size_gb": 50, "data_center": "EU-RO-1"},
        "budget": {"hourly_usd": 2.5, "budget_usd": 40},
    }
    for key, value in changes.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def config(tmp_path: Path, **changes) -> DeployConfig:
    return load_config(DeployConfig, write_config(tmp_path, **changes))


def test_a_volume_in_a_data_center_rest_v1_does_not_list_gets_its_pod_by_the_volume_alone(fake, tmp_path):
    """RunPod's v1 description lists no US-MD-1 for dataCenterIds: naming it was a request RunPod refuses."""
    from trainpod.remote.s3 import S3_DATACENTERS
    from trainpod.runpod.deploy import POD_CREATE_DATA_CENTERS

    assert "US-MD-1" in S3_DATACENTERS and "US-MD-1" not in POD_CREATE_DATA_CENTERS
    deploy(client_for(fake), config(tmp_path, **{"volume.data_center": "US-MD-1"}))
    (volume,) = fake.volumes.values()
    (_, _, body) = fake.calls("POST", "/pods")[0]
    assert body["networkVolumeId"] == volume["id"] and volume["dataCenterId"] == "US-MD-1"
    assert "dataCenterIds" not in body
    assert not fake.violations


def test_the_data_centers_named_in_pod_bodies_are_those_runpods_description_lists():
    import json

    schema = json.loads((Path(__file__).parent / "runpod_schema.json").read_text())
    listed = schema["schemas"]["PodCreateInput"]["properties"]["dataCenterIds"]["items"]["enum"]
    from trainpod.runpod.deploy import POD_CREATE_DATA_CENTERS

    assert frozenset(listed) == POD_CREATE_DATA_CENTERS


def test_deploy_creates_template_volume_and_pod_with_the_right_bodies(fake, tmp_path):
    done = deploy(client_for(fake), config(tmp_path))
    (template,) = fake.templates.values()
    (volume,) = fake.volumes.values()
    (pod,) = fake.pods.values()
    assert done.action == "created" and done.pod.id == pod["id"]
    assert template["imageName"] == "ghcr.io/org/trainpod:0.1.0" and template["category"] == "NVIDIA"
    assert volume == {"id": volume["id"], "name": "vol", "size": 50, "dataCenterId": "EU-RO-1"}
    (_, _, body) = fake.calls("POST", "/pods")[0]
    assert body["name"] == "tiny-pretrain" and body["templateId"] == template["id"]
    assert body["networkVolumeId"] == volume["id"] and body["dataCenterIds"] == ["EU-RO-1"]
    assert body["gpuTypeIds"] == GPUS and body["gpuTypePriority"] == "custom"
    assert body["interruptible"] is True
    assert body["allowedCudaVersions"] == ["13.0", "12.9", "12.8"], "the image's CUDA or newer"
    assert body["env"]["TRAINPOD_RUN"] == "tiny" and body["env"]["TRAINPOD_WORKLOAD"] == "pretrain"
    assert body["env"]["TRAINPOD_GPU_HOURLY_USD"] == "2.5" and body["env"]["TRAINPOD_BUDGET_USD"] == "40"
    assert body["dockerStartCmd"] == ["/opt/trainpod/entrypoints/pretrain"]


def test_secrets_are_runpod_secret_references_never_values(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_realsecretvalue123")
    deploy(client_for(fake), config(tmp_path))
    (pod,) = fake.pods.values()
    (template,) = fake.templates.values()
    for env in (pod["env"], template["env"]):
        assert env["HF_TOKEN"] == "{{ RUNPOD_SECRET_HF_TOKEN }}"
        assert env["WANDB_API_KEY"] == "{{ RUNPOD_SECRET_WANDB_API_KEY }}"
    assert "hf_realsecretvalue123" not in str(fake.requests)


def test_the_pod_is_told_which_secrets_its_log_filter_would_not_know_by_name(tmp_path):
    """A secret's value is masked in the pod's logs by its variable's name (HF_TOKEN, ..._KEY); one listed under
    `secrets` with another name (DB_CREDS) is named to the pod in TRAINPOD_SECRET_NAMES, never its value."""
    env = pod_env(config(tmp_path, secrets=["HF_TOKEN", "DB_CREDS", "OPENAI_API_KEY_2"]))
    assert env["TRAINPOD_SECRET_NAMES"] == "DB_CREDS,OPENAI_API_KEY_2"
    assert "TRAINPOD_SECRET_NAMES" not in pod_env(config(tmp_path)), "HF_TOKEN, WANDB_API_KEY: known by name"


def test_deploying_again_reuses_everything_and_sends_no_create(fake, tmp_path):
    cfg = config(tmp_path)
    first = deploy(client_for(fake), cfg)
    writes = len([r for r in fake.requests if r[0] != "GET"])
    second = deploy(client_for(fake), cfg)
    assert second.action == "reused" and second.pod.id == first.pod.id
    assert len([r for r in fake.requests if r[0] != "GET"]) == writes, "the second deploy changed something"


def test_deploying_a_stopped_run_starts_its_pod_again(fake, tmp_path):
    cfg = config(tmp_path)
    first = deploy(client_for(fake), cfg)
    fake.interrupt(first.pod.id)
    again = deploy(client_for(fake), cfg)
    assert again.action == "started" and fake.pods[first.pod.id]["desiredStatus"] == "RUNNING"
    assert len(fake.pods) == 1


def test_a_new_image_updates_the_template_in_place(fake, tmp_path):
    deploy(client_for(fake), config(tmp_path))
    (template_id,) = fake.templates
    cfg = config(tmp_path, **{"env.extra": {"EXTRA": "1"}})
    cfg.secrets = ["HF_TOKEN"]  # the template's env changes
    deploy(client_for(fake), cfg)
    assert [r[1] for r in fake.calls("PATCH")] == [f"/templates/{template_id}"]
    assert list(fake.templates) == [template_id]


def test_gpu_types_are_tried_in_the_configs_order(fake, tmp_path):
    fake.no_capacity.add(GPUS[0])
    done = deploy(client_for(fake), config(tmp_path))
    assert done.pod.gpu_type_id == GPUS[1]


def test_more_than_50_env_variables_are_refused_before_anything_is_sent(fake, tmp_path, capsys):
    extra = {f"EXTRA_{i}": "x" for i in range(41)}  # 10 from the contract and secrets + 41 = 51
    with pytest.raises(ConfigError, match=r"51 environment variables, RunPod allows at most 50; remove 1"):
        pod_env(config(tmp_path, **{"env.extra": extra}))
    code = cli.main(["deploy", str(write_config(tmp_path, **{"env.extra": extra}))])
    assert code == 2 and fake.requests == []
    assert "at most 50" in capsys.readouterr().out


def test_exactly_50_env_variables_are_fine(tmp_path):
    extra = {f"EXTRA_{i}": "x" for i in range(40)}
    assert len(pod_env(config(tmp_path, **{"env.extra": extra}))) == 50


def test_env_extra_cannot_override_what_the_deploy_config_sets_and_names_the_field(fake, tmp_path, capsys):
    """env.extra went into the pod's env over the contract's variables: TRAINPOD_RUN there made the pod train
    runs/<other>/ while deploy, supervise, status and pull went by `run`, TRAINPOD_VOLUME another mount."""
    with pytest.raises(ConfigError) as caught:
        config(
            tmp_path, **{"env.extra": {"TRAINPOD_RUN": "other", "TRAINPOD_VOLUME": "/data", "MY_FLAG": "1"}}
        )
    text = str(caught.value)
    assert "env.extra.TRAINPOD_RUN='other'" in text and "set `run`" in text
    assert "env.extra.TRAINPOD_VOLUME='/data'" in text and "volume.mount_path" in text
    assert "MY_FLAG" not in text
    with pytest.raises(ConfigError) as caught:
        config(
            tmp_path, **{"env.extra": {"TRAINPOD_GIT_REPO": "https://ghp_abcdef123456@github.com/o/r.git"}}
        )
    assert "env.git_repo" in str(caught.value) and "ghp_abcdef123456" not in str(caught.value)
    with pytest.raises(ConfigError, match="TRAINPOD_SECRET_NAMES from `secrets`"):
        config(tmp_path, **{"env.extra": {"TRAINPOD_SECRET_NAMES": ""}})  # would unmask the secrets it names
    code = cli.main(["deploy", str(write_config(tmp_path, **{"env.extra": {"TRAINPOD_BUDGET_USD": "5"}}))])
    assert code == 2 and fake.requests == []
    assert "env.extra.TRAINPOD_BUDGET_USD" in capsys.readouterr().out
    assert (
        pod_env(config(tmp_path, **{"env.extra": {"TRAINPOD_GIT_USER": "me"}}))["TRAINPOD_GIT_USER"] == "me"
    )


def test_ports_and_mount_path_out_of_runpods_form_are_refused_naming_the_field(fake, tmp_path, capsys):
    """RunPod's API takes ports as port/protocol (http or tcp) and an absolute mount path; `ports: ["22"]` or
    `mount_path: workspace` went to RunPod as written (TRAINPOD_VOLUME=workspace: the run relative to the
    pod's working directory, on the container disk every restart wipes)."""
    with pytest.raises(ConfigError) as caught:
        config(tmp_path, **{"pod.ports": ["22", "8888/https", "70000/tcp"], "volume.mount_path": "workspace"})
    text = str(caught.value)
    assert "pod.ports = ['22', '8888/https', '70000/tcp']" in text
    assert "'22', '8888/https', '70000/tcp' not of the form PORT/http or PORT/tcp" in text
    assert "volume.mount_path = 'workspace'" in text and "absolute path" in text
    code = cli.main(["deploy", str(write_config(tmp_path, **{"pod.ports": ["22"]}))])
    assert code == 2 and fake.requests == []
    assert "pod.ports" in capsys.readouterr().out
    assert config(tmp_path, **{"pod.ports": ["22/tcp", "8888/http"]}).pod.ports == ["22/tcp", "8888/http"]
    assert config(tmp_path, **{"volume.mount_path": "/data"}).volume.mount_path == "/data"


def test_a_git_repo_without_a_ref_is_synced_at_the_remotes_head_as_the_pods_contract_says(tmp_path):
    """README: TRAINPOD_GIT_REF unset is the remote's HEAD; a deploy sent `main`, which a repo whose default
    branch is another (master, trunk) lacks: exit 2 at the pod's boot, after it was paid for."""
    env = pod_env(config(tmp_path, **{"env.git_repo": "https://github.com/org/trainer.git"}))
    assert env["TRAINPOD_GIT_REPO"] == "https://github.com/org/trainer.git" and "TRAINPOD_GIT_REF" not in env
    pinned = pod_env(
        config(tmp_path, **{"env.git_repo": "https://github.com/org/t.git", "env.git_ref": "v2"})
    )
    assert pinned["TRAINPOD_GIT_REF"] == "v2"


def test_a_single_pod_gets_its_budget_with_or_without_a_price(tmp_path):
    """Without budget.hourly_usd the pod reads its own price from RunPod at boot (boot._learn_the_pods_price)."""
    env = pod_env(config(tmp_path, budget={"budget_usd": 40}))
    assert env["TRAINPOD_BUDGET_USD"] == "40" and "TRAINPOD_GPU_HOURLY_USD" not in env
    env = pod_env(config(tmp_path, budget={"hourly_usd": 2.5, "budget_usd": 40}))
    assert (env["TRAINPOD_GPU_HOURLY_USD"], env["TRAINPOD_BUDGET_USD"]) == ("2.5", "40")


def test_dry_run_prints_the_requests_and_sends_nothing(fake, tmp_path, capsys):
    code = cli.main(["deploy", str(write_config(tmp_path)), "--dry-run", "--on-demand"])
    out = capsys.readouterr().out
    assert code == 0 and fake.requests == []
    assert "POST /templates" in out and "POST /networkvolumes" in out and "POST /pods" in out
    assert '"interruptible": false' in out, "--on-demand overrides the config's spot: true"


def test_secret_values_from_the_shell_only_when_asked_and_masked_in_the_dry_run(
    fake, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("HF_TOKEN", "hf_realsecretvalue123")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_realsecret456")
    path = str(write_config(tmp_path))
    assert cli.main(["deploy", path, "--dry-run", "--secrets-from-env"]) == 0
    out = capsys.readouterr().out
    assert "hf_realsecretvalue123" not in out and '"HF_TOKEN": "***"' in out
    assert cli.main(["deploy", path, "--secrets-from-env"]) == 0
    (pod,) = fake.pods.values()
    assert pod["env"]["HF_TOKEN"] == "hf_realsecretvalue123"
    assert "hf_realsecretvalue123" not in capsys.readouterr().out


def test_secrets_from_env_that_are_not_set_are_an_error(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert cli.main(["deploy", str(write_config(tmp_path)), "--secrets-from-env"]) == 2
    assert "HF_TOKEN" in capsys.readouterr().out and fake.requests == []


def test_deploy_on_demand_then_supervise_keeps_replacement_pods_on_demand(fake, tmp_path, monkeypatch):
    """The YAML says spot; --on-demand overrides it for the deploy and for the supervisor it starts,
    whose replacement pods (start refused, pod gone) are made from that config."""
    import trainpod.runpod.supervise as supervising

    supervised = []
    monkeypatch.setattr(
        supervising, "supervise", lambda cfg, volume, once=False, **_: supervised.append(cfg) or 0
    )
    monkeypatch.setenv("TRAINPOD_VOLUME", str(tmp_path / "not-mounted"))
    assert cli.main(["deploy", str(write_config(tmp_path)), "--on-demand", "--supervise"]) == 0
    (pod,) = fake.pods.values()
    assert pod["interruptible"] is False
    (cfg,) = supervised
    assert cfg.pod.spot is False, "the supervisor would replace the on-demand pod with a spot one"


def test_stop_and_terminate_act_on_the_runs_pods_only(fake, tmp_path, capsys):
    deploy(client_for(fake), config(tmp_path))
    deploy(client_for(fake), config(tmp_path, run="other"))
    assert cli.main(["stop", "tiny"]) == 0
    status = {p["name"]: p["desiredStatus"] for p in fake.pods.values()}
    assert status == {"tiny-pretrain": "EXITED", "other-pretrain": "RUNNING"}
    assert cli.main(["stop", "tiny", "--terminate"]) == 0
    assert [p["name"] for p in fake.pods.values()] == ["other-pretrain"]


def test_stop_stops_the_pods_when_the_deploy_config_at_hand_cannot_be_read(
    fake, tmp_path, monkeypatch, capsys
):
    """With RunPod's S3 key exported, `trainpod stop` read the deploy config ($TRAINPOD_CONFIG, often a workload
    YAML left exported from `trainpod run`) to find the volume for its STOPPED record; a config that did not load
    ended the stop with exit 2 before any pod was stopped, and the GPUs billed on. The record is skipped, said so."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TRAINPOD_VOLUME", str(tmp_path / "not-mounted"))
    deploy(client_for(fake), config(tmp_path))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "user_test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    workload = tmp_path / "pretrain.yaml"
    workload.write_text("name: tiny\ntrain: {max_steps: 5}\n")
    monkeypatch.setenv("TRAINPOD_CONFIG", str(workload))
    assert cli.main(["stop", "tiny"]) == 0
    assert fake.pods_named("tiny-pretrain")[0]["desiredStatus"] == "EXITED", "the pod was left billing"
    said = capsys.readouterr()
    assert "STOPPED is not recorded on the volume" in said.out + said.err


def test_stop_goes_on_past_a_pod_that_terminated_itself_meanwhile(fake, tmp_path, monkeypatch):
    """The supervisor pod (stopped first) terminates itself between the listing and its stop: the
    training pod must still be stopped and the run marked stopped, or it keeps billing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TRAINPOD_VOLUME", str(tmp_path / "not-mounted"))
    deploy(client_for(fake), config(tmp_path))
    deploy(client_for(fake), config(tmp_path, workload="supervise"))
    (supervisor_pod,) = fake.pods_named("tiny-supervise")
    handle = fake.handle

    def terminated_meanwhile(method, raw_path, headers, raw_body):
        answer = handle(method, raw_path, headers, raw_body)
        if method == "GET" and raw_path.startswith("/v1/pods"):
            fake.pods.pop(supervisor_pod["id"], None)  # on_finish: terminate, at its own DONE
        return answer

    fake.handle = terminated_meanwhile
    assert cli.main(["stop", "tiny"]) == 0
    assert fake.pods_named("tiny-pretrain")[0]["desiredStatus"] == "EXITED"
    from trainpod.runpod.supervise import SupervisorState, state_path

    assert SupervisorState.load(state_path(None, "tiny")).stopped_unix is not None


def test_status_shows_the_runs_pods_when_a_key_is_at_hand(fake, tmp_path, capsys):
    deploy(client_for(fake), config(tmp_path))
    assert cli.main(["status", "tiny", "--volume", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tiny: 1 pod(s) on RunPod" in out
    assert "RUNNING, up <1m | 1 x NVIDIA H100 80GB HBM3 | $2.00/hr | spot" in out


def test_a_bad_deploy_config_names_the_field_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as caught:
        config(tmp_path, **{"pod.gpu_types": [], "image.cuda_version": "10.1", "volume.size_gb": 5})
    text = str(caught.value)
    assert "pod.gpu_types is empty" in text or "image.cuda_version='10.1'" in text
    assert "volume.size_gb = 5" in text


def test_a_missing_deploy_field_is_not_told_to_be_passed_with_a_set_flag_deploy_lacks(tmp_path, capsys):
    """The deploy config's missing fields said "add it to the YAML or pass --set volume.data_center=VALUE", and
    `trainpod deploy` (supervise, status) has no --set: the flag the message named was an argparse error."""
    path = write_config(tmp_path, volume={"name": "vol"})
    assert cli.main(["deploy", str(path), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert "volume.data_center: required but missing" in out and "add it to the YAML" in out
    assert "--set" not in out


def test_a_missing_deploy_config_file_is_not_told_to_be_set_in_a_variable_deploy_never_reads(
    tmp_path, capsys
):
    """`trainpod deploy nope.yaml` said "set TRAINPOD_CONFIG to an existing YAML file": deploy takes its config as
    its argument and reads no TRAINPOD_CONFIG."""
    assert cli.main(["deploy", str(tmp_path / "nope.yaml"), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert "nope.yaml does not exist; give the path of an existing YAML file" in out
    assert "TRAINPOD_CONFIG" not in out


def test_a_workload_configs_missing_field_names_env_set_the_deploys_way_to_override_it(tmp_path, capsys):
    """A workload config's missing field, found by deploy, repeated the loader's "pass --set train.max_steps=VALUE";
    deploy has no --set (argparse: unrecognized arguments). The pod applies the deploy YAML's env.set to it."""
    workload = tmp_path / "work.yaml"
    workload.write_text("train: {}\n")
    path = write_config(tmp_path, config=str(workload))
    assert cli.main(["deploy", str(path), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert "train.max_steps: required but missing" in out
    assert "add train.max_steps=VALUE to the deploy YAML's env.set" in out
    assert "--set" not in out, "deploy has no --set flag: the fix must name env.set"


def test_a_convert_that_pushes_to_the_hub_without_hf_token_among_the_secrets_is_refused(
    fake, tmp_path, capsys
):
    """A hub task's push needs HF_TOKEN: a deploy without it rented a pod whose preflight could only refuse it."""
    workload = tmp_path / "convert.yaml"
    workload.write_text(
        yaml.safe_dump(
            {"name": "tiny", "task": [{"kind": "hub", "source": "merged", "repo_id": "me/tiny-ft"}]}
        )
    )
    without = write_config(tmp_path, workload="convert", config=str(workload), secrets=["WANDB_API_KEY"])
    assert cli.main(["deploy", str(without), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert "pushes to the Hugging Face Hub (me/tiny-ft)" in out and "add HF_TOKEN to `secrets`" in out
    with_token = write_config(tmp_path, workload="convert", config=str(workload), secrets=["HF_TOKEN"])
    assert cli.main(["deploy", str(with_token), "--dry-run"]) == 0, capsys.readouterr().out
    by_reference = {"extra": {"HF_TOKEN": "{{ RUNPOD_SECRET_hf_write }}"}}  # a secret of another name
    with_token = write_config(
        tmp_path, workload="convert", config=str(workload), secrets=[], env=by_reference
    )
    assert cli.main(["deploy", str(with_token), "--dry-run"]) == 0, capsys.readouterr().out
    assert fake.requests == []


def test_a_cuda_version_written_unquoted_is_the_version_it_spells(tmp_path):
    """YAML reads `cuda_version: 12.8` as a float: it was refused as "not a valid string", next to a
    description that lists 12.8 among the versions to pick."""
    path = write_config(tmp_path)
    path.write_text(path.read_text().replace("cuda_version: '12.8'", "cuda_version: 12.8"))
    assert "cuda_version: 12.8\n" in path.read_text()
    assert load_config(DeployConfig, path).image.cuda_version == "12.8"
    assert config(tmp_path, **{"image.cuda_version": 13}).image.cuda_version == "13.0"
    with pytest.raises(ConfigError, match=r"image.cuda_version='10.1' is not a CUDA version"):
        config(tmp_path, **{"image.cuda_version": 10.1})


@pytest.mark.parametrize("path", sorted(SHIPPED.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_deploy_configs_load(path):
    cfg = load_config(DeployConfig, path)
    assert cfg.pod_name == f"{cfg.run}-{cfg.workload}" and cfg.pod.gpu_types


def test_stop_leaves_a_run_whose_name_starts_with_this_runs_name_alone(fake, tmp_path, capsys):
    deploy(client_for(fake), config(tmp_path, run="llama"))
    deploy(client_for(fake), config(tmp_path, run="llama-v2"))
    assert cli.main(["stop", "llama", "--terminate"]) == 0
    assert [p["name"] for p in fake.pods.values()] == ["llama-v2-pretrain"]


def test_deploying_a_changed_config_replaces_an_exited_pod_instead_of_starting_the_old_one(fake, tmp_path):
    first = deploy(client_for(fake), config(tmp_path))
    fake.pods[first.pod.id]["desiredStatus"] = "EXITED"
    again = deploy(client_for(fake), config(tmp_path, **{"image.name": "ghcr.io/org/trainpod:0.1.1",
                                                         "pod.spot": False}))  # fmt: skip
    (pod,) = fake.pods_named("tiny-pretrain")
    assert again.action == "created" and pod["id"] != first.pod.id
    assert pod["image"] == "ghcr.io/org/trainpod:0.1.1" and pod["interruptible"] is False


def test_deploying_the_same_config_still_starts_the_exited_pod(fake, tmp_path):
    first = deploy(client_for(fake), config(tmp_path))
    fake.pods[first.pod.id]["desiredStatus"] = "EXITED"
    assert deploy(client_for(fake), config(tmp_path)).action == "started"


def test_deploying_a_changed_config_while_the_pod_runs_says_the_old_one_goes_on_and_how_to_switch(
    fake, tmp_path, caplog
):
    """A fixed image pushed and deployed: 'reusing it' alone left the user paying for the old image."""
    first = deploy(client_for(fake), config(tmp_path, **{"env.extra": {"MY_TOKEN": "{{ RUNPOD_SECRET_X }}"}}))
    caplog.set_level("INFO", "trainpod")
    again = deploy(client_for(fake), config(tmp_path, **{"image.name": "ghcr.io/org/trainpod:0.1.1"}))
    assert again.action == "reused" and again.pod.id == first.pod.id, "a running pod is never replaced"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "image" in warning and "trainpod stop tiny" in warning and "RUNPOD_SECRET" not in warning


@pytest.mark.parametrize(
    "moved", [{"volume.name": "vol2"}, {"volume.data_center": "US-KS-2"}], ids=["name", "data_center"]
)
@pytest.mark.parametrize("pod_state", ["EXITED", "RUNNING"])
def test_deploying_after_the_volume_changed_is_refused_before_anything_is_rented(
    fake, tmp_path, moved, pod_state
):
    """The run's checkpoints and data are on the volume its pod mounts: the old pod was started on the old
    volume (or reused) while a new volume was created beside it, billed and never used, with no word."""
    first = deploy(client_for(fake), config(tmp_path))
    fake.pods[first.pod.id]["desiredStatus"] = pod_state
    before = len([r for r in fake.requests if r[0] != "GET"])
    with pytest.raises(ConfigError) as refused:
        deploy(client_for(fake), config(tmp_path, **moved))
    assert len([r for r in fake.requests if r[0] != "GET"]) == before, "no volume made, no pod started"
    assert list(fake.volumes) == [first.volume.id] and fake.pods[first.pod.id]["desiredStatus"] == pod_state
    text = str(refused.value)
    assert (
        f"pod tiny-pretrain ({first.pod.id}) is on network volume 'vol' ({first.volume.id}) in EU-RO-1"
        in text
    )
    assert "trainpod stop tiny --terminate" in text and "volume.name: vol" in text


def test_deploy_refuses_a_volume_change_with_exit_2_naming_the_config(fake, tmp_path, capsys):
    deploy(client_for(fake), config(tmp_path))
    path = write_config(tmp_path, **{"volume.data_center": "US-KS-2"})
    assert cli.main(["deploy", str(path)]) == 2
    out = capsys.readouterr().out
    assert "volume.data_center: EU-RO-1 again" in out


def test_a_refused_deploy_leaves_the_users_stop_in_place(fake, tmp_path, monkeypatch, capsys):
    """`trainpod deploy` cleared the run's STOPPED (`trainpod stop`) before it was refused (here its volume
    moved, exit 2): the refusal said nothing was done, yet the next look of a supervisor (supervise.yml's, a
    loop elsewhere) found the stopped pod and no stop, and started it again, billing."""
    from trainpod.runpod.supervise import SupervisorState, state_path

    volume = tmp_path / "volume"
    (volume / "runs").mkdir(parents=True)
    monkeypatch.setenv("TRAINPOD_VOLUME", str(volume))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "old").mkdir()
    supervised = write_config(tmp_path / "old")
    deploy(client_for(fake), load_config(DeployConfig, supervised))
    assert cli.main(["stop", "tiny"]) == 0
    assert cli.main(["deploy", str(write_config(tmp_path, **{"volume.data_center": "US-KS-2"}))]) == 2
    assert "volume.data_center: EU-RO-1 again" in capsys.readouterr().out
    assert (volume / "runs/.tiny.STOPPED").exists(), "the refused deploy cleared the stop"
    assert SupervisorState.load(state_path(None, "tiny")).stopped_unix is not None
    assert cli.main(["supervise", "tiny", "--config", str(supervised), "--once"]) == 0
    (pod,) = fake.pods_named("tiny-pretrain")
    assert pod["desiredStatus"] == "EXITED", "the stopped pod was started again"


@pytest.mark.parametrize("run", ["tiny", None], ids=["one run", "every run"])
def test_status_on_a_laptop_with_only_the_api_key_shows_the_pods_and_what_the_volume_would_add(
    fake, tmp_path, monkeypatch, capsys, run
):
    """No volume mounted, no S3 key: `trainpod status tiny` was exit 2 'volume /workspace does not exist here',
    showing nothing of the pods RunPod's API could tell."""
    for name in ("TRAINPOD_VOLUME", "TRAINPOD_S3_VOLUME", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("trainpod.volume.DEFAULT_VOLUME", str(tmp_path / "workspace"))
    deploy(client_for(fake), config(tmp_path))
    deploy(client_for(fake), config(tmp_path, run="other"))
    assert cli.main(["status", *([run] if run else [])]) == 0
    out = capsys.readouterr().out
    assert (
        "tiny: 1 pod(s) on RunPod" in out
        and "RUNNING, up <1m | 1 x NVIDIA H100 80GB HBM3 | $2.00/hr | spot" in out
    )
    assert ("other: 1 pod(s) on RunPod" in out) == (run is None)
    assert "no volume mounted here" in out and "AWS_ACCESS_KEY_ID" in out and "--config" in out


def test_status_with_a_deploy_config_and_only_the_api_key_shows_the_runs_pods(
    fake, tmp_path, monkeypatch, capsys
):
    """`trainpod status tiny --config deploy.yaml` (the README's way to reach the volume from a laptop) without
    RunPod's S3 key was exit 2 'the S3 API needs AWS_ACCESS_KEY_ID ...', showing none of the pods the API key
    alone lists, as `trainpod status tiny` without --config shows them."""
    for name in (
        "TRAINPOD_VOLUME",
        "TRAINPOD_S3_VOLUME",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_PROFILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("trainpod.volume.DEFAULT_VOLUME", str(tmp_path / "workspace"))
    deploy(client_for(fake), config(tmp_path))
    assert cli.main(["status", "tiny", "--config", str(write_config(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "tiny: 1 pod(s) on RunPod" in out and "RUNNING, up <1m | 1 x NVIDIA H100 80GB HBM3" in out
    assert "AWS_ACCESS_KEY_ID" in out, "what the S3 key would add is said"


def test_status_with_neither_a_volume_nor_an_api_key_still_says_where_to_look(tmp_path, monkeypatch, capsys):
    for name in ("TRAINPOD_VOLUME", "TRAINPOD_S3_VOLUME", "RUNPOD_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr("trainpod.volume.DEFAULT_VOLUME", str(tmp_path / "workspace"))
    assert cli.main(["status", "tiny"]) == 2
    assert "does not exist here" in capsys.readouterr().out


def test_deploying_more_gpus_replaces_an_exited_pod_and_warns_about_a_running_one(fake, tmp_path, caplog):
    """`pod.gpu_count: 2` (the 1-GPU run was too slow, or ran out of memory) deployed again: the old 1-GPU pod was
    started again, or reused without a word, and trained on one GPU."""
    first = deploy(client_for(fake), config(tmp_path))
    caplog.set_level("INFO", "trainpod")
    again = deploy(client_for(fake), config(tmp_path, **{"pod.gpu_count": 2}))
    assert again.action == "reused", "a running pod is never replaced"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "GPU count" in warning and "trainpod stop tiny" in warning
    fake.pods[first.pod.id]["desiredStatus"] = "EXITED"
    replaced = deploy(client_for(fake), config(tmp_path, **{"pod.gpu_count": 2}))
    (pod,) = fake.pods_named("tiny-pretrain")
    assert replaced.action == "created" and pod["gpu"]["count"] == 2


def test_deploying_without_the_pods_gpu_type_replaces_the_exited_pod(fake, tmp_path):
    """H100 dropped from pod.gpu_types (its price): starting the old pod again put the run back on its H100."""
    first = deploy(client_for(fake), config(tmp_path))
    assert first.pod.gpu_type_id == GPUS[0]
    fake.pods[first.pod.id]["desiredStatus"] = "EXITED"
    again = deploy(client_for(fake), config(tmp_path, **{"pod.gpu_types": GPUS[1:]}))
    (pod,) = fake.pods_named("tiny-pretrain")
    assert again.action == "created" and pod["gpu"]["id"] == GPUS[1]


def test_deploying_a_larger_container_disk_or_new_ports_replaces_the_exited_pod(fake, tmp_path):
    """`pod.container_disk_gb` raised after the pod ran out of disk (or a port added for TensorBoard): starting
    the old pod again gave it its old disk, which filled again, and the old ports."""
    first = deploy(client_for(fake), config(tmp_path))
    fake.pods[first.pod.id]["desiredStatus"] = "EXITED"
    bigger = first.pod.container_disk_gb + 50
    again = deploy(client_for(fake), config(tmp_path, **{"pod.container_disk_gb": bigger}))
    (pod,) = fake.pods_named("tiny-pretrain")
    assert again.action == "created" and pod["containerDiskInGb"] == bigger
    fake.pods[pod["id"]]["desiredStatus"] = "EXITED"
    ports = ["22/tcp", "6006/http"]
    opened = deploy(
        client_for(fake), config(tmp_path, **{"pod.container_disk_gb": bigger, "pod.ports": ports})
    )
    (pod,) = fake.pods_named("tiny-pretrain")
    assert opened.action == "created" and pod["ports"] == ports
    fake.pods[pod["id"]]["desiredStatus"] = "EXITED"
    same = deploy(client_for(fake), config(tmp_path, **{"pod.container_disk_gb": bigger, "pod.ports": ports}))
    assert same.action == "started" and same.pod.id == pod["id"], "an unchanged config starts the same pod"
    assert not fake.violations


def test_a_pod_that_reports_no_gpu_while_stopped_is_started_again_unchanged(fake, tmp_path):
    """An exited pod may list no `gpu` (its GPU is released): an unknown count or type is no change."""
    first = deploy(client_for(fake), config(tmp_path))
    fake.pods[first.pod.id] |= {"desiredStatus": "EXITED", "gpu": None}
    assert deploy(client_for(fake), config(tmp_path)).action == "started"


def test_a_larger_volume_size_grows_the_volume_and_a_smaller_one_is_said_to_be_kept(fake, tmp_path, caplog):
    """Exit 5 (volume full) says to grow the network volume; volume.size_gb raised and deployed again reused the
    volume at its old size without a word, and the next start filled it again."""
    first = deploy(client_for(fake), config(tmp_path))
    caplog.set_level("INFO", "trainpod")
    grown = deploy(client_for(fake), config(tmp_path, **{"volume.size_gb": 200}))
    assert fake.volumes[first.volume.id]["size"] == 200 and grown.volume.size_gb == 200
    assert fake.calls("PATCH", f"/networkvolumes/{first.volume.id}")
    caplog.clear()
    deploy(client_for(fake), config(tmp_path, **{"volume.size_gb": 50}))
    assert fake.volumes[first.volume.id]["size"] == 200, "RunPod cannot shrink a volume"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "200 GB" in warning and "volume.size_gb=50" in warning


def test_a_volume_runpod_refuses_to_grow_is_a_warning_and_the_deploy_goes_on(fake, tmp_path, caplog):
    first = deploy(client_for(fake), config(tmp_path))
    fake.pods[first.pod.id]["desiredStatus"] = "EXITED"
    handle = fake.handle

    def refused_to_grow(method, raw_path, headers, raw_body):
        if method == "PATCH" and raw_path.startswith("/v1/networkvolumes/"):
            return 400, {"error": "cannot resize now"}, {}
        return handle(method, raw_path, headers, raw_body)

    fake.handle = refused_to_grow
    caplog.set_level("INFO", "trainpod")
    again = deploy(client_for(fake), config(tmp_path, **{"volume.size_gb": 200}))
    assert again.action == "started" and fake.volumes[first.volume.id]["size"] == 50
    assert any(
        "RunPod refused to grow it" in r.getMessage() for r in caplog.records if r.levelname == "WARNING"
    )


@pytest.mark.parametrize("status", [400, 500])
def test_no_machine_free_for_any_gpu_type_is_exit_75_saying_the_config_is_fine_and_what_to_do(
    fake, tmp_path, capsys, status
):
    """RunPod answers a create it has no machine for with a 400 whose text alone says so (v2's description: capacity
    carries no machine-readable code; 'There are no longer any instances available ...'), spot's most common
    failure. It read as 'the request does not fit RunPod's API; check the deploy config's values' (exit 2), sending
    the user to edit a config that was fine; as a 500, as 'RunPod may have done it anyway ... look before trying
    again'. It is now exit 75 (temporary) saying no machine is free and the ways on."""
    fake.no_capacity.update(GPUS)
    fake.no_capacity_status = status
    assert cli.main(["deploy", str(write_config(tmp_path))]) == 75
    out = capsys.readouterr().out
    assert "no capacity" in out and "no spot machine free" in out and all(gpu in out for gpu in GPUS), out
    assert "SECURE cloud" in out and "EU-RO-1" in out and "the config is fine" in out
    assert "pod.gpu_types" in out and "--on-demand" in out and "trainpod supervise tiny" in out
    assert "does not fit RunPod's API" not in out and "may have done it anyway" not in out
    assert len(fake.calls("POST", "/pods")) == 1 and not fake.pods, "nothing made, nothing sent twice"


def test_a_refusal_that_does_not_say_no_capacity_still_names_the_config(fake, tmp_path, capsys):
    """Only RunPod's own words for no capacity are read so: any other 400 to a create is the request's."""
    handle = fake.handle

    def refusing(method, raw_path, headers, raw_body):
        if method == "POST" and raw_path.split("?")[0].endswith("/pods"):
            return 400, {"error": "gpuCount exceeds the maximum for this GPU type"}, {}
        return handle(method, raw_path, headers, raw_body)

    fake.handle = refusing
    assert cli.main(["deploy", str(write_config(tmp_path))]) == 2
    out = capsys.readouterr().out
    assert "does not fit RunPod's API" in out and "no capacity" not in out
    assert "exceeds" not in out, "RunPod's body is never echoed"


def test_deploy_then_supervise_with_no_machine_free_hands_over_to_the_supervisor(
    fake, tmp_path, monkeypatch, capsys
):
    """`deploy --supervise` answered 'no instances available' ended with exit 75 and never supervised: the user
    who asked for a supervised spot run came back to no pod at all. The supervisor now takes over, and the pod it
    makes once a machine is free has the secrets' values, as the deploy asked (--secrets-from-env)."""
    import trainpod.runpod.supervise as supervising

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TRAINPOD_VOLUME", str(tmp_path / "not-mounted"))
    monkeypatch.setenv("HF_TOKEN", "hf_realsecretvalue123")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_realsecret456")
    fake.no_capacity.update(g["id"] for g in fake.gpu_catalog)
    looks = []

    def one_look_then_a_machine_frees(cfg, volume, once=False, **kwargs):
        assert not volume.root.is_dir()  # as supervise() builds it for a volume not mounted here:
        supervisor = supervising.Supervisor(
            client_for(fake), cfg, None, supervising.state_path(None, cfg.run), sleep=lambda s: None
        )
        looks.append(supervisor.step())  # no machine: waits
        fake.no_capacity.clear()
        supervisor.state_file.parent.mkdir(parents=True, exist_ok=True)
        state = supervising.SupervisorState.load(supervisor.state_file)
        state.next_attempt_unix = 0.0
        state.save(supervisor.state_file)
        looks.append(supervisor.step())
        return 0

    monkeypatch.setattr(supervising, "supervise", one_look_then_a_machine_frees)
    assert cli.main(["deploy", str(write_config(tmp_path)), "--secrets-from-env", "--supervise"]) == 0
    out = capsys.readouterr().out
    assert "no capacity" in out and "handing over to the supervisor" in out, out
    assert looks == [None, None]
    (pod,) = fake.pods.values()
    assert pod["env"]["HF_TOKEN"] == "hf_realsecretvalue123", "made with the values, as the deploy asked"
    assert "hf_realsecretvalue123" not in out
