"""datagen killed (SIGKILL, SIGTERM) at several moments and run again ends byte-identical to one run.

Each run is a subprocess driving `run_datagen` like the CLI does. A slow-disk fault (every fsync
sleeps a few ms) keeps the run long enough to be interrupted at a chosen moment: after some shards
are committed, and while a shard or progress file is half written (a `*.tmp-*` file exists).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainpod.config.datagen import DatagenConfig
from trainpod.config.loader import validate_tree
from trainpod.data.datagen import run_datagen
from trainpod.data.synthetic_corpus import write_corpus
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume

DRIVER = """
import json, os, sys, time
from pathlib import Path
delay = float(os.environ.get("SLOW_FSYNC_SECONDS", "0"))
if delay:
    real_fsync = os.fsync
    def slow_fsync(fd):
        time.sleep(delay)
        real_fsync(fd)
    os.fsync = slow_fsync
from trainpod.config.datagen import DatagenConfig
from trainpod.data.datagen import run_datagen
from trainpod.errors import TrainpodError
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume
config = DatagenConfig.model_validate(json.loads(sys.argv[1]))
try:
    run_datagen(config, Volume(Path(sys.argv[2])), PreemptionWatch().install())
except TrainpodError as exc:
    print(exc, file=sys.stderr)
    sys.exit(int(exc.exit_code))
"""
TIMEOUT = 60


def config_tree(tokenizer_folder: Path) -> dict:
    return {
        "name": "stories",
        "tokenizer": {"path": str(tokenizer_folder)},
        "sources": [{"path": "corpus/stories.txt.gz"}],
        "mode": "split",
        "val_ratio": 0.1,
        "shard_tokens": 4000,
        "workers": 2,
        "batch_documents": 16,
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    """One uninterrupted run (tokenizer trained here, shared by the interrupted runs)."""
    root = tmp_path_factory.mktemp("reference")
    (root / "corpus").mkdir()
    write_corpus(root / "corpus" / "stories.txt.gz", stories_count=1500, seed=3)
    train_tokenizer = validate_tree(
        DatagenConfig,
        {
            "name": "tok",
            "tokenizer": {"vocab_size": 500},
            "sources": [{"path": "corpus/stories.txt.gz"}],
            "mode": "smoke",
            "smoke_documents": 1,
            "val_ratio": 0.0,
            "workers": 1,
        },
    )
    run_datagen(train_tokenizer, Volume(root), PreemptionWatch())
    tree = config_tree(root / "tokenizers" / "tok")
    run_datagen(validate_tree(DatagenConfig, tree), Volume(root), PreemptionWatch())
    return root, tree


def start(volume_root: Path, tree: dict, slow_fsync: float) -> subprocess.Popen:
    env = {**os.environ, "SLOW_FSYNC_SECONDS": str(slow_fsync)}
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, json.dumps(tree), str(volume_root)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until(process: subprocess.Popen, condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if process.poll() is not None:
            pytest.fail(
                f"datagen ended (rc {process.returncode}) before {what}; make the corpus larger or "
                f"the fsync slower so the run can be interrupted:\n{process.stderr.read()[-2000:]}"
            )
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"datagen never reached {what} within {TIMEOUT} s")
        time.sleep(0.002)


def committed_shards(folder: Path) -> int:
    try:
        progress = json.loads((folder / "progress.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    return sum(len(split["shards"]) for split in progress["splits"].values())


def half_written_file(folder: Path) -> bool:
    return folder.is_dir() and any(".tmp-" in p.name for p in folder.iterdir())


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.bin"))}


@pytest.mark.slow
def test_killed_and_terminated_runs_resume_to_byte_identical_shards(reference, tmp_path):
    reference_root, tree = reference
    root = tmp_path / "volume"
    (root / "corpus").mkdir(parents=True)
    (root / "corpus" / "stories.txt.gz").write_bytes(
        (reference_root / "corpus" / "stories.txt.gz").read_bytes()
    )
    folder = root / "datasets" / "stories"

    process = start(root, tree, slow_fsync=0.01)  # 1) SIGKILL after a few shards are committed
    wait_until(process, lambda: committed_shards(folder) >= 3, "3 committed shards")
    process.kill()
    process.wait(TIMEOUT)
    after_first_kill = committed_shards(folder)

    process = start(root, tree, slow_fsync=0.05)  # 2) SIGKILL while a file is half written
    wait_until(
        process,
        lambda: committed_shards(folder) > after_first_kill and half_written_file(folder),
        "a new commit and a half-written *.tmp-* file",
    )
    process.kill()
    process.wait(TIMEOUT)
    assert half_written_file(folder), "the kill should leave a temp file for the next run to clean up"

    process = start(root, tree, slow_fsync=0.01)  # 3) SIGTERM: commit what is done, exit 143
    before_term = committed_shards(folder)
    wait_until(process, lambda: committed_shards(folder) >= before_term + 2, "2 more committed shards")
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 143, (
        f"SIGTERM should exit 143 (Preempted); got {process.returncode}: {stderr}"
    )
    assert "run it again" in stderr and not (folder / "manifest.json").exists()

    process = start(root, tree, slow_fsync=0.0)  # 4) run to the end
    _, stderr = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, stderr

    reference_folder = reference_root / "datasets" / "stories"
    assert shard_bytes(folder) == shard_bytes(reference_folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    expected = json.loads((reference_folder / "manifest.json").read_text())
    assert manifest["splits"] == expected["splits"] and manifest["total_tokens"] == expected["total_tokens"]
    assert len(manifest["splits"]["train"]["shards"]) > before_term
    assert not half_written_file(folder)
