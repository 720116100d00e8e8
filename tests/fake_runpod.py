"""A fake RunPod REST API on 127.0.0.1: the mock of RunPod itself (the only thing these tests mock).

    python tests/fake_runpod.py --derive    # rewrite tests/runpod_schema.json and runpod_v2_schema.json
                                            # from RunPod's OpenAPI files

It holds account state (pods, templates, network volumes, pod logs) in memory and validates every
request (method, path, query names, JSON body: field names, types, enums, required fields) against
`runpod_schema.json`, a small schema derived from RunPod's own OpenAPI description by
`derive_schema` (tests/test_runpod_schema.py keeps the two equal). Requests under /v2 are validated
the same way against `runpod_v2_schema.json`, derived from RunPod's v2 description by
`derive_schema_v2`: query parameters and headers by name, type, range, enum and date-time format.
`GET /v2/pods/{id}/logs` serves the pod's log lines as Server-Sent Events, resumes after
`Last-Event-ID` (exclusively), keeps the stream open for lines added later, and on demand cuts a
connection in the middle of an event (`drop_after`). Event ids are the lines' timestamps, as v2's
description says (its one example id carries a `/<sequence>` suffix, which its own date-time schema
for Last-Event-ID would refuse; the fake follows the schema, with microsecond timestamps). A request that does not validate
gets a 400 like RunPod's and is recorded in `violations`; the `fake_runpod` fixtures fail the test
when any is left. Pods are answered as RunPod's Pod schema has them: with their `networkVolume` only when
the query asks for it (`includeNetworkVolume=true`), and no `networkVolumeId` (it is the fake's own record). On demand it interrupts pods, refuses starts (no GPU free on the machine), has
no capacity for GPU types, answers 429/5xx/401, or answers slowly (timeouts).
`GET /v2/catalog/gpus` serves `gpu_catalog` with stock per CUDA version from `gpu_stock`; v2 answers
with a JSON schema in RunPod's description are checked against it before they are sent, and v2 request
bodies against their request schema. Instant Clusters: `POST /v2/clusters` (CreateClusterRequest) makes
a cluster and its member pods (v2 Pod objects with `cluster.rank`, RUNNING); `GET /v2/clusters`,
`/v2/clusters/{id}`, `/v2/clusters/{id}/pods` and `/v2/pods/{id}` serve them, `DELETE /v2/clusters/{id}`
removes the cluster and its nodes; `interrupt_node` and `lose_node` break a cluster as RunPod would.
"""

from __future__ import annotations

import datetime
import itertools
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema

HERE = Path(__file__).resolve().parent
SCHEMA_FILE = HERE / "runpod_schema.json"
SCHEMA_V2_FILE = HERE / "runpod_v2_schema.json"


# RunPod's own descriptions, kept in the repository (docs/runpod/README.md says where they come from).
REFERENCE = HERE.parent / "docs/runpod"
OPENAPI = REFERENCE / "runpod-rest-openapi.json"
OPENAPI_V2 = REFERENCE / "runpod-rest-v2-openapi.json"
KEY = "fake-runpod-key-for-tests"
# RunPod's words when no machine is free for a create (as recorded from its live API, v1 and v2 alike).
NO_CAPACITY_TEXT = (
    "There are no longer any instances available with the requested specifications. "
    "Please refresh and try again."
)

# What trainpod sends, as (method, OpenAPI path): the derived schema holds exactly these.
OPERATIONS = [
    ("GET", "/pods"),
    ("POST", "/pods"),
    ("GET", "/pods/{podId}"),
    ("DELETE", "/pods/{podId}"),
    ("POST", "/pods/{podId}/start"),
    ("POST", "/pods/{podId}/stop"),
    ("GET", "/templates"),
    ("POST", "/templates"),
    ("GET", "/templates/{templateId}"),
    ("PATCH", "/templates/{templateId}"),
    ("GET", "/networkvolumes"),
    ("POST", "/networkvolumes"),
    ("PATCH", "/networkvolumes/{networkVolumeId}"),
]
# What trainpod sends to REST v2, as (method, OpenAPI path).
OPERATIONS_V2 = [
    ("GET", "/v2/pods/{id}/logs"),
    ("GET", "/v2/catalog/gpus"),
    ("GET", "/v2/pods/{id}"),
    ("GET", "/v2/clusters"),
    ("POST", "/v2/clusters"),
    ("GET", "/v2/clusters/{id}"),
    ("DELETE", "/v2/clusters/{id}"),
    ("GET", "/v2/clusters/{id}/pods"),
]
_KEEP = ("type", "enum", "items", "minimum", "maximum", "required", "properties")
_KEEP_V2 = ("type", "enum", "minimum", "maximum", "format", "items", "maxItems", "pattern")


def _json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI 3.0 schema node as JSON Schema: nullable -> a null type, docs dropped."""
    out = {k: v for k, v in node.items() if k in _KEEP}
    if "properties" in out:
        out["properties"] = {name: _json_schema(prop) for name, prop in out["properties"].items()}
        out["additionalProperties"] = False  # RunPod ignores unknown keys silently; a typo must fail here
    if out.get("type") == "array" and "items" in out:
        out["items"] = _json_schema(out["items"])
    if out.get("type") == "object" and "properties" not in out:  # env: RunPod writes `items` on an object
        out = {"type": "object", "additionalProperties": {"type": "string"}}
    if node.get("nullable"):
        out["type"] = [out["type"], "null"]
    return out


def derive_schema(openapi: dict[str, Any]) -> dict[str, Any]:
    """The part of RunPod's OpenAPI that trainpod uses: operations (query names, body schema, status)."""
    components = openapi["components"]["schemas"]
    operations, schemas = {}, {}
    for method, path in OPERATIONS:
        op = openapi["paths"][path][method.lower()]
        body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        body_name = body["$ref"].rsplit("/", 1)[-1] if body else None
        if body_name:
            schemas[body_name] = _json_schema(components[body_name])
        operations[f"{method} {path}"] = {
            "operationId": op["operationId"],
            "query": sorted(p["name"] for p in op.get("parameters", []) if p["in"] == "query"),
            "body": body_name,
            "status": min(int(code) for code in op["responses"] if code.startswith("2")),
        }
    return {
        "source": "RunPod's OpenAPI description of https://rest.runpod.io/v1 (docs/runpod/runpod-rest-openapi.json)",
        "operations": operations,
        "schemas": schemas,
    }


def derive_schema_v2(openapi: dict[str, Any]) -> dict[str, Any]:
    """The part of RunPod's v2 OpenAPI that trainpod uses: each operation's query and header
    parameters with their value schemas (references resolved), and its success status and type."""
    operations = {}
    for method, path in OPERATIONS_V2:
        item = openapi["paths"][path]
        op = item[method.lower()]
        params = [_resolve(openapi, p) for p in [*item.get("parameters", []), *op.get("parameters", [])]]
        success = min(code for code in op["responses"] if code.startswith("2"))
        operations[f"{method} {path}"] = {
            "operationId": op["operationId"],
            **{
                where: {p["name"]: _value_schema(openapi, p["schema"]) for p in params if p["in"] == kind}
                for where, kind in (("query", "query"), ("headers", "header"))
            },
            "status": int(success),
            "content": sorted(op["responses"][success].get("content", {})),
        }
        json_answer = op["responses"][success].get("content", {}).get("application/json")
        if json_answer:  # the fake's own answers are checked against it
            operations[f"{method} {path}"]["response"] = _inlined(openapi, json_answer["schema"])
        body = op.get("requestBody", {}).get("content", {}).get("application/json")
        if body:  # requests are checked against it (JSON Schema 2020-12: allOf, unevaluatedProperties)
            operations[f"{method} {path}"]["body"] = _inlined(openapi, body["schema"])
    return {
        "source": "RunPod's OpenAPI description of https://api.runpod.io/v2 "
        "(docs/runpod/runpod-rest-v2-openapi.json)",
        "operations": operations,
    }


def _resolve(openapi: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = openapi
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def _value_schema(openapi: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in _resolve(openapi, node).items() if k in _KEEP_V2}
    if "items" in kept:  # an array parameter (style form, explode false): its items' schema, resolved
        kept["items"] = _value_schema(openapi, kept["items"])
    return kept


def _inlined(openapi: dict[str, Any], node: Any) -> Any:
    """A response schema with every $ref replaced by its target (v2's schemas are JSON Schema)."""
    if isinstance(node, dict):
        return {k: _inlined(openapi, v) for k, v in _resolve(openapi, node).items()}
    if isinstance(node, list):
        return [_inlined(openapi, v) for v in node]
    return node


def _value_problem(name: str, raw: str, schema: dict[str, Any]) -> str | None:
    """Why a query or header value does not fit its OpenAPI schema (None when it does)."""
    value: Any = raw
    if schema.get("type") == "array":  # style form, explode false: comma-separated
        problems = [_value_problem(name, item, schema.get("items", {})) for item in raw.split(",")]
        too_many = "maxItems" in schema and len(raw.split(",")) > schema["maxItems"]
        return next((p for p in problems if p), f"{name}={raw!r}: too many items" if too_many else None)
    if schema.get("type") == "integer":
        try:
            value = int(raw)
        except ValueError:
            return f"{name}={raw!r} is not an integer"
    if schema.get("format") == "date-time":
        try:
            parsed = datetime.datetime.fromisoformat(raw.replace("Z", "+00:00"))
        except ValueError:
            return f"{name}={raw!r} is not an RFC 3339 date-time"
        if parsed.tzinfo is None or "T" not in raw:
            return f"{name}={raw!r} is not an RFC 3339 date-time (needs a T and a time zone)"
    errors = list(
        jsonschema.Draft7Validator({k: v for k, v in schema.items() if k != "format"}).iter_errors(value)
    )
    return f"{name}={raw!r}: {errors[0].message}" if errors else None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class LogStream:
    """An open Server-Sent Events answer: the handler writes each chunk as it comes."""

    chunks: Iterator[bytes]


def default_gpu_catalog() -> list[dict[str, Any]]:
    """GPU types as v2's GET /catalog/gpus lists them (prices per GPU-hour: RunPod's list prices, 2026-08)."""

    def gpu(gpu_id: str, name: str, memory: int, secure: float, community: float) -> dict[str, Any]:
        return {
            "id": gpu_id,
            "name": name,
            "pool": None,
            "manufacturer": "NVIDIA",
            "memory": memory,
            "secure": True,
            "community": True,
            "price": {"secure": secure, "community": community},
            "maxCount": {"secure": 8, "community": 8},
        }

    return [
        gpu("NVIDIA H100 80GB HBM3", "H100 SXM", 80, 2.69, 2.39),
        gpu("NVIDIA A100 80GB PCIe", "A100 PCIe", 80, 1.64, 1.19),
        gpu("NVIDIA L40S", "L40S", 48, 0.86, 0.79),
        gpu("NVIDIA RTX A6000", "RTX A6000", 48, 0.49, 0.33),
        gpu("NVIDIA GeForce RTX 4090", "RTX 4090", 24, 0.69, 0.34),
        # RunPod's catalog lists every GPU type (deploy refuses one it lacks); the tests and the shipped configs
        # name these too. Their prices are not RunPod's: no test reads them.
        gpu("NVIDIA A100-SXM4-80GB", "A100 SXM", 80, 1.74, 1.39),
        gpu("NVIDIA H200", "H200 SXM", 141, 3.59, 3.29),
        gpu("NVIDIA H200 NVL", "H200 NVL", 143, 3.39, 3.09),
        gpu("NVIDIA H100 PCIe", "H100 PCIe", 80, 2.39, 1.99),
        gpu("NVIDIA H100 NVL", "H100 NVL", 94, 2.79, 2.59),
        gpu("NVIDIA A40", "A40", 48, 0.44, 0.40),
        gpu("NVIDIA RTX A4000", "RTX A4000", 16, 0.25, 0.17),
        gpu("NVIDIA RTX A5000", "RTX A5000", 24, 0.27, 0.16),
        gpu("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 48, 0.77, 0.74),
    ]


@dataclass
class Backend:
    """What happens to a pod's container; the e2e test replaces it with real `docker` commands."""

    create: Callable[[dict], None] = lambda pod: None
    start: Callable[[dict], None] = lambda pod: None
    stop: Callable[[dict], None] = lambda pod: None
    terminate: Callable[[dict], None] = lambda pod: None


@dataclass
class FakeRunPod:
    """Account state and controls; `url` is the base URL (set TRAINPOD_RUNPOD_API_URL to it)."""

    key: str = KEY
    price_per_gpu_hr: float = 2.0
    schema: dict[str, Any] = field(default_factory=lambda: json.loads(SCHEMA_FILE.read_text()))
    schema_v2: dict[str, Any] = field(default_factory=lambda: json.loads(SCHEMA_V2_FILE.read_text()))
    pods: dict[str, dict] = field(default_factory=dict)
    logs: dict[str, list[dict]] = field(default_factory=dict)  # pod id -> {"ts", "source", "line"}
    drop_after: list[int] = field(default_factory=list)  # per log connection: events before it is cut
    log_headers: list[dict[str, str]] = field(default_factory=list)  # Last-Event-ID etc. of each log request
    inclusive_cursor: bool = False  # resume at the Last-Event-ID's line rather than after it
    templates: dict[str, dict] = field(default_factory=dict)
    volumes: dict[str, dict] = field(default_factory=dict)
    clusters: dict[str, dict] = field(default_factory=dict)  # v2 Clusters, less their `pods` summary
    nodes: dict[str, dict] = field(default_factory=dict)  # v2 Pods of the clusters' members, by pod id
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    forced: list[tuple[int, str | None]] = field(default_factory=list)  # (status, Retry-After) to answer next
    no_capacity: set[str] = field(default_factory=set)  # GPU types with no free machine anywhere
    # What a create with none of its GPU types free is answered: RunPod's 400 (v2's description: capacity carries
    # no code of its own, its `detail` alone says it; v1 gives the same text as `error`); a test may ask for 500.
    no_capacity_status: int = 400
    # The account's balance pays for nothing: creates are answered 402 (v2's description: "Insufficient balance").
    out_of_funds: bool = False
    # RunPod having trouble: creates are answered 500 with no word of capacity (a create it may have made).
    create_outage: bool = False
    refuse_start: set[str] = field(default_factory=set)  # pod ids whose machine has no free GPU
    delay_s: float = 0.0
    gpu_catalog: list[dict[str, Any]] = field(default_factory=lambda: default_gpu_catalog())
    # (GPU type id, CUDA version) pairs with a free machine now; every other offered pair is full.
    gpu_stock: set[tuple[str, str]] = field(
        default_factory=lambda: {
            (g["id"], v) for g in default_gpu_catalog() for v in ("12.8", "12.9", "13.0")
        }
    )
    backend: Backend = field(default_factory=Backend)
    url: str = ""
    url_v2: str = ""
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _log_added: threading.Condition = field(default_factory=threading.Condition)
    _log_clock: Any = field(default_factory=lambda: itertools.count(1))
    closed: threading.Event = field(default_factory=threading.Event)

    # ------------------------------------------------------------------ controls
    def interrupt(self, pod_id: str) -> None:
        """A spot interruption: RunPod stops the pod (SIGTERM, SIGKILL 5 s later) and never restarts it."""
        pod = self.pods[pod_id]
        self.backend.stop(pod)
        pod["desiredStatus"] = "EXITED"
        pod["lastStatusChange"] = "Exited by RunPod: spot instance interrupted"

    def interrupt_node(self, cluster_id: str, rank: int, status: str = "EXITED") -> None:
        """A node of a cluster stops (its host failed, or its container was stopped): the cluster is broken."""
        node = self.nodes_of(cluster_id)[rank]
        node.update(status=status, cost=0.0, runtime=None)

    def lose_node(self, cluster_id: str, rank: int) -> None:
        """A node disappears from its cluster's member list."""
        del self.nodes[self.nodes_of(cluster_id)[rank]["id"]]

    def clusters_named(self, name: str) -> list[dict]:
        return [c for c in self.clusters.values() if c["name"] == name]

    def nodes_of(self, cluster_id: str) -> list[dict]:
        """Its member pods by node rank."""
        members = [n for n in self.nodes.values() if n["cluster"]["id"] == cluster_id]
        return sorted(members, key=lambda n: n["cluster"]["rank"])

    def fail_next(self, status: int, times: int = 1, retry_after: str | None = None) -> None:
        self.forced += [(status, retry_after)] * times

    def add_logs(self, pod_id: str, *lines: str, source: str = "container") -> None:
        """Lines the pod's container prints, each with its own microsecond timestamp (its event id)."""
        with self._log_added:
            for line in lines:
                when = datetime.datetime(2026, 6, 1, 12, tzinfo=datetime.timezone.utc) + datetime.timedelta(
                    microseconds=next(self._log_clock)
                )
                ts = when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                self.logs.setdefault(pod_id, []).append({"ts": ts, "source": source, "line": line})
            self._log_added.notify_all()

    def pods_named(self, name: str) -> list[dict]:
        return [p for p in self.pods.values() if p["name"] == name]

    def calls(self, method: str | None = None, prefix: str = "") -> list[tuple[str, str, Any]]:
        return [r for r in self.requests if (method is None or r[0] == method) and r[1].startswith(prefix)]

    # ------------------------------------------------------------------ request handling
    def handle(
        self, method: str, raw_path: str, headers: dict[str, str], raw_body: bytes
    ) -> tuple[int, Any, dict]:
        parts = urlsplit(raw_path)
        if parts.path.startswith("/v2/"):
            return self._handle_v2(method, parts.path, parts.query, headers, raw_body)
        path = parts.path.removeprefix("/v1")
        body = json.loads(raw_body) if raw_body.strip() else None
        self.requests.append((method, path, body))
        if self.delay_s:
            time.sleep(self.delay_s)
        if headers.get("Authorization") != f"Bearer {self.key}":
            return 401, {"message": "Unauthorized"}, {}
        if self.forced:
            status, retry_after = self.forced.pop(0)
            return (
                status,
                {"error": "forced by the test", "echo": headers.get("Authorization")},
                ({"Retry-After": retry_after} if retry_after else {}),
            )
        op_key, params = self._route(method, path)
        if op_key is None:
            return self._invalid(f"{method} {path}: no such operation in RunPod's API", 404)
        op = self.schema["operations"][op_key]
        unknown = set(parse_qs(parts.query)) - set(op["query"])
        if unknown:
            return self._invalid(f"{op_key}: unknown query parameters {sorted(unknown)}")
        problem = self._body_problem(op, body)
        if problem:
            return self._invalid(f"{op_key}: {problem}")
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        with self._lock:
            status, result = getattr(self, "_" + op["operationId"])(body, query, **params)
        return (op["status"] if status is None else status), result, {}

    def _handle_v2(
        self, method: str, path: str, raw_query: str, headers: dict[str, str], raw_body: bytes = b""
    ) -> tuple[int, Any, dict]:
        body = json.loads(raw_body) if raw_body.strip() else None
        self.requests.append((method, path, body))
        if headers.get("Authorization") != f"Bearer {self.key}":
            return 401, {"title": "Unauthorized", "status": 401}, {}
        if self.forced:
            status, retry_after = self.forced.pop(0)
            return (
                status,
                {"title": "forced by the test"},
                ({"Retry-After": retry_after} if retry_after else {}),
            )
        op_key, params = self._route_in(self.schema_v2["operations"], method, path)
        if op_key is None:
            return self._invalid(f"{method} {path}: no such operation in RunPod's v2 API", 404)
        op = self.schema_v2["operations"][op_key]
        query = {k: v[0] for k, v in parse_qs(raw_query).items()}
        unknown = set(query) - set(op["query"])
        if unknown:
            return self._invalid(f"{op_key}: unknown query parameters {sorted(unknown)}")
        lowered = {k.lower(): v for k, v in headers.items()}  # HTTP header names are case-insensitive
        given = {name: lowered[name.lower()] for name in op["headers"] if name.lower() in lowered}
        problems = [_value_problem(n, v, op["query"][n]) for n, v in query.items()]
        problems += [_value_problem(n, v, op["headers"][n]) for n, v in given.items()]
        if any(problems):
            return self._invalid(f"{op_key}: {'; '.join(p for p in problems if p)}")
        problem = self._v2_body_problem(op, body)
        if problem:
            return self._invalid(f"{op_key}: {problem}")
        with self._lock:
            status, answer, extra = getattr(self, "_" + op["operationId"])(query, given, body, **params)
        problems = (
            list(jsonschema.Draft202012Validator(op["response"]).iter_errors(answer))
            if status == op["status"] and "response" in op
            else []
        )
        if problems:  # the fake itself must answer as RunPod's description says
            return self._invalid(
                f"{op_key}: the fake's answer does not fit RunPod's schema: {problems[0].message}", 500
            )
        return status, answer, extra

    @staticmethod
    def _v2_body_problem(op: dict, body: Any) -> str | None:
        if "body" not in op:
            return None if body is None else "this operation takes no body"
        if body is None:
            return "a JSON body is required"
        errors = sorted(jsonschema.Draft202012Validator(op["body"]).iter_errors(body), key=str)
        return "; ".join(f"{'.'.join(map(str, e.path)) or '(body)'}: {e.message}" for e in errors) or None

    def _listGpuTypes(self, query, headers, body):
        # A rule v2's description states in words: include=AVAILABILITY and product= go together.
        if ("include" in query) != ("product" in query):
            return self._invalid(
                "GET /v2/catalog/gpus: include=AVAILABILITY and product= go together (400 at RunPod)"
            )
        if "cudaVersions" in query and "minCudaVersion" in query:
            return self._invalid(
                "GET /v2/catalog/gpus: cudaVersions and minCudaVersion are mutually exclusive"
            )
        return 200, {"gpus": [self._catalog_entry(gpu, query) for gpu in self.gpu_catalog]}, {}

    def _catalog_entry(self, gpu: dict[str, Any], query: dict[str, str]) -> dict[str, Any]:
        if query.get("include") != "AVAILABILITY":
            return gpu
        wanted = query["cudaVersions"].split(",") if "cudaVersions" in query else ["12.8", "12.9", "13.0"]
        cuda = [{"version": v, "available": (gpu["id"], v) in self.gpu_stock} for v in wanted]
        free = any(c["available"] for c in cuda)
        entry = {**gpu, "availability": "HIGH" if free else "NONE", "cudaVersions": cuda}
        if free:
            entry["dataCenters"] = [{"id": "EU-RO-1", "name": "Europe Romania 1", "availability": "HIGH"}]
        return entry

    # ------------------------------------------------------------------ v2 Instant Clusters
    def _createCluster(self, query, headers, body):
        gpu = body["compute"]["gpuTypeId"]
        if self.out_of_funds:
            return 402, {"title": "Payment Required", "status": 402, "detail": "insufficient balance"}, {}
        if self.create_outage:
            return 500, {"title": "Internal Server Error", "status": 500, "detail": "internal error"}, {}
        if gpu in self.no_capacity:
            status = self.no_capacity_status
            title = "Bad Request" if status == 400 else "Internal Server Error"
            return status, {"title": title, "status": status, "detail": NO_CAPACITY_TEXT}, {}
        cluster_id = self._new_id("cluster")
        data_center = (body.get("dataCenterIds") or ["EU-RO-1"])[0]
        cluster = {
            "id": cluster_id,
            "name": body["name"],
            "type": body["type"],
            "compute": dict(body["compute"]),
            "dataCenterId": data_center,
            "network": {"cidr": "10.65.0.0/16"},
            "createdAt": _now(),
        }
        self.clusters[cluster_id] = cluster
        for rank in range(body["compute"]["podCount"]):
            node = self._cluster_node(cluster, body, rank)
            self.nodes[node["id"]] = node
        return 201, self._cluster_view(cluster), {}

    def _cluster_node(self, cluster: dict, body: dict, rank: int) -> dict:
        """A member pod as v2's Pod schema describes it."""
        compute = cluster["compute"]
        node_id = self._new_id("pod")
        return {
            "id": node_id,
            "name": f"{cluster['name']}-{rank}",
            "status": "RUNNING",
            "actions": [],  # member pods are managed through /v2/clusters only
            "image": body.get("image", ""),
            "args": body.get("args", ""),
            "disk": body.get("disk", 20),
            "mounts": body.get("mounts", {}),
            "ports": body.get("ports", []),
            "env": dict(body.get("env", {})),
            "registry": None,
            "gpu": {"id": compute["gpuTypeId"], "count": compute["gpuCountPerPod"]},
            "cloud": "SECURE",
            "dataCenterId": cluster["dataCenterId"],
            "cudaVersion": "12.8",
            "ssh": {"proxy": None, "direct": None},
            "cluster": {"id": cluster["id"], "rank": rank, "ip": f"10.65.0.{rank + 2}"},
            "template": None,
            "cost": self.price_per_gpu_hr * compute["gpuCountPerPod"],
            "locked": False,
            "runtime": None,
            "globalNetworking": {"enabled": False},
            "createdAt": cluster["createdAt"],
            "startedAt": cluster["createdAt"],
        }

    def _cluster_view(self, cluster: dict) -> dict:
        nodes = self.nodes_of(cluster["id"])
        by_status: dict[str, int] = {}
        for node in nodes:
            by_status[node["status"]] = by_status.get(node["status"], 0) + 1
        view = {**cluster, "pods": {"total": len(nodes), "byStatus": by_status}}
        if nodes and nodes[0]["cluster"]["rank"] == 0:
            view["primary"] = {"podId": nodes[0]["id"], "status": nodes[0]["status"]}
        return view

    def _listClusters(self, query, headers, body):
        return 200, {"clusters": [self._cluster_view(c) for c in self.clusters.values()]}, {}

    def _getCluster(self, query, headers, body, id):
        if id not in self.clusters:
            return 404, {"title": "Not Found", "status": 404, "detail": "cluster not found"}, {}
        return 200, self._cluster_view(self.clusters[id]), {}

    def _deleteCluster(self, query, headers, body, id):
        if self.clusters.pop(id, None) is None:
            return 404, {"title": "Not Found", "status": 404, "detail": "cluster not found"}, {}
        for node in self.nodes_of(id):
            del self.nodes[node["id"]]
        return 204, None, {}

    def _listClusterPods(self, query, headers, body, id):
        if id not in self.clusters:
            return 404, {"title": "Not Found", "status": 404, "detail": "cluster not found"}, {}
        return 200, {"pods": self.nodes_of(id)}, {}

    def _getPod(self, query, headers, body, id):
        if id not in self.nodes:  # the fake serves v2 pods for cluster members only
            return 404, {"title": "Not Found", "status": 404, "detail": "pod not found"}, {}
        return 200, self.nodes[id], {}

    def _getPodLogs(self, query, headers, body, id):
        self.log_headers.append(headers)
        if id not in self.pods and id not in self.nodes:
            return 404, {"title": "Not Found", "status": 404, "detail": "pod not found"}, {}
        drop = self.drop_after.pop(0) if self.drop_after else None
        chunks = self._log_events(id, int(query.get("tail", 100)), headers.get("Last-Event-ID"), drop)
        sse = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return 200, LogStream(chunks), sse

    def _log_events(self, pod_id: str, tail: int, after: str | None, drop: int | None) -> Iterator[bytes]:
        lines = self.logs.setdefault(pod_id, [])
        with self._log_added:
            if after is not None:  # exclusive: the line with that id was delivered (unless inclusive_cursor)
                index = next(
                    (
                        i
                        for i, e in enumerate(lines)
                        if e["ts"] > after or (self.inclusive_cursor and e["ts"] == after)
                    ),
                    len(lines),
                )
            else:
                index = max(0, len(lines) - tail)
        sent = 0
        while not self.closed.is_set():
            with self._log_added:
                if index >= len(lines):
                    if pod_id not in self.pods and pod_id not in self.nodes:
                        return  # terminated: its stream ends (the next request for it is a 404)
                    self._log_added.wait(0.1)
                    continue
                entry = lines[index]
            chunk = f"id: {entry['ts']}\ndata: {json.dumps(entry)}\n\n".encode()
            if drop is not None and sent == drop:
                yield chunk[: len(chunk) // 2]  # cut in the middle of an event, then the connection
                return
            yield chunk
            index += 1
            sent += 1

    def _invalid(self, problem: str, status: int = 400) -> tuple[int, Any, dict]:
        self.violations.append(problem)
        return status, {"error": problem}, {}

    def _route(self, method: str, path: str) -> tuple[str | None, dict[str, str]]:
        return self._route_in(self.schema["operations"], method, path)

    def _route_in(self, operations: dict, method: str, path: str) -> tuple[str | None, dict[str, str]]:
        for op_key in operations:
            op_method, template = op_key.split(" ", 1)
            pattern = "^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", template) + "$"
            match = re.match(pattern, path)
            if op_method == method and match:
                return op_key, {k[0].lower() + k[1:]: v for k, v in match.groupdict().items()}
        return None, {}

    def _body_problem(self, op: dict, body: Any) -> str | None:
        if op["body"] is None:
            return None if body is None else "this operation takes no body"
        if body is None:
            return "a JSON body is required"
        errors = sorted(
            jsonschema.Draft7Validator(self.schema["schemas"][op["body"]]).iter_errors(body), key=str
        )
        return "; ".join(f"{'.'.join(map(str, e.path)) or '(body)'}: {e.message}" for e in errors) or None

    # ------------------------------------------------------------------ operations (RunPod's operationIds)
    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):04d}"

    def _pod_answer(self, pod: dict, query: dict[str, str]) -> dict:
        """A pod as RunPod's Pod schema gives it: no networkVolumeId (kept here, as the create asked), and its
        networkVolume (id, name, size, data center) only when the query asks with includeNetworkVolume=true."""
        answer = {k: v for k, v in pod.items() if k != "networkVolumeId"}
        volume = self.volumes.get(pod.get("networkVolumeId") or "")
        if query.get("includeNetworkVolume") == "true" and volume is not None:
            answer["networkVolume"] = {
                k: volume[k] for k in ("id", "name", "size", "dataCenterId") if k in volume
            }
        return answer

    def _ListPods(self, body, query):
        named = [p for p in self.pods.values() if query.get("name") in (None, p["name"])]
        return None, [self._pod_answer(p, query) for p in named]

    def _GetPod(self, body, query, podId):
        if podId not in self.pods:
            return 404, {"error": "pod not found"}
        return None, self._pod_answer(self.pods[podId], query)

    def _CreatePod(self, body, query):
        if self.out_of_funds:
            return 402, {"error": "insufficient balance"}
        if self.create_outage:
            return 500, {"error": "internal error"}
        gpu = None
        if body.get("computeType", "GPU") == "GPU":
            gpu = next((g for g in body.get("gpuTypeIds", []) if g not in self.no_capacity), None)
            if gpu is None:
                return self.no_capacity_status, {"error": NO_CAPACITY_TEXT}
        count = body.get("gpuCount", 1)
        pod = {
            "id": self._new_id("pod"),
            "name": body.get("name", ""),
            "desiredStatus": "RUNNING",
            "image": body.get("imageName", ""),
            "env": dict(body.get("env", {})),
            "interruptible": body.get("interruptible", False),
            "networkVolumeId": body.get("networkVolumeId"),
            "templateId": body.get("templateId"),
            "machineId": self._new_id("machine"),
            "gpu": {"id": gpu, "count": count, "displayName": gpu} if gpu else None,
            "costPerHr": self.price_per_gpu_hr * count if gpu else 0.1,
            "lastStatusChange": "Rented by User",
            "lastStartedAt": _now(),
            "containerDiskInGb": body.get("containerDiskInGb", 50),
            "ports": list(body.get("ports", [])),
        }
        self.pods[pod["id"]] = pod
        self.backend.create(pod)
        return None, self._pod_answer(pod, {})

    def _DeletePod(self, body, query, podId):
        pod = self.pods.pop(podId, None)
        if pod is None:
            return 404, {"error": "pod not found"}
        self.backend.terminate(pod)
        return None, None

    def _StartPod(self, body, query, podId):
        pod = self.pods.get(podId)
        if pod is None:
            return 404, {"error": "pod not found"}
        if podId in self.refuse_start:
            return 500, {"error": "There are not enough free GPUs on the host machine to start this pod."}
        if pod["desiredStatus"] != "RUNNING":
            pod["desiredStatus"] = "RUNNING"
            pod["lastStartedAt"] = _now()
            self.backend.start(pod)
        return None, None

    def _StopPod(self, body, query, podId):
        pod = self.pods.get(podId)
        if pod is None:
            return 404, {"error": "pod not found"}
        if pod["desiredStatus"] == "RUNNING":
            pod["desiredStatus"] = "EXITED"
            self.backend.stop(pod)
        return None, None

    def _ListTemplates(self, body, query):
        return None, list(self.templates.values())

    def _GetTemplate(self, body, query, templateId):
        found = self.templates.get(templateId)
        return (None, found) if found else (404, {"error": "template not found"})

    def _CreateTemplate(self, body, query):
        template = {**body, "id": self._new_id("tpl")}
        self.templates[template["id"]] = template
        return None, template

    def _UpdateTemplate(self, body, query, templateId):
        if templateId not in self.templates:
            return 404, {"error": "template not found"}
        self.templates[templateId].update(body)
        return None, self.templates[templateId]

    def _ListNetworkVolumes(self, body, query):
        return None, list(self.volumes.values())

    def _CreateNetworkVolume(self, body, query):
        volume = {**body, "id": self._new_id("vol")}
        self.volumes[volume["id"]] = volume
        return None, volume

    def _UpdateNetworkVolume(self, body, query, networkVolumeId):
        volume = self.volumes.get(networkVolumeId)
        if volume is None:
            return 404, {"error": "network volume not found"}
        if "size" in body and body["size"] <= volume["size"]:  # the OpenAPI: greater than the current size
            return 400, {"error": "the new size must be greater than the current size"}
        volume.update(body)
        return None, volume


def _handler_for(fake: FakeRunPod) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            status, result, extra = fake.handle(
                self.command, self.path, dict(self.headers), self.rfile.read(length)
            )
            if isinstance(result, LogStream):
                self._stream(status, result, extra)
                return
            payload = b"" if result is None else json.dumps(result).encode()
            self.send_response(status)
            for name, value in extra.items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _stream(self, status: int, stream: LogStream, headers: dict) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()  # HTTP/1.0, no length: the body ends when the connection closes
            try:
                for chunk in stream.chunks:
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away
            self.close_connection = True

        do_GET = do_POST = do_PATCH = do_DELETE = _serve

        def log_message(self, *args: Any) -> None:  # the test's output stays readable
            pass

    return Handler


class _QuietServer(ThreadingHTTPServer):
    """A client that gave up on its answer (a timeout test, a follow stopped mid-stream) is the test's
    own doing: nothing to report, where socketserver printed a traceback into the tier's output."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


class FakeRunPodServer:
    """Serves a FakeRunPod on 127.0.0.1 (a free port) in a thread, as a context manager."""

    def __init__(self, fake: FakeRunPod | None = None, host: str = "127.0.0.1"):
        self.fake = fake or FakeRunPod()
        self.httpd = _QuietServer((host, 0), _handler_for(self.fake))
        self.httpd.daemon_threads = True
        self.fake.url = f"http://{host}:{self.httpd.server_address[1]}/v1"
        self.fake.url_v2 = f"http://{host}:{self.httpd.server_address[1]}/v2"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeRunPod:
        self.thread.start()
        return self.fake

    def __exit__(self, *exc: object) -> None:
        self.fake.closed.set()  # open log streams end
        self.httpd.shutdown()
        self.httpd.server_close()


def client_for(fake: FakeRunPod, sleeps: list[float] | None = None, **kwargs: Any):
    """A real RunPodClient pointed at the fake; sleeps are recorded, never slept."""
    from trainpod.runpod.client import RunPodClient

    recorded = [] if sleeps is None else sleeps
    return RunPodClient(
        fake.key,
        base_url=fake.url,
        base_url_v2=fake.url_v2,
        sleep=recorded.append,
        jitter=lambda: 1.0,
        **kwargs,
    )


def api_env(fake: FakeRunPod) -> dict[str, str]:
    """The environment that points trainpod's client at the fake."""
    return {
        "TRAINPOD_RUNPOD_API_URL": fake.url,
        "TRAINPOD_RUNPOD_API_V2_URL": fake.url_v2,
        "RUNPOD_API_KEY": fake.key,
    }


if __name__ == "__main__" and sys.argv[1:] == ["--derive"]:
    derived = derive_schema(json.loads(OPENAPI.read_text()))
    SCHEMA_FILE.write_text(json.dumps(derived, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SCHEMA_FILE} ({len(derived['operations'])} operations, {len(derived['schemas'])} schemas)")
    derived_v2 = derive_schema_v2(json.loads(OPENAPI_V2.read_text()))
    SCHEMA_V2_FILE.write_text(json.dumps(derived_v2, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SCHEMA_V2_FILE} ({len(derived_v2['operations'])} operations)")
