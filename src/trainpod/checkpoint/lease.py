"""One writer per run: a LEASE file with owner, heartbeat and expiry.

A second process that finds a live lease refuses to start (exit 75, so a supervisor retries later).
A lease is stale, and taken over, when it expired, or when its owner ran on this same host (a
restarted pod keeps its hostname) and that process no longer exists: a pid alone is not enough
because pids are reused, so the owner's process start time is compared too. Another host's lease
that has not expired is watched until its holder renews it (live: refused) or it expires unrenewed
(a pod SIGKILLed before it could release it, say mid-commit at a spot interruption: taken over), so
that its replacement on a new machine starts instead of counting failed starts for up to one TTL.

Where there is no lease yet (a fresh run, or one released), it is created with link(2) from a complete temp
file, which fails where the file exists: of writers starting together exactly one makes it, and each other
reads the winner's and is refused at once, before it writes anything (a plain write, rename included,
replaces the file, and every one of them went on until its first heartbeat found it another's).

A stale lease is taken over by a compare-and-swap of those very bytes: the taker first links its complete
temp file to a claim named after them (`LEASE.takeover-<their hash>-<n>`), which fails where another writer
claimed them, then checks that the lease still holds them and renames its own over it. Of writers that found
the same stale lease, however late one of them writes, exactly one replaces it; the others exit 75. A claim
left by a writer killed in between holds no later taker up for longer than LEASE_TEMP_MAX_AGE_S. The holder's
heartbeat renews, and its release removes the lease, by the same compare-and-swap of its own last bytes, so a
holder stalled past its expiry never writes over (nor removes) the lease of the pod that took its run over meanwhile.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainpod import atomic
from trainpod.diskspace import is_disk_full
from trainpod.errors import TemporaryError
from trainpod.preemption import WorkAbandoned

log = logging.getLogger(__name__)

# How often a lease held by another machine is read again while waiting for its heartbeat (every TTL/4).
RENEWAL_POLL_S = 1.0
# After taking a lease over, how long to wait before reading it back: two pods that saw the same lease
# expire write theirs within a poll of each other, and the one whose write came first must find out
# before it writes a checkpoint (the file holds the last write; a heartbeat would notice only TTL/4 later).
TAKEOVER_SETTLE_S = 2 * RENEWAL_POLL_S
# A lease write's temp file (and a takeover's claim) lives milliseconds: written, fsynced, linked or renamed.
# One older than this was left by a process killed in between (a spot pod's SIGKILL) and is nobody's; ten
# minutes leaves room for a stalled volume and for clocks of pods on other hosts that differ.
LEASE_TEMP_MAX_AGE_S = 600.0
# As a training run's: a replacement pod on another machine waits at most this long for a killed one's.
FOLDER_LEASE_TTL_S = 90.0


def sibling_lease(folder: Path) -> Path:
    """The lease of a folder written by one process at a time that is not a run (a dataset being built):
    `.<name>.LEASE` beside it, so that the folder itself can be renamed into place whole."""
    return Path(folder).with_name(f".{Path(folder).name}.LEASE")


@contextmanager
def one_writer(folder: Path, what: str) -> Iterator[Lease]:
    """Hold the lease of `folder` (a dataset or tokenizer being made, `what` names it) while this process
    writes it.

    Two pods making one dataset (deployed twice, or a replacement while the old pod still runs) would each
    delete the other's temp files and unlisted shards; the second exits 75 instead, as a second training
    pod does. The lease is a sibling file (sibling_lease); a dataset or tokenizer name never starts with a
    dot. A complete folder is read without it, by any number of pods at once.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    lease = Lease(sibling_lease(folder), FOLDER_LEASE_TTL_S, what=f"{what} {folder.name}")
    lease.acquire()
    _folder_leases_held.append(lease)
    try:
        yield lease
    finally:
        _folder_leases_held.remove(lease)
        lease.release()


_folder_leases_held: list[Lease] = []  # one_writer's, innermost last

# Run by the next Lease of that path in this process once it holds it: boot's START marker of a pod that
# found the run leased by another pod, written when its own workload takes the lease over (runpod/finish.py).
_when_taken: dict[Path, list[Callable[[], None]]] = {}


def call_when_taken(path: Path, hook: Callable[[], None]) -> None:
    """Have the next `Lease(path).acquire()` of this process run `hook` once it holds the lease (where it is
    refused, the hook is dropped). A hook that raises ends that acquire with its error, the lease let go."""
    _when_taken.setdefault(Path(path).absolute(), []).append(hook)


def release_folder_leases() -> None:
    """Let every lease one_writer holds in this process go, from any thread: the process exits right after
    (a stop that came in one long C call, PreemptionWatch.ended_when_stuck), and a new pod on another host
    would otherwise wait out their TTL."""
    for lease in reversed(list(_folder_leases_held)):
        lease.release()
        log.warning("released the lease of the %s at the stop", lease.what)


def lease_lost(folder: Path) -> TemporaryError:
    """What a one_writer holder raises when it finds its lease taken over (Lease.lost): it writes no more."""
    return TemporaryError(
        f"another writer took over the lease of {folder} (this process could not renew it in time); "
        "stopping without writing more: the pod that holds it goes on"
    )


def read_lease(path: Path) -> dict[str, Any] | None:
    try:
        held = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        log.warning("LEASE at %s is unreadable; treating it as stale", path)
        return None
    return held if isinstance(held, dict) else None


def renewed_by_its_holder(path: Path, held: dict[str, Any]) -> bool:
    """Whether the lease at `path`, read as `held`, is renewed (or taken by yet another writer) before it
    expires: a live writer heartbeats every TTL/4. Waits at most until that expiry; False when it
    expires unrenewed or is released."""
    while (left := held.get("expires_unix", 0) - time.time()) > 0:
        time.sleep(min(RENEWAL_POLL_S, left))
        now = read_lease(path)
        if now is None:
            return False
        if now.get("heartbeat_unix") != held.get("heartbeat_unix") or now.get("owner") != held.get("owner"):
            return True
    return False


def json_or_empty(raw: bytes) -> dict[str, Any]:
    """A lease record from its bytes; {} for bytes that are no record (a damaged file, taken over as stale)."""
    try:
        held = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return {}
    return held if isinstance(held, dict) else {}


def _read_or_empty(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except FileNotFoundError:
        return False


def _age_s(path: Path) -> float | None:
    """Seconds since `path` was last modified; None once it is gone (removed by its owner meanwhile)."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None


# What link(2) fails with on a volume without hard links (a FUSE mount): the lease is then written over.
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK)


def _process_start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # Field 22 (starttime) counts from after the ")" that closes the command name.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pid_exists(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _process_alive_here(owner: dict[str, Any]) -> bool:
    """Whether the lease owner's process, on this host, still runs (its pid, not reused since)."""
    pid = int(owner.get("pid", -1))
    if owner.get("pid_start") is None:
        return _pid_exists(pid)  # no /proc where it ran (macOS): the pid alone, on the safe side
    start = _process_start_ticks(pid)
    return start is not None and start == owner.get("pid_start")


class Lease:
    def __init__(self, path: Path, ttl_seconds: float = 90.0, what: str = "run"):
        self.path = Path(path)
        self.ttl = ttl_seconds
        self.what = what  # what the lease guards, for messages: "run", "dataset tiny-stories"
        self.owner = {
            "id": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pod_id": os.environ.get("RUNPOD_POD_ID"),
            "pid": os.getpid(),
            "pid_start": _process_start_ticks(os.getpid()),
        }
        self.takeover_settle_s = TAKEOVER_SETTLE_S
        self.lost = threading.Event()
        self.released = threading.Event()
        self._publishing = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The bytes of this writer's lease as it last linked them in: each renewal is a compare-and-swap of
        # them (None where the volume has no hard links, and the lease is written over).
        self._held: bytes | None = None

    def _read(self) -> dict[str, Any] | None:
        return read_lease(self.path)

    def _holder_alive(self, held: dict[str, Any]) -> bool:
        if held.get("expires_unix", 0) < time.time():
            return False
        owner = held.get("owner", {})
        if owner.get("host") == self.owner["host"]:
            return _process_alive_here(owner)
        log.info(
            "the %s is leased by host %s (pod %s) for %.0f s more: waiting for its heartbeat, or for it to "
            "expire unrenewed and be taken over",
            self.what,
            owner.get("host"),
            owner.get("pod_id") or "-",
            held.get("expires_unix", 0) - time.time(),
        )
        return renewed_by_its_holder(self.path, held)

    def _record(self) -> dict[str, Any]:
        now = time.time()
        return {"owner": self.owner, "heartbeat_unix": now, "expires_unix": now + self.ttl}

    def _write(self) -> None:
        atomic.write_json(self.path, self._record())

    def _read_bytes(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def _complete_temp(self) -> tuple[Path, bytes]:
        """This writer's lease record in a temp file beside the lease, whole and fsynced, to be linked; and
        its bytes."""
        temp = atomic.temp_name(self.path)
        data = json.dumps(self._record()).encode("utf-8")
        with open(temp, "xb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        return temp, data

    def _create(self) -> bool | None:
        """Make the lease where none exists: True when this writer made it, False when another writer's came
        first, None where the volume has no hard links (the caller then writes it and reads it back).

        link(2) publishes a complete, fsynced file and refuses to replace one, so no reader sees it half
        written. Over NFS a link whose reply was lost is retried and says EEXIST though it was made: the
        lease read back decides."""
        temp, data = self._complete_temp()
        try:
            os.link(temp, self.path)
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
            return None
        finally:
            temp.unlink(missing_ok=True)
        atomic.fsync_dir(self.path.parent)
        if self._read_bytes() != data:
            return False
        self._held = data
        return True

    def _take_over(self, stale: bytes) -> bool | None:
        """Replace the stale lease whose bytes are `stale` with this writer's, if it still holds them: True
        when this writer did, False when the lease is gone meanwhile (released: look again), None where the
        volume has no hard links. TemporaryError when another writer took it over first.

        Writing over it and reading it back later was no compare-and-swap: a writer whose write came after
        another's read-back (a slow volume) read its own back too, and both went on."""
        temp, data = self._complete_temp()

        def replace() -> None:
            os.replace(temp, self.path)
            self._held = data

        try:
            return self._compare_and_swap(stale, temp, replace)
        finally:
            temp.unlink(missing_ok=True)

    def _compare_and_swap(self, expected: bytes, temp: Path, swap: Callable[[], None]) -> bool | None:
        """Run `swap` (a replace or a removal of the lease) if the lease still holds the bytes `expected`: True
        once it ran, False when the lease is gone, None where the volume has no hard links (nothing ran).
        TemporaryError when another writer holds it now, or claims these very bytes at this moment.

        The claim is made by linking `temp` (a complete record of this writer), which one writer alone makes,
        and only its maker checks the lease and swaps it; a winner's lease never holds the bytes it replaced,
        so a claim made after its end finds them gone. The check comes after the claim: before it, a taker
        could claim, replace and let go between the check and this writer's own claim."""
        claim = self._claim(hashlib.sha256(expected).hexdigest()[:16], temp, json_or_empty(expected))
        if claim is None:
            return None
        try:
            now = self._read_bytes()
            if now is None:
                return False
            if now != expected:
                raise self._holding_now(json_or_empty(now), json_or_empty(expected))
            swap()
            atomic.fsync_dir(self.path.parent)
            return True
        finally:
            claim.unlink(missing_ok=True)

    def _claim(self, stale_hash: str, temp: Path, stale: dict[str, Any]) -> Path | None:
        """Link `temp` to the first claim of the stale lease `stale_hash` that is free (one older than
        LEASE_TEMP_MAX_AGE_S is a killed taker's and skipped): the claim, or None without hard links.
        TemporaryError where another writer's claim is younger: it is taking the lease over now."""
        attempt = 0
        while True:
            claim = self.path.with_name(f"{self.path.name}.takeover-{stale_hash}-{attempt}")
            try:
                os.link(temp, claim)
                return claim
            except FileExistsError:
                if _same_file(temp, claim):  # made by this link, whose NFS reply was lost and retried
                    return claim
                age = _age_s(claim)
                if age is not None and age > LEASE_TEMP_MAX_AGE_S:
                    attempt += 1
                elif age is not None:
                    rival = json_or_empty(_read_or_empty(claim)).get("owner", {})
                    if rival.get("id") is not None and rival.get("id") == stale.get("owner", {}).get("id"):
                        raise self._alive(rival) from None  # its holder, renewing it (stalled, not gone)
                    raise self._taken_by(rival, stale=True) from None
                # else: gone meanwhile, its taker done or given up: claimed again, and checked as any
            except OSError as exc:
                if exc.errno not in _NO_HARD_LINKS:
                    raise
                return None

    def _holding_now(self, now: dict[str, Any], stale: dict[str, Any]) -> TemporaryError:
        """The refusal where the lease no longer holds the stale bytes, naming who holds it now."""
        owner = now.get("owner", {})
        if owner.get("id") is not None and owner.get("id") == stale.get("owner", {}).get("id"):
            return self._alive(owner)  # renewed by its holder, which was stalled past its expiry, not gone
        return self._taken_by(owner, stale=True)

    def _alive(self, owner: dict[str, Any]) -> TemporaryError:
        return TemporaryError(
            f"{self.what} is leased by another writer (host {owner.get('host')}, pid {owner.get('pid')}, "
            f"pod {owner.get('pod_id') or '-'}), which is alive and renews it every {self.ttl / 4:.0f} s or so; "
            f"stop that process or pod first (its lease at {self.path} is then released)"
        )

    def _taken_by(self, rival: dict[str, Any], stale: bool) -> TemporaryError:
        return TemporaryError(
            f"another writer (host {rival.get('host')}, pid {rival.get('pid')}, pod "
            f"{rival.get('pod_id') or '-'}) took this {self.what}'s {'stale ' if stale else ''}lease over at the "
            "same moment; it goes on, this start stops"
        )

    def _remove_leftovers(self) -> None:
        """Remove what lease writes killed midway left beside the lease (a spot pod's SIGKILL between a temp
        file and its rename or link): a temp file older than any write of one takes (LEASE_TEMP_MAX_AGE_S; a
        younger one may be a live writer's), and a takeover's claim of a lease that is no longer there (its
        bytes are gone for good, so the claim decides nothing). A claim of the lease there now is left: a
        later claim of it, skipping an old one, is only exclusive while the old one stays."""
        temps = list(self.path.parent.glob(f"{self.path.name}.tmp-*"))
        # Listed before the lease is read: a claim made since may be of the lease read, never of one before it.
        claims = list(self.path.parent.glob(f"{self.path.name}.takeover-*"))
        now = self._read_bytes()
        current = (
            f"{self.path.name}.takeover-{hashlib.sha256(now).hexdigest()[:16]}-" if now is not None else None
        )
        leftovers = [temp for temp in temps if (_age_s(temp) or 0.0) > LEASE_TEMP_MAX_AGE_S]
        leftovers += [claim for claim in claims if current is None or not claim.name.startswith(current)]
        for leftover in leftovers:
            leftover.unlink(missing_ok=True)
        if leftovers:
            log.info(
                "removed %d leftover file(s) of lease writes killed midway: %s",
                len(leftovers),
                ", ".join(sorted(leftover.name for leftover in leftovers)),
            )

    def acquire(self) -> None:
        """Hold the lease (TemporaryError, exit 75, where a live writer holds it), then run what call_when_taken
        left for it; a hook that raises lets the lease go again."""
        # For this attempt only: where it is refused, a later acquire in this process is no takeover of boot's.
        hooks = _when_taken.pop(self.path.absolute(), [])
        self._take()
        try:
            for hook in hooks:
                hook()
        except BaseException:
            self.release()
            raise

    def _take(self) -> None:
        self._remove_leftovers()
        for _ in range(3):  # a lease released (or made and released by another writer) in between: look again
            found = self._read_bytes()
            if found is None:
                made = self._create()
                if made:
                    self._start_heartbeat()
                    return
                if made is None:
                    return self._write_and_read_back(stale=False)
                continue  # another writer's, made since: judged as any lease found
            held = json_or_empty(found) or None
            if held is None:
                log.warning("LEASE at %s is unreadable; treating it as stale", self.path)
            elif held.get("owner", {}).get("id") != self.owner["id"] and self._holder_alive(held):
                # Named as it is now: watched for a heartbeat, it may be another pod's that took it over since.
                raise self._alive((self._read() or held).get("owner", {}))
            log.info(
                "taking over a stale lease (owner host %s pid %s)",
                (held or {}).get("owner", {}).get("host"),
                (held or {}).get("owner", {}).get("pid"),
            )
            taken = self._take_over(found)
            if taken is None:
                return self._write_and_read_back(stale=True)
            if taken:
                return self._read_back_after_settle(stale=True)
        raise TemporaryError(
            f"the {self.what}'s lease at {self.path} was made and released by other writers again and again "
            "while this one looked; this start stops"
        )

    def _write_and_read_back(self, stale: bool) -> None:
        """Where the volume has no hard links: the file holds the last write of any writers doing the same,
        read back after they all have."""
        self._write()
        self._read_back_after_settle(stale)

    def _read_back_after_settle(self, stale: bool) -> None:
        """A writer outside the compare-and-swap (one writing over the lease, as a kit without it did, or a
        holder stalled past its expiry renewing it) writes within a poll of this one: the last write holds."""
        time.sleep(self.takeover_settle_s)
        rival = (self._read() or {}).get("owner", {})
        if rival.get("id") != self.owner["id"]:
            raise self._taken_by(rival, stale)
        self._start_heartbeat()

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        """Renew this writer's lease; TemporaryError where another writer holds it now.

        A renewal that read the lease and then wrote its own could overwrite a taker's: a holder stalled
        (a volume hang, a swapping host) past its expiry between the two, while a replacement pod took the
        run over, wrote its lease back over the taker's, and both went on committing to one run until the
        taker's next heartbeat. A renewal is a takeover of this writer's own last bytes, by the same claim a
        taker of them makes: of the two, one alone replaces them, and the other finds them gone."""
        if self._held is not None:
            renewed = self._as_its_own(lambda: self._take_over(self._held))
            if renewed is False:  # removed from under a live writer (by hand): made again, as before
                renewed = self._create()
                if renewed is False:
                    raise self._taken_by((self._read() or {}).get("owner", {}), stale=False)
            if renewed is not None:
                return
        self._held = None  # no hard links here: read, then written over
        held = self._read()
        if held and held.get("owner", {}).get("id") != self.owner["id"]:
            raise self._taken_by(held.get("owner", {}), stale=False)
        self._write()

    def _as_its_own(self, swap_held: Callable[[], bool | None]) -> bool | None:
        """`swap_held`, a compare-and-swap of this writer's last bytes (one read of the lease, the one after the
        claim). Where the lease holds other bytes of this writer (a renewal that failed after it landed: an
        fsync error), those are its last, and the swap is made of them; another writer's stay its own."""
        try:
            return swap_held()
        except TemporaryError:
            now = self._read_bytes()
            if now is None or json_or_empty(now).get("owner", {}) != self.owner:
                raise
            self._held = now
            return swap_held()

    def _temp_if_writable(self) -> Path | None:
        """A complete temp file of this writer's record, to claim with; None where it cannot be written (a
        full volume, an I/O error). Then the lease is removed as before the compare-and-swap, read then
        removed: on a full volume no taker can write its own either, and a release (a run's exit 5 makes one)
        must not fail nor leave the lease to expire."""
        try:
            return self._complete_temp()[0]
        except OSError as exc:
            log.warning("releasing the lease at %s without its compare-and-swap (%s)", self.path, exc)
            return None

    def _heartbeat(self) -> None:
        expires = time.time() + self.ttl
        while not self._stop.wait(self.ttl / 4):
            try:
                renewing = time.time() + self.ttl
                self._renew()
                expires = renewing
            except TemporaryError:
                log.error("the lease at %s was taken over by another writer; stopping", self.path)
                self.lost.set()
                return
            except OSError as exc:
                # A volume error must not end the heartbeat unnoticed: the lease would expire and another
                # writer take the run over while this one goes on writing. Retried at the next beat; lost
                # once the lease expires before that beat. Not on a full volume: no other writer can write
                # its lease there either, and the run's next commit ends it with exit 5 (diskspace.py).
                if time.time() + self.ttl / 4 < expires or is_disk_full(exc):
                    log.warning("could not renew the lease at %s (%s); trying again", self.path, exc)
                    continue
                log.error("could not renew the lease at %s before it expires (%s); stopping", self.path, exc)
                self.lost.set()
                return

    @contextmanager
    def publishing(self) -> Iterator[None]:
        """Around a write that publishes this writer's work (an export's rename into place): refused once the
        lease is released (WorkAbandoned), and a release from another thread meanwhile waits for its end.

        A stop under several ranks releases the run's lease from a thread while the export runs on
        (PreemptionWatch.releasing); a new pod may take the run over at once and sweep or publish export/.
        """
        with self._publishing:
            if self.released.is_set():
                raise WorkAbandoned(
                    f"the {self.what}'s lease was released at a stop; nothing more is published"
                )
            yield

    def release(self) -> None:
        with self._publishing:  # a publish begun ends first, and none begins after
            self.released.set()
            self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._remove_if_its_own()

    def _remove_if_its_own(self) -> None:
        """Remove the lease where it still holds this writer's bytes, by the compare-and-swap a renewal makes.

        Read, then deleted, it could delete the lease of a writer that took the run over in between (this
        holder stalled past its expiry); a taker of the same bytes claims them as this removal does, so one of
        the two alone acts. Another writer's lease, or one claimed by a taker now, is left to it."""
        if self._held is not None and (temp := self._temp_if_writable()) is not None:
            try:
                removed = self._as_its_own(
                    lambda: self._compare_and_swap(self._held, temp, lambda: self.path.unlink())
                )
            except TemporaryError:
                return  # another writer's now, or being taken over by one
            finally:
                temp.unlink(missing_ok=True)
            if removed is not None:
                return
        held = self._read()  # no hard links here (or no room for a claim): read, then removed
        if held and held.get("owner", {}).get("id") == self.owner["id"]:
            self.path.unlink(missing_ok=True)
            atomic.fsync_dir(self.path.parent)


def foreign_writer(path: Path) -> dict[str, Any] | None:
    """The owner of a live lease at `path` that is neither this process nor one of its ancestors (a program
    holding the lease through the Python Checkpointer may run `trainpod checkpoint commit` itself), else None."""
    owner = live_holder(path)
    if owner is None:
        return None
    here = owner.get("host") == socket.gethostname()
    return None if here and int(owner.get("pid", -1)) in _this_process_and_ancestors() else owner


def _this_process_and_ancestors() -> set[int]:
    """This process's pid and its ancestors', read from /proc (this one's alone where there is none: macOS)."""
    pid = os.getpid()
    ancestors = {pid}
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, ppid
        ancestors.add(pid)
    return ancestors


def held_by_another(path: Path) -> bool:
    """Whether a live writer holds the lease at `path` (a process other than one holding it through `Lease`
    here: this asks from outside, e.g. a command run beside a training run)."""
    return live_holder(path) is not None


def live_holder(path: Path) -> dict[str, Any] | None:
    """The owner record of the live writer holding the lease at `path` (held_by_another's), from one read of
    it; None where nobody does."""
    return live_owner(read_lease(path))


def live_owner(held: dict[str, Any] | None) -> dict[str, Any] | None:
    """The owner of a lease record `held` (as read from its file, here or through S3) while it is live: not
    expired and, where it was taken on this host, its process still running; None otherwise."""
    if not held or held.get("expires_unix", 0) < time.time():
        return None
    owner = held.get("owner", {})
    if owner.get("host") != socket.gethostname():
        return owner  # another machine's unexpired lease: a reader does not wait to see it renewed
    return owner if _process_alive_here(owner) else None
