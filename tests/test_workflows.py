"""GitHub Actions workflows pass GitHub's workflow JSON schema and zizmor's offline audits.

    .venv/bin/pytest -q tests/test_workflows.py

The same two checkers run in `make lint`. Each is also shown a broken workflow, so a checker that
silently passes everything (a wrong flag, an empty file list) fails here instead of reading as green.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
BIN = Path(sys.executable).parent  # check-jsonschema and zizmor come with the dev dependencies

# Valid YAML, invalid workflow: `runs-on` missing and `steps` not a list.
SCHEMA_BROKEN = """\
name: broken
on: push
jobs:
  build:
    steps: "make test"
"""
# Schema-valid, insecure: an action by a movable tag, and a pull request's title pasted into a shell.
AUDIT_BROKEN = """\
name: insecure
on: pull_request_target
jobs:
  greet:
    runs-on: ubuntu-24.04
    steps:
      - uses: actions/checkout@v4
      - run: echo "${{ github.event.pull_request.title }}"
"""


def check_jsonschema(*paths: Path) -> subprocess.CompletedProcess:
    tool = BIN / "check-jsonschema"
    assert tool.exists(), f"{tool} is missing: run `make setup` (check-jsonschema is a dev dependency)"
    args = [str(tool), "--builtin-schema", "vendor.github-workflows", *map(str, paths)]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def zizmor(*paths: Path) -> subprocess.CompletedProcess:
    tool = BIN / "zizmor"
    assert tool.exists(), f"{tool} is missing: run `make setup` (zizmor is a dev dependency)"
    args = [str(tool), "--offline", "--no-progress", *map(str, paths)]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_the_three_workflows_are_there():
    assert {p.name for p in WORKFLOWS} >= {"test.yml", "images.yml", "supervise.yml"}


def test_every_workflow_passes_the_github_workflow_schema():
    result = check_jsonschema(*WORKFLOWS)
    assert result.returncode == 0, (
        f"fix the workflow against GitHub's schema:\n{result.stdout}{result.stderr}"
    )


def test_every_workflow_passes_zizmor_offline():
    result = zizmor(*WORKFLOWS)
    assert result.returncode == 0, (
        "zizmor found problems; fix each one (the help link says how) rather than ignoring it:\n"
        f"{result.stdout}{result.stderr}"
    )


@pytest.mark.parametrize(
    ("text", "check", "expected"),
    [
        (SCHEMA_BROKEN, check_jsonschema, "runs-on"),
        (AUDIT_BROKEN, zizmor, "template-injection"),
        (AUDIT_BROKEN, zizmor, "unpinned-uses"),
    ],
    ids=["schema", "zizmor-injection", "zizmor-unpinned"],
)
def test_each_checker_fails_a_broken_workflow(tmp_path: Path, text: str, check, expected: str):
    workflow = tmp_path / ".github" / "workflows" / "broken.yml"
    workflow.parent.mkdir(parents=True)
    workflow.write_text(text)
    result = check(workflow)
    assert result.returncode != 0, f"{check.__name__} passed a broken workflow:\n{result.stdout}"
    assert expected in result.stdout + result.stderr


def test_every_action_is_pinned_to_a_full_commit_sha():
    """zizmor's policy, checked here too so the pin format stays exact: 40 hex digits and the tag."""
    for path in WORKFLOWS:
        for line in path.read_text().splitlines():
            if match := re.search(r"uses:\s*(\S+)", line):
                ref = match.group(1)
                assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", ref), (
                    f"{path.name}: {ref} is not a sha pin"
                )
                assert re.search(r"#\s*v\d", line), f"{path.name}: say which release {ref} is (# vX.Y.Z)"


def test_the_image_matrix_builds_cpu_cu128_and_cu130_each_from_its_own_lock():
    images = yaml.safe_load((REPO / ".github/workflows/images.yml").read_text())
    flavours = {entry["target"] for entry in images["jobs"]["image"]["strategy"]["matrix"]["include"]}
    assert flavours == {"cpu", "cu128", "cu130"}
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M)) - {
        "wheelhouse-cpu",
        "wheelhouse-cuda",
        "lock-cuda",
    }
    assert stages == {"cpu", "cuda"}
    for flavour in flavours:
        assert (REPO / "docker" / f"constraints-{flavour}.txt").is_file()
        args = make_lines("image-build-args", flavour)
        assert args[0] == f"target={'cpu' if flavour == 'cpu' else 'cuda'}", args
        if flavour != "cpu":
            assert f"LOCK=docker/constraints-{flavour}.txt" in args and f"FLAVOUR={flavour}" in args


def make_lines(goal: str, flavour: str) -> list[str]:
    result = subprocess.run(
        ["make", "-s", goal, f"TARGET={flavour}"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.parametrize(
    ("flavour", "tags"),
    [
        ("cu128", ["0.1.0", "cu128-torch2.13.0", "latest"]),
        ("cu130", ["0.1.0-cu130", "cu130-torch2.13.0", "latest-cu130"]),
        ("cpu", ["0.1.0-cpu", "cpu-torch2.13.0", "latest-cpu"]),
    ],
)
def test_latest_and_the_bare_version_are_the_cu128_image(flavour: str, tags: list[str]):
    refs = make_lines("image-refs", flavour)
    named = [ref.split(":", 1)[1] for ref in refs]
    assert [named[0], named[2], named[3]] == tags, refs


def test_make_wheelhouse_fetches_the_flash_attn_wheel_without_printing_its_url(tmp_path: Path):
    """images.yml hands `make wheelhouse` FLASH_ATTN_WHEEL_URL from a repository variable, which GitHub never
    masks, and make printed the recipe's curl line with the URL in it: a token in the URL (a private host's
    https://user:token@...) went into the public build log. pip and curl are stand-ins here (no network)."""
    token = "ghp_notarealtoken0123456789"
    wheel = "flash_attn-2.8.3+cu12torch2.13cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    result, wheelhouse = _make_wheelhouse_with_flash_attn(
        tmp_path, f"https://me:{token}@wheels.example.com/cu128/{wheel.replace('+', '%2B')}"
    )
    assert (wheelhouse / wheel).is_file(), sorted(p.name for p in wheelhouse.iterdir())
    assert token not in result.stdout + result.stderr, result.stdout


@pytest.mark.parametrize(
    "query", ["?download=true", "?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=0123abcdef"]
)
def test_a_flash_attn_url_with_a_query_fetches_the_wheel_under_its_own_name(tmp_path: Path, query: str):
    """A presigned URL (S3's, GCS's: ?X-Amz-Signature=...) or a hub's ?download=true named the file after the whole
    URL's last part, query and all (flash_attn-...whl?X-Amz-...): the Dockerfile's flash_attn-*.whl matched nothing,
    and the image was built without flash-attn and without a word, the signature in the file's name."""
    wheel = "flash_attn-2.8.3+cu12torch2.13cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    result, wheelhouse = _make_wheelhouse_with_flash_attn(
        tmp_path, f"https://wheels.example.com/cu128/{wheel.replace('+', '%2B')}{query}"
    )
    assert sorted(p.name for p in wheelhouse.iterdir()) == [wheel]
    assert query not in result.stdout + result.stderr


def _make_wheelhouse_with_flash_attn(tmp_path: Path, url: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`make wheelhouse` for cu128 with pip and curl as stand-ins (no network): pip downloads nothing, curl
    writes a file where -o says."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "curl").write_text(
        '#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\necho wheel > "$out"\n'
    )
    (shim / "curl").chmod(0o755)
    wheelhouse = tmp_path / "wheelhouse"
    result = subprocess.run(
        [
            "make",
            "wheelhouse",
            "TARGET=cu128",
            "PYTHON=true",  # `true -m pip download ...`: nothing downloaded
            f"WHEELHOUSE={wheelhouse}",
            f"FLASH_ATTN_WHEEL_URL={url}",
        ],
        cwd=REPO,
        env={**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result, wheelhouse


def test_cuda_flavours_pin_torch_for_their_cuda_and_leave_flash_attn_optional():
    cu128 = (REPO / "docker/constraints-cu128.txt").read_text()
    cu130 = (REPO / "docker/constraints-cu130.txt").read_text()
    assert "\ntorch==2.13.0+cu128\n" in cu128 and "nvidia-nccl-cu13" not in cu128
    assert "\ntorch==2.13.0\n" in cu130 and "nvidia-nccl-cu13==" in cu130
    for lock in (cu128, cu130):
        assert "\nflash-attn" not in lock, "flash-attn is optional: it comes from FLASH_ATTN_WHEEL_URL only"


def test_supervise_runs_once_with_the_key_from_a_secret():
    text = (REPO / ".github/workflows/supervise.yml").read_text()
    workflow = yaml.safe_load(text)
    steps = workflow["jobs"]["supervise"]["steps"]
    run = next(step for step in steps if "trainpod supervise" in step.get("run", ""))
    assert run["run"].strip() == 'trainpod supervise "$RUN" --once'
    assert run["env"]["RUNPOD_API_KEY"] == "${{ secrets.RUNPOD_API_KEY }}"
    # PyYAML reads the `on:` key as True (YAML 1.1 boolean).
    assert "schedule" in workflow[True]


def workflow_step_env(
    env: dict[str, str], secrets: dict[str, str], variables: dict[str, str]
) -> dict[str, str]:
    """A step's `env:` as GitHub fills it: `${{ secrets.X }}` and `${{ vars.X }}`, empty when not set."""
    lookup = {"secrets": secrets, "vars": variables}

    def fill(match: re.Match) -> str:
        return lookup[match.group(1)].get(match.group(2), "")

    return {
        name: re.sub(r"\$\{\{\s*(secrets|vars)\.(\w+)\s*\}\}", fill, value) for name, value in env.items()
    }


@pytest.fixture
def fake_runpod():
    from fake_runpod import FakeRunPodServer

    with FakeRunPodServer() as fake:
        yield fake
    assert not fake.violations, f"requests RunPod would refuse: {fake.violations}"


def users_checkout(tmp_path: Path) -> Path:
    """The runner's checkout of a user's fork: this repository's configs with the user's own image in
    place of the shipped placeholder (ghcr.io/YOUR_ORG/...), which a supervisor refuses before its first
    request, as deploy does."""
    checkout = tmp_path / "checkout"
    for path in (REPO / "configs").rglob("*.yaml"):
        target = checkout / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text().replace("YOUR_ORG", "acme"))
    return checkout


@pytest.mark.parametrize("config_variable", ["", "configs/deploy/pretrain-spot.yaml"], ids=["found", "named"])
def test_the_scheduled_supervisor_restarts_an_interrupted_pod(tmp_path: Path, fake_runpod, config_variable):
    """The workflow's own command line and step env, run in a checkout (this repository) as the runner
    would run it, against the fake RunPod API: SUPERVISE_CONFIG unset (the run's deploy config is
    found under configs/deploy/) or naming it."""
    from trainpod.config import load_config
    from trainpod.config.deploy import DeployConfig
    from trainpod.runpod.deploy import deploy

    from fake_runpod import client_for

    checkout = users_checkout(tmp_path)
    deployed = deploy(
        client_for(fake_runpod), load_config(DeployConfig, checkout / "configs/deploy/pretrain-spot.yaml")
    )
    fake_runpod.interrupt(deployed.pod.id)
    workflow = yaml.safe_load((REPO / ".github/workflows/supervise.yml").read_text())
    step = next(s for s in workflow["jobs"]["supervise"]["steps"] if "trainpod supervise" in s.get("run", ""))
    variables = {"SUPERVISE_RUN": "pretrain-125m", "SUPERVISE_CONFIG": config_variable}
    env = workflow_step_env(step["env"], {"RUNPOD_API_KEY": fake_runpod.key}, variables)
    shim = tmp_path / "bin" / "trainpod"  # what `pip install .` puts on the runner's PATH
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m trainpod "$@"\n')
    shim.chmod(0o755)
    runner = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "RUNPOD_"))}
    runner |= {"PATH": f"{shim.parent}:{runner['PATH']}", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # The one difference from GitHub's runner: RunPod's API (v1, and v2 for clusters) is the fake.
    runner |= {"TRAINPOD_RUNPOD_API_URL": fake_runpod.url, "TRAINPOD_RUNPOD_API_V2_URL": fake_runpod.url_v2}
    result = subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
        cwd=checkout, env=runner | env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, f"the scheduled supervisor failed:\n{result.stdout}{result.stderr}"
    assert fake_runpod.pods[deployed.pod.id]["desiredStatus"] == "RUNNING", result.stdout
    assert "restart 1/50" in result.stdout


def test_the_scheduled_supervisors_state_is_carried_from_one_run_to_the_next(tmp_path: Path, fake_runpod):
    """Every scheduled run gets a fresh runner: without its state (supervise.json: restarts, backoff,
    cost) carried over, supervise.max_restarts never ends anything, and a run that is DONE (invisible
    without the volume) has its pod started again every 10 minutes, forever. The workflow restores the
    state folder before `trainpod supervise` and saves it after, whatever it exited with; this runs the
    step twice on two runners that share only what the cache steps carry."""
    import shutil

    from trainpod.config import load_config
    from trainpod.config.deploy import DeployConfig
    from trainpod.runpod.deploy import deploy

    from fake_runpod import client_for

    workflow = yaml.safe_load((REPO / ".github/workflows/supervise.yml").read_text())
    steps = workflow["jobs"]["supervise"]["steps"]
    names = [s.get("uses", "").split("@")[0] for s in steps]
    restore = steps[names.index("actions/cache/restore")] if "actions/cache/restore" in names else None
    save = steps[names.index("actions/cache/save")] if "actions/cache/save" in names else None
    assert restore is not None and save is not None, "the supervisor's state is not carried between runs"
    step_index = next(i for i, s in enumerate(steps) if "trainpod supervise" in s.get("run", ""))
    assert names.index("actions/cache/restore") < step_index < names.index("actions/cache/save")
    assert save.get("if") == "always()", "a supervisor that ends with 2 or 75 must keep its state too"
    assert restore["with"]["path"] == save["with"]["path"]
    prefix = restore["with"]["restore-keys"].strip()
    assert save["with"]["key"].startswith(prefix) and "github.run_id" in save["with"]["key"]
    checkout = users_checkout(tmp_path)
    deployed = deploy(
        client_for(fake_runpod), load_config(DeployConfig, checkout / "configs/deploy/pretrain-spot.yaml")
    )
    step = steps[step_index]
    env = workflow_step_env(
        step["env"], {"RUNPOD_API_KEY": fake_runpod.key}, {"SUPERVISE_RUN": "pretrain-125m"}
    )
    shim = tmp_path / "bin" / "trainpod"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m trainpod "$@"\n')
    shim.chmod(0o755)
    cache = tmp_path / "actions-cache"
    for run in (1, 2):
        home = tmp_path / f"runner-{run}"  # a fresh runner: its home holds only what the cache restores
        home.mkdir()
        cached = Path(restore["with"]["path"].replace("~", str(home), 1))
        if cache.exists():
            shutil.copytree(cache, cached)
        fake_runpod.interrupt(deployed.pod.id)
        runner = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "RUNPOD_", "XDG_"))}
        runner |= {"PATH": f"{shim.parent}:{runner['PATH']}", "HOME": str(home)}
        runner |= {
            "TRAINPOD_RUNPOD_API_URL": fake_runpod.url,
            "TRAINPOD_RUNPOD_API_V2_URL": fake_runpod.url_v2,
        }
        result = subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
            cwd=checkout, env=runner | env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, f"the scheduled supervisor failed:\n{result.stdout}{result.stderr}"
        assert f"restart {run}/50" in result.stdout, result.stdout
        shutil.rmtree(cache, ignore_errors=True)
        shutil.copytree(cached, cache)


def _pins(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    return {
        line.split("==")[0].lower(): line.split("==")[1]
        for line in lines
        if "==" in line and not line.startswith("#")
    }


@pytest.mark.parametrize("flavour", ["cu128", "cu130"])
def test_each_cuda_lock_pins_every_package_of_the_cpu_lock_alike(flavour: str):
    cpu, cuda = _pins(REPO / "docker/constraints-cpu.txt"), _pins(REPO / f"docker/constraints-{flavour}.txt")
    missing = sorted(set(cpu) - set(cuda))
    differ = sorted(name for name in set(cpu) & set(cuda) if cpu[name] != cuda[name] and name != "torch")
    assert not missing and not differ, (
        f"docker/constraints-{flavour}.txt lacks {missing} and pins {differ} otherwise than the cpu lock: a "
        "package added to pyproject.toml goes into every lock, or that flavour's offline build fails"
    )
