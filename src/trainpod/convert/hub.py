"""The convert workload's `hub` task: an export folder pushed to a Hugging Face Hub model repo from the pod.

    TRAINPOD_CONFIG=configs/convert/tiny.yaml TRAINPOD_VOLUME=/tmp/vol HF_TOKEN=hf_... trainpod run convert

    task:
      - kind: merge
      - kind: hub
        source: merged
        repo_id: someone/tiny-ft

The folder is checked against its manifest.json first (every file's size and sha256, no file more or
less), so that a folder torn by a kill, or changed after the kit wrote it, never reaches the Hub. Its
files go up in one Hub commit (huggingface_hub's create_commit: the Hub shows the old model or the
whole new one, never half), on the branch `revision`, in a repo created private when missing.

After the commit, runs/<name>/hub/<owner>--<repo>@<revision>.json records what was pushed: the repo,
branch, commit and the sha256 of the source's manifest.json (docs/design.md, "The volume"). A start
that finds the record for the same manifest pushes nothing; a source made again pushes again. A kill
mid-upload leaves no record, so the next start pushes again, and the Hub keeps what it has (an LFS
object already uploaded is not sent twice).

Errors: HF_TOKEN missing, or huggingface_hub in offline mode (HF_HUB_OFFLINE), is exit 2 before anything runs; the Hub refusing the token (401/403) exit 2
naming HF_TOKEN; a network failure, a timeout or a Hub answering 429 or 5xx exit 75, tried again at
the next start (docs/design.md, "Exit codes").
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import trainpod
from trainpod import atomic
from trainpod.config.convert import HubTask
from trainpod.convert.output import FORMAT_FAMILY, MANIFEST
from trainpod.errors import InputError, TemporaryError, TrainpodError
from trainpod.preemption import PreemptionWatch
from trainpod.train.export import EXPORT_FORMAT_FAMILY

log = logging.getLogger(__name__)

TOKEN_VARIABLE = "HF_TOKEN"  # the kit's name for the Hub token (docs/design.md, "The pod's environment")
RECORD_FORMAT = "trainpod-hub-push/1"
# The manifests of folders the kit writes: a conversion's (convert/output.py) and a training run's
# export/hf and export/adapter (train/export.py). Both list every file's bytes and whole-file sha256.
MANIFEST_FORMATS = (FORMAT_FAMILY, EXPORT_FORMAT_FAMILY)
# The task that makes each export folder, named in the error for a folder that is missing or torn.
_MADE_BY = {
    "merged": "a convert `kind: merge` task",
    "mlx": "a convert `kind: mlx` task",
    "adapter": "the finetune",
    "hf": "the pretrain or finetune export",
}
UPLOAD_THREADS = 5  # huggingface_hub's default for LFS uploads


@dataclass
class HubPush:
    """One hub task, planned: the folder it pushes, where, and its record (`target`)."""

    task: HubTask
    number: int  # the task's place in the config, from 1, as errors name it
    source: Path
    target: Path  # the record, runs/<name>/hub/<owner>--<repo>@<revision>.json
    run_name: str
    token: str = field(repr=False)  # never in a repr, a log line or a traceback's message

    def finished(self) -> bool:
        """Pushed already: the record names this repo and branch and the source's present manifest."""
        record = _read_record(self.target)
        return record is not None and record == {**record, **self._identity(_manifest_digest(self.source))}

    def check(self) -> None:
        """Nothing before the other tasks: the source may be one of theirs, verified when it is pushed."""

    def push(self, watch: PreemptionWatch) -> Path:
        """Push the source unless the record says it is there; the record's path either way."""
        if self.finished():
            log.info(
                "%s is on the Hub already at %s@%s (same manifest, %s); skipping",
                self.source,
                self.task.repo_id,
                self.task.revision,
                self.target,
            )
            return self.target
        digest = _manifest_digest(self.source)
        with watch.abandoning():  # a stop ends the upload: no record, so the next start pushes again
            files = verify_source(self.source, self.number)
            commit = self._commit(files)
        record = {"format": RECORD_FORMAT, **self._identity(digest), **commit, "pushed_unix": time.time()}
        self.target.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(self.target, record)
        return self.target

    def _identity(self, digest: str | None) -> dict[str, Any]:
        return {
            "repo_id": self.task.repo_id,
            "revision": self.task.revision,
            "source": self.task.source,
            "source_manifest_sha256": digest,
        }

    def _commit(self, files: dict[str, dict[str, Any]]) -> dict[str, str]:
        """Every file of `files` (verified: {name: {bytes, sha256}}) in one commit on the task's branch."""
        from huggingface_hub import CommitOperationAdd, HfApi
        from huggingface_hub.utils import disable_progress_bars

        if not sys.stderr.isatty():  # a bar per file, redrawn, is hundreds of lines in a run's log
            disable_progress_bars()
        task = self.task
        total = sum(entry["bytes"] for entry in files.values())
        log.info(
            "pushing %s (%d files, %.1f MB) to the Hugging Face Hub: %s, branch %s%s",
            self.source,
            len(files),
            total / 1e6,
            task.repo_id,
            task.revision,
            ", a private repo when it is created" if task.private else "",
        )
        started = time.monotonic()
        api = HfApi(token=self.token, library_name="trainpod", library_version=trainpod.__version__)
        try:
            api.create_repo(task.repo_id, repo_type="model", private=task.private, exist_ok=True)
            if task.revision != "main":
                api.create_branch(task.repo_id, branch=task.revision, repo_type="model", exist_ok=True)
            operations = []
            for name, entry in files.items():
                operation = CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(self.source / name))
                # Hashed by verify_source already: huggingface_hub would read the whole file again for it.
                operation.upload_info.sha256 = bytes.fromhex(entry["sha256"])
                operations.append(operation)
            commit = api.create_commit(
                task.repo_id,
                operations,
                commit_message=f"{self.source.name} of run {self.run_name}, pushed by trainpod",
                repo_type="model",
                revision=task.revision,
                num_threads=UPLOAD_THREADS,
            )
        except Exception as exc:
            error = hub_error(exc, task, self.number, api.endpoint)
            if error is None:
                raise  # not the Hub's answer nor the network: a crash, its traceback in the log
            raise error from None
        seconds = time.monotonic() - started
        log.info(
            "pushed %s to %s in %.1f s (%.1f MB/s, files the Hub had already not sent): commit %s (%s)",
            self.source.name,
            task.repo_id,
            seconds,
            total / 1e6 / max(seconds, 1e-3),
            commit.oid,
            commit.commit_url,
        )
        return {
            "commit": commit.oid,
            "commit_url": commit.commit_url,
            "url": f"{api.endpoint}/{task.repo_id}",
        }


def plan_push(
    task: HubTask, number: int, export_root: Path, record_root: Path, run_name: str, made_by: str | None
) -> HubPush:
    """The push of `task` (number `number` in the config), checked as far as it can be before any task runs:
    HF_TOKEN set, and the source there with a manifest of the kit's unless `made_by` (an earlier task of the
    config) makes it. InputError (exit 2) otherwise."""
    token = check_push_environment(task, number, os.environ)
    source = export_root / task.source
    if made_by is None and _source_manifest(source) is None:
        raise InputError(
            f"task {number} (hub): {source} is no export folder the kit finished (no {MANIFEST} of a conversion "
            f"or an export in it); make it with {_maker(task.source)} first, or put that task before this one"
        )
    owner, name = task.repo_id.split("/")
    record = record_root / f"{owner}--{name}@{quote(task.revision, safe='')}.json"
    return HubPush(task, number, source, record, run_name, token)


def check_push_environment(task: HubTask, number: int, environ: Mapping[str, str]) -> str:
    """The token the push of `task` sends, from `environ`; InputError (exit 2) without one, or in huggingface_hub's
    offline mode. Nothing of the run is needed: boot checks it for a deploy's `then` before the training starts."""
    from huggingface_hub.constants import is_offline_mode

    if is_offline_mode():  # every request of huggingface_hub's raises then: exit 75 at every start, to FAILED
        raise InputError(
            f"task {number} (hub, {task.repo_id}): HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, and "
            "huggingface_hub sends no request in offline mode; unset it for this convert (a merge of a hub base "
            "the finetune downloaded reads it from the volume's cache/hf either way)"
        )
    token = environ.get(TOKEN_VARIABLE, "").strip()
    if not token:
        raise InputError(
            f"task {number} (hub, {task.repo_id}): {TOKEN_VARIABLE} is not set; the push needs a Hugging Face "
            f"token with write access to {task.repo_id}: set {TOKEN_VARIABLE} (a deploy config's `secrets`)"
        )
    return token


def verify_source(folder: Path, number: int) -> dict[str, dict[str, Any]]:
    """The folder's files as its manifest lists them ({name: {bytes, sha256}}), each file checked against it;
    InputError (exit 2) naming the folder and the file when one differs, is missing, or is not listed."""
    manifest = _source_manifest(folder)
    if manifest is None:
        raise InputError(
            f"task {number} (hub): {folder} has no {MANIFEST} the kit wrote, so what it holds cannot be checked; "
            f"make it again with {_maker(folder.name)}"
        )
    listed: dict[str, dict[str, Any]] = manifest["files"]
    total = sum(int(entry.get("bytes", 0)) for entry in listed.values())
    log.info(
        "checking the %d files (%.1f MB) of %s against its %s", len(listed), total / 1e6, folder, MANIFEST
    )
    present = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    present = [name for name in present if name != MANIFEST]
    torn = _torn_files(folder, listed, present)
    if torn:
        raise InputError(
            f"task {number} (hub): {folder} does not match its {MANIFEST} ({torn}): it was changed after the kit "
            f"wrote it, or torn by a kill, and is not pushed; make it again with {_maker(folder.name)}"
        )
    return listed


def _torn_files(folder: Path, listed: dict[str, dict[str, Any]], present: list[str]) -> str:
    """How the folder differs from its manifest's list, in words ('' when it does not)."""
    unlisted = sorted(set(present) - set(listed))
    if unlisted:
        return f"{unlisted[0]} is not in it"
    for name, entry in listed.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, not {entry['bytes']}"
    names = list(listed)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as hashers:  # hashlib releases the GIL
        digests = hashers.map(atomic.file_sha256, [folder / name for name in names])
        for name, digest in zip(names, digests, strict=True):
            if digest != listed[name]["sha256"]:
                return f"{name} has another sha256 than the one recorded"
    return ""


def hub_error(exc: BaseException, task: HubTask, number: int, endpoint: str) -> TrainpodError | None:
    """The exit the failed push `exc` means: a refused token exit 2, the network or a Hub outage 75; None for
    a failure that is neither. `endpoint`: the Hub's; a refusal from another host is its object storage's.

    huggingface_hub wraps an LFS upload's failure in a RuntimeError; the cause chain holds the HTTP error. The
    upload itself goes to a presigned link on the storage's host, whose 403 is that link's (expired on a slow
    upload), not the token's: the next start asks for fresh links.
    hf_xet (the image's upload path to the real Hub) raises XetAuthenticationError, a PermissionError, for a
    token its storage refuses; ConnectionError for the network, its 429s and 5xx, TimeoutError for a timeout
    (xet-core's `impl From<XetError> for PyErr`, xet_pkg/src/error.rs). A failure it only carries as text (a
    background task's, "Task error: ...") is a RuntimeError: None here, a crash (exit 1), which finish.py counts
    as it counts a 75, so the next start pushes again all the same."""
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    where = f"task {number} (hub): pushing to {task.repo_id}@{task.revision}"
    for cause in _causes(exc):
        if isinstance(cause, HfHubHTTPError) and cause.response is not None:
            status = cause.response.status_code
            if status in (401, 403) and _from_elsewhere(cause.response, endpoint):
                return TemporaryError(
                    f"{where}: the Hub's storage refused an upload (HTTP {status}: its upload link, expired "
                    "or not taken); the next start pushes again with new links"
                )
            if status in (401, 403) or isinstance(cause, RepositoryNotFoundError):
                return _token_refused(where, task, f"HTTP {status}")
            if status == 429 or status >= 500:
                return TemporaryError(f"{where}: the Hub answered HTTP {status}; the next start pushes again")
            return InputError(f"{where}: the Hub refused the push (HTTP {status}): {_first_line(cause)}")
        if type(cause).__name__ == "XetAuthenticationError":
            return _token_refused(where, task, "its Xet storage refused it")
        if isinstance(cause, OSError | TimeoutError) or _is_transport_error(cause):
            return TemporaryError(
                f"{where}: the Hub could not be reached ({type(cause).__name__}); the next start pushes again"
            )
    return None


def _from_elsewhere(response: Any, endpoint: str) -> bool:
    """Whether `response` came from another host than the Hub's `endpoint` (the object storage of an upload)."""
    url = getattr(response, "url", None)
    return url is not None and urlsplit(str(url)).netloc != urlsplit(endpoint).netloc


def _token_refused(where: str, task: HubTask, how: str) -> InputError:
    return InputError(
        f"{where}: the Hub refused {TOKEN_VARIABLE} ({how}); it needs write access to {task.repo_id}: give "
        f"{TOKEN_VARIABLE} a token with the write role, or a fine-grained one that may write to "
        f"{task.repo_id.split('/')[0]}'s repos"
    )


def _causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _is_transport_error(exc: BaseException) -> bool:
    """A connection refused or dropped, a timeout: huggingface_hub 2.x speaks httpx2, 1.x (some images) httpx."""
    for name in ("httpx2", "httpx"):
        module = sys.modules.get(name)
        if module is not None and isinstance(exc, module.TransportError):
            return True
    return False


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def _maker(source: str) -> str:
    if source.startswith("hf-step-"):
        return "a convert `kind: export` task"
    return _MADE_BY.get(source, "the task that writes it (a convert task's `output`)")


def _source_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = atomic.read_json(folder / MANIFEST)
    except (FileNotFoundError, NotADirectoryError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(manifest, dict) or not str(manifest.get("format", "")).startswith(MANIFEST_FORMATS):
        return None
    return manifest if isinstance(manifest.get("files"), dict) else None


def _manifest_digest(folder: Path) -> str | None:
    try:
        return hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = atomic.read_json(path)
    except (FileNotFoundError, NotADirectoryError, ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and record.get("format") == RECORD_FORMAT else None
