"""One writer per run: a live lease refuses a second writer; a stale one is taken over."""

from __future__ import annotations

import json
import logging
import multiprocessing
import subprocess
import sys
import threading
import time

import pytest

from trainpod import atomic
from trainpod.checkpoint import Lease
from trainpod.errors import ExitCode, TemporaryError
from trainpod.preemption import WorkAbandoned


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


def test_a_release_from_another_thread_waits_for_a_publish_begun_and_none_begins_after_it(tmp_path):
    # A stop under several ranks releases the run's lease from a thread while rank 0's export runs on; a
    # new pod may take the run at once, so rank 0 must not rename its export into place after that.
    lease = Lease(tmp_path / "LEASE", ttl_seconds=60)
    lease.acquire()
    with lease.publishing():
        releasing = threading.Thread(target=lease.release)
        releasing.start()
        time.sleep(0.2)  # time for a release that did not wait to land (the assertion never fails otherwise)
        assert (tmp_path / "LEASE").exists(), "the lease was released in the middle of a publish"
    releasing.join()
    assert not (tmp_path / "LEASE").exists()
    with pytest.raises(WorkAbandoned, match="lease was released"), lease.publishing():
        pytest.fail("published after the lease was released")


def test_expired_lease_from_another_host_is_taken_over(tmp_path):
    path = tmp_path / "LEASE"
    path.write_text(
        json.dumps({"owner": {"id": "x", "host": "elsewhere", "pid": 1}, "expires_unix": time.time() - 1})
    )
    lease = Lease(path, ttl_seconds=60)
    lease.acquire()
    assert json.loads(path.read_text())["owner"]["id"] == lease.owner["id"]
    lease.release()


def another_hosts_lease(path, expires_in: float, beat: float) -> None:
    owner = {"id": "x", "host": "elsewhere", "pid": 1, "pod_id": "pod-elsewhere"}
    now = time.time()
    atomic.write_json(path, {"owner": owner, "heartbeat_unix": beat, "expires_unix": now + expires_in})


def test_a_lease_that_another_host_renews_is_respected(tmp_path):
    path = tmp_path / "LEASE"
    another_hosts_lease(path, expires_in=60, beat=time.time())
    stop = threading.Event()

    def renew():  # the other pod's heartbeat thread, fast
        while not stop.wait(0.2):
            another_hosts_lease(path, expires_in=60, beat=time.time())

    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        with pytest.raises(TemporaryError, match="host elsewhere, pid 1, pod pod-elsewhere"):
            Lease(path, ttl_seconds=60).acquire()
    finally:
        stop.set()
        renewer.join()


def test_another_hosts_lease_left_unrenewed_is_waited_out_and_taken_over(tmp_path, caplog):
    # A spot pod SIGKILLed mid-commit never released its lease; its replacement runs on a new machine.
    path = tmp_path / "LEASE"
    another_hosts_lease(path, expires_in=1.5, beat=time.time())
    lease = Lease(path, ttl_seconds=60)
    with caplog.at_level(logging.INFO):
        lease.acquire()
    try:
        assert json.loads(path.read_text())["owner"]["id"] == lease.owner["id"]
        assert "waiting for its heartbeat" in caplog.text and "taking over a stale lease" in caplog.text
    finally:
        lease.release()


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


def test_a_release_never_removes_the_lease_of_a_writer_that_took_it_over_meanwhile(tmp_path, monkeypatch):
    """The release read the lease, found it its own, and removed it: a holder stalled in between (past its
    expiry) removed the lease of the pod that took the run over meanwhile, and a third one then took the run
    beside it. The release is now a compare-and-swap of the holder's own bytes, the claim a taker makes: of
    the two, one alone acts."""
    import pathlib

    path = tmp_path / "LEASE"
    lease = Lease(path, ttl_seconds=60)
    lease.acquire()
    taker = Lease(path, ttl_seconds=60)
    taker.owner = {**taker.owner, "id": "taker", "host": "elsewhere", "pod_id": "pod-taker"}
    taken = []
    unlink = pathlib.Path.unlink

    def a_taker_lands_just_before(self, missing_ok=False):  # it judged the lease stale: its holder stalled
        if self == path and not taken:
            try:
                taken.append(taker._take_over(path.read_bytes()))
            except TemporaryError:
                taken.append(False)
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", a_taker_lands_just_before)
    lease.release()
    monkeypatch.undo()
    assert taken, "the release removed the lease"
    if taken[0]:
        assert json.loads(path.read_text())["owner"]["id"] == "taker", "the taker's lease was removed"
    else:
        assert not path.exists(), "refused, the taker leaves the released lease to its holder"


def test_a_release_on_a_full_volume_still_removes_the_lease(tmp_path, monkeypatch):
    """No room for the claim's temp file: no taker has room for its own either, and a run ending with exit 5
    must not leave its lease to expire."""
    import errno

    path = tmp_path / "LEASE"
    lease = Lease(path, ttl_seconds=60)
    lease.acquire()

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lease, "_complete_temp", full)
    lease.release()
    assert not path.exists()


def test_a_holder_stalled_in_its_renewal_does_not_write_over_the_lease_a_replacement_took(
    tmp_path, monkeypatch
):
    """The heartbeat read the lease, found it its own, and wrote its renewal: a holder stalled in between (a
    volume hang, a swapping host) past its expiry, while a replacement pod took the run over, wrote back over
    the taker's lease, and both pods committed to one run until the taker's next heartbeat. A renewal is now
    a compare-and-swap of the holder's own last bytes: it finds them gone, and stops."""
    from trainpod.checkpoint import lease as lease_module

    path = tmp_path / "LEASE"
    lease = Lease(path, ttl_seconds=2)  # a beat every 0.5 s
    lease.acquire()
    taker = {"id": "taker", "host": "elsewhere", "pid": 7, "pod_id": "pod-taker"}
    record = lease_module.Lease._record

    def stalled_while_a_replacement_takes_over(self):  # the renewal's record, made after its read
        if threading.current_thread() is self._thread:
            now = time.time()
            atomic.write_json(path, {"owner": taker, "heartbeat_unix": now, "expires_unix": now + 60})
        return record(self)

    monkeypatch.setattr(lease_module.Lease, "_record", stalled_while_a_replacement_takes_over)
    assert lease.lost.wait(timeout=10), "the stalled holder must find its lease taken over"
    monkeypatch.undo()
    assert json.loads(path.read_text())["owner"]["id"] == "taker", "the taker's lease was written over"
    lease.release()
    assert json.loads(path.read_text())["owner"]["id"] == "taker"


def test_a_taker_that_meets_the_holder_renewing_a_lease_it_judged_stale_is_told_the_holder_is_alive(tmp_path):
    # A holder stalled past its expiry renews by the very claim a taker of its lease makes: the taker that
    # meets it is refused, naming the holder as alive (not "another writer took it over at the same moment").
    import hashlib

    path = tmp_path / "LEASE"
    another_hosts_lease(path, expires_in=-1, beat=0.0)
    held = json.loads(path.read_text())
    claim = tmp_path / f"LEASE.takeover-{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}-0"
    claim.write_text(json.dumps({**held, "expires_unix": time.time() + 60}))  # its renewal, under way
    with pytest.raises(TemporaryError, match="pod pod-elsewhere\\), which is alive"):
        Lease(path, ttl_seconds=60).acquire()
    assert json.loads(path.read_text()) == held, "the lease is left to its holder"


def test_a_lease_that_cannot_be_renewed_is_lost_before_it_expires_and_a_transient_error_is_retried(
    tmp_path, monkeypatch
):
    """A volume error in the heartbeat ended its thread unnoticed: the lease expired, a second writer took
    the run over, and the first went on writing with `lost` never set."""
    from trainpod.checkpoint import lease as lease_module

    path = tmp_path / "LEASE"
    real = lease_module.Lease._complete_temp
    failing = {"writes": 1}

    def complete_temp(self):  # where a renewal writes its record
        if failing["writes"] > 0:
            failing["writes"] -= 1
            raise OSError(5, "Input/output error")
        return real(self)

    lease = Lease(path, ttl_seconds=2)  # a beat every 0.5 s
    lease.acquire()
    monkeypatch.setattr(lease_module.Lease, "_complete_temp", complete_temp)
    time.sleep(1.5)  # one failed renewal, then renewed again
    assert not lease.lost.is_set() and lease._thread.is_alive()
    assert json.loads(path.read_text())["expires_unix"] > time.time()
    failing["writes"] = 10**6  # the volume stays broken
    deadline = json.loads(path.read_text())["expires_unix"]
    assert lease.lost.wait(timeout=5), "a lease that can no longer be renewed must be reported lost"
    assert time.time() < deadline, "lost must be set before another writer may take the lease over"
    lease.release()


def test_a_full_volume_does_not_lose_the_lease(tmp_path, monkeypatch):
    """On a full volume the heartbeat cannot renew the lease, nor can another writer take it (its write fails
    the same way): the run goes on to its next commit, which exits 5 naming the full volume, rather than 75."""
    import errno
    import os

    from trainpod.checkpoint import lease as lease_module

    def full(self):  # where a renewal writes its record
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    lease = Lease(tmp_path / "LEASE", ttl_seconds=2)
    lease.acquire()
    monkeypatch.setattr(lease_module.Lease, "_complete_temp", full)
    assert not lease.lost.wait(timeout=3)
    assert lease._thread.is_alive()
    monkeypatch.undo()
    lease.release()


def test_without_proc_a_live_owner_on_this_host_is_respected_and_a_dead_one_taken_over(tmp_path, monkeypatch):
    """Where /proc does not exist (macOS) every owner's start time was unknown, so every lease on the same
    host looked stale: a second writer took over a live one."""
    from trainpod.checkpoint import lease as lease_module

    monkeypatch.setattr(lease_module, "_process_start_ticks", lambda pid: None)
    path = tmp_path / "LEASE"
    first = Lease(path, ttl_seconds=60)
    first.acquire()
    with pytest.raises(TemporaryError, match="leased by another writer"):
        Lease(path, ttl_seconds=60).acquire()
    first.release()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    held = {"id": "x", "host": first.owner["host"], "pid": int(dead.stdout), "pid_start": None}
    path.write_text(json.dumps({"owner": held, "expires_unix": time.time() + 60}))
    taker = Lease(path, ttl_seconds=60)
    taker.acquire()
    taker.release()


def test_of_two_writers_taking_over_the_same_stale_lease_at_once_only_the_last_goes_on(tmp_path):
    # Two replacement pods that waited for the same lease to expire write theirs within a poll of each
    # other: the file holds the last write, and the first must stop before it commits anything.
    path = tmp_path / "LEASE"
    another_hosts_lease(path, expires_in=-1, beat=0.0)
    first = Lease(path, ttl_seconds=60)
    first.takeover_settle_s = 1.0
    rival = {"id": "rival", "host": "elsewhere-too", "pid": 7, "pod_id": "pod-rival"}

    def rival_writes_once_first_has():
        deadline = time.monotonic() + 5
        while (read := json.loads(path.read_text()))["owner"]["id"] != first.owner["id"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        atomic.write_json(path, {**read, "owner": rival})

    writer = threading.Thread(target=rival_writes_once_first_has)
    writer.start()
    with pytest.raises(TemporaryError, match="pod pod-rival\\) took this run's stale lease over"):
        first.acquire()
    writer.join()
    assert json.loads(path.read_text())["owner"]["id"] == "rival", "the rival's lease is left alone"


def _race_for_a_fresh_lease(path, barrier, results, all_told) -> None:
    lease = Lease(path, ttl_seconds=60)  # made in this process: its pid is the owner's
    barrier.wait()
    try:
        lease.acquire()
    except TemporaryError:
        results.put("refused")
        return
    results.put("won")
    all_told.wait(60)  # still holding it while the others look, however slow a loaded machine makes them
    lease.release()


FORKED = multiprocessing.get_context("fork")


def race(writers: int, racer, args_of) -> list[str]:
    """Start `writers` processes of `racer(*args_of(index), results, all_told)`; their outcomes, sorted, once each
    has told its own (they hold on until `all_told`, so a winner cannot release before a loser has looked)."""
    results, all_told = FORKED.Queue(), FORKED.Event()
    racers = [
        FORKED.Process(target=racer, args=(*args_of(index), results, all_told)) for index in range(writers)
    ]
    for process in racers:
        process.start()
    outcomes = sorted(results.get(timeout=120) for _ in racers)
    all_told.set()
    for process in racers:
        process.join(timeout=30)
    return outcomes


def test_of_writers_racing_for_a_runs_first_lease_exactly_one_wins_at_once(tmp_path):
    """Pods started together on a fresh run (deployed twice, a supervisor and a hand start) all found no
    LEASE and each wrote its own: every one of them went on, writing the same run, until its first heartbeat
    a quarter TTL later found the file another's. The lease file is now created atomically: one wins."""
    writers = 4
    barrier = FORKED.Barrier(writers)
    outcomes = race(writers, _race_for_a_fresh_lease, lambda _: (tmp_path / "LEASE", barrier))
    assert outcomes == ["refused"] * (writers - 1) + ["won"], (
        f"{outcomes.count('won')} writers took the lease"
    )
    assert not (tmp_path / "LEASE").exists(), "the winner released it"


def test_on_a_volume_without_hard_links_a_first_lease_is_written_and_read_back(tmp_path, monkeypatch):
    import errno
    import os

    def no_hard_links(*_):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hard_links)  # a FUSE volume that refuses link(2)
    lease = Lease(tmp_path / "LEASE", ttl_seconds=60)
    lease.takeover_settle_s = 0.05
    lease.acquire()
    assert json.loads((tmp_path / "LEASE").read_text())["owner"]["id"] == lease.owner["id"]
    assert [p.name for p in tmp_path.iterdir()] == ["LEASE"], "no temp file is left"
    lease.release()


def _race_for_a_stale_lease(path, judged, late, someone_won, results, all_told) -> None:
    """One pod taking over the stale lease at `path`: it judges the lease stale, waits until every racer has
    judged the same one (`judged`), and the `late` one goes on only after another racer has won (a pod whose
    write came seconds after its read: a slow network volume, a loaded host)."""
    lease = Lease(path, ttl_seconds=60)
    lease.takeover_settle_s = 0.2
    judge = lease._holder_alive

    def judge_then_wait(held):
        alive = judge(held)
        judged.wait()
        if late:
            someone_won.wait(60)
        return alive

    lease._holder_alive = judge_then_wait
    try:
        lease.acquire()
    except TemporaryError:
        results.put("refused")
        return
    results.put("won")
    someone_won.set()
    all_told.wait(60)
    lease.release()


def test_of_writers_taking_over_one_stale_lease_exactly_one_wins_even_when_one_writes_late(tmp_path):
    """Pods that all found the same stale lease each wrote theirs, waited 2 s and read it back: one whose write
    came after another's read-back (a slow volume, a loaded host) read its own back too, and two writers
    committed to one run. A takeover is now a compare-and-swap of that very lease: one writer wins."""

    path = tmp_path / "LEASE"
    another_hosts_lease(path, expires_in=-1, beat=0.0)  # expired: every racer takes it over at once
    writers = 4
    judged, someone_won = FORKED.Barrier(writers), FORKED.Event()
    outcomes = race(writers, _race_for_a_stale_lease, lambda index: (path, judged, index == 0, someone_won))
    assert outcomes == ["refused"] * (writers - 1) + ["won"], (
        f"{outcomes.count('won')} writers took the lease"
    )
    assert not path.exists(), "the winner released it"


def test_a_takeover_claim_left_by_a_killed_writer_holds_the_next_one_up_only_while_it_is_young(tmp_path):
    # A pod killed between its claim of a stale lease and its rename over it left the claim behind: a
    # young one is a takeover running now (refused), an old one a killed taker's (skipped, the lease taken).
    import hashlib
    import os

    from trainpod.checkpoint import lease as lease_module

    path = tmp_path / "LEASE"
    another_hosts_lease(path, expires_in=-1, beat=0.0)
    claim = tmp_path / f"LEASE.takeover-{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}-0"
    killed = {"id": "killed", "host": "elsewhere-too", "pid": 9, "pod_id": "pod-killed"}
    claim.write_text(json.dumps({"owner": killed}))
    with pytest.raises(TemporaryError, match="pod pod-killed\\) took this run's stale lease over"):
        Lease(path, ttl_seconds=60).acquire()
    assert json.loads(path.read_text())["owner"]["id"] == "x", "the stale lease is left to the claim's taker"
    old = time.time() - lease_module.LEASE_TEMP_MAX_AGE_S - 1
    os.utime(claim, (old, old))
    lease = Lease(path, ttl_seconds=60)
    lease.takeover_settle_s = 0.05
    lease.acquire()
    try:
        assert json.loads(path.read_text())["owner"]["id"] == lease.owner["id"]
    finally:
        lease.release()


def test_temp_files_and_claims_of_lease_writes_killed_midway_are_removed_and_a_live_ones_kept(tmp_path):
    """A pod killed between a lease write's temp file and its rename or link (a heartbeat, a first lease, a
    takeover's claim) left LEASE.tmp-<id> behind, and nothing removed them: one more on the volume per kill."""
    import os

    from trainpod.checkpoint import lease as lease_module

    path = tmp_path / "LEASE"
    killed = tmp_path / "LEASE.tmp-0123456789ab"
    live = tmp_path / "LEASE.tmp-ba9876543210"  # another writer's, being written now
    past_claim = tmp_path / "LEASE.takeover-0123456789abcdef-0"  # of a lease taken over since
    for leftover in (killed, live, past_claim):
        leftover.write_text("{")
    old = time.time() - lease_module.LEASE_TEMP_MAX_AGE_S - 1
    os.utime(killed, (old, old))
    lease = Lease(path, ttl_seconds=60)
    lease.acquire()
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["LEASE", live.name]
    finally:
        lease.release()


def test_a_lease_taken_over_by_another_pod_while_it_was_watched_names_that_pod(tmp_path):
    # A replacement pod watching a killed pod's lease for its heartbeat, when another replacement took it over
    # meanwhile, was refused naming the killed pod as alive, and told to stop it: the pod to stop is the other.
    path = tmp_path / "LEASE"
    another_hosts_lease(path, expires_in=30, beat=time.time())
    taker = {"id": "taker", "host": "elsewhere-too", "pid": 7, "pod_id": "pod-taker"}

    stop = threading.Event()

    def take_over_and_renew():  # the other replacement, then its heartbeat, fast
        while not stop.wait(0.1):  # after this pod's first read (or, under load, before: named as well)
            now = time.time()
            atomic.write_json(path, {"owner": taker, "heartbeat_unix": now, "expires_unix": now + 60})

    renewer = threading.Thread(target=take_over_and_renew)
    renewer.start()
    try:
        with pytest.raises(TemporaryError, match="host elsewhere-too, pid 7, pod pod-taker"):
            Lease(path, ttl_seconds=60).acquire()
    finally:
        stop.set()
        renewer.join()
