"""The checkpoint writer: snapshots that do not alias live tensors, background commits, abandon."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from trainpod.checkpoint import CheckpointStore, tree
from trainpod.checkpoint.store import SMALL_WRITE_BYTES
from trainpod.checkpoint.writer import CheckpointWriter, tensor_memory


class HeldStore(CheckpointStore):
    """A real store whose `begin` waits until the test lets it go: a background commit held in flight."""

    def __init__(self, root: Path):
        super().__init__(root, keep_last=2)
        self.go = threading.Event()
        self.began = threading.Event()

    def begin(self, step, abandoned=None):  # noqa: ANN001
        self.began.set()
        assert self.go.wait(30), "the test never let the commit go on"
        return super().begin(step, abandoned)


# An optimizer's state as the trainer writes it (a tensor tree in safetensors, checkpoint/tree.py) and
# as the user-code checkpointer writes a `state_dict()` (torch.save).
OPTIMIZER_FILES = ["optimizer.safetensors", "optimizer.pt"]


def state(
    weights: torch.Tensor, moment: torch.Tensor, step: int, optimizer_file: str = "optimizer.pt"
) -> dict:
    return {
        "model.safetensors": {"w": weights},
        optimizer_file: {"state": {0: {"exp_avg": moment, "step": torch.tensor(float(step))}}, "lr": 0.1},
        "trainer_state.json": {"step": step},
        "note.bin": b"raw bytes",
    }


def read(path: Path, optimizer_file: str = "optimizer.pt") -> tuple[torch.Tensor, torch.Tensor]:
    weights = safetensors.torch.load((path / "model.safetensors").read_bytes())["w"]
    if optimizer_file.endswith(".safetensors"):
        optimizer = tree.load(path / optimizer_file)
    else:
        optimizer = torch.load(path / optimizer_file, weights_only=True)
    assert optimizer["lr"] == 0.1 and list(optimizer["state"]) == [0]
    return weights, optimizer["state"][0]["exp_avg"]


@pytest.mark.parametrize("optimizer_file", OPTIMIZER_FILES)
def test_a_background_commit_holds_the_state_at_its_step_while_training_changes_the_tensors(
    tmp_path, optimizer_file
):
    store = HeldStore(tmp_path)
    writer = CheckpointWriter(store)
    weights, moment = torch.arange(6.0), torch.ones(3)
    assert writer.commit(7, state(weights, moment, 7, optimizer_file), {}, background=True) is None
    weights.add_(100.0)  # the next optimizer steps, before the writer has read anything
    moment.mul_(-1.0)
    store.go.set()
    committed = writer.wait()
    assert committed.step == 7
    saved_weights, saved_moment = read(committed.path, optimizer_file)
    assert torch.equal(saved_weights, torch.arange(6.0)), "the snapshot must not alias the live weights"
    assert torch.equal(saved_moment, torch.ones(3)), "the snapshot must not alias the live optimizer state"
    assert (committed.path / "trainer_state.json").read_text().count('"step": 7') == 1
    assert (committed.path / "note.bin").read_bytes() == b"raw bytes"
    assert store.latest().step == 7


@pytest.mark.parametrize("optimizer_file", OPTIMIZER_FILES)
def test_sync_and_background_commits_write_the_same_checkpoint(tmp_path, optimizer_file):
    weights, moment = torch.randn(4, 4), torch.randn(4)
    files = state(weights, moment, 3, optimizer_file)
    sync = CheckpointWriter(CheckpointStore(tmp_path / "sync")).commit(3, files, {})
    background = CheckpointWriter(CheckpointStore(tmp_path / "background"))
    background.commit(3, files, {}, background=True)
    done = background.wait()
    for a, b in zip(read(sync.path, optimizer_file), read(done.path, optimizer_file), strict=True):
        assert torch.equal(a, b)
    for name in ("model.safetensors", optimizer_file):
        assert sync.manifest["files"][name] == done.manifest["files"][name], name


@pytest.mark.parametrize("background", [False, True])
def test_the_weights_file_is_safetensors_that_the_library_loads_for_every_dtype_and_shape(
    tmp_path, background
):
    # Written from the tensors' own memory with a header built here (writer.write_safetensors): the
    # library must read back every tensor, by its mmap path too, with its dtype, shape and bytes.
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "f16": torch.randn(2, 2, 2).half(),
        "f64": torch.randn(1).double(),
        "i64": torch.arange(5),
        "i32": torch.arange(3, dtype=torch.int32),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "u8": torch.tensor([1, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "fp8": torch.randn(4).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "view of a column": torch.randn(4, 3)[:, 1],  # not contiguous: written as its values
    }
    writer = CheckpointWriter(CheckpointStore(tmp_path))
    writer.commit(1, {"model.safetensors": tensors}, {}, background=background)
    committed = writer.wait() if background else writer.store.latest()
    path = committed.path / "model.safetensors"
    for loaded in (safetensors.torch.load(path.read_bytes()), safetensors.torch.load_file(path)):
        assert set(loaded) == set(tensors)
        for name, tensor in tensors.items():
            assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
            same_bytes = (
                loaded[name].reshape(-1).view(torch.uint8),
                tensor.contiguous().reshape(-1).view(torch.uint8),
            )
            assert torch.equal(*same_bytes), name


def test_torch_save_writes_from_the_saved_tensors_memory_uncopied_and_copies_anything_else(tmp_path):
    # The optimizer file: torch.save hands each storage over in one piece, from the tensor's own memory,
    # which the writer keeps unchanged until the file is closed; its other writes come from buffers it
    # reuses, which must be copied before the hashers read them. Small writes are copied unlooked-at.
    big = SMALL_WRITE_BYTES // 4 * 3  # float32 elements: three times the size below which writes are copied
    moments = {
        "state": {i: {"exp_avg": torch.randn(big), "step": torch.tensor(3.0)} for i in range(3)},
        "lr": 0.1,
    }
    pending = CheckpointStore(tmp_path).begin(1)
    with pending.open("optimizer.pt", tensor_memory(moments)) as f:
        for i in range(3):
            inside = moments["state"][i]["exp_avg"].numpy()
            assert f._in_stable_memory(memoryview(inside)), f"tensor {i}'s storage needs no copy"
            assert f._in_stable_memory(memoryview(inside[big // 2 :])), "nor does a large part of it"
            assert not f._in_stable_memory(memoryview(inside[:10])), "a small write is copied"
        assert not f._in_stable_memory(memoryview(bytearray(SMALL_WRITE_BYTES * 2))), (
            "someone else's is copied"
        )
        torch.save(moments, f)
    loaded = torch.load(pending.dir / "optimizer.pt", weights_only=True)
    for i in range(3):
        assert torch.equal(loaded["state"][i]["exp_avg"], moments["state"][i]["exp_avg"])
    content = (pending.dir / "optimizer.pt").read_bytes()
    assert pending.files["optimizer.pt"]["sha256_pieces"] == [hashlib.sha256(content).hexdigest()]


def test_a_write_running_past_the_end_of_stable_memory_is_copied(tmp_path):
    backing = np.zeros(4 * SMALL_WRITE_BYTES, dtype=np.uint8)
    start = backing.ctypes.data
    stable = [
        (start + 2 * SMALL_WRITE_BYTES, start + 4 * SMALL_WRITE_BYTES),
        (start, start + SMALL_WRITE_BYTES),
    ]
    with CheckpointStore(tmp_path).begin(1).open("x.bin", stable) as f:
        assert f._in_stable_memory(memoryview(backing[:SMALL_WRITE_BYTES]))
        assert f._in_stable_memory(memoryview(backing[2 * SMALL_WRITE_BYTES :]))
        assert not f._in_stable_memory(memoryview(backing[: 2 * SMALL_WRITE_BYTES])), (
            "runs past the first range"
        )
        assert not f._in_stable_memory(memoryview(backing[SMALL_WRITE_BYTES : 3 * SMALL_WRITE_BYTES]))


def test_a_dtype_the_header_writer_does_not_name_goes_through_the_library(tmp_path):
    tensors = {"complex": torch.randn(3, dtype=torch.complex64), "f32": torch.randn(2)}
    committed = CheckpointWriter(CheckpointStore(tmp_path)).commit(1, {"model.safetensors": tensors}, {})
    loaded = safetensors.torch.load_file(committed.path / "model.safetensors")
    assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)


def test_snapshots_reuse_their_host_buffers_from_one_commit_to_the_next(tmp_path):
    writer = CheckpointWriter(CheckpointStore(tmp_path))
    weights, moment = torch.zeros(1000), torch.zeros(10)
    writer.commit(1, state(weights, moment, 1), {}, background=True)
    writer.wait()
    allocated = writer.buffers.nbytes
    pointers = {k: b.data_ptr() for k, b in writer.buffers._buffers.items()}
    writer.commit(2, state(weights + 1, moment + 1, 2), {}, background=True)
    assert read(writer.wait().path)[0][0].item() == 1.0
    assert writer.buffers.nbytes == allocated
    assert {k: b.data_ptr() for k, b in writer.buffers._buffers.items()} == pointers


def test_the_next_commit_waits_for_the_one_in_flight(tmp_path):
    store = HeldStore(tmp_path)
    writer = CheckpointWriter(store)
    writer.commit(1, state(torch.zeros(2), torch.zeros(2), 1), {}, background=True)
    second = threading.Thread(target=writer.commit, args=(2, state(torch.ones(2), torch.ones(2), 2), {}))
    second.start()
    assert store.began.wait(30)
    second.join(0.2)
    assert second.is_alive(), "a second commit must not start while the first is in flight"
    assert writer.in_flight_step == 1
    store.go.set()
    second.join(30)
    assert [c.step for c in store.committed()] == [2, 1]


def test_an_abandoned_commit_is_never_published_and_its_temp_folder_goes_at_the_next_start(tmp_path):
    store = HeldStore(tmp_path)
    store.go.set()
    writer = CheckpointWriter(store)
    writer.commit(10, state(torch.zeros(2), torch.zeros(2), 10), {})
    store.go.clear()
    store.began.clear()
    writer.commit(20, state(torch.ones(2), torch.ones(2), 20), {}, background=True)
    assert store.began.wait(30)
    job = writer._in_flight
    assert writer.abandon() is None, "abandoned before its commit point: nothing was published"
    assert writer.in_flight_step is None
    store.go.set()  # the thread goes on, finds the commit abandoned and stops it
    assert job.done.wait(30)
    assert (tmp_path / "LATEST").read_text().strip() == "step-10"
    assert not (tmp_path / "step-20").exists()
    assert CheckpointStore(tmp_path).latest().step == 10
    assert not list(tmp_path.glob("*.tmp-*")), "the next start removes what the abandoned commit wrote"


def test_abandoning_a_commit_that_already_published_keeps_it_committed(tmp_path):
    writer = CheckpointWriter(CheckpointStore(tmp_path))
    writer.commit(5, state(torch.zeros(2), torch.zeros(2), 5), {}, background=True)
    job = writer._in_flight
    assert job.done.wait(30)
    committed = writer.abandon()
    assert committed is not None and committed.step == 5, "LATEST never moves backwards"
    assert (tmp_path / "LATEST").read_text().strip() == "step-5"


def test_a_background_commit_error_reaches_the_training_thread(tmp_path):
    (tmp_path / "checkpoints").write_text("a file where the folder should be")
    writer = CheckpointWriter(CheckpointStore(tmp_path / "checkpoints"))
    writer.commit(1, state(torch.zeros(2), torch.zeros(2), 1), {}, background=True)
    with pytest.raises(OSError):
        writer.wait()
    assert writer.in_flight_step is None


def test_deferred_copies_are_made_by_the_writer_thread_and_wait_for_snapshot_waits_for_them(tmp_path):
    writer = CheckpointWriter(CheckpointStore(tmp_path))
    copy_now = threading.Event()
    copy_deferred = writer._copy_deferred

    def held_copy(job) -> None:  # noqa: ANN001
        assert job.deferred_copies, "the copies were left to the writer thread"
        assert copy_now.wait(30), "the test never let the copy go on"
        copy_deferred(job)

    writer._copy_deferred = held_copy
    weights, moment = torch.arange(6.0), torch.ones(3)
    writer.commit(7, state(weights, moment, 7), {}, background=True, defer_copies=True)
    # Training's forward and backward run here; the weights and moments are unchanged until the step.
    waiting = threading.Thread(target=writer.wait_for_snapshot)
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive(), "the optimizer step must wait until the writer holds its copy"
    copy_now.set()
    waiting.join(30)
    assert not waiting.is_alive()
    weights.add_(100.0)  # the optimizer step, once wait_for_snapshot returned
    moment.mul_(-1.0)
    committed = writer.wait()
    saved_weights, saved_moment = read(committed.path)
    assert torch.equal(saved_weights, torch.arange(6.0))
    assert torch.equal(saved_moment, torch.ones(3))


def test_a_failed_deferred_copy_fails_the_commit_and_never_hangs_the_optimizer_step(tmp_path):
    writer = CheckpointWriter(CheckpointStore(tmp_path))

    def broken_copy(job) -> None:  # noqa: ANN001
        raise RuntimeError("copy failed")

    writer._copy_deferred = broken_copy
    writer.commit(1, state(torch.zeros(2), torch.zeros(2), 1), {}, background=True, defer_copies=True)
    waiting = threading.Thread(target=writer.wait_for_snapshot)
    waiting.start()
    waiting.join(30)
    assert not waiting.is_alive()
    with pytest.raises(RuntimeError, match="copy failed"):
        writer.wait()
    assert CheckpointStore(tmp_path).latest() is None


def test_without_deferral_wait_for_snapshot_returns_at_once(tmp_path):
    store = HeldStore(tmp_path)
    writer = CheckpointWriter(store)
    writer.commit(1, state(torch.zeros(2), torch.zeros(2), 1), {}, background=True)
    writer.wait_for_snapshot()  # the copies were made in commit(): nothing to wait for, even held
    store.go.set()
    assert writer.wait().step == 1


def test_a_commit_that_finished_while_the_next_one_waited_for_it_is_reported_by_poll(tmp_path):
    store = HeldStore(tmp_path)
    store.go.set()
    writer = CheckpointWriter(store)
    writer.commit(1, state(torch.zeros(2), torch.zeros(2), 1), {}, background=True)
    assert writer._in_flight.done.wait(30)  # it finished after the last poll: the next commit waits for it
    store.go.clear()
    store.began.clear()
    writer.commit(2, state(torch.ones(2), torch.ones(2), 2), {}, background=True)
    assert store.began.wait(30)
    # The trainer records what poll reports (status.json's checkpoint, the free-space warning): step 1 is
    # committed though step 2 is still in flight; it was reported nowhere.
    reported = writer.poll()
    assert reported is not None and reported.step == 1
    assert writer.poll() is None, "reported once"
    store.go.set()
    assert writer.wait().step == 2
