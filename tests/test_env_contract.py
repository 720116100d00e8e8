"""The pod's environment is one contract: README, infra/ and the code name the same variables,
and every RunPod definition under infra/ is valid against RunPod's own OpenAPI description."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

REPO = Path(__file__).resolve().parents[1]
RUNPOD_REFERENCE = REPO / "docs/runpod"
OPENAPI = RUNPOD_REFERENCE / "runpod-rest-openapi.json"
INFRA = REPO / "infra/runpod"
VARIABLE = re.compile(r"\bTRAINPOD_[A-Z_]+\b")
SECRETS = ("HF_TOKEN", "WANDB_API_KEY")
# Set by the kit itself, never by a user or a template: the image's CUDA (docker/Dockerfile), the
# folder where the ranks of a multi-node run report their exit codes (trainpod.launch), the
# credentials git sync takes out of a repo URL and its server, for git's askpass (trainpod.gitsync), and the deploy's record
# that `trainpod deploy` gives a pod (runpod/deploy.py).
SET_BY_THE_KIT = {
    "TRAINPOD_IMAGE_CUDA",
    "TRAINPOD_RANK_EXIT_DIR",
    "TRAINPOD_GIT_URL_USER",
    "TRAINPOD_GIT_URL_PASSWORD",
    "TRAINPOD_GIT_URL_HOST",
    "TRAINPOD_DEPLOYED",
    "TRAINPOD_SECRET_NAMES",
}


def variables_in(paths: list[Path]) -> set[str]:
    return {name for path in paths for name in VARIABLE.findall(path.read_text(encoding="utf-8"))}


def code_files() -> list[Path]:
    return [*REPO.glob("src/trainpod/**/*.py"), *(p for p in (REPO / "entrypoints").iterdir() if p.is_file())]


def infra_files() -> list[Path]:
    return sorted(INFRA.glob("*.json"))


def test_readme_documents_exactly_the_variables_the_code_reads():
    in_code, in_readme = variables_in(code_files()), variables_in([REPO / "README.md"])
    assert in_code - in_readme == set(), f"read by the code but not in README's table: {in_code - in_readme}"
    assert in_readme - in_code == set(), f"in README but read nowhere: {in_readme - in_code}"


def laptop_only_variables() -> set[str]:
    """Variables in the table of README's "From a laptop" section: read by the CLI on a laptop, never in a pod."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## From a laptop", 1)[-1].split("\n## ", 1)[0] if "## From a laptop" in text else ""
    names = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]  # first cells
    return set(VARIABLE.findall("\n".join(names)))


def test_the_design_doc_documents_the_same_variables_as_the_readme():
    in_design, in_readme = variables_in([REPO / "docs/design.md"]), variables_in([REPO / "README.md"])
    assert in_design == in_readme, (
        f"only in docs/design.md: {in_design - in_readme}; only in README: {in_readme - in_design}: "
        "the pod's environment is one contract, keep both tables the same"
    )


def pod_variables() -> set[str]:
    """README's variables less the laptop's, those the `command` workload gives its program, and those the
    kit sets itself (the image's CUDA, the ranks' exit-code folder)."""
    from trainpod.config.command import PROGRAM_ENV

    return variables_in([REPO / "README.md"]) - laptop_only_variables() - set(PROGRAM_ENV) - SET_BY_THE_KIT


def test_the_template_names_every_variable_of_the_contract():
    template_env = json.loads((INFRA / "template.json").read_text())["env"]
    assert set(filter(VARIABLE.fullmatch, template_env)) == pod_variables()


def test_infra_names_no_variable_outside_the_contract():
    assert variables_in(infra_files()) <= pod_variables()


@pytest.mark.parametrize("path", infra_files(), ids=lambda p: p.name)
def test_secrets_in_infra_are_runpod_secret_references_never_values(path):
    env = json.loads(path.read_text()).get("env", {})
    for name, value in env.items():
        if name in SECRETS or name.endswith("_TOKEN"):
            assert re.fullmatch(r"\{\{ RUNPOD_SECRET_\w+ \}\}", value), f"{path.name}: {name} holds a value"


def runpod_schema(name: str) -> dict:
    """RunPod's schema for `name`, with unknown keys refused (RunPod ignores them silently)."""
    spec = json.loads(OPENAPI.read_text())
    schema = dict(spec["components"]["schemas"][name], additionalProperties=False)
    schema["properties"] = dict(
        schema["properties"], env={"type": "object", "additionalProperties": {"type": "string"}}
    )
    return schema


@pytest.mark.parametrize("path", infra_files(), ids=lambda p: p.name)
def test_infra_definitions_validate_against_runpods_openapi(path):
    kind = "TemplateCreateInput" if path.name.startswith("template") else "PodCreateInput"
    errors = sorted(
        jsonschema.Draft7Validator(runpod_schema(kind)).iter_errors(json.loads(path.read_text())), key=str
    )
    assert not errors, f"{path.name} is not a valid {kind}: " + "; ".join(
        f"{'.'.join(map(str, e.path)) or '(top)'}: {e.message}" for e in errors
    )


# A path in the repository (configs/..., entrypoints/..., examples/...) or in the image, where the
# Dockerfile copies those folders under /opt/trainpod; a sentence's full stop is not part of it.
NAMED_PATH = re.compile(r"(?:/opt/trainpod/)?\b(?:configs|entrypoints|examples|infra|docker)/[\w./<>-]*[\w>]")


def image_folders() -> set[str]:
    """The repository folders the Dockerfile copies into the image's /opt/trainpod."""
    dockerfile = (REPO / "docker/Dockerfile").read_text()
    return set(re.findall(r"^COPY (\w+) /opt/trainpod/\1$", dockerfile, re.M))


def named_paths() -> list[tuple[str, str]]:
    """(file, path) for every path named in infra/ and configs/deploy/ (JSON, YAML, README)."""
    files = sorted([*(REPO / "infra").rglob("*"), *(REPO / "configs/deploy").rglob("*")])
    return [
        (str(f.relative_to(REPO)), path)
        for f in files
        if f.is_file()
        for path in dict.fromkeys(NAMED_PATH.findall(f.read_text(encoding="utf-8")))
        if "<" not in path  # a pattern such as entrypoints/<workload>, not a path
    ]


def test_infra_and_deploy_configs_name_paths():
    assert len(named_paths()) >= 10, "the scan below found too few paths: its pattern is broken"


@pytest.mark.parametrize(("source", "path"), named_paths(), ids=lambda v: v)
def test_every_path_named_in_infra_and_deploy_configs_exists(source, path):
    in_repo = path.removeprefix("/opt/trainpod/")
    assert (REPO / in_repo).exists(), f"{source} names {path}, which is not in the repository; fix the name"
    if path.startswith("/opt/trainpod/"):
        folder = in_repo.split("/")[0]
        assert folder in image_folders(), (
            f"{source} names {path}, but docker/Dockerfile does not copy {folder}/ into /opt/trainpod"
        )


def test_the_cluster_variables_boot_reads_are_the_ones_runpod_documents_for_instant_clusters():
    """boot.py starts torchrun from what RunPod puts into a cluster's pods (runpod-platform.md)."""
    platform = (RUNPOD_REFERENCE / "runpod-platform.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`([A-Z_]+)`", platform.split("## Environment inside a pod", 1)[1]))
    read = set(re.findall(r'environ(?:\.get\(|\[)"([A-Z_]+)"', (REPO / "src/trainpod/boot.py").read_text()))
    # RANK is torchrun's own (set for each rank it starts), the TRAINPOD_ names are the kit's contract.
    platform_reads = {name for name in read if not name.startswith("TRAINPOD_") and name != "RANK"}
    assert {"NUM_NODES", "NODE_RANK", "NUM_TRAINERS", "PRIMARY_ADDR", "PRIMARY_PORT"} <= platform_reads
    assert platform_reads <= documented, (
        f"boot.py reads {sorted(platform_reads - documented)}, which RunPod does not set in a pod; "
        "use the names in docs/runpod/runpod-platform.md, 'Environment inside a pod'"
    )
