"""The pod's environment is one contract: README, infra/ and the code name the same variables,
and every RunPod definition under infra/ is valid against RunPod's own OpenAPI description."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

REPO = Path(__file__).resolve().parents[1]
OPENAPI = REPO.parent / "shared/reference/runpod-rest-openapi.json"
INFRA = REPO / "infra/runpod"
VARIABLE = re.compile(r"\bTRAINPOD_[A-Z_]+\b")
SECRETS = ("HF_TOKEN", "WANDB_API_KEY")
# Set by the kit itself, never by a user or a template: the image's CUDA (docker/Dockerfile) and the
# folder where the ranks of a multi-node run report their exit codes (trainpod.launch).
SET_BY_THE_KIT = {"TRAINPOD_IMAGE_CUDA", "TRAINPOD_RANK_EXIT_DIR"}


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


def test_the_template_names_every_variable_of_the_contract():
    template_env = json.loads((INFRA / "template.json").read_text())["env"]
    assert set(filter(VARIABLE.fullmatch, template_env)) == variables_in([REPO / "README.md"]) - SET_BY_THE_KIT


def test_infra_names_no_variable_outside_the_contract():
    assert variables_in(infra_files()) <= variables_in([REPO / "README.md"])


@pytest.mark.parametrize("path", infra_files(), ids=lambda p: p.name)
def test_secrets_in_infra_are_runpod_secret_references_never_values(path):
    env = json.loads(path.read_text()).get("env", {})
    for name, value in env.items():
        if name in SECRETS or name.endswith("_TOKEN"):
            assert re.fullmatch(r"\{\{ RUNPOD_SECRET_\w+ \}\}", value), f"{path.name}: {name} holds a value"


def runpod_schema(name: str) -> dict:
    """RunPod's schema for `name`, with unknown keys refused (RunPod ignores them silently)."""
    assert OPENAPI.is_file(), (
        f"{OPENAPI} is missing: the checkout needs shared/ beside it (DESIGN.md, reference/)"
    )
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
