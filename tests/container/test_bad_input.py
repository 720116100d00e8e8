"""Bad input fails fast with exit 2, one clear ERROR line in `docker logs`, and an untouched volume."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import PRETRAIN_ENV, Pods, snapshot

pytestmark = pytest.mark.container

BAD_YAML = "name: bad\ntrain:\n  max_steps: lots\n  bogus_key: 1\n"
CASES = {
    # case: (env, volume mode, words the ERROR line must contain)
    "bad-config": (
        {"TRAINPOD_WORKLOAD": "pretrain", "TRAINPOD_CONFIG": "/workspace/bad.yaml"},
        "rw",
        ["bad.yaml"],
    ),
    "missing-config": ({"TRAINPOD_WORKLOAD": "pretrain"}, "rw", ["TRAINPOD_CONFIG"]),
    "read-only-volume": (PRETRAIN_ENV, "ro", ["/workspace", "writable"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_with_one_clear_error_line_and_leaves_the_volume_untouched(
    case: str, pods: Pods, tmp_path: Path
) -> None:
    env, mode, words = CASES[case]
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "bad.yaml").write_text(BAD_YAML)
    before = snapshot(volume)
    box = pods.run(volume, env, volume_mode=mode, timeout=60)
    logs = box.logs()
    assert box.exit_code() == 2, f"{case}: exited {box.exit_code()}, expected 2 (bad input):\n{logs[-3000:]}"
    assert "Traceback" not in logs, f"{case}: a traceback reached the user:\n{logs[-3000:]}"
    errors = [line for line in logs.splitlines() if " ERROR " in line]
    assert len(errors) == 1, f"{case}: expected one ERROR line, got {len(errors)}:\n{logs[-3000:]}"
    problem = "\n".join(logs.splitlines()[logs.splitlines().index(errors[0]) :])
    missing = [w for w in words if w not in problem]
    assert not missing, f"{case}: the error does not name {missing}:\n{problem}"
    after = snapshot(volume)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, (
        f"{case}: bad input changed the volume ({changed}); boot must validate before it creates "
        f"anything (src/trainpod/boot.py: _prepare_volume runs before _preflight)"
    )
