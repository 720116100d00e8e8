"""Tokens given to a pod as environment variables never show up in its logs, on the volume, or in
the image (`docker history --no-trunc`, `docker save`)."""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

import pytest
from conftest import DONE, PRETRAIN_ENV, Pods

from engine import DOCKER, Engine, docker, docker_env

pytestmark = pytest.mark.container


def files_containing(root: Path, needles: list[bytes]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            hits += [f"{path.relative_to(root)}" for n in needles if n in data]
    return hits


def test_tokens_in_the_environment_never_reach_logs_volume_or_image(
    pods: Pods, engine: Engine, fresh_volume: Path
) -> None:
    tokens = {
        "HF_TOKEN": "hf_" + secrets.token_hex(16),
        "WANDB_API_KEY": secrets.token_hex(20),
        "TRAINPOD_GIT_TOKEN": "ghp_" + secrets.token_hex(18),
    }
    box = pods.run(fresh_volume, {**PRETRAIN_ENV, **tokens})
    logs = box.logs()
    assert box.exit_code() == 0, f"pretrain with tokens set exited {box.exit_code()}:\n{logs[-3000:]}"
    assert (fresh_volume / DONE).is_file()
    needles = [v.encode() for v in tokens.values()]

    leaked_logs = [name for name, value in tokens.items() if value in logs]
    assert not leaked_logs, (
        f"{leaked_logs} printed in `docker logs`; route the line through trainpod.log's filter"
    )
    leaked_files = files_containing(fresh_volume, needles)
    assert not leaked_files, f"a token was written to the volume in: {leaked_files}"

    history = docker("history", "--no-trunc", engine.image).stdout
    assert not [v for v in tokens.values() if v in history], "a token is in the image history"
    save = subprocess.Popen([DOCKER, "save", engine.image], stdout=subprocess.PIPE, env=docker_env())
    assert save.stdout is not None
    tail, found = b"", []
    while chunk := save.stdout.read(1 << 22):
        window = tail + chunk
        found += [n for n in needles if n in window]
        tail = window[-64:]
    assert save.wait() == 0, "`docker save` failed"
    assert not found, "a token is inside the image (docker save)"
