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

from fake_runpod import (
    OPENAPI,
    OPENAPI_V2,
    REFERENCE,
    SCHEMA_FILE,
    SCHEMA_V2_FILE,
    FakeRunPodServer,
    derive_schema,
    derive_schema_v2,
)

DEPLOY_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs/deploy").glob("*.yaml"))


def openapi() -> dict:
    return json.loads(OPENAPI.read_text())


def test_derived_schema_equals_what_runpods_openapi_says_today():
    assert derive_schema(openapi()) == json.loads(SCHEMA_FILE.read_text()), (
        f"{SCHEMA_FILE.name} is out of date with RunPod's OpenAPI; run `python tests/fake_runpod.py --derive`"
    )


def test_derived_v2_schema_equals_what_runpods_v2_openapi_says_today():
    assert derive_schema_v2(json.loads(OPENAPI_V2.read_text())) == json.loads(SCHEMA_V2_FILE.read_text()), (
        f"{SCHEMA_V2_FILE.name} is out of date with RunPod's v2 OpenAPI; run `python tests/fake_runpod.py --derive`"
    )


def upstream_reference() -> Path | None:
    """The brief's shared/reference beside the checkout, where the copies in docs/runpod came from."""
    for parent in REFERENCE.parents:
        if (parent / "shared/reference").is_dir():
            return parent / "shared/reference"
    return None


def test_the_reference_kept_in_docs_runpod_is_the_upstream_copy_when_one_is_beside_the_checkout():
    """docs/runpod/ makes any checkout self-sufficient (GitHub's runners have no shared/); where the
    brief's copy is at hand, ours must be byte for byte the same, so a newer description is noticed."""
    upstream = upstream_reference()
    if upstream is None:
        pytest.skip("no shared/reference beside this checkout to compare docs/runpod/ with")
    names = sorted(p.name for p in upstream.iterdir() if p.is_file())
    assert names == sorted(p.name for p in REFERENCE.iterdir() if p.name != "README.md")
    for name in names:
        assert (REFERENCE / name).read_bytes() == (upstream / name).read_bytes(), (
            f"docs/runpod/{name} differs from {upstream / name}; copy it over, then run "
            "`python tests/fake_runpod.py --derive` and fix what the tests then find"
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


def test_the_default_image_admits_every_cuda_version_runpod_lists_from_12_8_up(tmp_path):
    """cu128 runs on hosts reporting 12.8, 12.9 and 13.0; RunPod matches the list exactly, so all belong in it."""
    enum = openapi()["components"]["schemas"]["PodCreateInput"]["properties"]["allowedCudaVersions"]["items"][
        "enum"
    ]
    at_least_12_8 = [v for v in enum if tuple(map(int, v.split("."))) >= (12, 8)]
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "run: r\nworkload: pretrain\nconfig: configs/pretrain/tiny.yaml\nimage: {name: ghcr.io/o/trainpod:latest}\n"
        "pod: {gpu_types: [NVIDIA H100 80GB HBM3]}\nvolume: {data_center: EU-RO-1}\n"
    )
    body = pod_body(load_config(DeployConfig, path), "tpl1", "vol1")
    assert sorted(body["allowedCudaVersions"]) == sorted(at_least_12_8) == ["12.8", "12.9", "13.0"]
    schema = json.loads(SCHEMA_FILE.read_text())["schemas"]["PodCreateInput"]
    assert not list(jsonschema.Draft7Validator(schema).iter_errors(body))


def test_a_cu130_image_admits_only_hosts_reporting_13_0(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "run: r\nworkload: pretrain\nconfig: configs/pretrain/tiny.yaml\n"
        "image: {name: 'ghcr.io/o/trainpod:latest-cu130', cuda_version: '13.0'}\n"
        "pod: {gpu_types: [NVIDIA H100 80GB HBM3]}\nvolume: {data_center: EU-RO-1}\n"
    )
    assert pod_body(load_config(DeployConfig, path), "tpl1", "vol1")["allowedCudaVersions"] == ["13.0"]


@pytest.mark.parametrize(
    "error, printed",
    [(BrokenPipeError(), False), (ConnectionResetError(), False), (ValueError("a bug"), True)],
)
def test_the_fake_server_prints_a_traceback_for_its_own_errors_only(error, printed, capsys):
    """A client that gave up on its answer (a timeout test) left socketserver's traceback in the tier's
    output; an error of the fake's own still shows."""
    server = FakeRunPodServer()
    try:
        try:
            raise error
        except Exception:
            server.httpd.handle_error(None, ("127.0.0.1", 1))
    finally:
        server.httpd.server_close()
    assert ("Traceback" in capsys.readouterr().err) is printed
