"""Recognising a full volume in every shape it reaches trainpod, and the headroom check's thresholds.

    .venv/bin/pytest -q tests/test_diskspace.py

The end-to-end runs on a real full file system are in tests/test_disk_full.py.
"""

from __future__ import annotations

import errno
import os

import pytest

from trainpod import diskspace
from trainpod.errors import ExitCode, VolumeFull


def raised_while_handling(inner: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:
            raise outer  # noqa: B904 - the implicit __context__ is what torch.save leaves
    except BaseException as exc:
        return exc


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
        OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)),
        raised_while_handling(OSError(errno.ENOSPC, "x"), RuntimeError("unexpected pos 704 vs 598")),
        RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
    ],
    ids=["enospc", "edquot", "torch-save", "safetensors"],
)
def test_a_full_volume_is_recognised_in_each_shape_it_arrives_in(exc):
    assert diskspace.is_disk_full(exc)


@pytest.mark.parametrize(
    "exc", [OSError(errno.EACCES, "Permission denied"), RuntimeError("size mismatch"), None]
)
def test_other_errors_are_not_taken_for_a_full_volume(exc):
    assert not diskspace.is_disk_full(exc)


def test_the_block_turns_enospc_into_exit_5_naming_what_and_the_fix(tmp_path):
    with pytest.raises(VolumeFull) as caught, diskspace.volume_full_as_exit_5(tmp_path, "the shards"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert caught.value.exit_code == ExitCode.VOLUME_FULL == 5
    assert f"no space left on the volume at {tmp_path} for the shards" in str(caught.value)
    assert "grow the network volume" in str(caught.value) and "\n" not in str(caught.value)


def test_headroom_refuses_a_start_where_no_checkpoint_fits_and_warns_below_two(tmp_path, caplog):
    free = diskspace.free_bytes(tmp_path)
    with pytest.raises(VolumeFull, match="the first checkpoint: it needs about"):
        diskspace.check_headroom(tmp_path, free + 2**30, first=True)
    diskspace.check_headroom(tmp_path, free // 2 + 1)
    assert "only 1 checkpoint(s) of about" in caplog.text
    caplog.clear()
    diskspace.check_headroom(tmp_path, max(free // 4, 1))
    assert "checkpoint(s)" not in caplog.text


def test_an_error_trainpod_reports_already_keeps_its_own_exit_code(tmp_path):
    from trainpod.errors import InputError

    with pytest.raises(InputError), diskspace.volume_full_as_exit_5(tmp_path):
        raise InputError("the source quotes an old log: No space left on device")


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("OSError: [Errno 28] No space left on device: '/tmp/cache/x.bin'", "/tmp/cache/x.bin"),
        ("OSError: [Errno 28] No space left on device", None),  # a failed write() names no file
        ("open('/workspace/a') failed: No space left on device", None),  # a path before the message is not it
        ('shutil.Error: [Errno 122] Disk quota exceeded: "/workspace/runs/r/x"', "/workspace/runs/r/x"),
        ("step 3 loss 2.1", None),
    ],
)
def test_the_file_a_disk_full_line_names_is_read_after_the_oss_message(line, named):
    found = diskspace.full_path_named(line)
    assert (str(found) if found else None) == named
