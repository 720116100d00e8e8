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


CLI_DRIVER = (
    DRIVER.split("from trainpod.config.datagen")[0]
    + """
from trainpod.cli import main
sys.exit(main(["run", "datagen", "--config", sys.argv[1]]))
"""
)


def start_pod(volume_root: Path, config_file: Path, slow_fsync: float) -> subprocess.Popen:
    """`trainpod run datagen` as a pod runs it (the workload's lifecycle, its exit code)."""
    env = {**os.environ, "SLOW_FSYNC_SECONDS": str(slow_fsync), "TRAINPOD_VOLUME": str(volume_root)}
    return subprocess.Popen(
        [sys.executable, "-c", CLI_DRIVER, str(config_file)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_a_second_datagen_on_a_dataset_being_built_exits_75_and_the_first_ends_byte_identical(
    reference, tmp_path
):
    # Without a lease the second pod deleted the first's half-written *.tmp-* and unlisted shards, and its
    # own renames then failed (a crash, exit 1, counted as a failed start), or both wrote the same shards.
    reference_root, tree = reference
    root = tmp_path / "volume"
    (root / "corpus").mkdir(parents=True)
    (root / "corpus" / "stories.txt.gz").write_bytes(
        (reference_root / "corpus" / "stories.txt.gz").read_bytes()
    )
    config_file = root / "datagen.yaml"
    config_file.write_text(json.dumps({"kind": "tokens", **tree}))
    folder = root / "datasets" / "stories"

    first = start_pod(root, config_file, slow_fsync=0.02)
    wait_until(first, lambda: committed_shards(folder) >= 2, "2 committed shards")
    second = start_pod(root, config_file, slow_fsync=0.0)
    output, _ = second.communicate(timeout=TIMEOUT)
    assert second.returncode == 75, f"the second datagen should wait its turn (exit 75):\n{output[-2000:]}"
    assert "dataset stories is leased by another writer" in output and ".stories.LEASE" in output
    assert first.poll() is None, "the second datagen should leave the first running"
    output, _ = first.communicate(timeout=TIMEOUT)
    assert first.returncode == 0, output[-2000:]

    reference_folder = reference_root / "datasets" / "stories"
    assert shard_bytes(folder) == shard_bytes(reference_folder)
    assert not (root / "datasets" / ".stories.LEASE").exists(), "the lease is released at the end"

    # A complete dataset is reused without the lease: pods reading it never wait on one another.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from trainpod.checkpoint import Lease; "
            "Lease(sys.argv[1], ttl_seconds=600).acquire(); print('held', flush=True); time.sleep(60)",
            str(root / "datasets" / ".stories.LEASE"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        reuse = start_pod(root, config_file, slow_fsync=0.0)
        output, _ = reuse.communicate(timeout=TIMEOUT)
        assert reuse.returncode == 0 and "reusing it" in output, output[-2000:]
    finally:
        holder.kill()
        holder.wait()
