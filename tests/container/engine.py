"""A real Docker engine for the container tier, made ready idempotently (shared/container-testing.md).

    python tests/container/engine.py      # install, start, base image, wheelhouse, build; prints timings

Each step is skipped when its result is already there: Debian's docker.io/debootstrap installed,
dockerd answering, the debootstrap base imported (rootfs tarball cached under .cache/container),
the wheelhouse downloaded (.cache/wheelhouse/cpu, stamped with the lock file's hash), the `cpu`
image built (BuildKit's cache makes a rebuild seconds). Any failure raises EngineError with the
step, the command and the tail of its output. bench/bench_image.py imports this module too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"
STATE = CACHE / "container"
# Debian's client: another `docker` may come first on PATH without buildx (container-testing.md, 3).
DOCKER = "/usr/bin/docker"
DOCKERD = "/usr/sbin/dockerd"
DEBOOTSTRAP = "/usr/sbin/debootstrap"
BASE_PACKAGES = (
    "python3,python3-venv,python3-dev,ca-certificates,git,git-lfs,tini,gcc,g++,libc6-dev,openssh-server"
)
# The tag changes with the packages and with how the rootfs is slimmed (slim_down).
BASE_RECIPE = BASE_PACKAGES + ";slim-1"
BASE_IMAGE = "trainpod-ci/bookworm-base:" + hashlib.sha256(BASE_RECIPE.encode()).hexdigest()[:12]
CPU_IMAGE = "trainpod:ci-cpu"
CUDA_STAND_IN_IMAGE = "trainpod:ci-cuda-stand-in"
# The cuda target built here with stand-ins for what cannot be had offline (test_cuda_stand_in.py):
# the local Debian base for nvidia/cuda:12.8.1-base-ubuntu24.04, the cpu wheelhouse and lock (CPU
# torch) for the cu128 wheelhouse and lock (CUDA torch + nvidia-* wheels). Everything else is the
# cu128 build's: its stage, system packages, venv, one pip step, bitsandbytes' CUDA 12.8 kernels,
# compile smoke, kit, entrypoints and TRAINPOD_IMAGE_CUDA=12.8.
CUDA_STAND_IN_ARGS = {
    "LOCK": "docker/constraints-cpu.txt",
    "TORCH_VERSION": "2.13.0+cpu",
    "TORCH_CUDA": "none",
    "CUDA_VERSION": "12.8",
    "FLAVOUR": "cu128-stand-in",
}
DEBIAN_MIRROR = "http://deb.debian.org/debian"
SYSTEM_REGISTRY = Path("/usr/bin/docker-registry")


class EngineError(RuntimeError):
    """A step of making the engine ready failed; the message says which and how to look into it."""


@dataclass
class Engine:
    """What the container tier needs: the image tag and whether this process started dockerd."""

    image: str = CPU_IMAGE
    dockerd: subprocess.Popen | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def stop(self) -> None:
        """Stop dockerd by its pid, only if this process started it."""
        if self.dockerd is None:
            return
        self.dockerd.terminate()
        try:
            self.dockerd.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.dockerd.kill()
            self.dockerd.wait()
        self.dockerd = None


def sh(cmd: list[str], step: str, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """Run a command; on failure raise EngineError naming the step, the command and its output."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineError(f"{step}: `{' '.join(cmd)}` could not run: {exc}") from exc
    if res.returncode != 0:
        tail = (res.stdout + res.stderr)[-3000:]
        raise EngineError(f"{step}: `{' '.join(cmd)}` exited {res.returncode}:\n{tail}")
    return res


def docker_env() -> dict[str, str]:
    return {**os.environ, "DOCKER_BUILDKIT": "1"}


def docker(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """`/usr/bin/docker ARGS` with BuildKit on; check=False returns the result whatever the code."""
    cmd = [DOCKER, *args]
    if check:
        return sh(cmd, f"docker {args[0]}", timeout=timeout, env=docker_env())
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=docker_env())


def ensure_packages() -> None:
    """apt-get install docker.io debootstrap, unless there already (about 40 s when not).

    An engine that already answers (GitHub's runners ship Docker's own packages, with dockerd in
    /usr/bin) is used as it is: installing docker.io next to it would conflict with its containerd.
    """
    missing = [] if Path(DEBOOTSTRAP).exists() else ["debootstrap"]
    if not (Path(DOCKER).exists() and Path(DOCKERD).exists()) and not engine_answers():
        missing.append("docker.io")
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    sh(["apt-get", "update", "-qq"], "install engine (apt-get update)", env=env)
    sh(["apt-get", "install", "-y", "-qq", *missing], "install engine", env=env)


def engine_answers() -> bool:
    if not Path(DOCKER).exists():
        return False
    return subprocess.run([DOCKER, "info"], capture_output=True, timeout=30).returncode == 0


def ensure_daemon() -> subprocess.Popen | None:
    """Start dockerd (no bridge, no iptables) unless `docker info` answers; returns it if started."""
    if engine_answers():
        return None
    STATE.mkdir(parents=True, exist_ok=True)
    log = open(STATE / "dockerd.log", "ab")  # noqa: SIM115 - lives as long as the daemon
    proc = subprocess.Popen(
        [DOCKERD, "--storage-driver=overlay2", "--bridge=none", "--iptables=false"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if engine_answers():
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.terminate()
    tail = (STATE / "dockerd.log").read_text(errors="replace")[-2000:]
    raise EngineError(f"start dockerd: `docker info` never answered within 60 s; dockerd.log ends:\n{tail}")


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, check=False).returncode == 0


def ensure_base_image() -> None:
    """A local Debian bookworm base made with debootstrap and `docker import` (no registry here)."""
    if image_exists(BASE_IMAGE):
        return
    tarball = STATE / f"{BASE_IMAGE.split(':')[1]}-rootfs.tar"
    if not tarball.exists():
        rootfs = STATE / "rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        STATE.mkdir(parents=True, exist_ok=True)
        sh(
            [
                DEBOOTSTRAP,
                "--variant=minbase",
                f"--include={BASE_PACKAGES}",
                "bookworm",
                str(rootfs),
                DEBIAN_MIRROR,
            ],
            "debootstrap the base image",
            timeout=900,
        )
        # apt lists and caches would only grow the base; the image never runs apt offline anyway.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for item in (rootfs / junk).glob("*"):
                if item.is_file():
                    item.unlink()
        slim_down(rootfs)
        partial = tarball.with_suffix(".partial")
        sh(["tar", "-C", str(rootfs), "-cf", str(partial), "."], "pack the base rootfs")
        partial.rename(tarball)
        shutil.rmtree(rootfs, ignore_errors=True)
    docker("import", str(tarball), BASE_IMAGE, timeout=600)


def slim_down(rootfs: Path) -> None:
    """What debian:bookworm-slim (the real cpu base) leaves out by its dpkg path-excludes: docs but
    their copyright files, man pages, info, locales (about 90 MB), so image sizes measured here are
    the real base's."""
    for folder in (
        "usr/share/man",
        "usr/share/info",
        "usr/share/groff",
        "usr/share/lintian",
        "usr/share/locale",
    ):
        shutil.rmtree(rootfs / folder, ignore_errors=True)
    for path in (rootfs / "usr/share/doc").rglob("*"):
        if (path.is_file() or path.is_symlink()) and path.name != "copyright":
            path.unlink()


def lock_file(target: str) -> Path:
    return REPO / "docker" / f"constraints-{target}.txt"


def wheelhouse_dir(target: str = "cpu") -> Path:
    return CACHE / "wheelhouse" / target


def ensure_wheelhouse(target: str = "cpu") -> Path:
    """`pip download` every pin of the lock file (the host is cp311 like bookworm's python3)."""
    lock = lock_file(target)
    out = wheelhouse_dir(target)
    stamp = out / ".lock-sha256"
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return out
    out.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out)]
    # The lock's torch==X+cpu is on PyTorch's CPU index, which the Makefile's TORCH_INDEX names
    # where pip's own configuration does not know it (GitHub's runners).
    if os.environ.get("TORCH_INDEX"):
        pip += ["--extra-index-url", os.environ["TORCH_INDEX"]]
    sh([*pip, "-r", str(lock)], f"download the {target} wheelhouse", timeout=1200)
    stamp.write_text(digest)
    return out


def project_version() -> str:
    # A regex, not tomllib: the kit supports Python 3.10, which has no tomllib.
    match = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    return match.group(1) if match else "0.0.0"


def git_sha() -> str:
    res = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
    )
    return res.stdout.strip() or "unknown"


def build_image(target: str = "cpu", tag: str = CPU_IMAGE, extra_args: dict[str, str] | None = None) -> str:
    """Build a target offline (`--network none`) from the cpu wheelhouse; returns the tag."""
    wheelhouse = wheelhouse_dir("cpu").relative_to(REPO)
    base_arg = "CPU_BASE_IMAGE" if target == "cpu" else "BASE_IMAGE"
    args = {
        base_arg: BASE_IMAGE,
        "WHEELHOUSE": str(wheelhouse),
        "VERSION": project_version(),
        "GIT_SHA": git_sha(),
        **(extra_args or {}),
    }
    build_args = [arg for name, value in args.items() for arg in ("--build-arg", f"{name}={value}")]
    docker(
        "build", "--network", "none", "-f", str(REPO / "docker/Dockerfile"), "--target", target,
        *build_args, "-t", tag, str(REPO),
        timeout=1800,
    )  # fmt: skip
    return tag


def build_cuda_stand_in() -> str:
    """The cuda target's path with CPU torch standing in for the CUDA wheels (CUDA_STAND_IN_ARGS)."""
    return build_image("cuda", CUDA_STAND_IN_IMAGE, CUDA_STAND_IN_ARGS)


def ensure_engine() -> Engine:
    """Every step in order, timed; a failure stops dockerd again if this call started it."""
    engine = Engine()
    steps = [
        ("engine install", ensure_packages),
        ("dockerd start", lambda: setattr(engine, "dockerd", ensure_daemon())),
        ("base image (debootstrap + import)", ensure_base_image),
        ("wheelhouse", ensure_wheelhouse),
        ("image build (cpu, --network none)", build_image),
    ]
    try:
        for name, step in steps:
            start = time.monotonic()
            step()
            engine.timings[name] = round(time.monotonic() - start, 1)
    except BaseException:
        engine.stop()
        raise
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "timings.json").write_text(json.dumps(engine.timings, indent=2))
    return engine


def ensure_registry_binary() -> Path:
    """Debian's `docker-registry` server: the installed binary, else the package unpacked under .cache.

    Not `apt-get install`: the package's maintainer script starts a system service that listens on
    :5000 on every interface and outlives the test. `apt-get download` + `dpkg-deb -x` takes the
    same Debian binary (about 20 MB) and starts nothing.
    """
    if SYSTEM_REGISTRY.exists():
        return SYSTEM_REGISTRY
    unpacked = STATE / "docker-registry"
    binary = unpacked / "usr/bin/docker-registry"
    if binary.exists():
        return binary
    downloads = STATE / "debs"
    downloads.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    download = ["apt-get", "download", "-qq", "docker-registry"]
    if subprocess.run(download, cwd=downloads, capture_output=True, env=env).returncode != 0:
        # A fresh machine may have no package lists yet.
        sh(["apt-get", "update", "-qq"], "registry package (apt-get update)", env=env)
        sh(download, "registry package (apt-get download docker-registry)", cwd=downloads, env=env)
    deb = max(downloads.glob("docker-registry_*.deb"))
    partial = unpacked.with_suffix(".partial")
    shutil.rmtree(partial, ignore_errors=True)
    sh(["dpkg-deb", "-x", str(deb), str(partial)], "registry package (dpkg-deb -x)")
    shutil.rmtree(unpacked, ignore_errors=True)
    partial.rename(unpacked)
    return binary


def image_size_bytes(tag: str) -> int:
    return int(docker("image", "inspect", "-f", "{{.Size}}", tag).stdout.strip())


if __name__ == "__main__":
    eng = ensure_engine()
    print(json.dumps(eng.timings, indent=2))
    print(
        f"{CPU_IMAGE}: {image_size_bytes(CPU_IMAGE) / 1e9:.2f} GB; dockerd left running: {eng.dockerd is not None}"
    )
