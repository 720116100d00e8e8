"""The one way trainpod reaches RunPod's REST API (https://rest.runpod.io/v1, and v2 at
https://api.runpod.io/v2 for what only v2 has), through `request`.

    client = RunPodClient.from_env()          # RUNPOD_API_KEY, else the runpod CLI's ~/.runpod/config.toml
    client.list_pods(name="tiny-pretrain-pretrain")
    client.request("GET", "/pods/ID/logs", api="v2", stream=True)   # an open response (Server-Sent Events)
    client.list_clusters(name="tiny-pretrain")   # Instant Clusters (v2 only); client.cluster_pods(ID)

Timeouts on every call; retries with exponential backoff and jitter on 429, 5xx, timeouts and
dropped connections (a 4xx other than 429 is our mistake and is not retried), honouring Retry-After.
A create (POST /pods, /v2/clusters, ...) is not idempotent: after a timeout, a 5xx or a dropped
connection RunPod may have made it anyway, so it is not sent again (the caller's next look by name
finds it); only a 429 or a connection that was never made is retried. Errors carry the status
code, the method and path and a hint, never the key and never the response body (RunPod's bodies
may echo the request, secrets included; a create's is read only to tell RunPod's "no instances available"
apart, RunPodNoCapacity, exit 75); the key goes to the origin it is meant for alone (a redirect
to another host, or from https to http, is followed without it). The official `runpod` SDK is not
used: it has no spot support, builds GraphQL without escaping, and pulls about 100 packages.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import random
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainpod.errors import ExitCode, TemporaryError, TrainpodError

log = logging.getLogger("trainpod.runpod")

DEFAULT_API_URL = "https://rest.runpod.io/v1"
API_URL_ENV = "TRAINPOD_RUNPOD_API_URL"
DEFAULT_API_V2_URL = "https://api.runpod.io/v2"  # v2 (beta) lives on another host than v1
API_V2_URL_ENV = "TRAINPOD_RUNPOD_API_V2_URL"
KEY_ENV = "RUNPOD_API_KEY"
# Where the runpod CLIs keep the key: the Python CLI writes `[default] api_key = "..."` to
# config.toml (older releases: credentials.toml); runpodctl writes a top-level `apikey = "..."`.
CLI_CONFIG_FILES = ("~/.runpod/config.toml", "~/.runpod/credentials.toml")
RETRY_AFTER_CAP_S = 300.0


class RunPodError(TrainpodError):
    """RunPod refused or failed a request; the message names the endpoint and the status."""

    exit_code = ExitCode.BAD_INPUT

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RunPodAuthError(RunPodError):
    """No key, or RunPod rejected it (401, or a 403 about the key): nothing will work until the user fixes the key."""


class RunPodForbidden(RunPodAuthError):
    """403 about what the request names, not the key (v2's "no access to this pool"): the key works, but as with a
    key refused every later try of the same request fails until the user acts, so it ends deploy and supervise (exit
    2) as a refused key does, with its own fix."""


# A 403 is about what was asked for when RunPod's words name a thing the request names and not the key; any other
# (the key named, a bare "Forbidden", no words) stays the key refused, as RunPod's 403s were read before.
KEY_WORDS = re.compile(r"\b(api[ _-]?key|key|token|credential|unauthori[sz]ed|authenticat)", re.IGNORECASE)
RESOURCE_WORDS = re.compile(
    r"\b(pool|gpu|volume|template|data ?cent(er|re)|region|cloud|cluster|pod|resource)s?\b", re.IGNORECASE
)


class RunPodNoFunds(RunPodAuthError):
    """402: the account's balance cannot pay for what was asked. As with a key refused, every later try (another GPU
    type, a supervisor's next start) fails the same way until the user acts: adds funds."""


class RunPodNotFound(RunPodError):
    """404: the pod, template or volume does not exist (any more)."""


class RunPodUnavailable(RunPodError, TemporaryError):
    """429/5xx/timeouts that outlasted every retry: a later attempt may succeed (exit 75)."""

    exit_code = ExitCode.TEMPORARY


class RunPodNoCapacity(RunPodUnavailable):
    """A create RunPod has no machine free for now (NO_CAPACITY): the request is fine, a later one, or one of other
    GPU types, cloud or data center, may be placed (exit 75). Nothing was made."""


# RunPod's words when it has no machine free for a create: v2's description says capacity "carries no
# machine-readable code of its own, only a human-readable `detail`" of a 400 (v1 gives the same text as `error`),
# e.g. "There are no longer any instances available with the requested specifications. Please refresh and try
# again." Matched narrowly: any other refusal stays the request's (_client_error).
NO_CAPACITY = re.compile(r"\bno (?:longer any )?instances available\b", re.IGNORECASE)
ERROR_BODY_READ_LIMIT = 64 * 1024  # an error's JSON is a line; a proxy's HTML page is not read whole


@dataclass(frozen=True)
class Pod:
    id: str
    name: str
    desired_status: str  # RUNNING, EXITED or TERMINATED
    image: str = ""
    env: dict[str, str] = field(default_factory=dict)
    gpu_type_id: str | None = None
    gpu_count: int = 0
    cost_per_hr: float | None = None
    interruptible: bool = False
    network_volume_id: str | None = None
    template_id: str | None = None
    machine_id: str | None = None
    last_status_change: str = ""
    last_started_at: str = (
        ""  # v1: when it was last started (ISO 8601, UTC): `trainpod status` shows its uptime
    )
    # 0 and () where the API does not say (v2): unknown, never a difference from a config
    container_disk_gb: int = 0
    ports: tuple[str, ...] = ()
    cluster_id: str | None = None  # v2: the Instant Cluster this pod is a node of
    node_rank: int | None = None  # v2: its NODE_RANK in that cluster

    @classmethod
    def from_api_v2(cls, data: dict[str, Any]) -> Pod:
        """A pod as REST v2 describes it (Pod: `status`, `cost`, `mounts`, `cluster`)."""
        gpu = data.get("gpu") or {}
        network = ((data.get("mounts") or {}).get("network") or [{}])[0]
        cluster = data.get("cluster") or {}
        return cls(
            id=data["id"],
            name=data.get("name") or "",
            desired_status=data.get("status") or "",
            image=data.get("image") or "",
            env=dict(data.get("env") or {}),
            gpu_type_id=gpu.get("id"),
            gpu_count=int(gpu.get("count") or 0),
            cost_per_hr=float(data["cost"]) if data.get("cost") is not None else None,
            network_volume_id=network.get("volumeId"),
            template_id=data.get("template"),
            last_status_change=data.get("lastStatusChange") or "",
            cluster_id=cluster.get("id"),
            node_rank=cluster.get("rank"),
        )

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> Pod:
        gpu = data.get("gpu") or {}
        machine = data.get("machine") or {}
        # The adjusted price (discounts) when RunPod gives one; the field may be there as null.
        cost = next((data[k] for k in ("adjustedCostPerHr", "costPerHr") if data.get(k) is not None), None)
        return cls(
            id=data["id"],
            name=data.get("name") or "",
            desired_status=data.get("desiredStatus") or "",
            image=data.get("image") or data.get("imageName") or "",
            env=dict(data.get("env") or {}),
            gpu_type_id=gpu.get("id") or machine.get("gpuTypeId"),
            gpu_count=int(gpu.get("count") or 0),
            cost_per_hr=float(cost) if cost is not None else None,
            interruptible=bool(data.get("interruptible")),
            network_volume_id=data.get("networkVolumeId") or (data.get("networkVolume") or {}).get("id"),
            template_id=data.get("templateId"),
            machine_id=data.get("machineId"),
            last_status_change=data.get("lastStatusChange") or "",
            last_started_at=data.get("lastStartedAt") or "",
            container_disk_gb=int(data.get("containerDiskInGb") or 0),
            ports=tuple(data.get("ports") or ()),
        )


@dataclass(frozen=True)
class Cluster:
    """A RunPod Instant Cluster (REST v2): `node_count` identical pods; its members come from cluster_pods."""

    id: str
    name: str
    gpu_type_id: str
    gpu_count_per_pod: int
    node_count: int
    data_center_id: str | None = None
    members_by_status: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> Cluster:
        compute = data.get("compute") or {}
        return cls(
            id=data["id"],
            name=data.get("name") or "",
            gpu_type_id=compute.get("gpuTypeId") or "",
            gpu_count_per_pod=int(compute.get("gpuCountPerPod") or 0),
            node_count=int(compute.get("podCount") or 0),
            data_center_id=data.get("dataCenterId"),
            members_by_status=dict((data.get("pods") or {}).get("byStatus") or {}),
        )


@dataclass(frozen=True)
class Template:
    id: str
    name: str
    image_name: str
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> Template:
        return cls(
            data["id"], data.get("name") or "", data.get("imageName") or "", dict(data.get("env") or {})
        )


@dataclass(frozen=True)
class NetworkVolume:
    id: str
    name: str
    size_gb: int
    data_center_id: str

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> NetworkVolume:
        return cls(
            data["id"], data.get("name") or "", int(data.get("size") or 0), data.get("dataCenterId") or ""
        )


@dataclass(frozen=True)
class GpuOffer:
    """One GPU type in RunPod's v2 catalog: list prices per GPU-hour and, when asked, current stock."""

    id: str
    name: str
    memory_gb: int
    price_secure: float | None
    price_community: float | None
    availability: str | None = None  # NONE, LOW, MEDIUM, HIGH
    cuda_versions: dict[str, bool] = field(default_factory=dict)  # version -> a machine on it is free now
    data_centers: dict[str, str] = field(default_factory=dict)  # data center id -> availability

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> GpuOffer:
        price = data.get("price") or {}
        return cls(
            id=data["id"],
            name=data.get("name") or data["id"],
            memory_gb=int(data.get("memory") or 0),
            price_secure=price.get("secure"),
            price_community=price.get("community"),
            availability=data.get("availability"),
            cuda_versions={c["version"]: bool(c["available"]) for c in data.get("cudaVersions") or []},
            data_centers={d["id"]: d.get("availability") or "" for d in data.get("dataCenters") or []},
        )

    def price(self, cloud: str) -> float | None:
        return self.price_secure if cloud == "SECURE" else self.price_community


def _key_from_cli_config(home: Path | None = None) -> str | None:
    for raw in CLI_CONFIG_FILES:
        path = Path(raw.replace("~", str(home), 1)) if home else Path(raw).expanduser()
        if path.is_file():
            key = _key_in_toml(path.read_text(encoding="utf-8", errors="replace"))
            if key:
                return key
    return None


def _key_in_toml(text: str) -> str | None:
    try:
        import tomllib  # Python 3.11+; on 3.10 the pattern below reads the one line we need
    except ModuleNotFoundError:
        match = re.search(r'^\s*api_?key\s*=\s*"([^"]+)"', text, re.M | re.I)
        return match.group(1) if match else None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return None
    for table in (data, data.get("default") or {}, *[v for v in data.values() if isinstance(v, dict)]):
        for name in ("apikey", "api_key", "apiKey"):
            if isinstance(table.get(name), str) and table[name]:
                return table[name]
    return None


def api_key(environ: dict[str, str] | None = None, home: Path | None = None) -> str:
    """The key from RUNPOD_API_KEY, else the runpod CLI's config file; RunPodAuthError when neither."""
    environ = os.environ if environ is None else environ
    # A key has no whitespace: a line end from a .env file written on Windows (CR) is not part of it.
    key = (environ.get(KEY_ENV) or "").strip() or (_key_from_cli_config(home) or "").strip()
    if not key:
        raise RunPodAuthError(
            f"no RunPod API key: {KEY_ENV} is unset and no api_key is in {' or '.join(CLI_CONFIG_FILES)}; "
            f"create a key at https://console.runpod.io/user/settings and export {KEY_ENV}=... "
            "(or run `runpod config`)"
        )
    if any(char.isspace() or not char.isprintable() for char in key):
        # http.client would refuse the header with a ValueError that quotes it, key and all.
        raise RunPodAuthError(
            f"the RunPod API key ({KEY_ENV} or the runpod CLI's config file) has a line break, a space or a "
            "control character inside; copy it again from https://console.runpod.io/user/settings"
        )
    return key


class RunPodClient:
    """RunPod's REST API; every call goes through `request` (timeout, retries, clean errors)."""

    def __init__(
        self,
        key: str,
        base_url: str = DEFAULT_API_URL,
        base_url_v2: str = DEFAULT_API_V2_URL,
        timeout_s: float = 30.0,
        max_attempts: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
        jitter: Callable[[], float] = random.random,
    ):
        self._key = key
        self.base_url = base_url.rstrip("/")
        self.base_url_v2 = base_url_v2.rstrip("/")
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.sleep = sleep
        self.jitter = jitter

    def __repr__(self) -> str:  # never the key, not even in a traceback's locals
        return f"RunPodClient({self.base_url})"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **kwargs: Any) -> RunPodClient:
        environ = os.environ if environ is None else environ
        base_url = environ.get(API_URL_ENV) or DEFAULT_API_URL
        base_url_v2 = environ.get(API_V2_URL_ENV) or DEFAULT_API_V2_URL
        return cls(api_key(environ), base_url=base_url, base_url_v2=base_url_v2, **kwargs)

    # ---------------------------------------------------------------- the one request function
    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, Any] | None = None,
        *,
        api: str = "v1",
        headers: dict[str, str] | None = None,
        stream: bool = False,
        timeout_s: float | None = None,
        idempotent: bool = True,
        answer_needed: bool = True,
    ) -> Any:
        """Send one call, retrying 429/5xx/timeouts; returns the decoded JSON (None when empty).

        `api="v2"` sends it to the v2 base URL. `stream=True` returns the open response once its
        status is 200 (the caller reads and closes it: Server-Sent Events); only opening is retried.
        `answer_needed=False` (a pod action, whose 200 RunPod's description gives no content): the
        status alone says it was done, and the body, JSON or not, is read and dropped.
        """
        endpoint = f"{method} {'/v2' if api == 'v2' else ''}{path}"
        url = (self.base_url_v2 if api == "v2" else self.base_url) + path
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        data = json.dumps(body).encode() if body is not None else None
        done_maybe_before = False  # an earlier try may have done it (its answer lost, or a 5xx)
        for attempt in range(1, self.max_attempts + 1):
            try:
                timeout = timeout_s or self.timeout_s
                return self._send(method, url, data, headers or {}, stream, timeout, answer_needed)
            except urllib.error.HTTPError as exc:
                retry_after = exc.headers.get("Retry-After") if exc.headers else None
                said = _answer_text(exc)  # read to tell answers of one status apart, never shown
                no_capacity = not idempotent and _says_no_capacity(exc.code, said)
                exc.close()
                if no_capacity:
                    raise RunPodNoCapacity(
                        f"RunPod has no machine free for {endpoint} now ({exc.code}: no instances available); "
                        "nothing was made",
                        exc.code,
                    ) from None
                if exc.code == 404 and method == "DELETE" and done_maybe_before:
                    return None  # an earlier try whose answer was lost deleted it: done, nothing left to bill
                if exc.code != 429 and exc.code < 500:
                    raise _client_error(exc.code, endpoint, said) from None
                status, problem, wait = exc.code, f"answered {exc.code}", self._delay(attempt, retry_after)
                maybe_done = exc.code != 429  # a 429 is refused before anything is done
            except TimeoutError:
                status, problem, wait = (
                    None,
                    f"timed out after {timeout_s or self.timeout_s:g} s",
                    self._delay(attempt, None),
                )
                maybe_done = True
            except urllib.error.URLError as exc:
                status, problem, wait = (
                    None,
                    f"could not be reached ({_reason(exc)})",
                    self._delay(attempt, None),
                )
                maybe_done = not isinstance(
                    exc.reason, (ConnectionRefusedError, socket.gaierror, TimeoutError)
                )
            except (ConnectionError, http.client.HTTPException) as exc:  # reset, or closed before answering
                status, problem, wait = (
                    None,
                    f"dropped the connection ({type(exc).__name__})",
                    self._delay(attempt, None),
                )
                maybe_done = True
            done_maybe_before = done_maybe_before or maybe_done
            not_resent = maybe_done and not idempotent  # a create RunPod may have made: never sent twice
            if attempt == self.max_attempts or not_resent:
                again = "; RunPod may have done it anyway, so it was not sent again: look before trying again"
                raise RunPodUnavailable(
                    f"RunPod {endpoint} {problem}, {attempt} attempt{'s' if attempt > 1 else ''} in a row"
                    f"{again if not_resent else ''}; RunPod or the "
                    "network is having trouble: try again later (https://uptime.runpod.io)",
                    status,
                )
            log.warning(
                "RunPod %s %s; retry %d/%d in %.1f s", endpoint, problem, attempt, self.max_attempts - 1, wait
            )
            self.sleep(wait)
        raise AssertionError("not reached")

    def _send(
        self,
        method: str,
        url: str,
        data: bytes | None,
        extra: dict[str, str],
        stream: bool,
        timeout_s: float,
        answer_needed: bool = True,
    ) -> Any:
        accept = "text/event-stream" if stream else "application/json"
        headers = {**extra, "Authorization": f"Bearer {self._key}", "Accept": accept}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        response = _OPENER.open(req, timeout=timeout_s)  # noqa: S310 - https/our fake
        if stream:
            return response
        with response:
            raw = response.read()
        return json.loads(raw) if answer_needed and raw.strip() else None

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after:
            try:
                asked = float(retry_after)
            except ValueError:
                asked = math.nan  # an HTTP date: fall back to our own backoff
            if asked >= 0:  # not nan, not negative (a proxy's): sleep() raises ValueError on either
                return min(asked, RETRY_AFTER_CAP_S)
        capped = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return capped * (0.5 + 0.5 * self.jitter())  # jitter: many supervisors never retry in lockstep

    # ---------------------------------------------------------------- pods
    def list_pods(self, name: str | None = None) -> list[Pod]:
        # A pod's network volume is in the answer only when asked for (Pod.networkVolume, includeNetworkVolume):
        # deploy refuses a config whose volume moved by it, and a replacement goes on the same volume.
        query = {"name": name, "includeNetworkVolume": "true"}
        pods = [Pod.from_api(p) for p in self.request("GET", "/pods", query=query) or []]
        return [p for p in pods if name is None or p.name == name]  # the filter may be a prefix match

    def get_pod(self, pod_id: str) -> Pod | None:
        try:
            return Pod.from_api(self.request("GET", f"/pods/{_segment(pod_id)}"))
        except RunPodNotFound:
            return None

    def create_pod(self, body: dict[str, Any]) -> Pod:
        return Pod.from_api(self.request("POST", "/pods", body, idempotent=False))

    def start_pod(self, pod_id: str) -> None:
        self.request("POST", f"/pods/{_segment(pod_id)}/start", answer_needed=False)

    def stop_pod(self, pod_id: str) -> None:
        self.request("POST", f"/pods/{_segment(pod_id)}/stop", answer_needed=False)

    def terminate_pod(self, pod_id: str) -> None:
        self.request("DELETE", f"/pods/{_segment(pod_id)}", answer_needed=False)

    def open_pod_logs(
        self, pod_id: str, tail: int | None, last_event_id: str | None, read_timeout_s: float
    ) -> Any:
        """v2's log stream of a pod (Server-Sent Events), open: from `last_event_id` when given
        (RunPod then ignores `tail`), else the last `tail` lines first. The caller closes it."""
        return self.request(
            "GET",
            f"/pods/{_segment(pod_id)}/logs",
            query=None if last_event_id else {"tail": tail},
            api="v2",
            headers={"Last-Event-ID": last_event_id} if last_event_id else None,
            stream=True,
            timeout_s=read_timeout_s,
        )

    # ---------------------------------------------------------------- Instant Clusters (REST v2 only)
    def list_clusters(self, name: str | None = None) -> list[Cluster]:
        answer = self.request("GET", "/clusters", api="v2") or {}
        clusters = [Cluster.from_api(c) for c in answer.get("clusters") or []]
        return [c for c in clusters if name is None or c.name == name]

    def get_cluster(self, cluster_id: str) -> Cluster | None:
        try:
            return Cluster.from_api(self.request("GET", f"/clusters/{_segment(cluster_id)}", api="v2"))
        except RunPodNotFound:
            return None

    def create_cluster(self, body: dict[str, Any]) -> Cluster:
        return Cluster.from_api(self.request("POST", "/clusters", body, api="v2", idempotent=False))

    def delete_cluster(self, cluster_id: str) -> None:
        """Deletes the cluster and terminates every node (v2 has no stop for clusters); the volume stays."""
        self.request("DELETE", f"/clusters/{_segment(cluster_id)}", api="v2", answer_needed=False)

    def cluster_pods(self, cluster_id: str) -> list[Pod]:
        answer = self.request("GET", f"/clusters/{_segment(cluster_id)}/pods", api="v2") or {}
        return [Pod.from_api_v2(p) for p in answer.get("pods") or []]

    def get_pod_v2(self, pod_id: str) -> Pod | None:
        """The pod as v2 sees it, with its cluster membership (v1 knows nothing of clusters)."""
        try:
            return Pod.from_api_v2(self.request("GET", f"/pods/{_segment(pod_id)}", api="v2"))
        except RunPodNotFound:
            return None

    # ---------------------------------------------------------------- catalog (REST v2)
    def catalog_gpus(
        self, gpu_count: int = 1, cloud: str = "SECURE", cuda_versions: list[str] | None = None
    ) -> list[GpuOffer]:
        """Every GPU type with list prices, stock for pods of `gpu_count` GPUs and the CUDA versions offered."""
        query = {
            "include": "AVAILABILITY",
            "product": "POD",
            "count": gpu_count,
            "cloud": cloud,
            "cudaVersions": ",".join(cuda_versions) if cuda_versions else None,
        }
        answer = self.request("GET", "/catalog/gpus", query=query, api="v2") or {}
        return [GpuOffer.from_api(gpu) for gpu in answer.get("gpus") or []]

    # ---------------------------------------------------------------- templates
    def list_templates(self) -> list[Template]:
        return [Template.from_api(t) for t in self.request("GET", "/templates") or []]

    def get_template(self, template_id: str) -> Template | None:
        try:
            return Template.from_api(self.request("GET", f"/templates/{_segment(template_id)}"))
        except RunPodNotFound:
            return None

    def create_template(self, body: dict[str, Any]) -> Template:
        return Template.from_api(self.request("POST", "/templates", body, idempotent=False))

    def update_template(self, template_id: str, body: dict[str, Any]) -> Template:
        return Template.from_api(self.request("PATCH", f"/templates/{_segment(template_id)}", body))

    # ---------------------------------------------------------------- network volumes
    def list_network_volumes(self) -> list[NetworkVolume]:
        return [NetworkVolume.from_api(v) for v in self.request("GET", "/networkvolumes") or []]

    def grow_network_volume(self, volume_id: str, size_gb: int) -> NetworkVolume:
        """RunPod grows a volume only (the new size must be greater than the current one)."""
        body = {"size": size_gb}
        return NetworkVolume.from_api(self.request("PATCH", f"/networkvolumes/{_segment(volume_id)}", body))

    def create_network_volume(self, name: str, size_gb: int, data_center_id: str) -> NetworkVolume:
        body = {"name": name, "size": size_gb, "dataCenterId": data_center_id}
        return NetworkVolume.from_api(self.request("POST", "/networkvolumes", body, idempotent=False))


class _KeyStaysWithItsOrigin(urllib.request.HTTPRedirectHandler):
    """Follows a redirect with the key only within the origin (scheme, host, port) it was sent to. urllib
    copies every header of a request into the redirected one, so an answer naming another host (a proxy's, a
    log archive's, an http:// downgrade) would be handed the account's key, which rents GPUs on it."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[override]
        if req.get_method() not in ("GET", "HEAD"):
            raise RunPodError(
                f"RunPod answered {code} redirecting {req.get_method()} {urllib.parse.urlsplit(req.full_url).path} "
                f"to {_origin(newurl)[1]}: a create, update or delete is never sent on ({_what_sending_on_does(code)}); "
                f"nothing was sent there; check {API_URL_ENV} / {API_V2_URL_ENV} or the proxy in between",
                code,
            )
        redirected = super().redirect_request(req, fp, code, msg, headers, newurl)
        if redirected is not None and _origin(redirected.full_url) != _origin(req.full_url):
            redirected.remove_header("Authorization")
        return redirected


def _what_sending_on_does(code: int) -> str:
    """What following this redirect would do to a create, update or delete; 307 and 308 keep method and body."""
    if code in (307, 308):
        return f"a {code} asks for the same request, body and all, at that address"
    return f"a {code} turns it into a GET without its body: another request"


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.hostname, parts.port or {"http": 80, "https": 443}.get(parts.scheme)


_OPENER = urllib.request.build_opener(_KeyStaysWithItsOrigin)

DRY_RUN_VERBS = {"POST": "create", "PATCH": "update", "DELETE": "terminate"}


class DryRunClient(RunPodClient):
    """Prints each request (method, path, JSON body) and sends nothing, as if the account were empty."""

    def __init__(self, echo: Callable[[str], None] = print):
        super().__init__(key="", base_url=DEFAULT_API_URL)
        self.echo = echo
        self.sent: list[tuple[str, str, Any]] = []

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, Any] | None = None,
        *,
        api: str = "v1",
        **_: Any,
    ) -> Any:
        if method == "GET":
            return [] if path.count("/") == 1 else None  # lists are empty, nothing exists yet
        self.sent.append((method, path, body))
        shown = "" if body is None else "\n" + json.dumps(body, indent=2)
        kind = path.strip("/").split("/")[0].rstrip("s")
        what = (body or {}).get("name", "")
        shown_path = ("/v2" if api == "v2" else "") + path
        self.echo(f"would {DRY_RUN_VERBS.get(method, method)} {kind} {what}: {method} {shown_path}{shown}")
        return {**(body or {}), "id": f"<new {kind} id>", "desiredStatus": "RUNNING"}


def _client_error(status: int, endpoint: str, said: str | None = None) -> RunPodError:
    if status == 403 and said and RESOURCE_WORDS.search(said) and not KEY_WORDS.search(said):
        return RunPodForbidden(
            f"RunPod refused {endpoint} (403): the key was accepted, but what the request names is not open to "
            "it (a GPU type's pool, a data center, a volume or template of another account), or the key may read "
            "but not write; nothing was made. Check pod.gpu_types and volume.data_center against what the account "
            "can rent in RunPod's console, and that the key has All permissions "
            "(https://console.runpod.io/user/settings)",
            status,
        )
    if status in (401, 403):
        return RunPodAuthError(
            f"RUNPOD_API_KEY rejected: RunPod answered {status} to {endpoint}; the key is wrong, revoked, "
            "or lacks read/write permission (a pod's own key only controls that pod): create one with "
            "All permissions at https://console.runpod.io/user/settings",
            status,
        )
    if status == 402:
        return RunPodNoFunds(
            f"RunPod refused {endpoint} (402): the account's balance is too low to pay for it; nothing was made. "
            "Add funds (https://console.runpod.io/user/billing), then run the same command again",
            status,
        )
    if status == 404:
        return RunPodNotFound(f"RunPod {endpoint}: not found (404); it may have been terminated", status)
    if 300 <= status < 400:  # one urllib does not follow: no Location (a proxy's), a 308 on Python 3.10, ...
        return RunPodError(
            f"RunPod {endpoint} answered {status}, a redirect that was not followed (nothing sent on): RunPod's API "
            f"answers without redirects, so the URL or something in between is wrong; check {API_URL_ENV} / "
            f"{API_V2_URL_ENV} (unset: {DEFAULT_API_URL}, {DEFAULT_API_V2_URL}) or the proxy in between",
            status,
        )
    return RunPodError(
        f"RunPod refused {endpoint} ({status}): the request does not fit RunPod's API; check the deploy "
        "config's values (GPU type names, data center ids, sizes) against https://docs.runpod.io/api-reference",
        status,
    )


def _answer_text(exc: urllib.error.HTTPError) -> str | None:
    """RunPod's words in an error answer: `detail` (v2), `error` or `message` (v1); None when it has none. Read only
    to tell answers of one status apart, never shown: it may echo the request, secrets included."""
    try:
        answer = json.loads(exc.read(ERROR_BODY_READ_LIMIT) or b"null")
    except (OSError, ValueError, http.client.HTTPException):
        return None
    if not isinstance(answer, dict):
        return None
    text = answer.get("detail") or answer.get("error") or answer.get("message")
    return text if isinstance(text, str) else None


def _says_no_capacity(status: int, said: str | None) -> bool:
    """Whether RunPod's error answer is its "no instances available" (NO_CAPACITY), by its text alone."""
    if status in (401, 402, 403, 404, 429) or said is None:
        return False
    return NO_CAPACITY.search(said) is not None


def _reason(exc: urllib.error.URLError) -> str:
    return type(exc.reason).__name__ if not isinstance(exc.reason, str) else exc.reason


def _segment(value: str) -> str:
    return urllib.parse.quote(value, safe="")
