"""How a run is deployed on RunPod and supervised: image, pod, volume, env, secrets, budget, restarts.

    trainpod deploy configs/deploy/pretrain-spot.yaml [--dry-run] [--spot|--on-demand]
    trainpod supervise RUN --config configs/deploy/pretrain-spot.yaml

The pod's environment is built from this file alone (README, "The pod's environment"); secrets are
`{{ RUNPOD_SECRET_<name> }}` references that RunPod fills from the account's secrets.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from trainpod.config.loader import Section
from trainpod.log import SECRET_NAMES_ENV, redact

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
PORT = re.compile(r"([0-9]{1,5})/(?:http|tcp)")  # RunPod's form of an exposed port (PodCreateInput.ports)
# RunPod's `allowedCudaVersions` enum (PodCreateInput), newest first; tests/test_runpod_schema.py
# checks it against RunPod's OpenAPI file so the two cannot drift.
CUDA_VERSIONS = (
    "13.0",
    "12.9",
    "12.8",
    "12.7",
    "12.6",
    "12.5",
    "12.4",
    "12.3",
    "12.2",
    "12.1",
    "12.0",
    "11.8",
)
# The cu128 image (docker/constraints-cu128.txt): hosts reporting 12.8, 12.9 or 13.0 run it, which is
# most of RunPod's GPUs; CUDA 13.0 alone needs a driver >= 580, which few hosts have.
DEFAULT_IMAGE_CUDA = "12.8"
MAX_POD_ENV = 50  # RunPod's limit on environment variables per pod
MAX_CLUSTER_NODES = 250  # ClusterCompute.podCount's maximum in RunPod's v2 description
# The pod's variables the deploy sets from this file's fields (runpod.deploy.pod_env), and those fields: one in
# env.extra would replace the field's value in the pod alone (TRAINPOD_RUN: the pod trains another run than
# deploy, supervise, status and pull go by), so it is refused, naming the field to set instead.
SET_BY_DEPLOY = {
    "TRAINPOD_WORKLOAD": "workload",
    "TRAINPOD_CONFIG": "config",
    "TRAINPOD_RUN": "run",
    "TRAINPOD_VOLUME": "volume.mount_path",
    "TRAINPOD_ON_FINISH": "env.on_finish",
    "TRAINPOD_MAX_FAILED_STARTS": "env.max_failed_starts",
    "TRAINPOD_SET": "env.set",
    "TRAINPOD_GIT_REPO": "env.git_repo",
    "TRAINPOD_GIT_REF": "env.git_ref",
    "TRAINPOD_GPU_HOURLY_USD": "budget.hourly_usd",
    "TRAINPOD_BUDGET_USD": "budget.budget_usd",
    "TRAINPOD_THEN_WORKLOAD": "then.workload",
    "TRAINPOD_THEN_CONFIG": "then.config",
    SECRET_NAMES_ENV: "secrets",  # the secrets the pod's log filter would not know by their names
}


class ImageSettings(Section):
    """The image a pod runs (built by `make image push`)."""

    name: str = Field(description="Image reference, e.g. ghcr.io/you/trainpod:0.1.0 (or :0.1.0-cpu).")
    flavour: Literal["cuda", "cpu"] = Field(
        "cuda", description="cuda for GPU pods (pretrain, finetune), cpu for CPU pods (datagen, convert)."
    )
    cuda_version: str | None = Field(
        DEFAULT_IMAGE_CUDA,
        description="The CUDA version the cuda image is built for: 12.8 for the default cu128 image, 13.0 for "
        "cu130. Pods are limited to hosts reporting it or any newer version (allowedCudaVersions): RunPod "
        f"matches that list exactly. One of: {', '.join(CUDA_VERSIONS)}.",
    )

    @field_validator("cuda_version", mode="before")
    @classmethod
    def _version_written_as_a_number(cls, value: object) -> object:
        """`cuda_version: 12.8` unquoted is a YAML float: "Input should be a valid string" for a version the
        description lists. A number is read as the version it spells (13 and 13.0: "13.0")."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return f"{value:.1f}"
        return value

    @model_validator(mode="after")
    def _known_cuda(self) -> ImageSettings:
        if self.flavour == "cuda" and self.cuda_version not in CUDA_VERSIONS:
            raise ValueError(
                f"image.cuda_version={self.cuda_version!r} is not a CUDA version RunPod can select hosts by; "
                f"set it to one of: {', '.join(CUDA_VERSIONS)}"
            )
        return self


class PodSettings(Section):
    """What RunPod rents: GPU types in priority order (or CPU flavours), spot or on demand, cloud."""

    gpu_types: list[str] = Field(
        default_factory=list,
        description="RunPod GPU type ids in priority order, e.g. ['NVIDIA H100 80GB HBM3', 'NVIDIA H200']; "
        "the first that has a free machine is rented. Required for the cuda flavour.",
    )
    gpu_count: int = Field(
        1, ge=1, le=8, description="GPUs per pod, per node of a cluster (one training process each)."
    )
    cpu_flavors: list[Literal["cpu3c", "cpu3g", "cpu3m", "cpu5c", "cpu5g", "cpu5m"]] = Field(
        default_factory=lambda: ["cpu3c"], description="CPU flavours for cpu-flavour pods, in priority order."
    )
    vcpu_count: int = Field(8, ge=1, description="vCPUs of a CPU pod.")
    spot: bool = Field(
        True, description="true: an interruptible (spot) pod, cheaper, stopped at any time with 5 s warning."
    )
    cloud: Literal["SECURE", "COMMUNITY"] = Field("SECURE", description="SECURE or COMMUNITY cloud.")
    container_disk_gb: int = Field(
        40, ge=5, description="Container disk in GB: the image plus temp space; wiped on every restart."
    )
    ports: list[str] = Field(
        default_factory=lambda: ["22/tcp"],
        description="Ports to expose, each PORT/http or PORT/tcp (1-65535), e.g. 22/tcp.",
    )

    @field_validator("ports")
    @classmethod
    def _ports_in_runpods_form(cls, ports: list[str]) -> list[str]:
        """RunPod's API takes `[port number]/[protocol]`, http or tcp: checked here, before a template or a
        volume is made, rather than refused by RunPod with its 400."""
        bad = [p for p in ports if not ((m := PORT.fullmatch(p)) and 1 <= int(m.group(1)) <= 65535)]
        if bad:
            raise ValueError(
                f"{', '.join(repr(p) for p in bad)} not of the form PORT/http or PORT/tcp (1-65535), as RunPod "
                "takes them; write e.g. 22/tcp or 8888/http"
            )
        return ports


class VolumeSettings(Section):
    """The network volume that holds datasets, runs and checkpoints; created when none has the name."""

    name: str = Field("trainpod", min_length=1, description="Network volume name (reused when one exists).")
    size_gb: int = Field(
        100,
        ge=10,
        le=4000,
        description="Size in GB (10-4000); a later deploy with a larger one grows the volume (RunPod "
        "never shrinks one).",
    )
    data_center: str = Field(
        description="RunPod data center id of the volume, e.g. EU-RO-1; pods are created there."
    )
    mount_path: str = Field(
        "/workspace",
        # RunPod's volumeMountPath is an absolute path; a relative one would be TRAINPOD_VOLUME relative to the
        # pod's working directory: the run on the container disk, which every restart wipes.
        pattern=r"^/.",
        description="Where pods mount it (TRAINPOD_VOLUME): an absolute path, e.g. /workspace.",
    )


class EnvSettings(Section):
    """The pod's environment beyond workload, config and run (README, "The pod's environment")."""

    set: str = Field("", description="TRAINPOD_SET: config overrides, key.path=value separated by spaces.")
    git_repo: str = Field(
        "",
        description="TRAINPOD_GIT_REPO: a repo of configs cloned under repos/ (optional); no token in the URL "
        "(deploy refuses one): a private repo's goes in `secrets` as TRAINPOD_GIT_TOKEN.",
    )
    git_ref: str = Field(
        "",
        description="TRAINPOD_GIT_REF: branch, tag or commit of git_repo; empty: the remote's HEAD (its default "
        "branch), as in a pod without TRAINPOD_GIT_REF.",
    )
    on_finish: Literal["stop", "terminate", "idle"] = Field(
        "stop", description="TRAINPOD_ON_FINISH: what the pod does after DONE: stop, terminate or idle."
    )
    max_failed_starts: int = Field(
        3, ge=1, description="TRAINPOD_MAX_FAILED_STARTS: failed starts in a row before the run is FAILED."
    )
    extra: dict[str, str] = Field(
        default_factory=dict,
        description="Further variables, NAME: value (never secrets: use `secrets`; never one the deploy sets "
        "from a field, e.g. TRAINPOD_RUN: set `run`).",
    )


class BudgetSettings(Section):
    """Cost tracking in the pod and a cap the supervisor and the workload both respect."""

    hourly_usd: float | None = Field(
        None,
        ge=0,
        description="The pod's price per hour (per node of a cluster); the pod gets it times `nodes` as "
        "TRAINPOD_GPU_HOURLY_USD, the run's price. Unset, a single pod reads its own from RunPod at boot; "
        "a cluster with a budget needs it.",
    )
    budget_usd: float | None = Field(
        None, ge=0, description="TRAINPOD_BUDGET_USD: the most the run may spend; unset: no cap."
    )


class SuperviseSettings(Section):
    """How `trainpod supervise` brings interrupted pods back."""

    poll_s: float = Field(60.0, gt=0, description="Seconds between looks at the pods and the volume.")
    max_restarts: int = Field(
        50,
        ge=0,
        description="Starts or new pods the supervisor makes at most without the run's progress in between: "
        "a restart after which status.json's step moves on starts the count anew (a long spot run's "
        "interruptions); a supervisor that cannot see the volume counts every restart.",
    )
    backoff_s: float = Field(30.0, ge=0, description="First wait after a failed start; doubles each time.")
    max_backoff_s: float = Field(900.0, ge=0, description="Longest wait between failed starts.")
    max_failed_starts: int = Field(
        5,
        ge=1,
        description="Failed start attempts in a row (RunPod failing them) before supervising stops with exit 75; "
        "no machine free for any GPU type (spot's shortage) is waited out instead, every max_backoff_s at most.",
    )
    max_replacements: int = Field(
        3,
        ge=0,
        description="New pods in a row made because a pod's machine could not run the image (exit 4, e.g. a "
        "driver older than the image's CUDA) before supervising stops with exit 4.",
    )

    @model_validator(mode="after")
    def _backoff_range(self) -> SuperviseSettings:
        # The wait is min(max_backoff_s, backoff_s doubling): with the cap below the first wait, every wait is the
        # cap, and the backoff_s the user wrote is never used, silently.
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"supervise.max_backoff_s={self.max_backoff_s:g} is below supervise.backoff_s={self.backoff_s:g}: "
                "the longest wait would be shorter than the first; raise max_backoff_s or lower backoff_s"
            )
        return self


class ThenSettings(Section):
    """A conversion the pod runs after the run is DONE, before it stops: merge, export to MLX, push to the Hub
    without a second pod (docs/design.md, "Then: a conversion after DONE")."""

    workload: str = Field(
        "convert",
        description="TRAINPOD_THEN_WORKLOAD: a conversion workload of `trainpod run --help` (convert); checked "
        "against the registry when deploying.",
    )
    config: str = Field(
        min_length=1,
        description="TRAINPOD_THEN_CONFIG: its YAML, found as `config` is (env.set does not apply to it); its "
        "name is the run's, its outputs go to runs/<run>/export/.",
    )


class DeployConfig(Section):
    """One run on RunPod: the pod `<run>-<workload>` on a network volume, from a template for the image."""

    # Read by deploy, supervise, status and estimate, none of which takes --set: a missing field's message
    # says to add it to the YAML only (config.loader._describe).
    takes_overrides: ClassVar[bool] = False

    run: str = Field(pattern=NAME_PATTERN, description="Run name (TRAINPOD_RUN): runs/<run>/ on the volume.")
    workload: str = Field(
        description="TRAINPOD_WORKLOAD: a workload of `trainpod run --help` (datagen, pretrain, finetune, convert, "
        "...); checked against the registry (trainpod/workloads/) when deploying."
    )
    config: str = Field(
        description="TRAINPOD_CONFIG: the workload's YAML, as the pod sees it (a path in the image's configs/, "
        "in the synced git checkout, or on the volume)."
    )
    image: ImageSettings
    nodes: int = Field(
        1,
        ge=1,
        le=MAX_CLUSTER_NODES,
        description="Nodes (pods) that train together. 1: one pod (spot or on demand). More: a RunPod Instant "
        "Cluster (REST v2 POST /v2/clusters) of that many identical on-demand nodes in the volume's data "
        "center, each with pod.gpu_count GPUs of the first of pod.gpu_types RunPod accepts, one torchrun "
        "across them; the supervisor deletes and recreates it as one unit.",
    )
    pod: PodSettings = Field(default_factory=PodSettings, description="What RunPod rents.")
    volume: VolumeSettings
    env: EnvSettings = Field(default_factory=EnvSettings, description="The pod's environment.")
    secrets: list[str] = Field(
        default_factory=lambda: ["HF_TOKEN", "WANDB_API_KEY"],
        description="Variables filled from RunPod secrets of the same name ({{ RUNPOD_SECRET_<name> }}); "
        "create the secrets in RunPod's console first.",
    )
    budget: BudgetSettings = Field(default_factory=BudgetSettings, description="Cost tracking and cap.")
    then: ThenSettings | None = Field(
        None,
        description="A conversion the pod runs after the run is DONE, before it stops (a finetune's merge, "
        "its push to the Hub); the supervisor brings the pod back until it has run. Unset: the pod stops at DONE.",
    )
    supervise: SuperviseSettings = Field(default_factory=SuperviseSettings, description="Restart policy.")

    @property
    def pod_name(self) -> str:
        return f"{self.run}-{self.workload}"

    @model_validator(mode="after")
    def _consistent(self) -> DeployConfig:
        problems = []
        if self.image.flavour == "cuda" and not self.pod.gpu_types:
            problems.append("pod.gpu_types is empty; list GPU type ids in priority order for a cuda image")
        bad = [name for name in [*self.secrets, *self.env.extra] if not _is_env_name(name)]
        if bad:
            problems.append(f"{', '.join(bad)}: not environment variable names; use letters, digits and _")
        for name, value in self.env.extra.items():
            if name in SET_BY_DEPLOY:
                problems.append(
                    f"env.extra.{name}={redact(value)!r}: the deploy sets {name} from `{SET_BY_DEPLOY[name]}`, and a "
                    f"value here would replace it in the pod alone; remove it from env.extra and set "
                    f"`{SET_BY_DEPLOY[name]}` instead"
                )
            elif name == "TRAINPOD_DEPLOYED":
                problems.append(
                    f"env.extra.{name}: set by `trainpod deploy` itself (what it rented); remove it from env.extra"
                )
        problems += cluster_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def cluster_problems(config: DeployConfig) -> list[str]:
    """What an Instant Cluster (nodes > 1) cannot do, each with its fix; none for one pod.

    POST /v2/clusters (runpod-rest-v2-openapi.json, CreateClusterRequest) takes one GPU type, a GPU
    count per pod, a pod count, preferred data centers and a network mount: no spot, no cloud choice,
    no CUDA filter, no CPU nodes.
    """
    if config.nodes == 1:
        return []
    nodes = f"nodes={config.nodes}"
    problems = []
    if config.image.flavour != "cuda":
        problems.append(f"{nodes} with image.flavour={config.image.flavour!r}: an Instant Cluster's nodes are "
                        "GPU pods; set image.flavour: cuda and pod.gpu_types, or nodes: 1")  # fmt: skip
    if config.pod.spot:
        problems.append(f"{nodes} with pod.spot=true: RunPod's Instant Clusters have no spot option (POST "
                        "/v2/clusters has no interruptible field); set pod.spot: false, or nodes: 1")  # fmt: skip
    if config.then is not None:
        problems.append(f"{nodes} with then.config={config.then.config!r}: node 0 would convert while every other "
                        "node waited, billed; deploy the conversion as its own one-pod config once the run is "
                        "DONE, or nodes: 1")  # fmt: skip
    if config.pod.cloud != "SECURE":
        problems.append(f"{nodes} with pod.cloud={config.pod.cloud!r}: POST /v2/clusters has no cloud choice; "
                        "set pod.cloud: SECURE (or leave it out)")  # fmt: skip
    if not config.volume.data_center.strip():
        problems.append(f"{nodes} with volume.data_center empty: a cluster lives in one data center, the "
                        "network volume's; set volume.data_center, e.g. EU-RO-1")  # fmt: skip
    return problems


def _is_env_name(name: str) -> bool:
    import re

    return re.fullmatch(ENV_NAME_PATTERN, name) is not None
