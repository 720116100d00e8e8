"""A fake RunPod REST API on 127.0.0.1: the mock of RunPod itself (the only thing these tests mock).

    python tests/fake_runpod.py --derive    # rewrite runpod_schema.json and runpod_v2_schema.json

It holds account state (pods, templates, network volumes) in memory and validates every request
(method, path, query names, JSON body: field names, types, enums, required fields) against
`runpod_schema.json`, a small schema derived from RunPod's own OpenAPI description by
`derive_schema` (tests/test_runpod_schema.py keeps the two equal). A request that does not validate
gets a 400 like RunPod's and is recorded in `violations`; the `fake_runpod` fixtures fail the test
when any is left. On demand it interrupts pods, refuses starts (no GPU free on the machine), has
no capacity for GPU types, answers 429/5xx/401, or answers slowly (timeouts). REST v2's GPU catalog
(GET /v2/catalog/gpus: prices, stock per CUDA version) is served from `gpu_catalog` and `gpu_stock`,
its query checked against `runpod_v2_schema.json` (derived from RunPod's v2 description by
`derive_v2_schema`) and its answer against the same file's ListGpuTypesResponse.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema

HERE = Path(__file__).resolve().parent
SCHEMA_FILE = HERE / "runpod_schema.json"
OPENAPI = HERE.parent.parent / "shared/reference/runpod-rest-openapi.json"
OPENAPI_V2 = HERE.parent.parent / "shared/reference/runpod-rest-v2-openapi.json"
SCHEMA_V2_FILE = HERE / "runpod_v2_schema.json"
KEY = "fake-runpod-key-for-tests"

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
]
_KEEP = ("type", "enum", "items", "minimum", "maximum", "required", "properties")


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
        "source": "RunPod's OpenAPI description of https://rest.runpod.io/v1 (shared/reference/runpod-rest-openapi.json)",
        "operations": operations,
        "schemas": schemas,
    }


# What trainpod sends to REST v2, as (method, path) in RunPod's v2 OpenAPI.
OPERATIONS_V2 = [("GET", "/v2/catalog/gpus")]


def derive_v2_schema(openapi: dict[str, Any]) -> dict[str, Any]:
    """The part of RunPod's v2 OpenAPI (3.1: its schemas are JSON Schema) that trainpod uses: each
    operation's query parameters and response schema, and every component schema they reach."""
    components = openapi["components"]
    operations, wanted = {}, []
    for method, path in OPERATIONS_V2:
        op = openapi["paths"][path][method.lower()]
        query = {}
        for param in op.get("parameters", []):
            if "$ref" in param:
                param = components["parameters"][param["$ref"].rsplit("/", 1)[-1]]
            if param["in"] == "query":
                query[param["name"]] = param["schema"]
        response = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
        operations[f"{method} {path}"] = {
            "operationId": op["operationId"],
            "query": query,
            "response": response,
        }
        wanted += [response, *_refs(query)]
    schemas: dict[str, Any] = {}
    while wanted:
        name = wanted.pop()
        if name not in schemas:
            schemas[name] = components["schemas"][name]
            wanted += _refs(schemas[name])
    return {
        "source": "RunPod's OpenAPI description of https://api.runpod.io/v2 "
        "(shared/reference/runpod-rest-v2-openapi.json)",
        "operations": operations,
        "components": {"schemas": schemas},
    }


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"].rsplit("/", 1)[-1]] if isinstance(node.get("$ref"), str) else []
        return own + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


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
    pods: dict[str, dict] = field(default_factory=dict)
    templates: dict[str, dict] = field(default_factory=dict)
    volumes: dict[str, dict] = field(default_factory=dict)
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    forced: list[tuple[int, str | None]] = field(default_factory=list)  # (status, Retry-After) to answer next
    no_capacity: set[str] = field(default_factory=set)  # GPU types with no free machine anywhere
    refuse_start: set[str] = field(default_factory=set)  # pod ids whose machine has no free GPU
    delay_s: float = 0.0
    gpu_catalog: list[dict[str, Any]] = field(default_factory=default_gpu_catalog)
    # (GPU type id, CUDA version) pairs with a free machine now; every other offered pair is full.
    gpu_stock: set[tuple[str, str]] = field(
        default_factory=lambda: {
            (g["id"], v) for g in default_gpu_catalog() for v in ("12.8", "12.9", "13.0")
        }
    )
    schema_v2: dict[str, Any] = field(default_factory=lambda: json.loads(SCHEMA_V2_FILE.read_text()))
    backend: Backend = field(default_factory=Backend)
    url: str = ""
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ controls
    def interrupt(self, pod_id: str) -> None:
        """A spot interruption: RunPod stops the pod (SIGTERM, SIGKILL 5 s later) and never restarts it."""
        pod = self.pods[pod_id]
        self.backend.stop(pod)
        pod["desiredStatus"] = "EXITED"
        pod["lastStatusChange"] = "Exited by RunPod: spot instance interrupted"

    def fail_next(self, status: int, times: int = 1, retry_after: str | None = None) -> None:
        self.forced += [(status, retry_after)] * times

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
            return self._handle_v2(method, parts.path, parts.query, headers)
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

    # ------------------------------------------------------------------ REST v2
    def _handle_v2(
        self, method: str, path: str, raw_query: str, headers: dict[str, str]
    ) -> tuple[int, Any, dict]:
        """v2 routes, each request's query checked against the parameters RunPod's v2 OpenAPI declares."""
        self.requests.append((method, path, None))
        if headers.get("Authorization") != f"Bearer {self.key}":
            return 401, {"message": "Unauthorized"}, {}
        if self.forced:
            status, retry_after = self.forced.pop(0)
            return (
                status,
                {"error": "forced by the test"},
                ({"Retry-After": retry_after} if retry_after else {}),
            )
        operation = self.schema_v2["operations"].get(f"{method} {path}")
        if operation is None:
            return self._invalid(f"{method} {path}: not served by this fake (or not in RunPod's v2 API)", 404)
        query = {k: v[0] for k, v in parse_qs(raw_query).items()}
        problem = self._v2_query_problem(operation["query"], query)
        if problem:
            return self._invalid(f"{method} {path}: {problem}")
        answer = {"gpus": [self._catalog_entry(gpu, query) for gpu in self.gpu_catalog]}
        schema_problem = self._v2_schema_problem(operation["response"], answer)
        if schema_problem:  # the fake itself must answer as RunPod's description says
            return self._invalid(
                f"the fake's own answer does not fit ListGpuTypesResponse: {schema_problem}", 500
            )
        return 200, answer, {}

    def _v2_query_problem(self, params: dict[str, Any], query: dict[str, str]) -> str | None:
        unknown = sorted(set(query) - set(params))
        if unknown:
            return f"unknown query parameters {unknown}"
        problems = []
        for name, raw in query.items():
            schema = params[name]
            resolved = self._v2_resolve(schema)
            if resolved.get("type") == "array":  # style form, explode false: comma-separated
                value: Any = raw.split(",")
            elif resolved.get("type") == "integer":
                value = int(raw) if raw.lstrip("-").isdigit() else raw
            else:
                value = raw
            problem = self._v2_schema_problem(None, value, schema)
            if problem:
                problems.append(f"{name}={raw!r}: {problem}")
        # Rules the description states in words: include=AVAILABILITY needs product and vice versa.
        if ("include" in query) != ("product" in query):
            problems.append(
                "include=AVAILABILITY and product= go together (RunPod answers 400 to either alone)"
            )
        if "cudaVersions" in query and "minCudaVersion" in query:
            problems.append("cudaVersions and minCudaVersion are mutually exclusive")
        return "; ".join(problems) or None

    def _v2_resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.schema_v2["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def _v2_schema_problem(
        self, name: str | None, value: Any, schema: dict[str, Any] | None = None
    ) -> str | None:
        root = {"$ref": f"#/components/schemas/{name}"} if name else dict(schema or {})
        root["components"] = self.schema_v2["components"]
        errors = sorted(jsonschema.Draft202012Validator(root).iter_errors(value), key=str)
        return "; ".join(e.message for e in errors) or None

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

    def _invalid(self, problem: str, status: int = 400) -> tuple[int, Any, dict]:
        self.violations.append(problem)
        return status, {"error": problem}, {}

    def _route(self, method: str, path: str) -> tuple[str | None, dict[str, str]]:
        for op_key in self.schema["operations"]:
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

    def _ListPods(self, body, query):
        return None, [p for p in self.pods.values() if query.get("name") in (None, p["name"])]

    def _GetPod(self, body, query, podId):
        return (None, self.pods[podId]) if podId in self.pods else (404, {"error": "pod not found"})

    def _CreatePod(self, body, query):
        gpu = None
        if body.get("computeType", "GPU") == "GPU":
            gpu = next((g for g in body.get("gpuTypeIds", []) if g not in self.no_capacity), None)
            if gpu is None:
                return 500, {
                    "error": "There are no longer any instances available with the requested specifications."
                }
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
        }
        self.pods[pod["id"]] = pod
        self.backend.create(pod)
        return None, pod

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


def _handler_for(fake: FakeRunPod) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            status, result, extra = fake.handle(
                self.command, self.path, dict(self.headers), self.rfile.read(length)
            )
            payload = b"" if result is None else json.dumps(result).encode()
            self.send_response(status)
            for name, value in extra.items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PATCH = do_DELETE = _serve

        def log_message(self, *args: Any) -> None:  # the test's output stays readable
            pass

    return Handler


class FakeRunPodServer:
    """Serves a FakeRunPod on 127.0.0.1 (a free port) in a thread, as a context manager."""

    def __init__(self, fake: FakeRunPod | None = None, host: str = "127.0.0.1"):
        self.fake = fake or FakeRunPod()
        self.httpd = ThreadingHTTPServer((host, 0), _handler_for(self.fake))
        self.httpd.daemon_threads = True
        self.fake.url = f"http://{host}:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeRunPod:
        self.thread.start()
        return self.fake

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def client_for(fake: FakeRunPod, sleeps: list[float] | None = None, **kwargs: Any):
    """A real RunPodClient pointed at the fake; sleeps are recorded, never slept."""
    from trainpod.runpod.client import RunPodClient

    recorded = [] if sleeps is None else sleeps
    return RunPodClient(fake.key, base_url=fake.url, sleep=recorded.append, jitter=lambda: 1.0, **kwargs)


def api_env(fake: FakeRunPod) -> dict[str, str]:
    """The environment that points trainpod's client at the fake."""
    return {"TRAINPOD_RUNPOD_API_URL": fake.url, "RUNPOD_API_KEY": fake.key}


if __name__ == "__main__" and sys.argv[1:] == ["--derive"]:
    derived = derive_schema(json.loads(OPENAPI.read_text()))
    SCHEMA_FILE.write_text(json.dumps(derived, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SCHEMA_FILE} ({len(derived['operations'])} operations, {len(derived['schemas'])} schemas)")
    derived = derive_v2_schema(json.loads(OPENAPI_V2.read_text()))
    SCHEMA_V2_FILE.write_text(json.dumps(derived, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SCHEMA_V2_FILE} ({len(derived['operations'])} operations)")
