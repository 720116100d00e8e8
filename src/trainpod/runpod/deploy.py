"""`trainpod deploy CONFIG`: the template, the network volume and the pod of one run, idempotently.

    trainpod deploy configs/deploy/pretrain-spot.yaml --dry-run     # prints the requests, sends nothing
    trainpod deploy configs/deploy/pretrain-spot.yaml --on-demand

Deploying again changes nothing that is already right: the template is updated only when it
differs, a volume of that name is reused, a RUNNING pod `<run>-<workload>` is reused and an EXITED
one started again (replaced when its image, env, spot setting, GPU count or type changed; a pod on
another volume than the config's is refused, refuse_another_volume). GPU types are tried in the
config's order by RunPod itself (`gpuTypePriority: custom`). A config with `nodes: N` (N > 1) is an Instant Cluster instead
(runpod/cluster.py). This module speaks in pods and templates; HTTP lives in client.py.
"""

from __future__ import annotations

import datetime
import logging
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from trainpod.config.deploy import CUDA_VERSIONS, MAX_POD_ENV, DeployConfig
from trainpod.errors import ConfigError
from trainpod.log import SECRET_NAMES_ENV, is_secret_name, redact
from trainpod.runpod.client import (
    NetworkVolume,
    Pod,
    RunPodAuthError,
    RunPodClient,
    RunPodError,
    RunPodNoCapacity,
    RunPodNotFound,
    Template,
)
from trainpod.runpod.cluster import ClusterDeployment, delete_run_clusters, deploy_cluster

log = logging.getLogger("trainpod.deploy")

IMAGE_ROOT = "/opt/trainpod"  # where the images keep the kit and its entrypoints (docker/Dockerfile)
# In a deployed pod's env: what the deploy rented (runpod/supervise.py, DeployRecord, as JSON). Its boot writes it
# beside the run (runs/.<run>.DEPLOYED) when newer than the record there: a deploy that reached neither the volume
# nor its S3 API still replaces an older deploy's record (an earlier --on-demand) for supervisors elsewhere.
DEPLOYED_ENV = "TRAINPOD_DEPLOYED"


@dataclass(frozen=True)
class Deployment:
    template: Template
    volume: NetworkVolume
    pod: Pod
    action: str  # what happened to the pod: created, started, reused

    def summary(self) -> str:
        return f"pod {self.pod.name} ({self.pod.id}) {self.action}"


PLACEHOLDER_IMAGE = re.compile(
    r"YOUR_ORG|YOUR_REGISTRY|<[^>]*>"
)  # what the shipped configs and infra/ carry (git_repo too)
REFERENCE = re.compile(r"^\{\{\s*RUNPOD_SECRET_[A-Za-z0-9_]+\s*\}\}$")
# A token given as a URL's user alone (https://<token>@github.com/...: GitHub's and GitLab's own way), by the
# prefixes GitHub, GitLab (personal, deploy, runner, trigger, OAuth ... tokens) and Hugging Face give their
# tokens, or by a token's shape: 40 or more letters, digits, _ and - (a classic GitHub token is 40 hex digits
# with no prefix, an Azure DevOps one 52 characters), longer than any GitHub user name (39). A user name alone
# is no secret.
_TOKEN_AS_USER = re.compile(
    r"gh[pousr]_|github_pat_|gl(pat|dt|rt|ptt|cbt|imt|agent|oas|soat|ft|ffct)-|hf_|[A-Za-z0-9_-]{40,}$"
)


def pod_problems(config: DeployConfig) -> list[str]:
    """What no pod made from `config` may carry, whoever makes it: `trainpod deploy` (deploy_checks), or a
    supervisor replacing a pod (a placeholder image is a paid GPU pulling an image no registry serves)."""
    problems = []
    if PLACEHOLDER_IMAGE.search(config.image.name):
        problems.append(
            f"image.name={config.image.name!r} is the shipped placeholder; set it to the image "
            "`make image push "
            "REGISTRY=...` pushed, e.g. ghcr.io/you/trainpod:0.1.0"
        )
    if PLACEHOLDER_IMAGE.search(
        config.env.git_repo
    ):  # the pod would rent, pull the image, then fail its git sync
        problems.append(
            f"env.git_repo={config.env.git_repo!r} is the shipped placeholder; set it to the repo holding your "
            "program (your fork), e.g. https://github.com/you/trainpod.git, or remove it"
        )
    if _url_credentials(config.env.git_repo):  # the pod's env is plain text in RunPod's console and API
        problems.append(
            f"env.git_repo={redact(config.env.git_repo)} holds credentials, which would reach the pod as plain text "
            "(RunPod's console and API show a pod's env): remove them from the URL, list TRAINPOD_GIT_TOKEN under "
            "`secrets` (sent as {{ RUNPOD_SECRET_TRAINPOD_GIT_TOKEN }}; TRAINPOD_GIT_USER in env.extra where the "
            "server wants a user other than x-access-token) and create the secret in RunPod's console"
        )
    for name, value in config.env.extra.items():
        if is_secret_name(name) and not REFERENCE.match(value):
            problems.append(
                f"env.extra.{name} holds a value, and its name says it is a secret: list {name} "
                "under `secrets` "
                f"(sent as {{{{ RUNPOD_SECRET_{name} }}}}) and create the secret in RunPod's console"
            )
        elif _url_credentials(value):  # MLFLOW_TRACKING_URI=https://user:password@host: a secret by its value
            problems.append(
                f"env.extra.{name}={redact(value)} holds credentials in its URL, which would reach the pod as plain "
                f"text (RunPod's console and API show a pod's env): list {name} under `secrets` (sent as "
                f"{{{{ RUNPOD_SECRET_{name} }}}}) and create the secret in RunPod's console with the whole URL"
            )
    return problems


def _url_credentials(url: str) -> bool:
    """Whether `url` carries a password, or a token as its user (_TOKEN_AS_USER)."""
    userinfo, at, _ = urlsplit(url).netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    return bool(at) and (bool(password) or bool(_TOKEN_AS_USER.match(unquote(user))))


def secret_reference(name: str) -> str:
    return "{{ RUNPOD_SECRET_" + name + " }}"


def allowed_cuda_versions(config: DeployConfig) -> list[str]:
    """The image's CUDA version and every newer one RunPod knows: a newer driver runs older CUDA."""
    wanted = _version(config.image.cuda_version or "0")
    return [v for v in CUDA_VERSIONS if _version(v) >= wanted]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def pod_env(config: DeployConfig, secret_values: dict[str, str] | None = None) -> dict[str, str]:
    """The pod's environment: the contract's variables, extras, then secrets (references by default).

    `secret_values` (from the user's shell, only with --secrets-from-env) replaces the references.
    """
    env = {
        "TRAINPOD_WORKLOAD": config.workload,
        "TRAINPOD_CONFIG": config.config,
        "TRAINPOD_RUN": config.run,
        "TRAINPOD_VOLUME": config.volume.mount_path,
        "TRAINPOD_ON_FINISH": config.env.on_finish,
        "TRAINPOD_MAX_FAILED_STARTS": str(config.env.max_failed_starts),
    }
    optional = {
        "TRAINPOD_SET": config.env.set,
        "TRAINPOD_GIT_REPO": config.env.git_repo,
        "TRAINPOD_GIT_REF": config.env.git_ref if config.env.git_repo else "",
        # The run's price: rank 0 on node 0 counts the whole cluster's cost against the budget.
        "TRAINPOD_GPU_HOURLY_USD": _usd(
            None if config.budget.hourly_usd is None else config.budget.hourly_usd * config.nodes
        ),
        # A single pod without a price reads its own from RunPod at boot; a cluster's node cannot (its price is
        # all the nodes'), and given a budget alone it would refuse to start (exit 2). Deploy refuses such a
        # cluster config; a supervisor's replacement of one deployed before still runs, its budget kept by
        # the supervisor from RunPod's cost.
        "TRAINPOD_BUDGET_USD": _usd(config.budget.budget_usd)
        if config.budget.hourly_usd is not None or config.nodes == 1
        else "",
        "TRAINPOD_THEN_WORKLOAD": config.then.workload if config.then is not None else "",
        "TRAINPOD_THEN_CONFIG": config.then.config if config.then is not None else "",
    }
    env.update({name: value for name, value in optional.items() if value})
    env.update(config.env.extra)
    for name in config.secrets:
        env[name] = secret_values[name] if secret_values is not None else secret_reference(name)
    # The pod's log filter knows a secret by its variable's name (log.is_secret_name): the others are named to it,
    # or a program's print of one reached program.log and the console unmasked.
    unknown_by_name = [name for name in config.secrets if not is_secret_name(name)]
    if unknown_by_name:
        env[SECRET_NAMES_ENV] = ",".join(unknown_by_name)
    if len(env) > MAX_POD_ENV:
        raise ConfigError(
            [
                f"the pod would get {len(env)} environment variables, RunPod allows at most {MAX_POD_ENV}; "
                f"remove {len(env) - MAX_POD_ENV} from env.extra or secrets (or move settings into the "
                "workload's YAML / env.set)"
            ]
        )
    return env


def secrets_from_shell(config: DeployConfig, environ: dict[str, str]) -> dict[str, str]:
    """The secrets' values from the user's shell (only when asked with --secrets-from-env)."""
    missing = [name for name in config.secrets if not environ.get(name)]
    if missing:
        raise ConfigError(
            [f"--secrets-from-env: {', '.join(missing)} not set in this shell; export them or drop the flag "
             "(the pod then uses RunPod secrets of those names)"]
        )  # fmt: skip
    return {name: environ[name] for name in config.secrets}


def secrets_sent_as_values(config: DeployConfig, env: dict[str, str] | None) -> bool | None:
    """Whether a pod's `env` holds the config's secrets as values (deploy --secrets-from-env) rather than
    RunPod references; None when it holds none of them (no secrets in the config, or no env to read)."""
    sent = {name: env[name] for name in config.secrets if env and name in env}
    if not sent:
        return None
    return any(value != secret_reference(name) for name, value in sent.items())


def _usd(value: float | None) -> str:
    return "" if value is None else f"{value:g}"


def template_name(config: DeployConfig) -> str:
    return "trainpod-" + config.image.flavour + "-" + re.sub(r"[^A-Za-z0-9._-]+", "-", config.image.name)


def template_body(config: DeployConfig) -> dict[str, Any]:
    """A TemplateCreateInput: the image and what every pod of it shares; never a secret's value."""
    return {
        "name": template_name(config),
        "imageName": config.image.name,
        "category": "NVIDIA" if config.image.flavour == "cuda" else "CPU",
        "isServerless": False,
        "isPublic": False,
        "containerDiskInGb": config.pod.container_disk_gb,
        "volumeInGb": 0,
        "volumeMountPath": config.volume.mount_path,
        "dockerStartCmd": [f"{IMAGE_ROOT}/entrypoints/boot"],
        "ports": list(config.pod.ports),
        "env": {
            "TRAINPOD_VOLUME": config.volume.mount_path,
            **{n: secret_reference(n) for n in config.secrets},
        },
    }


# PodCreateInput.dataCenterIds' enum in RunPod's REST v1 description. Newer data centers with network
# volumes (US-MD-1, US-MO-1, ...: remote/s3.py's list) are not in it, and a request naming one is refused
# as invalid; RunPod places a pod with a networkVolumeId in the volume's data center anyway, so for those
# the field is left out.
POD_CREATE_DATA_CENTERS = frozenset(
    ("EU-RO-1", "CA-MTL-1", "EU-SE-1", "US-IL-1", "EUR-IS-1", "EU-CZ-1", "US-TX-3", "EUR-IS-2", "US-KS-2",
     "US-GA-2", "US-WA-1", "US-TX-1", "CA-MTL-3", "EU-NL-1", "US-TX-4", "US-CA-2", "US-NC-1", "OC-AU-1",
     "US-DE-1", "EUR-IS-3", "CA-MTL-2", "AP-JP-1", "EUR-NO-1", "EU-FR-1", "US-KS-3", "US-GA-1")
)  # fmt: skip


def pod_body(
    config: DeployConfig,
    template_id: str,
    volume_id: str,
    env: dict[str, str] | None = None,
    spot: bool | None = None,
) -> dict[str, Any]:
    """A PodCreateInput for `<run>-<workload>` on the volume; `env` and `spot` override the config's (the
    same pod again, as it was deployed: `--on-demand` of a spot YAML stays on demand)."""
    body: dict[str, Any] = {
        "name": config.pod_name,
        "templateId": template_id,
        "imageName": config.image.name,
        "cloudType": config.pod.cloud,
        "networkVolumeId": volume_id,
        "volumeMountPath": config.volume.mount_path,
        "containerDiskInGb": config.pod.container_disk_gb,
        "ports": list(config.pod.ports),
        "dockerStartCmd": [f"{IMAGE_ROOT}/entrypoints/{config.workload}"],
        "env": env if env else pod_env(config),
    }
    if config.volume.data_center in POD_CREATE_DATA_CENTERS:  # a network volume attaches only in its own
        body["dataCenterIds"] = [config.volume.data_center]
    if config.image.flavour == "cuda":
        body |= {
            "computeType": "GPU",
            "gpuTypeIds": list(config.pod.gpu_types),
            "gpuTypePriority": "custom",  # RunPod tries the types in our order, not by availability
            "gpuCount": config.pod.gpu_count,
            "interruptible": config.pod.spot if spot is None else spot,
            "allowedCudaVersions": allowed_cuda_versions(config),
        }
    else:
        body |= {
            "computeType": "CPU",
            "cpuFlavorIds": list(config.pod.cpu_flavors),
            "cpuFlavorPriority": "custom",
            "vcpuCount": config.pod.vcpu_count,
        }
    return body


def ensure_template(client: RunPodClient, config: DeployConfig) -> Template:
    body = template_body(config)
    existing = next((t for t in client.list_templates() if t.name == body["name"]), None)
    if existing is None:
        template = client.create_template(body)
        log.info("template %s created (%s)", body["name"], template.id)
        return template
    if existing.image_name == body["imageName"] and existing.env == body["env"]:
        log.info("template %s is up to date (%s)", body["name"], existing.id)
        return existing
    update = {k: v for k, v in body.items() if k not in ("category", "isServerless")}  # not updatable
    template = client.update_template(existing.id, update)
    log.info("template %s updated (%s)", body["name"], existing.id)
    return template


def ensure_volume(client: RunPodClient, config: DeployConfig) -> NetworkVolume:
    want = config.volume
    for volume in client.list_network_volumes():
        if volume.name == want.name and volume.data_center_id == want.data_center:
            log.info(
                "network volume %s reused (%s, %d GB in %s)",
                want.name,
                volume.id,
                volume.size_gb,
                want.data_center,
            )
            return _resized(client, volume, want.size_gb)
    volume = client.create_network_volume(want.name, want.size_gb, want.data_center)
    log.info(
        "network volume %s created (%s, %d GB in %s)", want.name, volume.id, want.size_gb, want.data_center
    )
    return volume


def _resized(client: RunPodClient, volume: NetworkVolume, size_gb: int) -> NetworkVolume:
    """The volume grown to a larger volume.size_gb (what a full volume, exit 5, asks for); a smaller one cannot be
    had (RunPod never shrinks a volume), and is said so rather than passed over."""
    if size_gb > volume.size_gb:
        try:
            grown = client.grow_network_volume(volume.id, size_gb)
        except RunPodAuthError:
            raise
        except RunPodError as exc:  # the deploy goes on: the run fits as well as it did, and the user is told
            log.warning("network volume %s stays at %d GB: RunPod refused to grow it to volume.size_gb=%d (%s); "
                        "grow it in RunPod's console (Storage)", volume.name, volume.size_gb, size_gb,
                        exc.status)  # fmt: skip
            return volume
        log.info(
            "network volume %s grown from %d to %d GB (volume.size_gb)", volume.name, volume.size_gb, size_gb
        )
        return grown
    if size_gb < volume.size_gb:
        log.warning("network volume %s stays at %d GB (and is billed so): RunPod cannot shrink a volume to "
                    "volume.size_gb=%d; set volume.size_gb: %d to say what is there",
                    volume.name, volume.size_gb, size_gb, volume.size_gb)  # fmt: skip
    return volume


def bring_back(
    client: RunPodClient,
    config: DeployConfig,
    old: Pod | None,
    template_id: str | None = None,
    volume_id: str | None = None,
    env: dict[str, str] | None = None,
    replace: bool = False,
) -> tuple[Pod, str]:
    """Start an EXITED pod again, or (start refused, no pod, or `replace`) create one on the same volume.

    `replace`: never start `old` again (its machine cannot run the image): a new pod, which RunPod
    places on a machine with a free GPU of the config's types, in the config's order.
    `env` (deploy: from the config) wins; without it a replacement keeps the old pod's env and its
    spot setting (a supervisor reads the YAML, which `deploy --spot/--on-demand` may have overridden).
    Returns the pod and what was done ("started" or "created"); RunPodError when both fail.
    """
    if old is not None and not replace:
        try:
            client.start_pod(old.id)
            return old, "started"
        except RunPodAuthError:
            raise
        except RunPodError as exc:
            log.info(
                "start of pod %s refused (%s): creating a new pod on the same volume", old.id, exc.status
            )
    if old is not None:
        template_id = template_id or old.template_id  # deploy's (the config's image) wins
        volume_id = old.network_volume_id or volume_id
    if template_id is None or volume_id is None:
        template_id, volume_id = ensure_template(client, config).id, ensure_volume(client, config).id
    spot = None
    if env is None and old is not None:
        # The supervisor's replacement gets exactly the env and spot setting the interrupted pod had.
        env, spot = old.env, old.interruptible
    body = pod_body(config, template_id, volume_id, env=env, spot=spot)
    try:
        pod = client.create_pod(body)
    except RunPodNoCapacity as exc:
        raise no_capacity(config, bool(body.get("interruptible")), exc) from None
    if old is not None:
        _terminate_quietly(client, old)  # one pod per name: the replacement takes over
    return pod, "created"


def no_capacity(config: DeployConfig, spot: bool, exc: RunPodNoCapacity) -> RunPodNoCapacity:
    """RunPod placed no pod of `config` for want of a free machine: exit 75 saying so and the ways on, never
    'check the config' (the config is fine; spot machines run out first and most often)."""
    if config.image.flavour == "cuda":
        kind = f"{'spot' if spot else 'on-demand'} machine free with {config.pod.gpu_count} x any of pod.gpu_types"
        machines, choice = f"{kind} {list(config.pod.gpu_types)}", "more GPU types in pod.gpu_types"
    else:
        flavors = list(config.pod.cpu_flavors)
        machines = f"machine free with {config.pod.vcpu_count} vCPUs of any of pod.cpu_flavors {flavors}"
        choice = "more CPU flavors in pod.cpu_flavors"
    return RunPodNoCapacity(
        f"no capacity: RunPod has no {machines} in the {config.pod.cloud} cloud in {config.volume.data_center} "
        f"(the network volume's data center) now ({exc.status} to POST /pods: no instances available). Nothing of "
        "the pod was made and the config is fine: deploy again later, or `trainpod supervise "
        f"{config.run} --config ...`, which tries again with backoff; or widen the choice: {choice}"
        + (", --on-demand (spot machines run out first)" if spot else "")
        + ", the other pod.cloud, or a volume in another data center (volume.name and volume.data_center: a new "
        "volume there; the run's checkpoints stay on this one)",
        exc.status,
    )


def _terminate_quietly(client: RunPodClient, pod: Pod) -> None:
    try:
        client.terminate_pod(pod.id)
    except RunPodAuthError:
        raise
    except RunPodError as exc:
        log.warning(
            "could not terminate the replaced pod %s (%s); terminate it in the console", pod.id, exc.status
        )


def deploy(
    client: RunPodClient,
    config: DeployConfig,
    secret_values: dict[str, str] | None = None,
    deployed: str | None = None,
    accepted: Callable[[], None] = lambda: None,
) -> Deployment | ClusterDeployment:
    """Template, volume and pod of `config`, each created only when missing; or (nodes > 1) its cluster.
    `deployed`: the deploy's record (DeployRecord as JSON) for a new pod's env, DEPLOYED_ENV. `accepted`: called
    once nothing refuses the deploy any more, before anything is made or started (`trainpod deploy` clears the
    run's stop there: a refused deploy changes nothing)."""
    if config.nodes > 1:
        return deploy_cluster(client, config, secret_values, accepted)
    env = pod_env(config, secret_values)  # first: a config with too many variables sends nothing
    # At RunPod's limit the pod goes without its record: only a deploy that reaches the volume writes it then.
    if deployed is not None and len(env) < MAX_POD_ENV:
        env[DEPLOYED_ENV] = deployed
    pods = client.list_pods(name=config.pod_name)
    refuse_another_volume(client, config, pods)  # first: nothing is made or started for a config that moved
    refuse_beside_a_cluster(client, config)
    accepted()
    template = ensure_template(client, config)
    volume = ensure_volume(client, config)
    running = next((p for p in pods if p.desired_status == "RUNNING"), None)
    if running is not None:
        log.info("pod %s (%s) is already running: reusing it", running.name, running.id)
        changes = _differences(running, pod_body(config, template.id, volume.id, env))
        if changes:  # never replaced while it trains; but the user must know the new config is not running
            log.warning("pod %s (%s) was made from another config (its %s differ): it goes on as it is; to run "
                        "this config, `trainpod stop %s` and deploy again (it resumes from the last checkpoint)",
                        running.name, running.id, ", ".join(changes), config.run)  # fmt: skip
        return Deployment(template, volume, running, "reused")
    exited = next((p for p in pods if p.desired_status == "EXITED"), None)
    changes = [] if exited is None else _differences(exited, pod_body(config, template.id, volume.id, env))
    changed = bool(changes)
    if changed:
        log.info("pod %s (%s) was made from another config (its %s differ): replacing it", exited.name,
                 exited.id, ", ".join(changes))  # fmt: skip
    pod, action = bring_back(client, config, exited, template.id, volume.id, env, replace=changed)
    log.info("pod %s (%s) %s", pod.name, pod.id, action)
    return Deployment(template, volume, pod, action)


def refuse_beside_a_cluster(client: RunPodClient, config: DeployConfig) -> None:
    """ConfigError (exit 2) while the run has an Instant Cluster (deployed with nodes > 1): a pod beside it would
    train the same run, refused the run's lease (exit 75, a duplicate) for as long as the cluster holds it."""
    cluster = next(iter(client.list_clusters(name=config.pod_name)), None)
    if cluster is None:
        return
    raise ConfigError(
        [
            f"nodes=1: run {config.run} has the Instant Cluster {cluster.name} ({cluster.id}, {cluster.node_count} "
            f"nodes) and a pod beside it would train the same run; `trainpod stop {config.run}` (which deletes "
            "the cluster; the volume keeps the run) first, then deploy again: the pod resumes from the last "
            "checkpoint"
        ]
    )


def refuse_another_volume(client: RunPodClient, config: DeployConfig, pods: list[Pod]) -> None:
    """ConfigError (exit 2) when the run's pod mounts another network volume than `config` names (volume.name or
    volume.data_center changed since it was deployed). The run's checkpoints and data are on the pod's volume:
    starting or reusing the pod would train there beside a new, billed and unused volume, and a new pod on the
    new volume would start the run over; the user chooses, knowing which."""
    pod = next((p for p in pods if p.network_volume_id), None)
    if pod is None:
        return
    volume = next((v for v in client.list_network_volumes() if v.id == pod.network_volume_id), None)
    want = config.volume
    if volume is None or (volume.name, volume.data_center_id) == (want.name, want.data_center):
        return
    raise ConfigError(
        [
            f"volume: pod {pod.name} ({pod.id}) is on network volume {volume.name!r} ({volume.id}) in "
            f"{volume.data_center_id}, which holds run {config.run}'s checkpoints and data; this config names "
            f"{want.name!r} in {want.data_center}. To go on where the run is, set volume.name: {volume.name} and "
            f"volume.data_center: {volume.data_center_id} again. To move the run there, `trainpod push` its "
            f"datasets to the new volume, `trainpod stop {config.run} --terminate` and deploy again: the new pod "
            f"starts the run over (its checkpoints stay on {volume.name!r}; `trainpod pull {config.run}` fetches "
            "them)"
        ]
    )


def _differences(pod: Pod, body: dict[str, Any]) -> list[str]:
    """What `pod` runs otherwise than `body` asks for, by name only (an env may hold secrets' values). The deploy's
    record in the env is no difference: it holds the time of each deploy."""

    def config_env(env: dict[str, str] | None) -> dict[str, str]:
        return {name: value for name, value in (env or {}).items() if name != DEPLOYED_ENV}

    differs = {
        "image": pod.image != body["imageName"],
        "env": config_env(pod.env) != config_env(body["env"]),
        "spot setting": pod.interruptible != body.get("interruptible", False),
        # A stopped pod may list no GPU (released while it is stopped): what it does not say is no difference.
        "GPU count": bool(pod.gpu_count) and "gpuCount" in body and pod.gpu_count != body["gpuCount"],
        "GPU type": bool(pod.gpu_type_id)
        and "gpuTypeIds" in body
        and pod.gpu_type_id not in body["gpuTypeIds"],
        # Raised after a pod ran out of disk: started again, the old pod would fill its old disk again.
        "container disk": bool(pod.container_disk_gb) and pod.container_disk_gb != body["containerDiskInGb"],
        "ports": bool(pod.ports) and sorted(pod.ports) != sorted(body["ports"]),
    }
    return [name for name, different in differs.items() if different]


def run_unit_names(run: str, workloads: Collection[str]) -> set[str]:
    """The names a run's pods and clusters have: `<run>-<workload>` for each registered workload
    (supervise included). Never a prefix match: the run `llama` does not own `llama-v2-pretrain`."""
    return {f"{run}-{workload}" for workload in workloads}


def run_pods(client: RunPodClient, run: str, workloads: Collection[str]) -> list[Pod]:
    """Every pod of a run: `<run>-<workload>` and its supervisor `<run>-supervise`."""
    names = run_unit_names(run, workloads)
    return [p for p in client.list_pods() if p.name in names]


def pod_line(pod: Pod) -> str:
    gpu = f"{pod.gpu_count} x {pod.gpu_type_id}" if pod.gpu_type_id else "cpu"
    cost = f"${pod.cost_per_hr:.2f}/hr" if pod.cost_per_hr is not None else "cost unknown"
    kind = "spot" if pod.interruptible else "on demand"
    return f"  pod {pod.name} ({pod.id}): {pod.desired_status}{_uptime(pod)} | {gpu} | {cost} | {kind}"


def _uptime(pod: Pod, now: float | None = None) -> str:
    """`, up 2h13m` for a running pod that says when it started; nothing otherwise."""
    from trainpod.train.reporting import hours_minutes

    if pod.desired_status != "RUNNING" or not pod.last_started_at:
        return ""
    try:
        started = datetime.datetime.fromisoformat(pod.last_started_at.replace("Z", "+00:00"))
    except ValueError:
        return ""
    now = time.time() if now is None else now
    return f", up {hours_minutes(max(0.0, now - started.timestamp()))}"


def stop_pod(client: RunPodClient, pod: Pod, terminate: bool = False) -> bool:
    """Stop (or terminate) the pod; False when it was gone already. A pod that terminated itself
    since it was listed (TRAINPOD_ON_FINISH=terminate) must not keep the run's other pods billing."""
    try:
        (client.terminate_pod if terminate else client.stop_pod)(pod.id)
    except RunPodNotFound:
        return False
    return True


def stop_run(
    client: RunPodClient,
    run: str,
    terminate: bool,
    workloads: Collection[str],
    echo: Callable[[str], None] = print,
) -> int:
    """Stop (or terminate) every pod of a run and delete its clusters; returns how many were acted on."""
    pods = [p for p in run_pods(client, run, workloads) if terminate or p.desired_status == "RUNNING"]
    pods.sort(
        key=lambda p: not p.name.endswith("-supervise")
    )  # its supervisor first: it cannot undo the rest
    for pod in pods:
        done = "terminated" if terminate else "stopped"
        if not stop_pod(client, pod, terminate):
            done = "already gone (terminated since it was listed)"
        echo(f"pod {pod.name} ({pod.id}) {done}")
    clusters = delete_run_clusters(client, run_unit_names(run, workloads))
    for cluster in clusters:
        echo(
            f"cluster {cluster.name} ({cluster.id}) deleted: v2 has no stop for clusters; the volume keeps the run"
        )
    if not pods and not clusters:
        echo(f"no {'' if terminate else 'running '}pods or clusters named {run}-*")
    return len(pods) + len(clusters)
