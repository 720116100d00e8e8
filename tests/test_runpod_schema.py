"""The fake RunPod API validates against a schema derived from RunPod's own OpenAPI file; the two
cannot drift, and what trainpod builds (deploy bodies, CUDA versions) fits RunPod's enums."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from trainpod.config import load_config
from trainpod.config.deploy import CUDA_VERSIONS, DeployConfig
from trainpod.runpod.deploy import pod_body, template_body

from fake_runpod import OPENAPI, OPENAPI_V2, SCHEMA_FILE, SCHEMA_V2_FILE, derive_schema, derive_schema_v2

DEPLOY_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs/deploy").glob("*.yaml"))


def openapi() -> dict:
    assert OPENAPI.is_file(), (
        f"{OPENAPI} is missing: the checkout needs shared/ beside it (shared/reference/)"
    )
    return json.loads(OPENAPI.read_text())


def test_derived_schema_equals_what_runpods_openapi_says_today():
    assert derive_schema(openapi()) == json.loads(SCHEMA_FILE.read_text()), (
        f"{SCHEMA_FILE.name} is out of date with RunPod's OpenAPI; run `python tests/fake_runpod.py --derive`"
    )


def test_derived_v2_schema_equals_what_runpods_v2_openapi_says_today():
    assert OPENAPI_V2.is_file(), f"{OPENAPI_V2} is missing: the checkout needs shared/ beside it"
    assert derive_schema_v2(json.loads(OPENAPI_V2.read_text())) == json.loads(SCHEMA_V2_FILE.read_text()), (
        f"{SCHEMA_V2_FILE.name} is out of date with RunPod's v2 OpenAPI; run `python tests/fake_runpod.py --derive`"
    )


def test_the_derived_schema_refuses_unknown_fields_and_wrong_enums():
    pod = json.loads(SCHEMA_FILE.read_text())["schemas"]["PodCreateInput"]
    validator = jsonschema.Draft7Validator(pod)
    assert validator.is_valid({"name": "a", "gpuTypeIds": ["NVIDIA H100 80GB HBM3"], "env": {"A": "1"}})
    assert not validator.is_valid({"gpuTypeId": "NVIDIA H100 80GB HBM3"}), "a misspelt field must not pass"
    assert not validator.is_valid({"cloudType": "secure"}), "enums are case-sensitive at RunPod"
    assert not validator.is_valid({"env": {"A": 1}}), "env values are strings"


def test_cuda_versions_trainpod_offers_are_runpods_allowed_cuda_versions():
    enum = openapi()["components"]["schemas"]["PodCreateInput"]["properties"]["allowedCudaVersions"]["items"]
    assert list(CUDA_VERSIONS) == enum["enum"], "update CUDA_VERSIONS in src/trainpod/config/deploy.py"


@pytest.mark.parametrize("path", DEPLOY_CONFIGS, ids=lambda p: p.name)
def test_shipped_deploy_configs_build_bodies_runpod_accepts(path):
    schemas = json.loads(SCHEMA_FILE.read_text())["schemas"]
    config = load_config(DeployConfig, path)
    for name, body in (
        ("TemplateCreateInput", template_body(config)),
        ("PodCreateInput", pod_body(config, "tpl1", "vol1")),
    ):
        errors = [e.message for e in jsonschema.Draft7Validator(schemas[name]).iter_errors(body)]
        assert not errors, f"{path.name}: the {name} it builds is refused: {errors}"
