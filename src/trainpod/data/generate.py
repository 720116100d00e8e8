"""Run a user's data generator function at scale and crash-safely: SFT records as train/val/test JSONL.

    TRAINPOD_CONFIG=configs/datagen/generator-tiny.yaml TRAINPOD_VOLUME=./demo-volume trainpod run datagen

The function (`generator: package.module:function` in the config, imported from `python_path` or
from a synced checkout under $TRAINPOD_VOLUME/repos/) has this contract:

    def generate(*, seed: int, chunk: int, kind: str | None, count: int, **params) -> Iterable[dict]

It yields exactly `count` JSON-serialisable dicts, made only from `seed` (and `params`): calling it
again with the same arguments must give the same records. The kit calls it once per chunk and kind
with a seed derived from (config.seed, chunk, kind), so the output depends neither on the worker
count nor on interruptions (the workers run with PYTHONHASHSEED=0 unless the environment sets it,
so a set of strings iterates alike in every run). `seed` is below 2**63 (fine for random.Random,
numpy's default_rng and torch; take `seed % 2**32` for numpy's legacy RandomState). `kind` is one of the config's `kinds`, or
None when the config has none; `params` are the config's `params` as they are.

How many records of each kind a chunk holds is fixed in advance: the dataset's totals per kind by
largest remainder (each within one record of records x share), then each chunk's share of what
remains, again by largest remainder, so the chunks add up to the totals exactly. The kit adds an
`id` ("<name>/<chunk>/<kind>/<index>") and, when kinds are configured, a `kind` field to every record
and leaves the user's fields as they are (alpaca instruction/input/output or chat `messages`: the
user's choice). A chunk's records are shuffled with a seed of their own, so kinds are interleaved.

Output in $TRAINPOD_VOLUME/datasets/<name>/:
  generation.json                what is being made (config hash, generator code identity), first
  chunks/chunk-000042.jsonl      one per chunk, each committed atomically by the main process
  train.jsonl val.jsonl test.jsonl   split by a hash of each record's id, once every chunk exists
  metadata.json                  last: counts per split and kind, sha256 of each file, seeds, code version

Chunks are made in parallel worker processes (spawn). Killed at any moment and run again, it skips
the committed chunks; SIGTERM stops it between chunk commits (the workers are stopped, their
unfinished chunks are made again next time) with exit 143. A complete dataset made with the same
settings is reused; another config, or other generator code for a half-made one, is refused.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import multiprocessing
import os
import random
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from trainpod.atomic import write_bytes, write_json, write_parts
from trainpod.checkpoint.lease import one_writer
from trainpod.config.generate import GeneratorDatagenConfig, exact_ratio
from trainpod.data.datagen import read_record, refuse_other_config
from trainpod.errors import ConfigError, InputError, Preempted, TemporaryError
from trainpod.gitsync import other_checkouts, own_checkout
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume

log = logging.getLogger(__name__)

FORMAT = "trainpod-generate/1"
METADATA_FILE = "metadata.json"
GENERATION_FILE = "generation.json"
CHUNKS_DIR = "chunks"
SPLITS = ("train", "val", "test")
SEED_DERIVATION = "int.from_bytes(sha256(f'{seed}/{chunk}/{label}').digest()[:8], 'big') >> 1"
# How often the main process looks at the stop flag while chunks are being made: a SIGTERM gives
# 5 s before SIGKILL, so a stop must not wait for a chunk that may take minutes.
POLL_SECONDS = 0.2
PROGRESS_LOG_SECONDS = 10.0
HASH_SEED_VARIABLE = "PYTHONHASHSEED"  # the workers' (GeneratorPool)


# ---------------------------------------------------------------------------------------------
# The plan: which records each chunk holds, fixed by the config alone
# ---------------------------------------------------------------------------------------------


def derive_seed(base: int, chunk: int, label: str | None) -> int:
    """A 63-bit seed for one (chunk, kind); `label` is the kind, or "order" for a chunk's shuffle."""
    digest = hashlib.sha256(f"{base}/{chunk}/{label}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def largest_remainder(total: int, weights: dict[Any, Fraction | int]) -> dict[Any, int]:
    """Split `total` in proportion to `weights` (exact arithmetic); ties go to the first key."""
    weight_sum = sum(weights.values())
    quotas = {key: Fraction(total) * weight / weight_sum for key, weight in weights.items()}
    counts = {key: int(quota) for key, quota in quotas.items()}
    by_remainder = sorted(weights, key=lambda key: quotas[key] - counts[key], reverse=True)  # stable
    for key in by_remainder[: total - sum(counts.values())]:
        counts[key] += 1
    return counts


@dataclass(frozen=True)
class KindBatch:
    """One call of the generator function: `count` records of `kind` from `seed`."""

    kind: str | None
    count: int
    seed: int


@dataclass(frozen=True)
class ChunkPlan:
    index: int
    records: int
    batches: tuple[KindBatch, ...]
    order_seed: int

    @property
    def file_name(self) -> str:
        return f"chunk-{self.index:06d}.jsonl"

    def to_json(self) -> dict:
        return {
            "chunk": self.index,
            "records": self.records,
            "order_seed": self.order_seed,
            "kinds": {str(b.kind): {"count": b.count, "seed": b.seed} for b in self.batches},
        }


def kind_totals(config: GeneratorDatagenConfig) -> dict[str | None, int]:
    """Records per kind over the whole dataset (kinds in name order; {None: records} without kinds)."""
    if config.kinds is None:
        return {None: config.records}
    shares = {kind: exact_ratio(config.kinds[kind]) for kind in sorted(config.kinds)}
    return largest_remainder(config.records, shares)


def plan_chunks(config: GeneratorDatagenConfig) -> list[ChunkPlan]:
    """Every chunk's size and per-kind counts: each chunk takes its share of what remains per kind."""
    remaining = kind_totals(config)
    left = config.records
    plans = []
    for index in range(config.chunk_count):
        size = min(config.chunk_records, left)
        counts = largest_remainder(size, remaining) if left else dict.fromkeys(remaining, 0)
        for kind, count in counts.items():
            remaining[kind] -= count
        left -= size
        batches = tuple(
            KindBatch(kind, count, derive_seed(config.seed, index, kind)) for kind, count in counts.items()
        )
        plans.append(ChunkPlan(index, size, batches, derive_seed(config.seed, index, "order")))
    return plans


def record_id(name: str, chunk: int, kind: str | None, index: int) -> str:
    """Stable and unique: '/' appears in neither a dataset name nor a kind."""
    return f"{name}/{chunk:06d}/{kind}/{index}" if kind is not None else f"{name}/{chunk:06d}/{index}"


def split_thresholds(config: GeneratorDatagenConfig) -> tuple[int, int]:
    """Hash values below the first go to train, below the second to val, the rest to test."""
    train = exact_ratio(config.splits.train)
    val = exact_ratio(config.splits.val)
    return int(train * 2**64), int((train + val) * 2**64)


def split_of(identifier: str, thresholds: tuple[int, int]) -> str:
    value = int.from_bytes(hashlib.sha256(identifier.encode()).digest()[:8], "big")
    return "train" if value < thresholds[0] else "val" if value < thresholds[1] else "test"


def settings_hash(config: GeneratorDatagenConfig) -> str:
    canonical = json.dumps(config.output_settings(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# The worker side: import the user's function once per process, make whole chunks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportCheck:
    """What a worker found when importing the generator: its file, or what went wrong."""

    module_file: str | None
    problem: str | None


@dataclass(frozen=True)
class ChunkDone:
    chunk: int
    data: bytes


@dataclass(frozen=True)
class ChunkFailed:
    message: str


_worker_function: Any = None
_worker_check = ImportCheck(None, "the worker was not initialised")
_worker_generator = ""


def _init_worker(search_path: list[str], generator: str, params: dict[str, Any]) -> None:
    global _worker_function, _worker_check, _worker_generator
    # The main process decides when to stop; a Ctrl-C reaching the whole process group must not kill
    # a worker mid-chunk with a traceback. SIGTERM keeps its default: the main process uses it to stop us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:0] = [folder for folder in search_path if folder not in sys.path]
    _worker_generator = generator
    # An exception here would only show as a broken pool; it is kept and reported by `_check_import`.
    _worker_function, _worker_check = _import_generator(generator, params)


def _import_generator(generator: str, params: dict[str, Any]) -> tuple[Any, ImportCheck]:
    import importlib

    module_name, _, function_name = generator.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            return None, ImportCheck(None, f"module {exc.name!r} was not found")
        return None, ImportCheck(None, f"importing {module_name!r} failed: {_describe_exception(exc)}")
    except BaseException as exc:  # SystemExit from user code included: it must not end the worker
        return None, ImportCheck(None, f"importing {module_name!r} raised {_describe_exception(exc)}")
    module_file = getattr(module, "__file__", None)
    function = getattr(module, function_name, None)
    if function is None:
        return None, ImportCheck(module_file, f"module {module_name!r} has no attribute {function_name!r}")
    if not callable(function):
        kind = type(function).__name__
        return None, ImportCheck(module_file, f"{module_name}.{function_name} is a {kind}, not a function")
    return function, ImportCheck(module_file, _signature_problem(function, params))


def _signature_problem(function: Any, params: dict[str, Any]) -> str | None:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # builtins and some C callables have none to check
        return None
    try:
        signature.bind(seed=0, chunk=0, kind=None, count=0, **params)
    except TypeError as exc:
        return (
            f"its signature {signature} cannot take seed, chunk, kind, count"
            + (f" and params {', '.join(params)}" if params else "")
            + f" as keywords ({exc})"
        )
    return None


def _describe_exception(exc: BaseException) -> str:
    """'ValueError: boom (at mygen.py:12)': the type, the message and the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = str(exc)
    return f"{type(exc).__name__}: {message}{where}" if message else f"{type(exc).__name__}{where}"


def _check_import() -> ImportCheck:
    return _worker_check


def _make_chunk(name: str, plan: ChunkPlan, params: dict[str, Any]) -> ChunkDone | ChunkFailed:
    lines: list[str] = []
    for batch in plan.batches:
        if batch.count:
            made = _make_batch(name, plan.index, batch, params)
            if isinstance(made, ChunkFailed):
                return made
            lines += made
    random.Random(plan.order_seed).shuffle(lines)
    return ChunkDone(plan.index, "".join(line + "\n" for line in lines).encode("utf-8"))


def _make_batch(name: str, chunk: int, batch: KindBatch, params: dict[str, Any]) -> list[str] | ChunkFailed:
    where = f"chunk {chunk}, kind {batch.kind!r}, seed {batch.seed}"

    def failed(problem: str) -> ChunkFailed:
        return ChunkFailed(f"generator {_worker_generator} ({where}): {problem}")

    try:
        records = iter(
            _worker_function(seed=batch.seed, chunk=chunk, kind=batch.kind, count=batch.count, **params)
        )
    except BaseException as exc:
        return failed(f"raised {_describe_exception(exc)}; fix the function and run again")
    lines = []
    for index in range(batch.count + 1):  # one more than asked for, to notice a generator that overflows
        try:
            record = next(records)
        except StopIteration:
            break
        except BaseException as exc:
            return failed(
                f"raised {_describe_exception(exc)} after {index} records; fix the function and run again"
            )
        if index == batch.count:
            return failed(f"yielded more than count={batch.count} records; yield exactly count records")
        try:
            lines.append(_record_line(record, record_id(name, chunk, batch.kind, index), batch.kind))
        except BadRecord as exc:
            return failed(f"record {index} {exc}")
    if len(lines) != batch.count:
        return failed(f"yielded {len(lines)} records, not count={batch.count}; yield exactly count records")
    return lines


class BadRecord(ValueError):
    """A record the kit cannot write; the message says what is wrong with it."""


def _record_line(record: Any, identifier: str, kind: str | None) -> str:
    """The record as one JSON line with the kit's id (and kind) added in front of the user's fields."""
    if not isinstance(record, dict):
        raise BadRecord(f"is a {type(record).__name__}, not a dict; yield dicts of JSON values")
    added = {"id": identifier} if kind is None else {"id": identifier, "kind": kind}
    for key, value in added.items():
        if key in record and record[key] != value:
            raise BadRecord(
                f"has its own {key!r} ({record[key]!r}); the kit sets {key}={value!r}: rename that field"
            )
    try:
        line = json.dumps(added | record, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        line.encode("utf-8")  # a lone surrogate in a string only fails here
    except (TypeError, ValueError, RecursionError) as exc:
        raise BadRecord(
            f"is not JSON-serialisable{_culprit_field(record)}: {exc}; yield only JSON values"
        ) from None
    return line


def _culprit_field(record: dict) -> str:
    for key, value in record.items():
        try:
            json.dumps({key: value}, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError, RecursionError):
            return f" (field {key!r} holds a {type(value).__name__})"
    return ""


# ---------------------------------------------------------------------------------------------
# The main process: find the code, make the missing chunks, then the splits and metadata.json
# ---------------------------------------------------------------------------------------------


def run_generator(config: GeneratorDatagenConfig, volume: Volume, watch: PreemptionWatch) -> Path:
    """Make (or reuse, or finish) the dataset `config.name`; returns its folder.

    Raises ConfigError (exit 2) when the generator cannot be imported, InputError (exit 2) when it
    raises or yields bad records, or the folder holds something else; Preempted (exit 143) when
    `watch` saw SIGTERM (committed chunks stay); TemporaryError (exit 75) when a worker process died or
    another datagen is making the same dataset.
    """
    volume.check_writable()
    folder = volume.dataset(config.name)
    expected_hash = settings_hash(config)
    if not _is_complete(folder, expected_hash):
        with one_writer(folder, "generated dataset"):
            # read again under the lease: the writer this one waited out may have finished meanwhile
            if not _is_complete(folder, expected_hash):
                return _generate(config, volume, watch, folder, expected_hash)
    log.info("dataset %s is complete and matches this config (hash %s): reusing it", folder, expected_hash)
    return folder


def _generate(
    config: GeneratorDatagenConfig, volume: Volume, watch: PreemptionWatch, folder: Path, expected_hash: str
) -> Path:
    recorded = _recorded_generation(folder, expected_hash)
    _remove_leftovers(folder)
    plan = plan_chunks(config)
    pending = [chunk for chunk in plan if not (folder / CHUNKS_DIR / chunk.file_name).is_file()]
    if pending:
        search_path = resolve_python_path(config, volume)
        workers = min(config.workers or _cpu_count(), len(pending))
        with GeneratorPool(config, search_path, workers) as pool:
            code = code_identity(pool.check_import(search_path, watch).module_file)
            recorded = _start_generation(folder, config, expected_hash, recorded, code)
            pool.make_chunks(pending, folder / CHUNKS_DIR, len(plan), watch)
    if watch.requested:
        raise Preempted(f"generator run stopped by {watch.signal_name}; every chunk is committed in {folder}")
    metadata = _metadata(
        config, expected_hash, plan, recorded["code"], _write_splits(folder, config, plan, watch)
    )
    write_json(folder / METADATA_FILE, metadata)
    log.info(
        "dataset %s complete: %s",
        folder,
        ", ".join(f"{split} {info['records']} records" for split, info in metadata["splits"].items()),
    )
    return folder


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _is_complete(folder: Path, expected_hash: str) -> bool:
    path = folder / METADATA_FILE
    if not path.is_file():
        return False
    metadata = read_record(path)
    refuse_other_config(folder, "a generated dataset", metadata.get("config_hash"), expected_hash)
    return bool(metadata.get("complete"))


def _recorded_generation(folder: Path, expected_hash: str) -> dict | None:
    """generation.json of a half-made dataset of this config; refuses a folder holding anything else."""
    path = folder / GENERATION_FILE
    if path.is_file():
        recorded = read_record(path)
        refuse_other_config(folder, "a partly generated dataset", recorded.get("config_hash"), expected_hash)
        return recorded
    others = sorted(p.name for p in folder.glob("*") if ".tmp-" not in p.name)
    if others:
        raise InputError(
            f"{folder} already holds files ({', '.join(others[:5])}) that a generator run did not make; "
            "they are not overwritten. Pick another dataset name, or move them away"
        )
    return None


def _remove_leftovers(folder: Path) -> None:
    for leftover in [*folder.glob("*.tmp-*"), *(folder / CHUNKS_DIR).glob("*.tmp-*")]:
        log.info("removing %s left by an interrupted write", leftover.name)
        leftover.unlink()


def _start_generation(
    folder: Path, config: GeneratorDatagenConfig, expected_hash: str, recorded: dict | None, code: dict
) -> dict:
    """Record what is being made before the first chunk; refuse to mix chunks of another generator file.

    Only the generator's own file is compared: a new commit elsewhere in the user's repo (a README, a
    config) is common during a long run and changes no record; it is logged.
    """
    if recorded is None:
        recorded = {
            "format": FORMAT,
            "config_hash": expected_hash,
            "config": config.model_dump(mode="json"),
            "code": code,
        }
        folder.mkdir(parents=True, exist_ok=True)
        write_json(
            folder / GENERATION_FILE, recorded
        )  # first: a folder with chunks always says what they are
    elif recorded["code"]["module_sha256"] != code["module_sha256"]:
        raise InputError(
            f"{folder / CHUNKS_DIR} holds chunks made by another version of {recorded['code']['module_file']} "
            f"(sha256 {str(recorded['code']['module_sha256'])[:12]}; now {code['module_file']}, sha256 "
            f"{str(code['module_sha256'])[:12]}); mixing them would give a dataset that no single version "
            f"makes. Restore that version, or delete {folder} to generate everything with the new one"
        )
    elif recorded["code"]["git"] != code["git"]:
        log.warning(
            "the generator's checkout moved from %s to %s; %s itself is unchanged, so generation continues",
            recorded["code"]["git"],
            code["git"],
            code["module_file"],
        )
    (folder / CHUNKS_DIR).mkdir(exist_ok=True)
    return recorded


def resolve_python_path(config: GeneratorDatagenConfig, volume: Volume) -> list[str]:
    """The folders to import from: each python_path entry, then TRAINPOD_GIT_REPO's checkout at its ref, then
    the other repos' checkouts under repos/ (never that repo's at another ref: gitsync.other_checkouts).

    A relative entry is looked for on the volume, in each synced checkout (where TRAINPOD_GIT_REPO
    lands, so a repo's `examples` folder works with `python_path: [examples]`), then here.
    """
    own = own_checkout(volume.root / "repos", os.environ)
    repos = ([own] if own is not None and own.is_dir() else []) + other_checkouts(volume.root / "repos", own)
    folders, problems = [], []
    for index, entry in enumerate(config.python_path):
        entry_path = Path(entry)
        bases = [Path("/")] if entry_path.is_absolute() else [volume.root, *repos, Path.cwd()]
        found = next((base / entry_path for base in bases if (base / entry_path).is_dir()), None)
        if found is None:
            problems.append(
                f"python_path[{index}] = {entry!r}: no such folder (looked in {', '.join(str(b) for b in bases)}); "
                "fix: give a folder that exists, absolute or relative to the volume root or a repos/ checkout"
            )
        else:
            folders.append(str(found.resolve()))
    if problems:
        raise ConfigError(problems)
    return folders + [str(repo.resolve()) for repo in repos]


def code_identity(module_file: str | None) -> dict:
    """The generator's file, its sha256 and the git commit of the checkout holding it (read, git not run)."""
    if module_file is None:
        return {"module_file": None, "module_sha256": None, "git": None}
    path = Path(module_file).resolve()
    return {
        "module_file": str(path),
        "module_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "git": git_head(path.parent),
    }


def git_head(start: Path) -> dict | None:
    """{repo, ref, commit} of the git checkout holding `start`, from .git/HEAD; None outside one."""
    for folder in (start, *start.parents):
        dot_git = folder / ".git"
        if dot_git.is_file():  # a worktree or submodule: ".git" names the real git dir
            text = dot_git.read_text().strip()
            dot_git = (folder / text.removeprefix("gitdir:").strip()).resolve()
        if dot_git.is_dir() and (dot_git / "HEAD").is_file():
            head = (dot_git / "HEAD").read_text().strip()
            if not head.startswith("ref:"):
                return {"repo": str(folder), "ref": None, "commit": head}
            ref = head.removeprefix("ref:").strip()
            return {"repo": str(folder), "ref": ref, "commit": _resolve_ref(dot_git, ref)}
    return None


def _resolve_ref(git_dir: Path, ref: str) -> str | None:
    common = git_dir
    if (git_dir / "commondir").is_file():  # worktrees keep branch refs in the main git dir
        common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
    for base in (git_dir, common):
        if (base / ref).is_file():
            return (base / ref).read_text().strip()
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            sha, _, name = line.partition(" ")
            if name == ref:
                return sha
    return None  # a branch with no commit yet


class GeneratorPool:
    """Worker processes (spawn) that import the generator and make whole chunks; the main commits them.

    Only the main process writes, so a worker killed at any moment leaves nothing half written.
    """

    def __init__(self, config: GeneratorDatagenConfig, search_path: list[str], workers: int):
        self.config = config
        self.workers = workers
        # Each spawned worker drew its own string hash seed, so a generator iterating a set of strings (or
        # dict keys built from one) made other records in every run from the same seed: the output changed
        # with the worker count and at each resume. Workers started while the pool lives get a fixed one,
        # unless the pod's environment sets PYTHONHASHSEED itself.
        self._saved_hash_seed = os.environ.get(HASH_SEED_VARIABLE)
        os.environ.setdefault(HASH_SEED_VARIABLE, "0")
        # spawn, not fork: a fork would copy the parent's threads, locks and open files into each worker.
        self._executor = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(search_path, config.generator, config.params),
        )

    def check_import(self, search_path: list[str], watch: PreemptionWatch) -> ImportCheck:
        """What a worker found importing the generator; a stop meanwhile raises Preempted (the pool's exit ends
        the workers): a module importing torch or vllm takes seconds, and the stop must not wait for it."""
        future = self._executor.submit(_check_import)
        try:
            while not watch.requested and not wait([future], timeout=POLL_SECONDS).done:
                pass
            if watch.requested:
                raise self._stopped_importing(watch)
            check = future.result()
        except BrokenProcessPool:
            if watch.requested:  # the signal reached the workers too (tini -g sends it to the group)
                raise self._stopped_importing(watch) from None
            check = ImportCheck(
                None, "the worker process died while importing it (os._exit or a native crash)"
            )
        if check.problem is not None:
            raise ConfigError(
                [
                    f"generator = {self.config.generator!r}: {check.problem}; searched python_path "
                    f"{search_path or '(empty: no python_path entries and no checkouts under repos/)'}; "
                    "fix: give package.module:function of a function fn(*, seed, chunk, kind, count, **params) "
                    "in a folder listed in python_path (or in a repo synced by TRAINPOD_GIT_REPO)"
                ]
            )
        return check

    def _stopped_importing(self, watch: PreemptionWatch) -> Preempted:
        return Preempted(
            f"generator run stopped by {watch.signal_name} while its workers imported {self.config.generator}; "
            "run it again to continue"
        )

    def make_chunks(
        self, pending: list[ChunkPlan], chunks_dir: Path, total_chunks: int, watch: PreemptionWatch
    ) -> None:
        """Make and commit every pending chunk; stops between commits when `watch` asks."""
        progress = _Progress(total_chunks, total_chunks - len(pending), self.workers)
        queue: Iterator[ChunkPlan] = iter(pending)
        in_flight: dict[Future, ChunkPlan] = {}
        while True:
            # At most two chunks per worker wait, so a stop cancels little and memory stays bounded.
            for plan in queue:
                try:
                    future = self._executor.submit(_make_chunk, self.config.name, plan, self.config.params)
                except (
                    BrokenProcessPool
                ):  # a worker died since the last wait: its chunk's future is not read yet
                    raise self._worker_died(plan, watch) from None
                in_flight[future] = plan
                if len(in_flight) >= 2 * self.workers:
                    break
            if not in_flight:
                return
            done, _ = wait(in_flight, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: in_flight[f].index):
                plan = in_flight.pop(future)
                write_bytes(chunks_dir / plan.file_name, self._result(future, plan, watch).data)
                progress.committed(plan.records)
            if watch.requested:
                raise Preempted(
                    f"generator run stopped by {watch.signal_name}: {progress.done} of {total_chunks} chunks "
                    f"are committed in {chunks_dir}; run it again to continue from there"
                )

    def _result(self, future: Future, plan: ChunkPlan, watch: PreemptionWatch) -> ChunkDone:
        try:
            result = future.result()
        except BrokenProcessPool:
            raise self._worker_died(plan, watch) from None
        if isinstance(result, ChunkFailed):
            raise InputError(result.message)
        return result

    @staticmethod
    def _worker_died(plan: ChunkPlan, watch: PreemptionWatch) -> Preempted | TemporaryError:
        if watch.requested:  # the signal reached the workers too (tini -g sends it to the group)
            return Preempted(f"generator run stopped by {watch.signal_name} before chunk {plan.index}")
        return TemporaryError(
            f"a generator worker process died without a Python error by chunk {plan.index} (killed by the OS, "
            "e.g. out of memory, or a crash in native code); the committed chunks are kept: run again (with "
            "fewer workers if memory is short)"
        )

    def close(self, stop_now: bool) -> None:
        try:
            self._shut_down(stop_now)
        finally:
            if self._saved_hash_seed is None:
                os.environ.pop(HASH_SEED_VARIABLE, None)

    def _shut_down(self, stop_now: bool) -> None:
        if not stop_now:
            self._executor.shutdown(wait=True)
            return
        # A running chunk cannot be cancelled through the public API before Python 3.14 (kill_workers),
        # and one may take minutes: the workers are killed, their uncommitted chunks are made next time.
        if hasattr(self._executor, "kill_workers"):
            self._executor.kill_workers()
            return
        processes = list((getattr(self._executor, "_processes", None) or {}).values())
        self._executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.kill()
        for process in processes:
            process.join()

    def __enter__(self) -> GeneratorPool:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.close(stop_now=exc_type is not None)


class _Progress:
    """Logs committed chunks, records/s and an ETA every PROGRESS_LOG_SECONDS and at the end."""

    def __init__(self, total: int, done: int, workers: int):
        self.total, self.done, self.this_start, self.records = total, done, 0, 0
        self.started = self.last_log = time.monotonic()
        log.info("generating %d chunks (%d committed earlier) with %d workers", total - done, done, workers)

    def committed(self, records: int) -> None:
        self.done += 1
        self.this_start += 1
        self.records += records
        now = time.monotonic()
        if now - self.last_log < PROGRESS_LOG_SECONDS and self.done < self.total:
            return
        self.last_log = now
        elapsed = max(now - self.started, 1e-9)
        eta_min = (self.total - self.done) * elapsed / self.this_start / 60
        log.info(
            "chunks %d/%d committed, %.1f records/s, ETA %.1f min",
            self.done,
            self.total,
            self.records / elapsed,
            eta_min,
        )


def _write_splits(
    folder: Path, config: GeneratorDatagenConfig, plan: list[ChunkPlan], watch: PreemptionWatch
) -> dict[str, dict]:
    """train/val/test.jsonl (chunk order, records by a hash of their id), each written atomically."""
    thresholds = split_thresholds(config)
    chunk_files = [folder / CHUNKS_DIR / chunk.file_name for chunk in plan]
    kinds: dict[str, Counter] = {split: Counter() for split in SPLITS}
    codes = [
        _assign_splits(path, chunk, thresholds, kinds) for path, chunk in zip(chunk_files, plan, strict=True)
    ]
    splits = {}
    for code, split in enumerate(SPLITS):
        if watch.requested:
            raise Preempted(f"generator run stopped by {watch.signal_name} before writing {split}.jsonl")
        digest = hashlib.sha256()
        path = folder / f"{split}.jsonl"
        write_parts(path, _hashed(digest, _split_lines(code, chunk_files, codes)))
        splits[split] = {
            "file": path.name,
            "records": sum(kinds[split].values()),
            "bytes": path.stat().st_size,
            "sha256": digest.hexdigest(),
            "kinds": dict(sorted(kinds[split].items())) if config.kinds is not None else None,
        }
    return splits


def _assign_splits(
    path: Path, chunk: ChunkPlan, thresholds: tuple[int, int], kinds: dict[str, Counter]
) -> bytes:
    """One byte per record of a committed chunk: its split's index in SPLITS; counts kinds per split.

    Refuses a chunk that does not hold what the plan says (changed after it was committed).
    """
    codes = bytearray()
    found: Counter = Counter()
    for line in path.read_bytes().splitlines():
        record = json.loads(line)
        kind = record.get("kind") if chunk.batches[0].kind is not None else None
        split = split_of(record["id"], thresholds)
        codes.append(SPLITS.index(split))
        kinds[split][kind] += 1
        found[kind] += 1
    planned = {batch.kind: batch.count for batch in chunk.batches if batch.count}
    if dict(found) != planned:
        raise InputError(
            f"{path} holds records {dict(found)} but chunk {chunk.index} is planned as {planned}: the file was "
            "changed after it was committed; delete it and run again to make it anew"
        )
    return bytes(codes)


def _split_lines(code: int, chunk_files: list[Path], codes: list[bytes]) -> Iterator[bytes]:
    for path, chunk_codes in zip(chunk_files, codes, strict=True):
        lines = path.read_bytes().splitlines(keepends=True)
        yield b"".join(line for line, line_code in zip(lines, chunk_codes, strict=True) if line_code == code)


def _hashed(digest: Any, parts: Iterator[bytes]) -> Iterator[bytes]:
    for part in parts:
        digest.update(part)
        yield part


def _metadata(
    config: GeneratorDatagenConfig, expected_hash: str, plan: list[ChunkPlan], code: dict, splits: dict
) -> dict:
    totals = kind_totals(config)
    return {
        "format": FORMAT,
        "complete": True,
        "name": config.name,
        "generator": config.generator,
        "code": code,
        "records": config.records,
        "kinds": {str(kind): count for kind, count in totals.items()} if config.kinds is not None else None,
        "splits": splits,
        "seeds": {"seed": config.seed, "derivation": SEED_DERIVATION, "chunks": [c.to_json() for c in plan]},
        "config": config.model_dump(mode="json"),
        "config_hash": expected_hash,
    }
