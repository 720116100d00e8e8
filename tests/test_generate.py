"""User data generators: exact kind ratios, splits, worker-count independence, crash-safe resume, errors.

The generator module lives in a folder that plays a synced repo (volume/repos/usergen/mygen.py), so it
is found the way a pod finds the user's code. Interrupted runs are subprocesses driving
`run_generator` like the CLI does; the rest run in-process (their workers are real spawned processes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from trainpod.checkpoint import Lease
from trainpod.config.generate import GeneratorDatagenConfig
from trainpod.config.loader import load_config, validate_tree
from trainpod.data.generate import (
    derive_seed,
    kind_totals,
    plan_chunks,
    run_generator,
    settings_hash,
    split_of,
    split_thresholds,
)
from trainpod.errors import ConfigError, ExitCode, InputError, Preempted, TemporaryError
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume

from support import child_env, tree_snapshot

REPO = Path(__file__).resolve().parents[1]
KINDS = {"single": 0.7, "compound": 0.2, "noop": 0.1}
USER_MODULE = '''
"""A user's generator as it would sit in their repo; `delay` slows it down for interruption tests."""
import random
import time


def generate(*, seed, chunk, kind, count, delay=0.0, prefix="edit"):
    time.sleep(delay)
    rng = random.Random(seed)
    for index in range(count):
        value = rng.randrange(10**6)
        yield {"instruction": f"{prefix} {kind} {value}", "input": str(value), "output": str(value)[::-1]}


def explode(*, seed, chunk, kind, count):
    if chunk == 2 and kind == "compound":
        raise ValueError("no template for compound edits")
    yield from generate(seed=seed, chunk=chunk, kind=kind, count=count)


def lists(*, seed, chunk, kind, count):
    for index in range(count):
        yield {"text": "fine"} if index != 3 else ["not", "a", "dict"]


def sets(*, seed, chunk, kind, count):
    for index in range(count):
        yield {"text": "fine", "tags": {"a", "b"} if index == 1 else []}


def too_few(*, seed, chunk, kind, count):
    yield from generate(seed=seed, chunk=chunk, kind=kind, count=count - 1)


def own_kind(*, seed, chunk, kind, count):
    for index in range(count):
        yield {"text": "fine", "kind": "something else"}


def dies_after_the_first_chunk(*, seed, chunk, kind, count):
    import os
    from pathlib import Path

    marks = Path(os.environ["DYING_MARKS"])
    while chunk == 1 and not (marks / "chunk 0 committed").exists():
        time.sleep(0.01)
    if chunk == 1:
        os._exit(9)  # a native crash: no Python error reaches the kit
    yield from generate(seed=seed, chunk=chunk, kind=kind, count=count)


def from_a_set(*, seed, chunk, kind, count):
    rng = random.Random(seed)
    words = list({"apple", "brook", "cedar", "dune", "ember", "fjord", "grove", "heath", "inlet", "junco"})
    for index in range(count):
        yield {"text": " ".join(rng.sample(words, 3))}


NOT_A_FUNCTION = 42
'''
DRIVER = """
import json, sys
from pathlib import Path
from trainpod.config.generate import GeneratorDatagenConfig
from trainpod.data.generate import run_generator
from trainpod.errors import TrainpodError
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume
config = GeneratorDatagenConfig.model_validate(json.loads(sys.argv[1]))
try:
    run_generator(config, Volume(Path(sys.argv[2])), PreemptionWatch().install())
except TrainpodError as exc:
    print(exc, file=sys.stderr)
    sys.exit(int(exc.exit_code))
"""
TIMEOUT = 90


def make_volume(root: Path) -> Volume:
    """A volume whose repos/usergen/ checkout holds the user's generator module."""
    checkout = root / "repos" / "usergen"
    checkout.mkdir(parents=True)
    (checkout / "mygen.py").write_text(USER_MODULE, encoding="utf-8")
    return Volume(root)


@pytest.fixture
def volume(tmp_path: Path) -> Volume:
    return make_volume(tmp_path / "volume")


def make_config(**changes) -> GeneratorDatagenConfig:
    tree = {
        "name": "edits",
        "generator": "mygen:generate",
        "records": 1003,
        "chunk_records": 100,
        "kinds": KINDS,
        "splits": {"train": 0.8, "val": 0.1, "test": 0.1},
        "seed": 7,
        "workers": 2,
    }
    return validate_tree(GeneratorDatagenConfig, tree | changes)


def run(config: GeneratorDatagenConfig, volume: Volume) -> Path:
    return run_generator(config, volume, PreemptionWatch())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def split_files(folder: Path) -> dict[str, bytes]:
    return {split: (folder / f"{split}.jsonl").read_bytes() for split in ("train", "val", "test")}


def test_plan_gives_each_kind_its_share_within_one_record_and_each_chunk_its_size():
    config = make_config()
    totals = kind_totals(config)
    assert sum(totals.values()) == config.records
    for kind, share in KINDS.items():
        assert abs(totals[kind] - config.records * share) < 1, (kind, totals)
    plan = plan_chunks(config)
    assert [chunk.records for chunk in plan] == [100] * 10 + [3]
    for chunk in plan:
        assert sum(batch.count for batch in chunk.batches) == chunk.records
    summed = Counter()
    for chunk in plan:
        summed.update({batch.kind: batch.count for batch in chunk.batches})
    assert dict(summed) == totals, "the chunks must add up to the dataset's totals exactly"
    assert plan_chunks(make_config(workers=1)) == plan


def test_records_hold_kinds_in_exact_apportioned_counts_over_the_dataset_and_the_splits(volume):
    folder = run(make_config(), volume)
    metadata = json.loads((folder / "metadata.json").read_text())
    totals = kind_totals(make_config())
    records = {split: read_jsonl(folder / f"{split}.jsonl") for split in ("train", "val", "test")}
    everything = [record for split_records in records.values() for record in split_records]
    assert dict(Counter(r["kind"] for r in everything)) == totals
    assert metadata["kinds"] == totals and metadata["records"] == 1003
    assert len({r["id"] for r in everything}) == 1003, "ids must be unique"
    thresholds = split_thresholds(make_config())
    for split, split_records in records.items():
        assert all(split_of(r["id"], thresholds) == split for r in split_records)
        assert metadata["splits"][split]["records"] == len(split_records)
        assert metadata["splits"][split]["kinds"] == dict(
            sorted(Counter(r["kind"] for r in split_records).items())
        )
    assert 0.7 < len(records["train"]) / 1003 < 0.9 and len(records["val"]) > 50 and len(records["test"]) > 50
    first = records["train"][0]
    assert list(first) == ["id", "kind", "instruction", "input", "output"], (
        "the user's fields stay as they are"
    )
    assert (
        first["instruction"].startswith(f"edit {first['kind']} ") and first["output"] == first["input"][::-1]
    )


def test_output_is_the_same_with_one_and_two_workers(tmp_path):
    one = run(make_config(workers=1), make_volume(tmp_path / "one"))
    two = run(make_config(workers=2), make_volume(tmp_path / "two"))
    assert split_files(one) == split_files(two)
    assert sorted(p.name for p in (one / "chunks").iterdir()) == sorted(
        p.name for p in (two / "chunks").iterdir()
    )


def test_a_generator_iterating_a_set_of_strings_gives_the_same_output_with_one_and_two_workers(
    tmp_path, monkeypatch
):
    # Each spawned worker drew its own string hash seed, so a set's order, and every record drawn from it with
    # the chunk's seed, changed from run to run: a resumed dataset was one that no single run makes.
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    config = make_config(generator="mygen:from_a_set", records=40, chunk_records=10, kinds=None)
    one = run(config.model_copy(update={"workers": 1}), make_volume(tmp_path / "one"))
    two = run(config.model_copy(update={"workers": 2}), make_volume(tmp_path / "two"))
    assert split_files(one) == split_files(two), "set order must not depend on the worker process"


def test_metadata_records_code_seeds_and_file_hashes(volume):
    import hashlib

    folder = run(make_config(), volume)
    metadata = json.loads((folder / "metadata.json").read_text())
    assert metadata["complete"] is True and metadata["generator"] == "mygen:generate"
    assert metadata["code"]["module_file"] == str((volume.root / "repos/usergen/mygen.py").resolve())
    assert metadata["code"]["git"] is None, "the checkout here has no .git"
    for split, info in metadata["splits"].items():
        assert info["sha256"] == hashlib.sha256((folder / f"{split}.jsonl").read_bytes()).hexdigest()
    chunk2 = metadata["seeds"]["chunks"][2]
    assert chunk2["kinds"]["noop"]["seed"] == derive_seed(7, 2, "noop")
    assert not list(folder.rglob("*.tmp-*"))


def test_git_commit_of_the_checkout_is_recorded_from_dot_git(volume):
    git_dir = volume.root / "repos/usergen/.git"
    (git_dir / "refs/heads").mkdir(parents=True)
    (git_dir / "HEAD").write_text("ref: refs/heads/main\n")
    (git_dir / "refs/heads/main").write_text("0123456789abcdef0123456789abcdef01234567\n")
    metadata = json.loads((run(make_config(records=50), volume) / "metadata.json").read_text())
    assert metadata["code"]["git"] == {
        "repo": str((volume.root / "repos/usergen").resolve()),
        "ref": "refs/heads/main",
        "commit": "0123456789abcdef0123456789abcdef01234567",
    }


def test_complete_dataset_is_reused_and_another_config_under_its_name_is_refused(volume):
    folder = run(make_config(), volume)
    before = tree_snapshot(folder)
    assert run(make_config(workers=1), volume) == folder, "the worker count may change"
    assert tree_snapshot(folder) == before
    with pytest.raises(InputError, match="different config") as caught:
        run(make_config(seed=8), volume)
    assert str(folder) in str(caught.value) and "another dataset name" in str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert tree_snapshot(folder) == before


def test_a_dataset_another_writer_is_making_is_left_to_it_and_a_complete_one_is_reused_meanwhile(volume):
    # A second pod on the same name deleted the first's leftovers and chunks mid-write: it exits 75 now.
    (volume.root / "datasets").mkdir(exist_ok=True)
    lease = Lease(volume.root / "datasets" / ".edits.LEASE", ttl_seconds=600)  # another live writer's
    lease.acquire()
    try:
        with pytest.raises(
            TemporaryError, match="generated dataset edits is leased by another writer"
        ) as caught:
            run(make_config(), volume)
        assert caught.value.exit_code == ExitCode.TEMPORARY
        assert not volume.dataset("edits").exists()
    finally:
        lease.release()
    folder = run(make_config(), volume)
    lease.acquire()
    try:
        assert run(make_config(), volume) == folder
    finally:
        lease.release()


def test_folder_holding_a_token_dataset_is_not_overwritten(volume):
    folder = volume.dataset("edits")
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    with pytest.raises(InputError, match="not overwritten") as caught:
        run(make_config(), volume)
    assert "manifest.json" in str(caught.value)
    assert [p.name for p in folder.iterdir()] == ["manifest.json"]


def start_driver(config: GeneratorDatagenConfig, volume: Volume) -> subprocess.Popen:
    # A session of its own, so a SIGKILL can hit the whole process group like a pod's end does.
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, config.model_dump_json(), str(volume.root)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_chunks(proc: subprocess.Popen, folder: Path, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while len(list((folder / "chunks").glob("chunk-*.jsonl"))) < count:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{count} chunks were never committed; output:\n{proc.communicate()}")
        time.sleep(0.01)


def test_run_killed_then_stopped_by_sigterm_then_resumed_matches_an_uninterrupted_run(tmp_path):
    # Slow enough (0.05 s per generator call, 3 calls per chunk) to be interrupted between chunks.
    config = make_config(records=480, chunk_records=30, params={"delay": 0.05})
    reference = run(config, make_volume(tmp_path / "reference"))
    volume = make_volume(tmp_path / "interrupted")
    folder = volume.dataset("edits")

    killed = start_driver(config, volume)
    wait_for_chunks(killed, folder, 3)
    os.killpg(killed.pid, signal.SIGKILL)  # the main process and its workers, as on a pod's end
    killed.communicate(timeout=TIMEOUT)
    after_kill = len(list((folder / "chunks").glob("chunk-*.jsonl")))
    assert 3 <= after_kill < 16 and not (folder / "metadata.json").exists()

    stopped = start_driver(config, volume)
    wait_for_chunks(stopped, folder, after_kill + 2)
    stopped.send_signal(signal.SIGTERM)  # the main process only: it must stop its workers itself
    # communicate() returns only once the workers, which hold the same pipes, are gone as well.
    _, stderr = stopped.communicate(timeout=TIMEOUT)
    assert stopped.returncode == ExitCode.PREEMPTED, stderr
    assert "stopped by SIGTERM" in stderr and "run it again" in stderr
    after_stop = len(list((folder / "chunks").glob("chunk-*.jsonl")))
    assert after_stop < 16 and not (folder / "metadata.json").exists(), "SIGTERM came too late to test"

    resumed = run(config, volume)
    assert split_files(resumed) == split_files(reference)
    metadata, expected = (json.loads((f / "metadata.json").read_text()) for f in (resumed, reference))
    assert metadata["splits"] == expected["splits"] and metadata["kinds"] == expected["kinds"]
    assert not list(folder.rglob("*.tmp-*"))


def test_malformed_generator_string_is_a_config_error_naming_the_field_value_and_fix():
    with pytest.raises(ConfigError) as caught:
        make_config(generator="mygen.generate")
    message = str(caught.value)
    assert "generator = 'mygen.generate'" in message and "package.module:function" in message
    assert caught.value.exit_code == ExitCode.BAD_INPUT


def test_kinds_and_splits_that_do_not_sum_to_one_are_config_errors():
    with pytest.raises(ConfigError) as caught:
        make_config(kinds={"single": 0.7, "noop": 0.2}, splits={"train": 0.9, "val": 0.2, "test": 0.0})
    message = str(caught.value)
    assert "kinds: the shares add up to 0.9, not 1" in message
    assert "train=0.9 + val=0.2 + test=0.0 = 1.1, not 1" in message


@pytest.mark.parametrize(
    ("generator", "expected"),
    [
        ("nosuch.module:generate", "module 'nosuch' was not found"),
        ("mygen:missing", "module 'mygen' has no attribute 'missing'"),
        ("mygen:NOT_A_FUNCTION", "mygen.NOT_A_FUNCTION is a int, not a function"),
    ],
)
def test_generator_that_cannot_be_imported_names_the_value_and_the_searched_path(volume, generator, expected):
    existing = volume.dataset("other")
    existing.mkdir(parents=True)
    (existing / "train.jsonl").write_text("{}\n")
    before = tree_snapshot(volume.root)
    with pytest.raises(ConfigError) as caught:
        run(make_config(generator=generator), volume)
    message = str(caught.value)
    assert f"generator = {generator!r}" in message and expected in message
    assert str((volume.root / "repos/usergen").resolve()) in message, "the searched folders are named"
    assert "fix:" in message and caught.value.exit_code == ExitCode.BAD_INPUT
    assert tree_snapshot(volume.root) == before, "nothing is written when the generator cannot be imported"


def test_params_the_function_does_not_take_are_a_config_error(volume):
    with pytest.raises(ConfigError, match="cannot take seed, chunk, kind, count and params colour"):
        run(make_config(generator="mygen:lists", params={"colour": "red"}), volume)
    assert not volume.dataset("edits").exists()


def test_missing_python_path_folder_is_a_config_error(volume):
    with pytest.raises(ConfigError, match=r"python_path\[0\] = 'gens': no such folder"):
        run(make_config(python_path=["gens"]), volume)


@pytest.mark.parametrize(
    ("generator", "expected"),
    [
        (
            "mygen:explode",
            [
                f"chunk 2, kind 'compound', seed {derive_seed(7, 2, 'compound')}",
                "raised ValueError: no template",
            ],
        ),
        ("mygen:lists", ["chunk 0, kind 'compound'", "record 3 is a list, not a dict"]),
        (
            "mygen:sets",
            ["chunk 0, kind 'compound'", "record 1 is not JSON-serialisable (field 'tags' holds a set)"],
        ),
        ("mygen:too_few", ["chunk 0, kind 'compound'", "yielded {fewer} records, not count={count}"]),
        ("mygen:own_kind", ["record 0 has its own 'kind'", "rename that field"]),
    ],
)
def test_generator_failures_are_input_errors_naming_chunk_kind_and_record(volume, generator, expected):
    with pytest.raises(InputError) as caught:
        run(make_config(generator=generator, records=300), volume)
    message = str(caught.value)
    count = plan_chunks(make_config(records=300))[0].batches[0].count  # compound, the first kind by name
    expected = [part.format(count=count, fewer=count - 1) for part in expected]
    assert all(part in message for part in expected), message
    assert f"generator {generator}" in message and caught.value.exit_code == ExitCode.BAD_INPUT
    assert not (volume.dataset("edits") / "metadata.json").exists()


def test_failed_run_keeps_committed_chunks_and_a_fixed_generator_cannot_mix_into_them(volume):
    with pytest.raises(InputError):
        run(make_config(generator="mygen:explode", workers=1), volume)
    chunks = volume.dataset("edits") / "chunks"
    committed = tree_snapshot(chunks)
    assert {"chunk-000000.jsonl", "chunk-000001.jsonl"} <= set(committed)
    (volume.root / "repos/usergen/mygen.py").write_text(USER_MODULE.replace("chunk == 2 and ", "False and "))
    with pytest.raises(InputError, match="another version of") as caught:
        run(make_config(generator="mygen:explode", workers=1), volume)
    assert f"delete {volume.dataset('edits')}" in str(caught.value)
    assert tree_snapshot(chunks) == committed


def test_bad_generator_exits_2_from_a_process(volume):
    proc = start_driver(make_config(generator="nosuch:generate"), volume)
    _, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == ExitCode.BAD_INPUT and "module 'nosuch' was not found" in stderr
    assert "Traceback" not in stderr


def test_shipped_example_runs_from_a_synced_checkout_of_this_repo(tmp_path, monkeypatch):
    path = REPO / "configs/datagen/generator-tiny.yaml"
    config = load_config(GeneratorDatagenConfig, path, ["records=300"])
    volume = Volume(tmp_path / "volume")
    (volume.root / "repos").mkdir(parents=True)
    (volume.root / "repos" / "trainpod").symlink_to(REPO)  # where TRAINPOD_GIT_REPO would sync it
    monkeypatch.chdir(tmp_path)  # not the repo: the code must be found through repos/
    folder = run(config, volume)
    metadata = json.loads((folder / "metadata.json").read_text())
    assert metadata["code"]["module_file"] == str(REPO / "examples/generators/edits.py")
    assert metadata["kinds"] == {"compound": 60, "noop": 30, "single": 210}
    records = [r for split in ("train", "val", "test") for r in read_jsonl(folder / f"{split}.jsonl")]
    assert all({"instruction", "input", "output"} <= set(r) for r in records)
    assert all((r["output"] == r["input"]) == (r["kind"] == "noop") for r in records), (
        "only noops keep the input"
    )


def test_split_files_load_as_an_alpaca_dataset_with_hugging_face_datasets(volume, tmp_path):
    from datasets import load_dataset

    folder = run(make_config(records=200), volume)
    files = {split: str(folder / f"{split}.jsonl") for split in ("train", "val", "test")}
    loaded = load_dataset("json", data_files=files, cache_dir=str(tmp_path / "hf-cache"))
    metadata = json.loads((folder / "metadata.json").read_text())
    assert {split: loaded[split].num_rows for split in files} == {
        split: metadata["splits"][split]["records"] for split in files
    }
    assert loaded["train"].column_names == ["id", "kind", "instruction", "input", "output"]


@pytest.mark.parametrize("damaged", ["metadata.json", "generation.json"])
def test_a_damaged_metadata_or_generation_file_is_exit_2_and_nothing_is_rewritten(volume, damaged):
    # A truncated file was a bare JSONDecodeError (exit 1), a crash at every start until FAILED.
    folder = run(make_config(), volume)
    if damaged == "generation.json":
        (folder / "metadata.json").unlink()  # as if killed before the splits were published
    (folder / damaged).write_text('{"config_hash": "')
    before = tree_snapshot(folder)
    with pytest.raises(InputError, match=rf"{damaged} is damaged \(JSONDecodeError") as caught:
        run(make_config(), volume)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert tree_snapshot(folder) == before


def test_the_settings_hash_of_todays_settings_is_pinned():
    # Every generated dataset made so far is recognised by this hash; a new setting that changes it makes a
    # resume after an upgrade refuse a half-made dataset. Add the setting to SETTINGS_ADDED_LATER with its
    # value of before (config/generate.py), instead of changing this number.
    assert settings_hash(make_config()) == "334cc5ffac56af1e"


SLOW_IMPORT_MODULE = '''
"""A generator whose module takes long to import (one importing torch or vllm at its top: seconds)."""
import os
import signal
import time
from pathlib import Path

marks = Path(os.environ["SLOW_IMPORT_MARKS"])
(marks / "import begun").touch()
deadline = time.monotonic() + 20
while not (marks / "go on").exists() and time.monotonic() < deadline:
    if (marks / "SIGTERM").exists():  # as tini -g signals the whole group: the worker dies of it
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)
(marks / "import ended").touch()


def generate(*, seed, chunk, kind, count):
    yield from ({"text": str(index)} for index in range(count))
'''


@pytest.mark.parametrize("to_the_group", [False, True], ids=["main-process", "group"])
def test_a_stop_while_the_workers_import_the_generator_ends_the_run_without_waiting_for_the_import(
    volume, tmp_path, monkeypatch, to_the_group
):
    # The run waited for a worker's import of the user's module before it looked at the stop flag again: a
    # module importing torch or vllm took the stop past the 5 s window, the dataset's lease held at the SIGKILL.
    # Sent to the group (tini -g on a pod), the SIGTERM killed the importing worker, which read as a generator
    # that cannot be imported: exit 2, a FAILED run that the supervisor never started again.
    import threading

    (volume.root / "repos" / "usergen" / "slowgen.py").write_text(SLOW_IMPORT_MODULE, encoding="utf-8")
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("SLOW_IMPORT_MARKS", str(marks))  # the spawned workers inherit it
    watch = PreemptionWatch()

    def stop_once_the_import_has_begun():
        while not (marks / "import begun").exists():
            time.sleep(0.01)
        watch.request("SIGTERM")
        if to_the_group:
            (marks / "SIGTERM").touch()

    stopper = threading.Thread(target=stop_once_the_import_has_begun, daemon=True)
    stopper.start()
    try:
        with pytest.raises(Preempted, match="run it again"):
            run_generator(make_config(generator="slowgen:generate"), volume, watch)
        assert not (marks / "import ended").exists(), (
            "the stop waited for the worker's import of the generator: it must end the workers instead"
        )
    finally:
        (marks / "go on").touch()
        stopper.join(timeout=TIMEOUT)
    assert not list(volume.root.glob("datasets/.*LEASE")), "the dataset's lease is released"


def test_a_worker_that_dies_between_two_waits_is_exit_75_keeping_the_committed_chunks(
    volume, tmp_path, monkeypatch
):
    # Broken while the main process committed a chunk, the pool refused the next submit: that raised past
    # the handler that reads a dead worker, and the run crashed with a traceback (exit 1) instead of exit 75.
    import trainpod.data.generate as generate

    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("DYING_MARKS", str(marks))
    pools, real_init, real_write_bytes = [], generate.GeneratorPool.__init__, generate.write_bytes

    def recorded(self, *args):
        real_init(self, *args)
        pools.append(self)

    def commit_then_wait_for_the_death(path, data):
        real_write_bytes(path, data)
        if path.name == "chunk-000000.jsonl":
            (marks / "chunk 0 committed").touch()
            deadline = time.monotonic() + TIMEOUT
            while not pools[0]._executor._broken and time.monotonic() < deadline:
                time.sleep(0.01)

    monkeypatch.setattr(generate.GeneratorPool, "__init__", recorded)
    monkeypatch.setattr(generate, "write_bytes", commit_then_wait_for_the_death)
    config = make_config(generator="mygen:dies_after_the_first_chunk", workers=1, kinds=None)
    with pytest.raises(TemporaryError, match="died without a Python error"):
        run(config, volume)
    assert (volume.dataset("edits") / "chunks" / "chunk-000000.jsonl").is_file()
