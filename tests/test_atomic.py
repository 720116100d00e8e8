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
