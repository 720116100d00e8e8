"""Sync TRAINPOD_GIT_REPO at TRAINPOD_GIT_REF into repos/<name>@<ref>/ on the volume before a workload starts
(repos/<name>/ without a ref: the remote's HEAD).

A checkout per ref: the volume is shared by every pod on it, and two pods on different refs of one repo
synced into one checkout, each `git checkout --force` changing the files the other was running (or, syncing
at the same moment, checking out the other's FETCH_HEAD). Pods on the same ref share one, at its newest
commit: pin TRAINPOD_GIT_REF to a commit or tag to keep a run's code from moving under a push.

The token (TRAINPOD_GIT_TOKEN, GIT_TOKEN or GITHUB_TOKEN) reaches git only through GIT_ASKPASS, a
script that reads it from the environment: it is never part of a URL, an argument, .git/config on
the volume, or a log line. Credentials written into the URL itself (https://user:token@host/...) are
taken out of it and handed to git the same way: git's argv is readable by every process (`ps`). The
repo's submodules are checked out with it, and its Git LFS files fetched (without git-lfs: exit 2; within
TRAINPOD_GIT_LFS_TIMEOUT_S, not the 600 s of every other git command), the askpass answering
TRAINPOD_GIT_REPO's server alone. A first clone goes to a temp folder renamed into
place, so a kill mid-clone leaves no half checkout under the name (a later sync removes the temp folder
once it is older than any clone runs); of two pods cloning one ref at once, the one whose rename comes
second takes the first's checkout, and a sync of a checkout another pod is syncing waits for it (its
git's locks). Failures are retried, then exit 75; a ref the remote does not have, a token the server
refuses, a repo it says is not there and an SSH URL ssh refuses (a pod has no SSH key) are exit 2 at
once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from trainpod import atomic
from trainpod.errors import ConfigError, InputError, TemporaryError
from trainpod.log import redact

log = logging.getLogger(__name__)

TOKEN_VARS = ("TRAINPOD_GIT_TOKEN", "GIT_TOKEN", "GITHUB_TOKEN")
ATTEMPTS = 3
GIT_TIMEOUT_S = 600.0  # one git command; a fetch from a host that never answers is a failed attempt
# The LFS pull's own bound: it downloads the LFS files whole (weights, data: gigabytes), which a slow link takes
# far longer than the shallow fetch of the repo's text, so under GIT_TIMEOUT_S such a repo timed out at every
# attempt and every start (exit 75). TRAINPOD_GIT_LFS_TIMEOUT_S raises it.
LFS_TIMEOUT_VAR = "TRAINPOD_GIT_LFS_TIMEOUT_S"
LFS_TIMEOUT_S = 3600.0
_LOCK_POLL_S = 1.0  # how often a sync waiting for another pod's on the same checkout looks at its locks
# git's words when another git holds a lock of the checkout: "Unable to create '<path>.lock': File exists".
_GIT_LOCKED = ".lock': File exists"
# Tries that found the lock taken first: each lets one pod's sync through (a cluster's nodes).
_LOCKED_TRIES = 64
# git's words for a ref the remote does not have (a branch never pushed, a typo, an unknown commit): a
# retry cannot help, and neither can a restart of the pod.
_NO_SUCH_REF = ("couldn't find remote ref", "not our ref")
_ABBREVIATED_COMMIT = re.compile(r"[0-9a-fA-F]{4,39}")  # as `git log --oneline` and GitHub show a commit
# git's words when a submodule's shallow fetch lacks the pinned commit and its server refuses it by its id
# ("Fetched in submodule path 'lib', but it did not contain <id>. Direct fetching of that commit failed.").
_NOT_FETCHABLE_BY_ID = "Direct fetching of that commit failed"
# Run in each submodule (git submodule foreach) before the update is tried again without --depth.
_UNSHALLOW = (
    'if [ "$(git rev-parse --is-shallow-repository)" = true ]; then git fetch --quiet --unshallow; fi'
)
# A first clone's temp folder (_sync_once): repos/<checkout>.tmp-<8 hex digits>.
_TEMP_CLONE = re.compile(r".+\.tmp-[0-9a-f]{8}")


def _temp_clone_max_age_s() -> float:
    """The longest a first clone's temp folder lives: its git commands (init, fetch, checkout, the submodules'
    update; a few commands of no time) each end within GIT_TIMEOUT_S, its LFS pulls within the LFS bound, and
    the folder is renamed or removed after them. One older than this was left by a pod killed mid-clone; twice
    the sum leaves room for clocks of pods on other hosts that differ."""
    return 2 * (5 * GIT_TIMEOUT_S + _lfs_timeout_s())


def _lfs_timeout_s() -> float:
    """The LFS pull's bound: TRAINPOD_GIT_LFS_TIMEOUT_S, else LFS_TIMEOUT_S."""
    raw = os.environ.get(LFS_TIMEOUT_VAR, "")
    try:
        seconds = float(raw) if raw else LFS_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(
            [f"{LFS_TIMEOUT_VAR}={raw!r} is not a number of seconds; set it like {LFS_TIMEOUT_VAR}=7200"]
        )
    return seconds


# A server refusing the credentials, or answering that no such repository is there (GitHub says so for
# a private one the token cannot read): a wrong token or URL, which no retry or pod restart fixes.
_REFUSED = re.compile(
    r"Authentication failed|could not read (Username|Password)|repository '[^']*' not found|"
    r"The requested URL returned error: 40[134]\b"
)
# ssh refusing an SSH URL (git@github.com:org/repo.git, ssh://...): a pod comes with no SSH key and no known
# host, so no retry or restart fixes it; the https URL with a token does. git's own fatal line says only
# "Could not read from remote repository", so these are looked for in all it wrote.
_SSH_REFUSED = re.compile(r"Host key verification failed|Permission denied \(publickey")
# git's words for a submodule it could not clone: "fatal: clone of '<url>' into submodule path '<path>' failed".
_SUBMODULE_CLONE_FAILED = re.compile(r"clone of '([^']*)' into submodule path '([^']*)' failed")
# The URL's own user and password, for the askpass script (set only in git's environment).
_URL_USER, _URL_PASSWORD = "TRAINPOD_GIT_URL_USER", "TRAINPOD_GIT_URL_PASSWORD"
# TRAINPOD_GIT_REPO's host (and port): the one server the askpass answers. git asks it for every server that
# wants credentials, and a submodule may live elsewhere (another forge, a mirror), which must never get the token.
_URL_HOST = "TRAINPOD_GIT_URL_HOST"
_ASKPASS = f"""#!/bin/sh
# git's prompt names the server: "Username for 'https://host': ", "Password for 'https://user@host': ".
case "$1" in
  *"://${{{_URL_HOST}}}'"*|*"@${{{_URL_HOST}}}'"*) ;;
  *) [ -z "${{{_URL_HOST}}}" ] || exit 1 ;;
esac
case "$1" in
  Username*) echo "${{{_URL_USER}:-${{TRAINPOD_GIT_USER:-x-access-token}}}}" ;;
  *) echo "${{{_URL_PASSWORD}:-${{TRAINPOD_GIT_TOKEN:-${{GIT_TOKEN:-$GITHUB_TOKEN}}}}}}" ;;
esac
"""


def repo_name(url: str) -> str:
    name = url.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1]
    return name.removesuffix(".git") or "repo"


def checkout_name(url: str, ref: str | None) -> str:
    """The checkout's folder under repos/: <name> for the remote's HEAD, <name>@<ref> for a ref (quoted: a
    branch may hold '/')."""
    name = repo_name(without_credentials(url)[0])  # never a password, even from a URL with no path
    return f"{name}@{quote(ref, safe='')}" if ref else name


def own_checkout(repos_root: Path, environ: Mapping[str, str]) -> Path | None:
    """TRAINPOD_GIT_REPO's checkout at TRAINPOD_GIT_REF under `repos_root`; None without a repo."""
    repo = environ.get("TRAINPOD_GIT_REPO")
    return repos_root / checkout_name(repo, environ.get("TRAINPOD_GIT_REF")) if repo else None


def other_checkouts(repos_root: Path, own: Path | None) -> list[Path]:
    """The checkouts under `repos_root` besides `own`, in name order, without `own`'s repo at other refs: those
    hold the same paths and modules at other commits, which must never stand in for this ref's. A first clone's
    temp folder is no checkout (another pod's, half made, or one a killed pod left)."""

    def repo_of(folder: Path) -> str:
        return folder.name.split("@", 1)[0]

    if not repos_root.is_dir():
        return []
    return [
        folder
        for folder in sorted(repos_root.iterdir())
        if folder.is_dir()
        and not _TEMP_CLONE.fullmatch(folder.name)
        and (own is None or repo_of(folder) != repo_of(own))
    ]


def without_credentials(url: str) -> tuple[str, dict[str, str]]:
    """`url` without the user and password an http(s) URL may carry, and those as askpass variables."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return url, {}
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    credentials = {_URL_USER: unquote(user)} if user else {}
    if password:
        credentials[_URL_PASSWORD] = unquote(password)
    return urlunsplit(parts._replace(netloc=host)), credentials


def _askpass_host(url: str) -> str:
    """The server of an http(s) URL as git's prompts name it (host, and port where given); "" for another scheme,
    whose servers git never asks through the askpass."""
    parts = urlsplit(url)
    return parts.netloc.rsplit("@", 1)[-1] if parts.scheme in ("http", "https") else ""


@dataclass(frozen=True)
class Synced:
    """A checkout `sync` made: where it is, and the commit it checked out there."""

    path: Path
    commit: str


def sync(url: str, ref: str | None, repos_root: Path, sleep=time.sleep) -> Synced:
    """Make repos/<name> hold `ref` (a branch, tag or commit; default: the remote's HEAD)."""
    target = repos_root / checkout_name(url, ref)
    plain_url, credentials = without_credentials(url)
    credentials[_URL_HOST] = _askpass_host(plain_url)
    if ref and ref.startswith("-"):  # git would read it as an option
        raise ConfigError(
            [f"TRAINPOD_GIT_REF={ref!r} is not a branch, tag or commit; set it like TRAINPOD_GIT_REF=main"]
        )
    _lfs_timeout_s()  # a malformed bound is exit 2 now, not after the fetch
    repos_root.mkdir(parents=True, exist_ok=True)
    _remove_killed_clones(repos_root)
    last_error = ""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            _sync_beside_other_pods(plain_url, ref or "HEAD", target, credentials)
            head = _git(["rev-parse", "HEAD"], target).strip()
            log.info("synced %s at %s (%s) into %s", redact(url), ref or "HEAD", head[:12], target)
            return Synced(target, head)
        except subprocess.CalledProcessError as exc:
            last_error = redact(_git_reason(exc))
            if any(words in last_error for words in _NO_SUCH_REF):
                raise ConfigError([_missing_ref(url, ref, last_error)]) from None
            ssh_refusal = _ssh_refusal(exc.stderr or "")
            if ssh_refusal:
                raise ConfigError(
                    [_refused_over_ssh(url, redact(ssh_refusal), exc.stderr, repos_root)]
                ) from None
            if _REFUSED.search(last_error):
                raise ConfigError([_refused(url, last_error, exc.stderr, repos_root)]) from None
        except subprocess.TimeoutExpired as exc:
            last_error = _timed_out(exc)
        log.warning("git sync attempt %d/%d failed: %s", attempt, ATTEMPTS, last_error)
        if attempt < ATTEMPTS:
            sleep(2**attempt)
    raise TemporaryError(
        f"could not sync TRAINPOD_GIT_REPO={redact(url)} at TRAINPOD_GIT_REF={ref or 'HEAD'} after "
        f"{ATTEMPTS} attempts ({last_error}); check the URL, the ref and the token"
    )


def _timed_out(exc: subprocess.TimeoutExpired) -> str:
    """Which git step ran past its bound, the bound, and for the LFS pull how to raise it."""
    args = exc.cmd[3:]  # after `git -c advice.detachedHead=false`
    if args[:2] == ["lfs", "pull"] or args[-1].endswith("git lfs pull"):  # the repo's, or its submodules'
        return (
            f"git lfs pull did not finish in {exc.timeout:g} s: the repo's LFS files take longer to download; "
            f"raise {LFS_TIMEOUT_VAR}"
        )
    step = " ".join(args[:2] if args[0] == "submodule" else args[:1])
    return f"git {step} did not finish in {exc.timeout:g} s"


def _refused_over_ssh(url: str, refusal: str, stderr: str, repos_root: Path) -> str:
    """What to do about an SSH URL ssh refused: TRAINPOD_GIT_REPO's, or a submodule's in .gitmodules (an https repo
    whose submodule was added by its SSH URL, as GitHub's clone button gives it), which no TRAINPOD_GIT_REPO fixes."""
    submodule = _failed_submodule(stderr, repos_root)
    if submodule is None:
        return (
            f"git could not fetch TRAINPOD_GIT_REPO={redact(url)} over SSH ({refusal}): a pod has no SSH key nor "
            "known host for it; set TRAINPOD_GIT_REPO to the repo's https:// URL (with TRAINPOD_GIT_TOKEN for a "
            "private repo)"
        )
    path, submodule_url = submodule
    return (
        f"git could not fetch the submodule '{path}' of TRAINPOD_GIT_REPO={redact(url)} over SSH ({refusal}): the "
        f".gitmodules listing it gives its URL as {redact(submodule_url)}, and a pod has no SSH key nor known host "
        "for it; set its url in that .gitmodules to the https:// one (a relative one such as ../lib.git for a repo "
        "on TRAINPOD_GIT_REPO's server, which then gets TRAINPOD_GIT_TOKEN), commit and push"
    )


def _refused(url: str, reason: str, stderr: str, repos_root: Path) -> str:
    """What to do about credentials a server refused: TRAINPOD_GIT_REPO's token, or, for a submodule on another
    server, which never gets that token (_URL_HOST), where that submodule's repo lives."""
    submodule = _failed_submodule(stderr, repos_root)
    if submodule is not None and _askpass_host(submodule[1]) not in ("", _askpass_host(url)):
        path, submodule_url = submodule
        return (
            f"git could not fetch the submodule '{path}' of TRAINPOD_GIT_REPO={redact(url)} ({reason}): its URL, "
            f"{redact(submodule_url)}, is on another server than TRAINPOD_GIT_REPO's, which asks for credentials, "
            "and TRAINPOD_GIT_TOKEN goes to TRAINPOD_GIT_REPO's server alone; make that repo readable without them, "
            "or move it beside TRAINPOD_GIT_REPO (a relative url such as ../lib.git in .gitmodules), commit and push"
        )
    return (
        f"git could not fetch TRAINPOD_GIT_REPO={redact(url)} ({reason}); check the URL and that TRAINPOD_GIT_TOKEN "
        "(and TRAINPOD_GIT_USER) holds a token that can read it"
    )


def _failed_submodule(stderr: str, repos_root: Path) -> tuple[str, str] | None:
    """The path (in the checkout) and URL of a submodule git could not clone, from what it wrote; None if none."""
    failed = _SUBMODULE_CLONE_FAILED.search(stderr)
    if failed is None:
        return None
    submodule_url, path = failed.groups()
    # The checkout's folder under repos/ (or its temp one) is no part of the path in the checkout.
    with contextlib.suppress(ValueError):
        path = Path(path).relative_to(repos_root).as_posix().split("/", 1)[-1]
    return path, submodule_url


def _ssh_refusal(stderr: str) -> str | None:
    """ssh's line refusing the connection (_SSH_REFUSED) among what git wrote, if any."""
    return next((line.strip() for line in stderr.splitlines() if _SSH_REFUSED.search(line)), None)


def _missing_ref(url: str, ref: str | None, reason: str) -> str:
    """What to do about a ref the remote does not have. A commit given by its abbreviated id (as GitHub and
    `git log --oneline` show it) is in the repo all the same: a server hands a commit out by its full id
    alone, so saying it was never pushed sent the user looking for a push that had happened."""
    if ref and _ABBREVIATED_COMMIT.fullmatch(ref):
        return (
            f"TRAINPOD_GIT_REF={ref} could not be fetched from TRAINPOD_GIT_REPO={redact(url)} ({reason}): git "
            f"fetches a commit by its full 40-character id only; set TRAINPOD_GIT_REF to it (`git rev-parse {ref}` "
            "in a clone prints it)"
        )
    return (
        f"TRAINPOD_GIT_REF={ref or 'HEAD'} is not in TRAINPOD_GIT_REPO={redact(url)} ({reason}); set "
        "TRAINPOD_GIT_REF to a branch, tag or commit that repo has (pushed)"
    )


CODE_FILE = "code.json"  # runs/<run>/code.json: the commit of TRAINPOD_GIT_REPO the newest start ran


def note_commit(synced: Synced, ref: str | None, run_root: Path) -> None:
    """Record the commit this start runs (the one `sync` checked out) in the run's folder, and say so when
    a resume runs another one: every start syncs the branch's newest commit, so a push between two spot
    starts changes the code that continues the checkpoints (pin TRAINPOD_GIT_REF to a commit or tag to
    keep it)."""
    if not run_root.is_dir():  # a first start outside a pod: the workload makes the folder, or refuses
        return
    head = synced.commit
    path = run_root / CODE_FILE
    try:
        before = atomic.read_json(path).get("commit")
    except (FileNotFoundError, ValueError, AttributeError):
        before = None
    if before and before != head:
        log.warning(
            "the code changed since the run's previous start: TRAINPOD_GIT_REF=%s is now at %s, was at %s; "
            "the run continues its checkpoints with the new code",
            ref or "HEAD",
            head[:12],
            before[:12],
        )
    if before != head:
        atomic.write_json(path, {"ref": ref or "HEAD", "commit": head, "unix": time.time()})


def _sync_beside_other_pods(url: str, ref: str, target: Path, credentials: dict[str, str]) -> None:
    """_sync_once, again where another pod's git took the checkout's lock first (pods starting together, each
    seeing no lock, then git's "Unable to create '....lock': File exists" for all but one): such a try lets that
    pod's sync through, so it is no failed attempt. The next goes after a random wait, so the pods waiting
    for one lock do not all start again in the same instant."""
    for _ in range(_LOCKED_TRIES):
        try:
            return _sync_once(url, ref, target, credentials)
        except subprocess.CalledProcessError as exc:
            if _GIT_LOCKED not in (exc.stderr or ""):
                raise
            log.info("another pod's sync of %s went first; going after it", target)
            time.sleep(random.uniform(0.1, 2 * _LOCK_POLL_S))
    _sync_once(url, ref, target, credentials)


def _sync_once(url: str, ref: str, target: Path, credentials: dict[str, str]) -> None:
    if (target / ".git").is_dir():
        _wait_for_other_syncs(target / ".git")
        _remove_stale_locks(target / ".git")
        _fetch_checkout(url, ref, target, credentials)
        return
    # Something else under the name is never replaced, nor merged into.
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InputError(
            f"{target} is on the volume but is not a git checkout (no .git in it), so TRAINPOD_GIT_REPO cannot "
            "be synced there; move it away (or delete it) and start again"
        )
    tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir(parents=True)
        _git(["init", "--quiet"], tmp)
        _fetch_checkout(url, ref, tmp, credentials)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / ".git").is_dir():
                raise
            _take_the_first_clone(url, ref, target, tmp, credentials)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _take_the_first_clone(url: str, ref: str, target: Path, ours: Path, credentials: dict[str, str]) -> None:
    """Another pod's first clone of this ref was renamed into place while ours ran (pods started together):
    that checkout is the one every pod on the ref shares, and ours goes. Where it is at another commit than
    ours (a push between the two fetches), it is brought to the ref's newest, as the next pod's sync would."""
    commit = _git(["rev-parse", "HEAD"], ours).strip()
    if _git(["rev-parse", "HEAD"], target).strip() != commit:
        _fetch_checkout(url, ref, target, credentials)
    log.info("another pod's clone of %s reached %s first; using it", ref, target)


def _remove_killed_clones(repos_root: Path) -> None:
    """A pod killed during a first clone (a spot interruption, the OOM killer) never reached its `finally`, and
    its temp folder, a whole clone's size, stayed on the volume. A temp folder is another pod's clone, perhaps
    running now, until it is older than any clone runs (_temp_clone_max_age_s): its mtime is at least the time
    it was made, so an older one is nobody's."""
    for folder in repos_root.iterdir():
        if not _TEMP_CLONE.fullmatch(folder.name) or not folder.is_dir():
            continue
        if (_age_s(folder) or 0.0) > _temp_clone_max_age_s():
            log.warning("removing %s: the temp folder of a first clone whose pod was killed", folder)
            shutil.rmtree(folder, ignore_errors=True)


def _wait_for_other_syncs(git_dir: Path) -> None:
    """Another pod's sync of this checkout running now (an Instant Cluster's nodes all sync at each start) holds
    shallow.lock or index.lock while its git runs, and a fetch beside it fails on them, at every retry where
    that fetch outlasts the retries' waits (a large repo). Wait until its locks go, at most until they are
    older than any git of a sync runs: then they are a killed git's, which _remove_stale_locks removes."""
    said = False
    while young := [lock for lock in git_dir.glob("*.lock") if _held(lock)]:
        if not said:
            log.info(
                "waiting for another pod's sync of %s (%s)", git_dir.parent, ", ".join(p.name for p in young)
            )
            said = True
        time.sleep(_LOCK_POLL_S)


def _held(lock: Path) -> bool:
    """Whether `lock` may be a running git's: there, and younger than any git of a sync runs."""
    age = _age_s(lock)
    return age is not None and age <= GIT_TIMEOUT_S


def _age_s(path: Path) -> float | None:
    """Seconds since `path` was last modified; None once it is gone (removed by its owner meanwhile)."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None


def _remove_stale_locks(git_dir: Path) -> None:
    """A git killed mid-sync (SIGKILL, the OOM killer, our own timeout's kill) leaves shallow.lock or
    index.lock, and every later fetch there fails on it. No git of a sync runs longer than GIT_TIMEOUT_S,
    so an older lock is nobody's (a younger one is another pod's sync: _wait_for_other_syncs waits for it)."""
    for lock in git_dir.glob("*.lock"):
        if (_age_s(lock) or 0.0) > GIT_TIMEOUT_S:
            log.warning("removing %s: older than any sync, left by a git that was killed", lock)
            lock.unlink(missing_ok=True)


def _fetch_checkout(url: str, ref: str, checkout: Path, credentials: dict[str, str]) -> None:
    # The URL is passed on each fetch, never stored with its credentials: .git/config stays credential-free.
    _git(["fetch", "--quiet", "--depth", "1", url, ref], checkout, credentials)
    # LFS files are checked out as their pointers here (git-lfs may be set up to fetch them in the checkout, from
    # a remote the first clone has none of): _pull_lfs_files fetches them.
    _git(["checkout", "--quiet", "--force", "FETCH_HEAD"], checkout, {"GIT_LFS_SKIP_SMUDGE": "1"})
    if (checkout / ".gitmodules").is_file():
        _update_submodules(url, checkout, credentials)
    if _tracks_lfs_files(checkout):
        _pull_lfs_files(url, checkout, credentials)


def _update_submodules(url: str, checkout: Path, credentials: dict[str, str]) -> None:
    """Check out the repo's submodules at the commits it records, nested ones too: without them the program's imports
    from a submodule fail, or find an empty folder. Shallow, as the repo's own fetch: a vendored library or model
    repo's whole history is gigabytes of old blobs no program reads. A pinned commit that is no branch's tip is
    fetched by its id, which a server may refuse (protocol 0 without uploadpack.allowReachableSHA1InWant): then the
    submodules' whole history is fetched instead. A relative submodule URL (../lib.git, GitHub's way for a sibling
    repo) resolves against remote.origin.url, so the URL (never its credentials) is stored as that; `sync` takes a
    URL changed in .gitmodules since the last start. Credentials reach git as for the fetch, and only
    TRAINPOD_GIT_REPO's server gets them (_URL_HOST)."""
    _git(["config", "remote.origin.url", url], checkout)
    _git(["submodule", "sync", "--quiet", "--recursive"], checkout)
    update = ["submodule", "update", "--quiet", "--init", "--recursive", "--force"]
    environment = {**credentials, "GIT_LFS_SKIP_SMUDGE": "1"}  # LFS files: _pull_lfs_files
    try:
        _git([*update, "--depth", "1"], checkout, environment)
    except subprocess.CalledProcessError as exc:
        if _NOT_FETCHABLE_BY_ID not in (exc.stderr or ""):
            raise
        log.info("a submodule's server hands out no commit by its id; fetching its whole history")
        _git(["submodule", "foreach", "--quiet", "--recursive", _UNSHALLOW], checkout, credentials)
        _git(update, checkout, environment)


def _tracks_lfs_files(checkout: Path) -> bool:
    """Whether a .gitattributes of the checkout or of a submodule in it has files stored by Git LFS (filter=lfs)."""
    listed = _git(
        ["ls-files", "--recurse-submodules", "-z", "--", ".gitattributes", "*/.gitattributes"], checkout
    )
    for name in filter(None, listed.split("\0")):
        with contextlib.suppress(OSError):
            lines = (checkout / name).read_text(errors="replace").splitlines()
            if any("filter=lfs" in line for line in lines if not line.lstrip().startswith("#")):
                return True
    return False


def _pull_lfs_files(url: str, checkout: Path, credentials: dict[str, str]) -> None:
    """Replace the LFS pointers the checkout and its submodules hold with their files (weights, data, tokenizers).
    Without git-lfs the program would read each pointer, 130 bytes of text, as the file: exit 2 naming the fix
    instead. LFS finds its server from remote.origin.url (the URL without its credentials, which the askpass
    gives; a submodule's own URL in it, whose server gets no token unless it is TRAINPOD_GIT_REPO's); its smudge
    stays off (--skip-smudge), so every checkout leaves pointers and this pull alone fetches."""
    try:
        _git(["lfs", "version"], checkout)
    except subprocess.CalledProcessError:
        raise ConfigError(
            [
                f"TRAINPOD_GIT_REPO={redact(url)} stores files with Git LFS (filter=lfs in its .gitattributes), "
                "and this image has no git-lfs: the program would read the LFS pointers (a few lines of text) as "
                "those files; use an image built with git-lfs (docker/system_packages.sh installs it), or keep "
                "the files out of LFS (on the volume, say)"
            ]
        ) from None
    _git(["config", "remote.origin.url", url], checkout)
    _git(["lfs", "install", "--local", "--skip-smudge"], checkout)
    _git(["lfs", "pull"], checkout, credentials, timeout_s=_lfs_timeout_s())
    if (checkout / ".gitmodules").is_file():
        each = "git lfs install --local --skip-smudge >/dev/null && git lfs pull"
        _git(
            ["submodule", "foreach", "--quiet", "--recursive", each], checkout, credentials, _lfs_timeout_s()
        )


def _git(
    args: list[str], cwd: Path, credentials: dict[str, str] | None = None, timeout_s: float | None = None
) -> str:
    with tempfile.TemporaryDirectory(prefix="trainpod-askpass-") as folder:
        askpass = Path(folder) / "askpass.sh"
        askpass.write_text(_ASKPASS)
        askpass.chmod(stat.S_IRWXU)
        env = dict(os.environ, **(credentials or {}), GIT_ASKPASS=str(askpass), GIT_TERMINAL_PROMPT="0")
        command = ["git", "-c", "advice.detachedHead=false", *args]
        timeout = timeout_s or GIT_TIMEOUT_S
        # Its own process group, ended whole at the bound: git runs git-lfs, git-remote-https, a submodule's git
        # as children, which killing git alone left downloading beside the next attempt. Ended as well when this
        # process is interrupted (Ctrl-C reaches our group alone, no longer git's).
        with subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        ) as process:  # fmt: skip
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except BaseException as stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
                if isinstance(stopped, subprocess.TimeoutExpired):
                    raise subprocess.TimeoutExpired(command, timeout) from None
                raise
        if process.returncode:
            raise subprocess.CalledProcessError(process.returncode, command, stdout, stderr)
        return stdout


def _git_reason(exc: subprocess.CalledProcessError) -> str:
    """git's own one-line reason ("fatal: ..."), not the advice lines around it."""
    lines = [line.strip() for line in (exc.stderr or "").splitlines() if line.strip()]
    return next((line for line in lines if line.startswith("fatal:")), lines[-1] if lines else str(exc))
