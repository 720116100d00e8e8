"""A fake Hugging Face Hub on 127.0.0.1 that holds state: repos, branches, commits, file contents (no tests here).

It speaks the part of the Hub's protocol that huggingface_hub 2.4's create_repo, create_branch,
create_commit and repo_info use, with the legacy LFS "basic" transfer (a client with hf_xet installed
uploads through Xet, which no fake can serve: tests set HF_HUB_DISABLE_XET=1):

    POST /api/repos/create                              {name, organization, visibility|private, type}
    POST /api/models/<owner>/<name>/branch/<branch>     {startingPoint?}
    POST /api/models/<owner>/<name>/preupload/<rev>     {files: [{path, sample, size}]} -> uploadMode lfs|regular
    POST /<owner>/<name>.git/info/lfs/objects/batch     {objects: [{oid, size}]} -> upload hrefs back here
    PUT  /lfs-objects/<oid>                             the object's bytes, checked against oid and size (on
                                                        `storage`, a server of its own, as S3 is the Hub's)
    POST /api/models/<owner>/<name>/commit/<rev>        NDJSON: header, file (base64), lfsFile (oid)
    POST /api/validate-yaml                             {content}: a README.md's metadata, before its commit
    GET  /api/models/<owner>/<name>[/revision/<rev>]    repo info with the branch's head

Every /api and .git request needs `Authorization: Bearer <token>`: a token in `tokens` with "write" may
do anything, one with "read" gets 403 on writes, any other 401. `fail` makes requests whose path
contains a key answer that status (or drop the connection, for "drop") instead.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".npz")  # the Hub's default .gitattributes, in part
LFS_MIN_BYTES = 10 << 20  # larger text files go to LFS too


@dataclass
class Commit:
    oid: str
    parent: str | None
    message: str
    files: dict[str, bytes]  # the whole tree at this commit


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)

    def tree(self, branch: str) -> dict[str, bytes]:
        head = self.branches.get(branch)
        return dict(self.commits[head].files) if head else {}

    def history(self, branch: str) -> list[Commit]:
        commits, oid = [], self.branches.get(branch)
        while oid:
            commits.append(self.commits[oid])
            oid = self.commits[oid].parent
        return commits


class FakeHub:
    def __init__(self, tokens: dict[str, str]):
        self.tokens = tokens
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}  # oid -> content
        self.fail: dict[str, int | str] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path), in order
        self.model_cards: list[dict[str, Any]] = []  # the README.md metadata commits had validated
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # The object storage LFS uploads go to, on a host of its own as the Hub's S3 links are.
        self.storage = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.storage_url = f"http://127.0.0.1:{self.storage.server_address[1]}"

    def lfs_puts(self) -> int:
        return sum(1 for method, path in self.requests if method == "PUT")

    def create_commit(self, repo: Repo, branch: str, message: str, files: dict[str, bytes]) -> Commit:
        parent = repo.branches.get(branch)
        oid = hashlib.sha1(f"{parent}{message}{len(repo.commits)}".encode()).hexdigest()
        commit = Commit(oid, parent, message, files)
        repo.commits[oid] = commit
        repo.branches[branch] = oid
        return commit


@contextmanager
def running_hub(tokens: dict[str, str]) -> Iterator[FakeHub]:
    hub = FakeHub(tokens)
    for server in (hub.server, hub.storage):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield hub
    finally:
        for server in (hub.server, hub.storage):
            server.shutdown()
            server.server_close()


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def _serve(self, method: str) -> None:
            path = unquote(urlsplit(self.path).path)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with hub.lock:
                hub.requests.append((method, path))
                failure = next((v for k, v in hub.fail.items() if k in path), None)
                if failure == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if failure is not None:
                    return self._reply(int(failure), {"error": "injected failure"})
                if method == "PUT" and path.startswith("/lfs-objects/"):
                    return self._put_object(path.rsplit("/", 1)[1], body)
                access = hub.tokens.get(self.headers.get("Authorization", "").removeprefix("Bearer "))
                if access is None:
                    return self._reply(401, {"error": "Invalid credentials in Authorization header"})
                writes = method != "GET"
                if writes and access != "write":
                    return self._reply(403, {"error": "You don't have the rights to write to this repo"})
                self._route(method, path, body)

        def _route(self, method: str, path: str, body: bytes) -> None:
            parts = path.strip("/").split("/")
            if path == "/api/repos/create":
                return self._create_repo(json.loads(body))
            if path.endswith(".git/info/lfs/objects/batch"):
                return self._lfs_batch(json.loads(body))
            if path == "/api/validate-yaml":
                return self._validate_yaml(json.loads(body))
            if parts[:2] != ["api", "models"] or len(parts) < 4:
                return self._reply(404, {"error": f"no route {method} {path}"})
            repo = hub.repos.get(f"{parts[2]}/{parts[3]}")
            if repo is None:
                return self._reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            action, rest = (parts[4], "/".join(parts[5:])) if len(parts) > 4 else ("info", "main")
            if action == "branch":
                return self._create_branch(repo, rest, json.loads(body or b"{}"))
            if rest not in repo.branches and not (action == "info" and not repo.branches):
                return self._reply(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
            if action == "preupload":
                return self._preupload(repo, rest, json.loads(body))
            if action == "commit":
                return self._commit(repo, rest, body)
            if action in ("info", "revision"):
                return self._reply(
                    200, {"id": repo.repo_id, "private": repo.private, "sha": repo.branches.get(rest)}
                )
            return self._reply(404, {"error": f"no route {method} {path}"})

        def _validate_yaml(self, payload: dict[str, Any]) -> None:
            """A commit with a README.md has its metadata (the YAML between its first two '---' lines) checked."""
            content = payload["content"]
            front = (
                content.split("---", 2)[1] if content.startswith("---") and content.count("---") >= 2 else ""
            )
            try:
                metadata = yaml.safe_load(front) or {}
            except yaml.YAMLError as exc:
                return self._reply(400, {"errors": [{"message": f"invalid YAML: {exc}"}]})
            if not isinstance(metadata, dict):
                return self._reply(400, {"errors": [{"message": "the metadata is not a mapping"}]})
            hub.model_cards.append(metadata)
            self._reply(200, {"warnings": []})

        def _create_repo(self, payload: dict[str, Any]) -> None:
            repo_id = f"{payload['organization']}/{payload['name']}"
            if repo_id in hub.repos:
                # The Hub's answer says where the repo is, which create_repo(exist_ok=True) returns.
                return self._reply(
                    409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"}
                )
            private = (
                payload.get("visibility", "private" if payload.get("private") else "public") == "private"
            )
            repo = hub.repos[repo_id] = Repo(repo_id, private)
            hub.create_commit(
                repo, "main", "initial commit", {".gitattributes": b"*.safetensors filter=lfs\n"}
            )
            self._reply(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

        def _create_branch(self, repo: Repo, branch: str, payload: dict[str, Any]) -> None:
            if branch in repo.branches:
                return self._reply(409, {"error": "Reference already exists"})
            repo.branches[branch] = repo.branches[payload.get("startingPoint", "main")]
            self._reply(200, {})

        def _preupload(self, repo: Repo, branch: str, payload: dict[str, Any]) -> None:
            tree, files = repo.tree(branch), []
            for entry in payload["files"]:
                sample = base64.b64decode(entry["sample"])
                lfs = (
                    entry["path"].endswith(LFS_SUFFIXES) or b"\0" in sample or entry["size"] >= LFS_MIN_BYTES
                )
                old = tree.get(entry["path"])
                oid = None if old is None else hashlib.sha256(old).hexdigest() if lfs else _git_blob_sha1(old)
                files.append(
                    {
                        "path": entry["path"],
                        "uploadMode": "lfs" if lfs else "regular",
                        "shouldIgnore": False,
                        "oid": oid,
                    }
                )
            self._reply(200, {"files": files})

        def _lfs_batch(self, payload: dict[str, Any]) -> None:
            objects = []
            for item in payload["objects"]:
                described = {"oid": item["oid"], "size": item["size"], "authenticated": True}
                if item["oid"] not in hub.lfs:
                    described["actions"] = {
                        "upload": {"href": f"{hub.storage_url}/lfs-objects/{item['oid']}", "header": {}}
                    }
                objects.append(described)
            self._reply(200, {"transfer": "basic", "objects": objects})

        def _put_object(self, oid: str, body: bytes) -> None:
            if hashlib.sha256(body).hexdigest() != oid:
                return self._reply(400, {"error": "content does not match its oid"})
            hub.lfs[oid] = body
            self._reply(200, {})

        def _commit(self, repo: Repo, branch: str, body: bytes) -> None:
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            header = next(line["value"] for line in lines if line["key"] == "header")
            files = repo.tree(branch)
            for line in lines:
                value = line["value"]
                if line["key"] == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif line["key"] == "lfsFile":
                    content = hub.lfs.get(value["oid"])
                    if content is None or len(content) != value["size"]:
                        return self._reply(422, {"error": f"LFS object {value['oid']} was not uploaded"})
                    files[value["path"]] = content
            commit = hub.create_commit(repo, branch, header["summary"], files)
            self._reply(
                200, {"commitUrl": f"{hub.url}/{repo.repo_id}/commit/{commit.oid}", "commitOid": commit.oid}
            )

        def _reply(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

    return Handler
