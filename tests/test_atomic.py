"""Atomic writes: an error midway leaves the previous file as it was and no temp file behind."""

from __future__ import annotations

import pytest

from trainpod import atomic


def test_a_write_failing_midway_keeps_the_previous_file_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "status.json"
    atomic.write_bytes(target, b"the previous version")

    def parts():
        yield b"half of the new "
        raise OSError("disk error midway")

    with pytest.raises(OSError, match="midway"):
        atomic.write_parts(target, parts())
    assert target.read_bytes() == b"the previous version"
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"], "the temp file must be removed"


def test_a_completed_write_replaces_the_file(tmp_path):
    target = tmp_path / "status.json"
    atomic.write_bytes(target, b"old")
    atomic.write_parts(target, [b"new ", memoryview(b"content")])
    assert target.read_bytes() == b"new content"
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_a_replacement_whose_sync_fails_leaves_the_older_folder_in_place(tmp_path, monkeypatch):
    """An export or conversion replacing an older one moved the older aside before syncing the new one's files:
    a sync that failed (an I/O error on a network volume; made to fail here, as none can be had on a local
    disk) left no output under the name, and the next start deleted the older one as a leftover."""
    target, new = tmp_path / "hf", tmp_path / "hf.tmp-new"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"older")
    new.mkdir()
    (new / "model.safetensors").write_bytes(b"newer")

    def failing_fsync(path):
        raise OSError(5, "Input/output error", str(path))

    monkeypatch.setattr(atomic, "fsync_file", failing_fsync)
    with pytest.raises(OSError, match="Input/output"):
        atomic.replace_dir(new, target)
    assert (target / "model.safetensors").read_bytes() == b"older"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf.tmp-new"], "nothing moved aside"


def test_a_replacement_publishes_the_new_folder_and_removes_the_older(tmp_path):
    target, new = tmp_path / "hf", tmp_path / "hf.tmp-new"
    for folder, text in ((target, b"older"), (new, b"newer")):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(text)
    atomic.replace_dir(new, target)
    assert (target / "model.safetensors").read_bytes() == b"newer"
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
