"""`make image push` to a real registry: Debian's docker-registry on 127.0.0.1 with a password.

    .venv/bin/python -m pytest -m container tests/container/test_registry_push.py -q

The image pushed is the one the session fixture built: `make image SOURCE_IMAGE=...` only tags it,
so nothing is built twice. The scenario: a push without credentials is refused; with REGISTRY_USER
and REGISTRY_PASSWORD in the environment all four tags are pushed; the registry holds every blob
intact; the tags pulled back after removing them locally carry the digests push reported and the
same image; the password appears in no output and no file left behind.

Docker trusts registries on 127.0.0.0/8 as insecure (plain HTTP) by default, so no TLS is needed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import socket
import subprocess
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from engine import (
    DOCKER,
    REPO,
    Engine,
    docker,
    docker_env,
    ensure_registry_binary,
    git_sha,
    lock_file,
    project_version,
)

pytestmark = pytest.mark.container

MANIFEST_TYPES = ", ".join(
    [
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
    ]
)
PUSHED = re.compile(r"^(\S+): digest: (sha256:[0-9a-f]{64}) size: \d+$", re.M)


def bcrypt_hash(password: str) -> str:
    """htpasswd wants bcrypt: glibc's crypt(3) (libxcrypt) makes it; Python 3.13 drops `crypt`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt
    except ImportError:
        import bcrypt  # the PyPI package; the test tier's venv needs it on Python >= 3.13

        return bcrypt.hashpw(password.encode(), bcrypt.gensalt()).decode()
    return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Registry:
    """A running registry: `127.0.0.1:PORT`, one user, and an authenticated HTTP client for its API."""

    address: str
    user: str
    password: str
    log: Path

    def get(self, path: str, accept: str | None = None) -> urllib.request.addinfourl:
        request = urllib.request.Request(f"http://{self.address}/v2/{path}")
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
        if accept:
            request.add_header("Accept", accept)
        return urllib.request.urlopen(request, timeout=60)

    def blob_sha256(self, name: str, digest: str) -> tuple[str, int]:
        """Stream one blob back from the registry: its sha256 and size."""
        hasher, size = hashlib.sha256(), 0
        with self.get(f"{name}/blobs/{digest}") as response:
            while chunk := response.read(1 << 20):
                hasher.update(chunk)
                size += len(chunk)
        return f"sha256:{hasher.hexdigest()}", size


@contextmanager
def local_registry(root: Path) -> Iterator[Registry]:
    """Debian's registry binary on 127.0.0.1:<free port>, storage and htpasswd under root."""
    user, password = "trainpod-ci", secrets.token_urlsafe(24)
    (root / "htpasswd").write_text(f"{user}:{bcrypt_hash(password)}\n")
    address = f"127.0.0.1:{free_port()}"
    config = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(root / "storage")}},
        "http": {"addr": address, "secret": secrets.token_hex(16)},
        "auth": {"htpasswd": {"realm": "trainpod-ci", "path": str(root / "htpasswd")}},
    }
    (root / "config.yml").write_text(yaml.safe_dump(config))
    registry = Registry(address, user, password, root / "registry.log")
    with open(registry.log, "wb") as log:
        proc = subprocess.Popen(
            [str(ensure_registry_binary()), "serve", str(root / "config.yml")], stdout=log, stderr=log
        )
    try:
        wait_until_answering(registry, proc)
        yield registry
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until_answering(registry: Registry, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            urllib.request.urlopen(f"http://{registry.address}/v2/", timeout=2)
            return
        except urllib.error.HTTPError as exc:
            if exc.code == 401:  # up, and asking for the password as configured
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(
        f"the registry never answered on {registry.address}; its log:\n{registry.log.read_text()}"
    )


def expected_tags() -> set[str]:
    """The Makefile's tags for TARGET=cpu, derived here from their sources, not from the Makefile."""
    lock = lock_file("cpu").read_text()
    torch = re.search(r"^torch==([0-9.]+)", lock, re.M).group(1)
    return {f"{project_version()}-cpu", f"{git_sha()}-cpu", f"cpu-torch{torch}", "latest-cpu"}


def make_image_push(registry: str, source: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "image", "push", "TARGET=cpu", f"REGISTRY={registry}", f"SOURCE_IMAGE={source}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def isolated_env(home: Path, tmpdir: Path) -> dict[str, str]:
    """The caller's environment without registry credentials, with its own HOME and TMPDIR: any file
    a push leaves behind (a docker config, a login) shows up there."""
    dropped = {"REGISTRY_USER", "REGISTRY_PASSWORD", "GITHUB_TOKEN", "GITHUB_ACTOR", "DOCKER_CONFIG"}
    env = {k: v for k, v in docker_env().items() if k not in dropped}
    return {**env, "HOME": str(home), "TMPDIR": str(tmpdir)}


def repo_digests(ref: str) -> list[str]:
    return json.loads(docker("image", "inspect", "-f", "{{json .RepoDigests}}", ref).stdout)


def image_id(ref: str) -> str:
    return docker("image", "inspect", "-f", "{{.Id}}", ref).stdout.strip()


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_make_image_push_sends_every_tag_and_pulls_back_with_the_same_digests(
    engine: Engine, tmp_path: Path
) -> None:
    home, tmpdir, registry_root = tmp_path / "home", tmp_path / "tmp", tmp_path / "registry"
    for folder in (home, tmpdir, registry_root):
        folder.mkdir()
    tags = expected_tags()
    with local_registry(registry_root) as registry:
        namespace = f"{registry.address}/trainpod"
        repo = f"{namespace}/trainpod"
        refs = [f"{repo}:{tag}" for tag in sorted(tags)]
        try:
            anonymous = make_image_push(namespace, engine.image, isolated_env(home, tmpdir))
            assert anonymous.returncode != 0, (
                "the registry accepted a push without credentials: its htpasswd auth is not on, so "
                f"this test would not prove the login works:\n{anonymous.stdout[-2000:]}"
            )

            env = {**isolated_env(home, tmpdir), "REGISTRY_USER": registry.user}
            env["REGISTRY_PASSWORD"] = registry.password
            pushed = make_image_push(namespace, engine.image, env)
            output = pushed.stdout + pushed.stderr
            assert pushed.returncode == 0, f"`make image push` failed:\n{output[-4000:]}"
            digests = dict(PUSHED.findall(pushed.stdout))
            assert set(digests) == tags, (
                f"push reported tags {sorted(digests)}, the Makefile should push {sorted(tags)}"
            )
            assert len(set(digests.values())) == 1, f"one image, one digest expected: {digests}"

            check_the_registry_holds_the_image(registry, "trainpod/trainpod", digests, image_id(engine.image))
            check_pulled_back_tags(
                registry, tmp_path / "pull-config", repo, refs, digests, image_id(engine.image)
            )

            assert registry.password not in anonymous.stdout + anonymous.stderr + output
            leftovers = [str(p) for p in files_under(tmpdir)]
            assert not leftovers, f"push left files in TMPDIR (its throwaway docker config?): {leftovers}"
            # docker keeps a login as base64("user:password") in config.json: look for both forms.
            login = base64.b64encode(f"{registry.user}:{registry.password}".encode())
            stored = [
                str(p)
                for p in files_under(home)
                if registry.password.encode() in p.read_bytes() or login in p.read_bytes()
            ]
            assert not stored, f"the push stored the password under HOME: {stored}"
        finally:
            docker("rmi", *refs, check=False)


def check_the_registry_holds_the_image(
    registry: Registry, name: str, digests: dict[str, str], local_id: str
) -> None:
    """Tags, manifests and every blob, read back over the registry's HTTP API and hashed here."""
    with registry.get(f"{name}/tags/list") as response:
        assert set(json.load(response)["tags"]) == set(digests)
    digest = next(iter(digests.values()))
    for tag in digests:
        with registry.get(f"{name}/manifests/{tag}", accept=MANIFEST_TYPES) as response:
            body = response.read()
            assert response.headers["Docker-Content-Digest"] == digest
    assert f"sha256:{hashlib.sha256(body).hexdigest()}" == digest, (
        "the manifest's bytes do not hash to its digest"
    )
    manifest = json.loads(body)
    # The config blob's digest is the image ID: the registry holds this very image, not a rebuild.
    assert manifest["config"]["digest"] == local_id
    for blob in [manifest["config"], *manifest["layers"]]:
        assert registry.blob_sha256(name, blob["digest"]) == (blob["digest"], blob["size"])


def check_pulled_back_tags(
    registry: Registry,
    docker_config: Path,
    repo: str,
    refs: list[str],
    digests: dict[str, str],
    local_id: str,
) -> None:
    """Remove the pushed tags and digest references locally, pull each tag, compare RepoDigests."""
    digest = next(iter(digests.values()))
    docker("rmi", *refs)
    docker("rmi", f"{repo}@{digest}", check=False)  # the digest reference push recorded
    assert not [d for d in repo_digests(local_id) if d.startswith(f"{repo}@")]

    env = {**docker_env(), "DOCKER_CONFIG": str(docker_config)}
    login = subprocess.run(
        [DOCKER, "login", "--username", registry.user, "--password-stdin", registry.address],
        input=registry.password, capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert login.returncode == 0, f"docker login to the test registry failed: {login.stderr}"
    try:
        for ref in refs:
            pull = subprocess.run([DOCKER, "pull", ref], capture_output=True, text=True, env=env, timeout=600)
            assert pull.returncode == 0, f"`docker pull {ref}` failed:\n{pull.stdout}{pull.stderr}"
            assert f"{repo}@{digest}" in repo_digests(ref), f"{ref} pulled back without digest {digest}"
            assert image_id(ref) == local_id, f"{ref} pulled back as another image"
    finally:
        subprocess.run([DOCKER, "logout", registry.address], capture_output=True, env=env)
    check_finetune_stack_runs(refs[0])


def check_finetune_stack_runs(ref: str) -> None:
    """The pulled image imports the finetune/tracking stack, with bitsandbytes' native CPU kernels."""
    script = (
        "import accelerate, peft, wandb, bitsandbytes\n"
        "from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib\n"
        "assert not isinstance(lib, ErrorHandlerMockBNBNativeLibrary), 'no libbitsandbytes_cpu'\n"
        "print('ok', bitsandbytes.__version__, peft.__version__, wandb.__version__)\n"
    )
    run = docker("run", "--rm", "--network", "none", ref, "python", "-c", script, timeout=120)
    assert run.stdout.startswith("ok "), run.stdout + run.stderr
