"""The one place trainpod talks S3: RunPod's S3-compatible API to a network volume, with no pod running.

    export AWS_ACCESS_KEY_ID=user_... AWS_SECRET_ACCESS_KEY=rps_...   # an "S3 API key" from RunPod's console
    trainpod ls --s3-volume VOLUME_ID --datacenter EU-RO-1              # or TRAINPOD_S3_VOLUME/_DATACENTER,
    trainpod ls --config configs/deploy/pretrain-spot.yaml              # or the deploy config's volume

The bucket is the network volume's id and a key is a path on the volume (`/workspace/a/b` is
`s3://VOLUME_ID/a/b`); the endpoint is `https://s3api-<data center, lower case>.runpod.io/` and the
region the data center id (TRAINPOD_S3_ENDPOINT_URL replaces the endpoint: tests point it at a
local S3 server). Credentials come from boto3's usual chain (AWS_* variables, AWS_PROFILE, the
files of `aws configure`); both halves are registered with trainpod.log's mask, so neither reaches
a log line or an error, and nothing here writes them anywhere.

Uploads are multipart and resumable: the parts of an unfinished upload are listed from the server, and
a part whose size and MD5 (its ETag) match the local bytes is kept. A gateway whose part ETags are not
MD5s (opaque tokens) proves nothing by them alone, so each part sent is also recorded on this machine
(UploadRecord: its MD5 and the ETag the server gave it, never a credential): a listed part of the
right size whose ETag is the one recorded for it, recorded with the MD5 the local bytes have now, is
kept too; anything else is sent again. Each part is sent with Content-MD5 and its returned ETag
compared; the completed object's multipart ETag (the MD5 of the parts' MD5s) is checked against the
local file's, then what the key holds by its size and recorded MD5 (a file of one part's too, sent in one
PutObject): another push's object completed meanwhile (other bytes, the last writer wins) is said to be
that, exit 2, not bytes corrupted on the way nor a verified upload. Every object uploaded carries the whole file's MD5 as user metadata (`trainpod-md5`), which tells
a file already on the volume from other bytes of its size on any gateway; an upload is resumed only by
the machine that started it, for the same bytes, so that metadata never misnames an object. Another
machine's unfinished upload of the same key is left alone (aborted, its push would fail at its next
part) until nothing was sent to it for a day (ABANDONED_UPLOAD_S); one the gateway gives no dates to
judge that by is left alone, and one ended meanwhile (NoSuchUpload) passed over; this push's own upload
ended so is exit 75, the same push again starting it anew. An object appears only when its upload
completes, so no reader ever sees half of one. Downloads append to a `.tmp-pull` file with ranged GETs,
so an interrupted one continues where it stopped.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainpod import atomic
from trainpod.errors import InputError, TemporaryError, is_whole_number
from trainpod.log import redact, register_secret

log = logging.getLogger("trainpod.s3")

ENDPOINT_ENV = "TRAINPOD_S3_ENDPOINT_URL"
VOLUME_ENV = "TRAINPOD_S3_VOLUME"
DATACENTER_ENV = "TRAINPOD_S3_DATACENTER"
PART_MB_ENV = "TRAINPOD_S3_PART_MB"
# Data centers whose volumes RunPod serves over S3 (its storage/s3-api page, 2026-08).
S3_DATACENTERS = (
    "EU-CZ-1", "EU-RO-1", "EUR-IS-1", "EUR-NO-1", "US-CA-2", "US-GA-2", "US-IL-1", "US-KS-2",
    "US-MD-1", "US-MO-1", "US-MO-2", "US-NC-1", "US-NC-2", "US-NE-1", "US-WA-1",
)  # fmt: skip
DEFAULT_PART_MB = 64  # 10,000 parts (S3's limit) of 64 MiB: 640 GB files; larger files get larger parts
MIN_PART_MB = 5  # S3's smallest part but the last
MAX_PARTS = 10_000
PARALLEL_PARTS = 4  # one TCP stream rarely fills a link to another continent; 4 parts in flight usually do
READ_CHUNK = 8 << 20
READ_ATTEMPTS = 3  # a small object's read, body included: 1 s and 2 s between them
DELETE_BATCH = 1000  # the most keys S3's DeleteObjects takes in one request
# Another machine's unfinished upload of a key is aborted by a push of that key only once nothing was sent to it
# for this long: a live one sends a part every few seconds, and a laptop that slept longer starts its upload anew.
ABANDONED_UPLOAD_S = 24 * 3600
_MD5_ETAG = re.compile(r"^[0-9a-f]{32}(-\d+)?$")


@dataclass(frozen=True)
class S3Target:
    volume_id: str
    datacenter: str
    endpoint_url: str


@dataclass(frozen=True)
class RemoteObject:
    size: int
    etag: str  # without quotes; an MD5 (or MD5-of-MD5s-N) on S3 proper, maybe something else elsewhere
    md5: str | None = (
        None  # the whole file's MD5 as trainpod recorded it (head only; None: not uploaded by it)
    )


# User metadata (x-amz-meta-trainpod-md5) on every object trainpod uploads: the whole file's MD5, a
# checksum that holds on any gateway and for any part size, where the ETag may be an opaque token.
METADATA_MD5 = "trainpod-md5"


def endpoint_for(datacenter: str, environ: dict[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get(ENDPOINT_ENV) or f"https://s3api-{datacenter.lower()}.runpod.io/"


def target_from(
    volume_id: str | None, datacenter: str | None, environ: dict[str, str] | None = None
) -> S3Target:
    """The volume and data center, each from its flag, else TRAINPOD_S3_VOLUME / TRAINPOD_S3_DATACENTER."""
    environ = os.environ if environ is None else environ
    volume_id = volume_id or environ.get(VOLUME_ENV)
    datacenter = datacenter or environ.get(DATACENTER_ENV)
    problems = []
    if not volume_id:
        problems.append(f"which network volume: pass --s3-volume VOLUME_ID or set {VOLUME_ENV}")
    if not datacenter:
        problems.append(f"its data center: pass --datacenter DC (e.g. EU-RO-1) or set {DATACENTER_ENV}")
    elif datacenter not in S3_DATACENTERS and not environ.get(ENDPOINT_ENV):
        problems.append(
            f"--datacenter {datacenter}: RunPod serves S3 only in {', '.join(S3_DATACENTERS)}; "
            f"a volume elsewhere is reachable through a pod only (or, where RunPod has opened S3 there since, set "
            f"{ENDPOINT_ENV} to its endpoint)"
        )
    if problems:
        raise InputError("the S3 API needs " + "; and ".join(problems))
    return S3Target(volume_id, datacenter, endpoint_for(datacenter, environ))


def s3_key_here() -> bool:
    """Whether the S3 views can run here: boto3 installed and an S3 key found (the environment, AWS_PROFILE,
    ~/.aws), as _make_client looks for it."""
    try:
        import boto3
    except ModuleNotFoundError:
        return False
    logging.getLogger("botocore").setLevel(logging.WARNING)
    return boto3.session.Session().get_credentials() is not None


def _boto3() -> Any:
    try:
        import boto3
    except ModuleNotFoundError:
        raise InputError(
            "push, pull and the S3 views of ls/status need boto3: pip install 'trainpod[remote]' "
            "(or pip install boto3)"
        ) from None
    return boto3


def part_size(size: int, part_bytes: int) -> int:
    """The part size for a file: `part_bytes`, grown (in whole MiB) when the file needs more than 10,000."""
    needed = -(-size // MAX_PARTS)
    return max(part_bytes, -(-needed // (1 << 20)) << 20)


def part_md5s(path: Path, part: int, whole: Any = None) -> list[bytes]:
    """Each part's MD5; `whole` (a hashlib MD5), when given, is fed the whole file in the same pass."""
    size = path.stat().st_size
    digests = []
    with open(path, "rb") as f:
        for _ in range(max(1, -(-size // part))):
            chunk = f.read(part)
            if whole is not None:
                whole.update(chunk)
            digests.append(hashlib.md5(chunk, usedforsecurity=False).digest())
    return digests


def file_md5(path: Path) -> str:
    whole = hashlib.md5(usedforsecurity=False)
    part_md5s(path, READ_CHUNK, whole)
    return whole.hexdigest()


def expected_etag(path: Path, part: int) -> str:
    """The ETag S3 gives this file uploaded by `upload_file`: plain MD5, or MD5 of the parts' MD5s."""
    size = path.stat().st_size
    digests = part_md5s(path, part)
    return digests[0].hex() if size <= part else multipart_etag(digests)


def multipart_etag(digests: list[bytes]) -> str:
    return hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest() + f"-{len(digests)}"


def md5_form(etag: str) -> bool:
    """Whether an ETag is an MD5 (or MD5-of-MD5s-N), as S3 proper gives; a gateway may give opaque tokens."""
    return _MD5_ETAG.match(etag) is not None


def etag_agrees(remote: str, expected: str) -> bool:
    """False only when the server's ETag is an MD5 form and differs; another form proves nothing."""
    return remote == expected or not md5_form(remote)


class UploadRecord:
    """What this machine sent of one unfinished multipart upload: per part, the MD5 of the bytes sent
    (which the server checked against Content-MD5) and the ETag it answered. In the user's cache folder,
    one small JSON per bucket and key, rewritten after each part and deleted once the upload completes."""

    def __init__(self, folder: Path, bucket: str, key: str):
        name = hashlib.sha256(f"{bucket}/{key}".encode()).hexdigest()[:32]
        self.path = folder / f"{name}.json"
        self.upload_id, self.part_bytes, self.md5 = "", 0, ""
        self.parts: dict[int, tuple[str, str]] = {}  # number: (MD5 of the local bytes, the server's ETag)

    def load(self, upload_id: str, part_bytes: int, md5: str) -> dict[int, tuple[str, str]] | None:
        """The parts recorded for `upload_id`, made by this machine for a file of MD5 `md5` (its metadata)
        cut in `part_bytes`; None for another upload, another file, or a torn record."""
        try:
            data = atomic.read_json(self.path)
            if (data["upload_id"], data["part_bytes"], data["md5"]) == (upload_id, part_bytes, md5):
                return {int(n): (part_md5, etag) for n, (part_md5, etag) in data["parts"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def made(self, upload_id: str) -> bool:
        """Whether this machine started `upload_id` (for whatever bytes): then it aborts it when not resuming it."""
        try:
            return atomic.read_json(self.path)["upload_id"] == upload_id
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def start(self, upload_id: str, part_bytes: int, md5: str, parts: dict[int, tuple[str, str]]) -> None:
        self.upload_id, self.part_bytes, self.md5, self.parts = upload_id, part_bytes, md5, dict(parts)
        self._save()

    def add(self, number: int, md5: str, etag: str) -> None:
        self.parts[number] = (md5, etag)
        self._save()

    def _save(self) -> None:
        parts = {str(n): list(pair) for n, pair in sorted(self.parts.items())}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_json(self.path, {"upload_id": self.upload_id, "part_bytes": self.part_bytes,
                                          "md5": self.md5, "parts": parts})  # fmt: skip
        except OSError as exc:  # a read-only cache folder: the upload goes on; only a resume sends more
            log.debug("could not record the parts of an upload in %s: %s", self.path, exc)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def cache_folder(environ: Mapping[str, str]) -> Path:
    """The user's cache folder for trainpod, like a supervisor's state away from the volume."""
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainpod"


def upload_records_folder(environ: Mapping[str, str]) -> Path:
    """Where UploadRecords live."""
    return cache_folder(environ) / "uploads"


class VolumeS3:
    """A network volume through the S3 API; every call translates S3's errors into trainpod's."""

    def __init__(
        self,
        target: S3Target,
        environ: dict[str, str] | None = None,
        part_bytes: int | None = None,
        max_attempts: int = 10,
        sleep: Callable[[float], None] = time.sleep,
    ):
        environ = os.environ if environ is None else environ
        self.target, self.sleep = target, sleep
        self.bucket = target.volume_id
        raw_mb = (environ.get(PART_MB_ENV) or str(DEFAULT_PART_MB)).strip()
        if not is_whole_number(raw_mb):
            raise InputError(
                f"{PART_MB_ENV}={raw_mb!r} is not a whole number of MiB; set it like {PART_MB_ENV}=64 "
                f"(at least {MIN_PART_MB}), or unset it for {DEFAULT_PART_MB}"
            )
        mb = int(raw_mb)
        self.part_bytes = part_bytes or max(mb, MIN_PART_MB) << 20
        self._records = upload_records_folder(environ)
        self._client = _make_client(target, max_attempts)
        self._batches_taken: bool | None = None  # remove_many: None until the gateway took or refused a batch

    def __repr__(self) -> str:  # never the credentials, not even in a traceback's locals
        return f"VolumeS3({self.bucket} in {self.target.datacenter})"

    # ------------------------------------------------------------------ reading
    def list_files(self, prefix: str) -> dict[str, RemoteObject]:
        """Every object under `prefix` (a folder path ending in /), by its path relative to it."""
        found = {}
        for page in self._pages(Prefix=prefix):
            for item in page.get("Contents", []):
                if not item["Key"].endswith("/"):  # RunPod lists folders as objects too
                    found[item["Key"][len(prefix) :]] = RemoteObject(item["Size"], _etag(item["ETag"]))
        return found

    def folders(self, prefix: str) -> list[str]:
        return sorted(
            {
                p["Prefix"][len(prefix) :].rstrip("/")
                for page in self._pages(Prefix=prefix, Delimiter="/")
                for p in page.get("CommonPrefixes", [])
            }
            - {""}
        )

    def files(self, prefix: str) -> dict[str, int]:
        return {
            item["Key"][len(prefix) :]: item["Size"]
            for page in self._pages(Prefix=prefix, Delimiter="/")
            for item in page.get("Contents", [])
            if not item["Key"].endswith("/")
        }

    def sizes(self, prefix: str) -> dict[str, int]:
        """Every object under `prefix` ("" for the whole volume), at any depth: its size (VolumeFiles.sizes)."""
        return {name: found.size for name, found in self.list_files(prefix).items()}

    def folder_objects(self, prefix: str) -> list[str]:
        """The keys under `prefix` that stand for folders (RunPod lists folders as objects ending in /), deepest
        first: an emptied folder is listed by a Delimiter listing while its object is there."""
        found = [
            item["Key"]
            for page in self._pages(Prefix=prefix)
            for item in page.get("Contents", [])
            if item["Key"].endswith("/")
        ]
        return sorted(found, key=lambda key: (-key.count("/"), key))

    def read(self, key: str) -> bytes | None:
        """The object's bytes; None when there is no such object. A connection lost while receiving them
        (which botocore's retries do not cover: they end with the response's headers) is tried again
        READ_ATTEMPTS times in all, a second apart and more, before it is a TemporaryError: a supervisor
        that could not read DONE would take the run for unfinished."""
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                answer = self._call("read", key, self._client.get_object, Bucket=self.bucket, Key=key)
            except FileNotFoundError:
                return None
            try:
                with self._receiving("read", key):
                    return answer["Body"].read()
            except TemporaryError as exc:
                if attempt == READ_ATTEMPTS:
                    raise
                log.info("%s; trying again (%d/%d)", exc, attempt + 1, READ_ATTEMPTS)
                self.sleep(2 ** (attempt - 1))
        raise AssertionError("unreachable: the last attempt returns or raises")

    def head(self, key: str) -> RemoteObject | None:
        try:
            answer = self._call("look at", key, self._client.head_object, Bucket=self.bucket, Key=key)
        except FileNotFoundError:
            return None
        recorded = (answer.get("Metadata") or {}).get(METADATA_MD5)
        return RemoteObject(answer["ContentLength"], _etag(answer["ETag"]), recorded)

    def _pages(self, **kwargs: Any) -> Iterator[dict]:
        token = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = self._call(
                "list", kwargs["Prefix"], self._client.list_objects_v2, Bucket=self.bucket, **kwargs, **extra
            )
            yield page
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    # ------------------------------------------------------------------ downloading
    def download(
        self, key: str, partial: Path, size: int, on_bytes: Callable[[int], None] | None = None
    ) -> tuple[int, str | None]:
        """Append the rest of `key` to `partial` (ranged GET from its length) and fsync it; returns the
        bytes that were already there and the ETag of the version the GET read (None: nothing to read)."""
        had = partial.stat().st_size if partial.exists() else 0
        etag = None
        if had > size:
            partial.unlink()
            had = 0
        if had < size:
            ranged = {"Range": f"bytes={had}-"} if had else {}
            try:
                answer = self._call(
                    "download", key, self._client.get_object, Bucket=self.bucket, Key=key, **ranged
                )
            except _RangePastTheEnd:
                # The object is no longer than the bytes kept (rewritten shorter since it was listed): they
                # are another version's. Read whole; the caller checks what it got against what it expects.
                partial.unlink()
                had = 0
                answer = self._call("download", key, self._client.get_object, Bucket=self.bucket, Key=key)
            with open(partial, "ab") as f, self._receiving("download", key):
                for chunk in answer["Body"].iter_chunks(READ_CHUNK):
                    f.write(chunk)
                    if on_bytes:
                        on_bytes(len(chunk))
                f.flush()
                os.fsync(f.fileno())
            etag = _etag(answer.get("ETag", ""))
        elif not partial.exists():  # an empty object: nothing to receive, but the file is made all the same
            partial.touch()
        return had, etag

    def remove(self, key: str) -> None:
        """Delete one object (S3 answers a missing key with success too)."""
        self._call("remove", key, self._client.delete_object, Bucket=self.bucket, Key=key)

    def remove_many(self, keys: list[str]) -> None:
        """Delete the objects in no particular order, DELETE_BATCH to a request (S3's DeleteObjects): an HF cache
        of thousands of files goes in a few requests, where one a file took minutes from a laptop. RunPod does not
        document DeleteObjects, so a gateway that refuses the first batch (any S3 error but a missing volume or a
        refused S3 API key: NotImplemented, a checksum it does not take) gets one request an object, as `remove`,
        from then on. An object the batch could not delete is a TemporaryError naming it: the same command again
        finishes it."""
        pending = list(keys)
        while pending and self._batches_taken is not False:
            batch = pending[:DELETE_BATCH]
            objects = {"Objects": [{"Key": key} for key in batch], "Quiet": True}
            try:
                answer = self._call(
                    "remove",
                    batch[0],
                    self._client.delete_objects,
                    batch=True,
                    Bucket=self.bucket,
                    Delete=objects,
                )
            except BatchRefused as exc:
                # It took batches before: not the operation refused but the gateway in trouble.
                if self._batches_taken:
                    raise TemporaryError(
                        f"could not remove s3://{self.bucket}/{batch[0]} and {len(batch) - 1} other object(s) "
                        f"({self.target.endpoint_url}): S3 answered {exc.code}; run the same command again (it resumes)"
                    ) from None
                log.info("the S3 API refused a batched delete (%s); deleting one object a request", exc.code)
                self._batches_taken = False
                break
            self._batches_taken = True
            if failed := answer.get("Errors"):
                first = failed[0]
                raise TemporaryError(
                    f"could not remove s3://{self.bucket}/{first.get('Key')} ({self.target.endpoint_url}): S3 "
                    f"answered {first.get('Code')} for it and {len(failed) - 1} other object(s); run the same "
                    "command again (it resumes)"
                )
            pending = pending[DELETE_BATCH:]
        for key in pending:
            self.remove(key)

    # ------------------------------------------------------------------ uploading
    def put_bytes(self, key: str, data: bytes) -> None:
        digest = hashlib.md5(data, usedforsecurity=False)
        answer = self._call(
            "upload",
            key,
            self._client.put_object,
            Bucket=self.bucket,
            Key=key,
            Body=data,
            ContentMD5=base64.b64encode(digest.digest()).decode(),
            Metadata={METADATA_MD5: digest.hexdigest()},
        )
        self._check_etag(key, _etag(answer["ETag"]), digest.hexdigest())

    def upload_file(self, path: Path, key: str, on_part: Callable[[int, int], None] | None = None) -> int:
        """Upload `path` to `key` (multipart beyond one part, resuming an unfinished upload of it) and
        verify the object's size and ETag; returns how many parts an earlier attempt had uploaded."""
        size = path.stat().st_size
        part = part_size(size, self.part_bytes)
        if size <= part:
            data = path.read_bytes()
            self.put_bytes(key, data)
            md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()
            # Checked as a multipart upload's: another push's PutObject of other bytes may land after this one's.
            self._check_landed(key, size, md5, md5)
            return 0
        whole = hashlib.md5(usedforsecurity=False)
        digests = part_md5s(path, part, whole)
        record = UploadRecord(self._records, self.bucket, key)
        upload_id, kept = self._resume(key, digests, part, size, record, whole.hexdigest())
        record.start(
            upload_id, part, whole.hexdigest(), {n: (digests[n - 1].hex(), e) for n, e in kept.items()}
        )
        sent = self._send_parts(
            path, key, upload_id, digests, part, sorted(set(range(1, len(digests) + 1)) - set(kept)), on_part,
            record,
        )  # fmt: skip
        # Each part as the server named it (an MD5 on S3 proper; a gateway may give other tokens, which a
        # completion naming the local MD5s would be refused with InvalidPart).
        etags = kept | sent
        parts = [{"PartNumber": n, "ETag": f'"{etags[n]}"'} for n in range(1, len(digests) + 1)]
        completed = self._call(
            "complete the upload of",
            key,
            self._client.complete_multipart_upload,
            Bucket=self.bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
        )
        # This upload's object as the server assembled it (not the file read again), then what the key holds now:
        # another writer's object completed meanwhile is not bytes corrupted on the way.
        self._check_etag(key, _etag(completed.get("ETag", "")), multipart_etag(digests))
        self._check_landed(key, size, whole.hexdigest(), multipart_etag(digests))
        record.remove()
        return len(kept)

    def _check_landed(self, key: str, size: int, md5: str, etag: str) -> None:
        """What the key holds after this file's upload: another push's object completed meanwhile (other bytes:
        the last writer wins) is InputError saying so, not bytes corrupted on the way nor a verified upload."""
        landed = self.head(key)
        if landed is None:
            raise TemporaryError(
                f"s3://{self.bucket}/{key}: no object on the volume after the upload (deleted meanwhile); run the "
                "same push again"
            )
        if not self._holds(landed, size, md5, etag):
            raise self._overwritten(key, landed, size)

    @staticmethod
    def _holds(landed: RemoteObject, size: int, md5: str, etag: str) -> bool:
        """Whether the key's object is this file: its size, and the whole file's MD5 its writer recorded (any
        gateway), else its ETag where that is an MD5 form."""
        if landed.size != size:
            return False
        return landed.md5 == md5 if landed.md5 is not None else etag_agrees(landed.etag, etag)

    def _overwritten(self, key: str, landed: RemoteObject, size: int) -> InputError:
        theirs = f"MD5 {landed.md5}" if landed.md5 else f"ETag {landed.etag}"
        return InputError(
            f"s3://{self.bucket}/{key}: another push wrote other bytes to this key meanwhile (another machine, or "
            f"the same push run twice with other files): the volume holds theirs ({landed.size:,} bytes, {theirs}), "
            f"not this file ({size:,} bytes), which arrived whole and was replaced. Decide which is wanted: push "
            "to another name, or delete it on the volume and push again"
        )

    def _resume(
        self, key: str, digests: list[bytes], part: int, size: int, record: UploadRecord, md5: str
    ) -> tuple[str, dict[int, str]]:
        """An unfinished upload of `key` that this machine started for this file (its record says so: the
        upload's metadata names the file's MD5) and its parts that match the local bytes (number: the
        server's ETag), else a new upload. A part matches by its ETag being the bytes' MD5, or (a gateway's
        opaque ETag) by being the ETag this machine recorded when it sent those same bytes as that part."""
        listed = self._call(
            "list the uploads of", key, self._client.list_multipart_uploads, Bucket=self.bucket, Prefix=key
        )
        uploads = [u for u in listed.get("Uploads", []) if u["Key"] == key]
        mine = next((u for u in uploads if record.load(u["UploadId"], part, md5) is not None), None)
        # Never completed: this machine's older attempts (for other bytes, or another part size: the file's
        # MD5 in their metadata would misname the object), and another machine's uploads (or an older
        # trainpod's) once idle past ABANDONED_UPLOAD_S. One with a part sent lately is another machine
        # pushing the same file right now: aborted, its next part would fail and its parts be lost.
        for other in uploads:
            # One ended since the listing (completed or aborted by the machine pushing it) is nothing to abort.
            with contextlib.suppress(UploadGone):
                if other is not mine and (record.made(other["UploadId"]) or self._abandoned(key, other)):
                    self._call(
                        "abort an old upload of",
                        key,
                        self._client.abort_multipart_upload,
                        Bucket=self.bucket,
                        Key=key,
                        UploadId=other["UploadId"],
                    )
        if mine is not None:
            with contextlib.suppress(UploadGone):  # aborted since the listing: begun anew
                return mine["UploadId"], self._kept_parts(
                    key, mine["UploadId"], digests, part, size, record, md5
                )
        created = self._call(
            "start the upload of",
            key,
            self._client.create_multipart_upload,
            Bucket=self.bucket,
            Key=key,
            Metadata={METADATA_MD5: md5},
        )
        return created["UploadId"], {}

    def _kept_parts(
        self,
        key: str,
        upload_id: str,
        digests: list[bytes],
        part: int,
        size: int,
        record: UploadRecord,
        md5: str,
    ) -> dict[int, str]:
        """The parts of this machine's unfinished `upload_id` that match the local bytes (number: the server's
        ETag), by their MD5 ETag or the ETag recorded when those bytes were sent as that part."""
        recorded = record.load(upload_id, part, md5) or {}
        kept = {}
        for sent in self._parts(key, upload_id):
            number, etag = sent["PartNumber"], _etag(sent["ETag"])
            want = min(part, size - (number - 1) * part)
            if number > len(digests) or sent["Size"] != want:
                continue
            part_md5 = digests[number - 1].hex()
            if etag == part_md5 or recorded.get(number) == (part_md5, etag):
                kept[number] = etag
        log.info(
            "resuming the upload of %s: %d of %d parts are on the volume already",
            key,
            len(kept),
            len(digests),
        )
        return kept

    def _abandoned(self, key: str, upload: dict) -> bool:
        """Whether nothing was sent to `upload` (started or a part uploaded) for ABANDONED_UPLOAD_S. A date the
        server does not give is no proof of age: an upload listed without its start date (a gateway need not
        give it) is judged by its parts' dates, and one with no part yet (begun a moment ago, maybe) or a part
        undated is another machine's of unknown age, left alone."""
        idle_since = time.time() - ABANDONED_UPLOAD_S
        started = upload.get("Initiated")
        if started is not None and started.timestamp() > idle_since:
            return False
        sent = [p.get("LastModified") for p in self._parts(key, upload["UploadId"])]
        if None in sent or (started is None and not sent):
            return False
        return all(date.timestamp() <= idle_since for date in sent)

    def _parts(self, key: str, upload_id: str) -> Iterator[dict]:
        marker = 0
        while True:
            page = self._call(
                "list the parts of",
                key,
                self._client.list_parts,
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumberMarker=marker,
            )
            yield from page.get("Parts", [])
            if not page.get("IsTruncated"):
                return
            marker = page["NextPartNumberMarker"]

    def _send_parts(
        self,
        path: Path,
        key: str,
        upload_id: str,
        digests: list[bytes],
        part: int,
        numbers: list[int],
        on_part: Callable[[int, int], None] | None,
        record: UploadRecord,
    ) -> dict[int, str]:
        """Upload the parts `numbers`, PARALLEL_PARTS at a time, and return the ETag the server gave each;
        `on_part(done, total)` after each (it may raise, e.g. KeyboardInterrupt: the parts already sent stay
        for the next attempt)."""
        fd = os.open(path, os.O_RDONLY)
        pool = ThreadPoolExecutor(max_workers=PARALLEL_PARTS, thread_name_prefix="s3-part")
        sent: dict[int, str] = {}
        try:
            pending: dict[Future, int] = {}
            queue = list(numbers)
            done = len(digests) - len(numbers)
            while queue or pending:
                while queue and len(pending) < PARALLEL_PARTS:
                    number = queue.pop(0)
                    future = pool.submit(
                        self._send_part, fd, key, upload_id, number, part, digests[number - 1]
                    )
                    pending[future] = number
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    number = pending.pop(future)
                    sent[number] = future.result()
                    record.add(number, digests[number - 1].hex(), sent[number])
                    done += 1
                    if on_part:
                        on_part(done, len(digests))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            os.close(fd)
        return sent

    def _send_part(self, fd: int, key: str, upload_id: str, number: int, part: int, digest: bytes) -> str:
        data = os.pread(fd, part, (number - 1) * part)
        answer = self._call(
            "upload a part of",
            key,
            self._client.upload_part,
            Bucket=self.bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=data,
            ContentMD5=base64.b64encode(digest).decode(),
        )
        etag = _etag(answer["ETag"])
        self._check_etag(key, etag, digest.hex())
        return etag

    def _check_etag(self, key: str, remote: str, expected: str) -> None:
        if not etag_agrees(remote, expected):
            raise TemporaryError(
                f"s3://{self.bucket}/{key}: the volume's checksum {remote} differs from this file's {expected} "
                "(corrupted on the way); run the same command again"
            )

    # ------------------------------------------------------------------ errors
    @contextlib.contextmanager
    def _receiving(self, doing: str, key: str) -> Iterator[None]:
        """A response body being read: the connection dropping midway is as temporary as a failed call
        (the bytes received so far stay in a download's partial file for the next attempt)."""
        from botocore.exceptions import BotoCoreError

        try:
            yield
        except BotoCoreError as exc:
            raise TemporaryError(
                f"could not {doing} s3://{self.bucket}/{key} ({self.target.endpoint_url}): {type(exc).__name__} "
                "while receiving it; the network or RunPod's S3 API is having trouble: run the same command "
                "again (it resumes)"
            ) from None

    def _call(
        self, doing: str, key: str, operation: Callable[..., Any], batch: bool = False, **kwargs: Any
    ) -> Any:
        """One S3 call: a missing key is FileNotFoundError; anything else a TrainpodError that names the
        volume, the key and what to do, never the credentials or the server's body. `batch` (a DeleteObjects,
        remove_many): an error that is not about the volume or the S3 API key is BatchRefused."""
        from botocore.exceptions import BotoCoreError, ClientError

        where = f"s3://{self.bucket}/{key} ({self.target.endpoint_url})"
        try:
            return operation(**kwargs)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(key) from None
            if code == "InvalidRange" and "Range" in kwargs:
                raise _RangePastTheEnd(key) from None
            if code == "NoSuchUpload":
                raise UploadGone(
                    f"could not {doing} {where}: its upload was ended meanwhile (NoSuchUpload: aborted by another "
                    "machine's push of it, which found it idle for a day, or by the gateway; or completed by "
                    "another push of the same file); run the same push again: it starts the upload anew"
                ) from None
            if batch and not _refused_key(code, status):
                raise BatchRefused(code or str(status)) from None
            raise _client_error(code, status, doing, where, self.target) from None
        except BotoCoreError as exc:
            raise TemporaryError(
                f"could not {doing} {where}: {type(exc).__name__}; the network or RunPod's S3 API is having "
                "trouble: run the same command again"
            ) from None


class _RangePastTheEnd(Exception):
    """A ranged GET from past the object's end (S3's InvalidRange): download reads it whole instead."""


class UploadGone(TemporaryError):
    """A multipart upload that is no more (S3's NoSuchUpload): completed or aborted by another machine, or expired
    by the gateway. Another push's doing, not a setting to fix: the same push again starts it anew."""


class BatchRefused(Exception):
    """The gateway answered a DeleteObjects with an error that is not about the volume or the key (remove_many)."""

    def __init__(self, code: str):
        super().__init__(code)
        self.code = code


def _refused_key(code: str, status: int) -> bool:
    """The volume is not there or the S3 API key was refused: as much a DeleteObject's error as a DeleteObjects's."""
    return code in (
        "NoSuchBucket",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
    ) or status in (401, 403)


def _client_error(code: str, status: int, doing: str, where: str, target: S3Target) -> Exception:
    if code == "NoSuchBucket":
        return InputError(
            f"could not {doing} {where}: no network volume {target.volume_id} in {target.datacenter}; check "
            "--s3-volume (the volume's id, not its name) and --datacenter in RunPod's console (Storage)"
        )
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403") or status in (401, 403):
        return InputError(
            f"could not {doing} {where}: the S3 API key was refused ({code or status}); export the RunPod S3 API "
            "key as AWS_ACCESS_KEY_ID (user_...) and AWS_SECRET_ACCESS_KEY (rps_...): console, Settings, S3 API Keys"
        )
    if status >= 500 or code in ("SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError"):
        return TemporaryError(
            f"could not {doing} {where}: RunPod's S3 API answered {code or status} after retries; run the same "
            "command again later (it resumes)"
        )
    return InputError(f"could not {doing} {where}: S3 answered {code or status}")


def _etag(raw: str) -> str:
    return raw.strip('"')


def _make_client(target: S3Target, max_attempts: int) -> Any:
    boto3 = _boto3()
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError

    logging.getLogger("botocore").setLevel(logging.WARNING)  # "Found credentials in ..." on every command
    try:
        session = boto3.session.Session()
        credentials = session.get_credentials()
        frozen = credentials.get_frozen_credentials() if credentials is not None else None
    except BotoCoreError as exc:
        # Half of the key exported (PartialCredentialsError), AWS_PROFILE naming no profile (ProfileNotFound),
        # a credentials file that does not parse: the user's to fix, not a crash. botocore names the
        # variable, profile or file, never a value; masked all the same.
        raise InputError(
            f"the S3 API key could not be read: {redact(str(exc))}; export both AWS_ACCESS_KEY_ID=user_... and "
            "AWS_SECRET_ACCESS_KEY=rps_... (RunPod console, Settings, S3 API Keys), or set AWS_PROFILE to a "
            "profile that holds them"
        ) from None
    if frozen is None:
        raise InputError(
            "no S3 API key: export AWS_ACCESS_KEY_ID=user_... and AWS_SECRET_ACCESS_KEY=rps_... (RunPod console, "
            "Settings, S3 API Keys; or AWS_PROFILE naming a profile that holds them)"
        )
    register_secret(frozen.access_key)
    register_secret(frozen.secret_key)
    config = Config(
        region_name=target.datacenter,
        retries={"mode": "standard", "max_attempts": max_attempts},  # RunPod advises retrying its 502s
        # Only the checksums S3-compatible servers all accept (Content-MD5, sent by us); boto3 >= 1.36
        # adds CRC32 trailers by default, which some of them refuse.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"},
        connect_timeout=10,
        read_timeout=120,
    )
    return session.client(
        "s3",
        endpoint_url=target.endpoint_url,
        aws_access_key_id=frozen.access_key,
        aws_secret_access_key=frozen.secret_key,
        config=config,
    )
