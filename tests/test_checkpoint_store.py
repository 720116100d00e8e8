"""The checkpoint protocol: atomic commit, verification with fallback, leftovers, retention."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch

from trainpod import atomic
from trainpod.checkpoint import CheckpointStore
from trainpod.checkpoint.store import PIECE_BYTES


def commit(store: CheckpointStore, step: int, payload: bytes = b"", eval_loss: float | None = None):
    pending = store.begin(step)
    pending.write_bytes("weights.bin", payload or f"weights at step {step}".encode() * 100)
    with pending.open("state.pt") as f:
        torch.save({"step": torch.tensor(step)}, f)
    return store.commit(pending, step, {"note": "test"}, eval_loss)


def test_commit_publishes_folder_manifest_and_latest(tmp_path):
    store = CheckpointStore(tmp_path)
    committed = commit(store, 10)
    assert committed.path == tmp_path / "step-10"
    assert (tmp_path / "LATEST").read_text().strip() == "step-10"
    manifest = json.loads((committed.path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"weights.bin", "state.pt"}
    assert manifest["files"]["weights.bin"]["bytes"] == (committed.path / "weights.bin").stat().st_size
    assert torch.load(committed.path / "state.pt", weights_only=True)["step"].item() == 10
    assert store.latest().step == 10
    assert store.last_commit_seconds is not None


def test_resume_uses_previous_checkpoint_when_latest_is_bit_flipped(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    commit(store, 10)
    commit(store, 20)
    weights = tmp_path / "step-20" / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[5] ^= 0x01  # same size, one bit different: only the sha256 notices
    weights.write_bytes(bytes(data))
    latest = CheckpointStore(tmp_path, keep_last=3).latest()
    assert latest.step == 10
    assert (tmp_path / "LATEST").read_text().strip() == "step-10"
    assert not (tmp_path / "step-20").exists(), "the invalid checkpoint must move out of the way of step 20"
    assert list(tmp_path.glob("step-20.invalid-*")), "the invalid checkpoint is kept for inspection"


def test_resume_uses_previous_checkpoint_when_latest_is_truncated(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3, verify="size")
    commit(store, 10)
    commit(store, 20)
    with open(tmp_path / "step-20" / "state.pt", "r+b") as f:
        f.truncate(10)
    assert CheckpointStore(tmp_path, verify="size").latest().step == 10


def test_missing_manifest_is_invalid(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    commit(store, 1)
    commit(store, 2)
    (tmp_path / "step-2" / "manifest.json").unlink()
    assert store.latest().step == 1


def test_leftover_temp_dirs_are_removed_and_never_chosen(tmp_path):
    store = CheckpointStore(tmp_path)
    commit(store, 5)
    half = store.begin(6)  # a kill while writing step 6
    half.write_bytes("weights.bin", b"partial")
    assert store.latest().step == 5
    assert not list(tmp_path.glob("*.tmp-*"))


def test_folder_renamed_but_never_committed_by_latest_is_discarded(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    commit(store, 5)
    commit(store, 6)
    (tmp_path / "LATEST").write_text("step-5\n")  # a kill between the rename and the LATEST replace
    assert store.latest().step == 5
    assert not (tmp_path / "step-6").exists()


def test_missing_latest_falls_back_to_newest_valid_by_number_not_mtime(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=5)
    for step in (9, 10, 100):
        commit(store, step)
    os.utime(tmp_path / "step-9", (2e9, 2e9))  # newest mtime must not matter
    (tmp_path / "LATEST").unlink()
    assert store.latest().step == 100


def test_retention_keeps_last_k_and_best_k(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2, keep_best=1)
    losses = {10: 3.0, 20: 1.0, 30: 2.5, 40: 2.0, 50: 2.2}
    for step, loss in losses.items():
        commit(store, step, eval_loss=loss)
    kept = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("step-*"))
    assert kept == [20, 40, 50]


def test_latest_is_never_deleted_even_when_retention_would(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=1)
    commit(store, 1)
    (tmp_path / "LATEST").write_text("step-1\n")
    commit(store, 2)
    assert store.latest().step == 2
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-2"]


def test_committing_a_step_again_keeps_the_first_commit(tmp_path):
    store = CheckpointStore(tmp_path)
    first = commit(store, 3, payload=b"first")
    commit(store, 3, payload=b"second")
    assert (first.path / "weights.bin").read_bytes() == b"first"
    assert not list(tmp_path.glob("*.tmp-*"))


def test_reserved_and_non_relative_names_are_refused(tmp_path):
    pending = CheckpointStore(tmp_path).begin(1)
    for name in ("manifest.json", "LATEST", "../escape", "/abs", "a//b", "a/./b"):
        with pytest.raises(ValueError):
            pending.open(name)


def test_nested_files_are_committed_and_verified_in_their_folders(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints")
    pending = store.begin(5)
    pending.write_bytes("global_step5/shard-0.bin", b"rank zero" * 10)
    committed = store.commit(pending, 5, {})
    assert (committed.path / "global_step5/shard-0.bin").read_bytes() == b"rank zero" * 10
    (committed.path / "global_step5/shard-0.bin").write_bytes(b"rank zer0" * 10)
    assert store.verify(committed.path)[0] is None, "a changed nested file must fail verification"


def test_an_adopted_file_is_moved_hashed_and_verified_like_a_written_one(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints")
    written = tmp_path / "program-output" / "weights.bin"
    written.parent.mkdir()
    written.write_bytes(os.urandom(PIECE_BYTES + 1000))  # two pieces
    expected = written.read_bytes()
    pending = store.begin(8)
    pending.adopt("weights.bin", written)
    committed = store.commit(pending, 8, {})
    assert not written.exists(), "adopting moves the file: nothing is copied on the same filesystem"
    assert (committed.path / "weights.bin").read_bytes() == expected
    assert store.verify(committed.path)[0] is not None
    assert len(committed.manifest["files"]["weights.bin"]["sha256_pieces"]) == 2


def test_latest_naming_a_deleted_folder_is_treated_as_missing_and_no_newer_checkpoint_is_deleted(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=5)
    for step in (10, 20, 30):
        commit(store, step)
    (tmp_path / "LATEST").write_text("step-15\n")  # a folder deleted by hand, LATEST left naming it
    assert store.latest().step == 30, "the newest whole checkpoint must be resumed, not deleted as a leftover"
    assert (tmp_path / "step-20").is_dir() and (tmp_path / "step-30").is_dir()
    assert (tmp_path / "LATEST").read_text().strip() == "step-30"


def test_garbage_in_latest_is_treated_as_missing(tmp_path: Path):
    store = CheckpointStore(tmp_path)
    commit(store, 4)
    (tmp_path / "LATEST").write_bytes(b"\xff\xfe garbage")
    assert store.latest().step == 4


def test_a_large_file_is_committed_whole_with_its_pieces_hashed(tmp_path):
    # Written in 32 MiB slices with the disk flushing behind them: every byte arrives, every piece hashed.
    payload = os.urandom(2 * PIECE_BYTES + 12345)
    committed = commit(CheckpointStore(tmp_path), 1, payload)
    assert (committed.path / "weights.bin").read_bytes() == payload
    pieces = [
        hashlib.sha256(payload[i : i + PIECE_BYTES]).hexdigest() for i in range(0, len(payload), PIECE_BYTES)
    ]
    assert committed.manifest["files"]["weights.bin"]["sha256_pieces"] == pieces


def test_pieces_are_hashed_right_when_writes_of_any_size_straddle_them_and_buffers_are_reused(tmp_path):
    # Many writes of odd sizes, copied (`write`) and not (`write_stable`), crossing piece boundaries: the
    # pieces' digests are those of the concatenated bytes, and a reused buffer (torch.save's way) does not
    # change what was hashed.
    rng = torch.Generator().manual_seed(0)
    sizes = [1, 7, PIECE_BYTES - 9, 3, 5 << 20, PIECE_BYTES + 17, 0, 4096, 1 << 20]
    chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng).numpy().tobytes() for n in sizes]
    store = CheckpointStore(tmp_path)
    pending = store.begin(1)
    reused = bytearray(max(sizes))
    with pending.open("weights.bin") as f:
        for i, chunk in enumerate(chunks):
            if i % 2:
                f.write_stable(memoryview(chunk))
            else:
                reused[: len(chunk)] = chunk
                f.write(memoryview(reused)[: len(chunk)])
                reused[: len(chunk)] = b"\x00" * len(chunk)  # the caller reuses its buffer at once
    committed = store.commit(pending, 1, {})
    payload = b"".join(chunks)
    assert (committed.path / "weights.bin").read_bytes() == payload
    pieces = [
        hashlib.sha256(payload[i : i + PIECE_BYTES]).hexdigest() for i in range(0, len(payload), PIECE_BYTES)
    ]
    assert committed.manifest["files"]["weights.bin"]["sha256_pieces"] == pieces
    assert store.verify(committed.path)[0] is not None


def test_a_failed_write_back_fails_the_file_instead_of_going_unnoticed(tmp_path):
    # Linux may report a write-back error to one fsync only: the one behind the writes must raise it.
    # fdatasync on a pipe fails (EINVAL) as it would on a disk with an I/O error.
    read_end, write_end = os.pipe()
    try:
        with atomic.WriteBehind(write_end, every_bytes=1) as flush, pytest.raises(OSError):
            for _ in range(1000):
                os.write(write_end, b"x")
                flush.nudge(1)
                time.sleep(0.001)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_retention_ranks_by_the_configured_score_when_a_manifest_has_one(tmp_path):
    """A CER (lower is better) keeps the checkpoint with the best CER, whatever its eval loss."""
    store = CheckpointStore(tmp_path, keep_last=2, keep_best=1)
    for step, loss, cer in ((10, 1.0, 0.9), (20, 3.0, 0.1), (30, 2.0, 0.5), (40, 2.0, 0.6)):
        pending = store.begin(step)
        pending.write_bytes("weights.bin", b"w" * step)
        store.commit(pending, step, {}, eval_loss=loss, score=("eval_cer", cer))
    kept = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("step-*"))
    assert kept == [20, 30, 40], "the lowest CER (step 20) must be kept, not the lowest loss (step 10)"
    manifest = json.loads((tmp_path / "step-20" / "manifest.json").read_text())
    assert manifest["score"] == {"metric": "eval_cer", "value": 0.1}


def test_manifests_without_a_score_are_ranked_by_their_eval_loss(tmp_path):
    """Checkpoints written before scores existed stay readable and keep competing by eval loss."""
    store = CheckpointStore(tmp_path, keep_last=2, keep_best=1)
    commit(store, 10, eval_loss=0.5)
    manifest = json.loads((tmp_path / "step-10" / "manifest.json").read_text())
    assert "score" not in manifest
    for step, loss in ((20, 2.0), (30, 3.0), (40, 4.0)):
        commit(store, step, eval_loss=loss)
    assert (tmp_path / "step-10").is_dir()
    assert store.committed()[-1].score == 0.5


def test_a_write_that_fails_removes_its_temp_folder_at_once_and_latest_stays(tmp_path):
    store = CheckpointStore(tmp_path)
    commit(store, 10)
    with pytest.raises(OSError, match="No space left"), store.writing(20) as pending:
        pending.write_bytes("weights.bin", b"part of the weights")
        raise OSError(28, "No space left on device")  # what a full volume's write raises (errno ENOSPC)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-10"]
    assert store.latest().step == 10


def test_every_folder_between_a_nested_file_and_the_checkpoint_is_fsynced_before_the_rename(
    tmp_path, monkeypatch
):
    """Only the files' own folders were fsynced: for a/b/x.bin the entry of b/ in a/ could be lost in a power
    loss after LATEST moved, and the newest committed checkpoint then failed verification."""
    synced = []
    real = atomic.fsync_dir
    monkeypatch.setattr(atomic, "fsync_dir", lambda path: (synced.append(Path(path)), real(path))[1])
    store = CheckpointStore(tmp_path)
    pending = store.begin(1)
    pending.write_bytes("a/b/x.bin", b"x")
    pending.write_bytes("top.bin", b"y")
    store.commit(pending, 1, {})
    inside = [p.relative_to(pending.dir).as_posix() for p in synced if p.is_relative_to(pending.dir)]
    assert inside == ["a/b", "a", "."], inside  # deepest first, the checkpoint's folder last


def test_checkpoints_without_the_configured_metric_do_not_compete_with_their_eval_loss(tmp_path):
    """generation_eval.every_evals=2 with early_stopping_metric=cer: every other eval measures the CER, the
    evals between record an eval loss alone. Ranked by that loss as if it were a CER, step 10's 0.05 beat
    step 20's CER of 0.1, and step 20, the run's best by its metric, was deleted."""
    store = CheckpointStore(tmp_path, keep_last=1, keep_best=1)
    for step, loss, cer in ((10, 0.05, None), (20, 0.06, 0.1), (30, 0.04, None), (40, 0.05, 0.3)):
        pending = store.begin(step)
        pending.write_bytes("weights.bin", b"w" * step)
        store.commit(pending, step, {}, eval_loss=loss, score=("eval_cer", cer) if cer is not None else None)
    kept = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("step-*"))
    assert kept == [20, 40], "the lowest CER (step 20) and the newest; an eval loss is no CER"


def test_a_nan_eval_loss_never_ranks_as_best_and_the_best_checkpoint_stays(tmp_path):
    """A run that diverged (an HF Trainer goes on saving after it, its evals NaN) is what keep_best is for. NaN
    compares neither lower nor higher, so the sort kept the NaN checkpoints as the best and deleted step 10,
    the best one, and step 20, the last good one."""
    store = CheckpointStore(tmp_path, keep_last=2, keep_best=1)
    for step, loss in ((10, 0.5), (20, 1.0), (30, float("nan")), (40, float("nan")), (50, float("nan"))):
        commit(store, step, eval_loss=loss)
    kept = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("step-*"))
    assert kept == [10, 40, 50], "the best finite eval loss (step 10) and the newest two"
