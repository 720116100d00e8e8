"""One writer per run: a live lease refuses a second writer; a stale one is taken over."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from trainpod.checkpoint import Lease
from trainpod.errors import ExitCode, TemporaryError


def test_second_writer_is_refused_while_the_first_is_alive(tmp_path):
    first = Lease(tmp_path / "LEASE", ttl_seconds=60)
    first.acquire()
    try:
        with pytest.raises(TemporaryError, match="leased by another writer") as caught:
            Lease(tmp_path / "LEASE", ttl_seconds=60).acquire()
        assert caught.value.exit_code == ExitCode.TEMPORARY
    finally:
        first.release()
    assert not (tmp_path / "LEASE").exists()


def test_expired_lease_from_another_host_is_taken_over(tmp_path):
    path = tmp_path / "LEASE"
    path.write_text(
        json.dumps({"owner": {"id": "x", "host": "elsewhere", "pid": 1}, "expires_unix": time.time() - 1})
    )
    lease = Lease(path, ttl_seconds=60)
    lease.acquire()
    assert json.loads(path.read_text())["owner"]["id"] == lease.owner["id"]
    lease.release()


def test_live_lease_from_another_host_is_respected(tmp_path):
    path = tmp_path / "LEASE"
    path.write_text(
        json.dumps({"owner": {"id": "x", "host": "elsewhere", "pid": 1}, "expires_unix": time.time() + 60})
    )
    with pytest.raises(TemporaryError, match="host elsewhere"):
        Lease(path, ttl_seconds=60).acquire()


def test_lease_of_a_dead_process_on_this_host_is_taken_over_before_expiry(tmp_path):
    path = tmp_path / "LEASE"
    code = (
        "import sys; from trainpod.checkpoint import Lease; "
        f"Lease({str(path)!r}, ttl_seconds=600).acquire()"
    )  # exits without releasing: like SIGKILL
    subprocess.run([sys.executable, "-c", code], check=True)
    assert json.loads(path.read_text())["expires_unix"] > time.time() + 500
    lease = Lease(path, ttl_seconds=60)
    lease.acquire()
    lease.release()


def test_heartbeat_notices_a_takeover(tmp_path):
    path = tmp_path / "LEASE"
    lease = Lease(path, ttl_seconds=6)  # heartbeat every 1.5 s
    lease.acquire()
    held = json.loads(path.read_text())
    held["owner"]["id"] = "someone-else"
    path.write_text(json.dumps(held))
    assert lease.lost.wait(timeout=10), "the heartbeat must notice that another writer owns the lease"
    lease.release()
    assert path.exists(), "release must not delete another writer's lease"
