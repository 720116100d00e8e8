"""The datagen workload: documents -> tokenizer -> llm.c-format token shards + manifest.json.

    TRAINPOD_CONFIG=configs/datagen/tiny.yaml TRAINPOD_VOLUME=./demo-volume trainpod run datagen

Output in $TRAINPOD_VOLUME/datasets/<name>/: `train_000000.bin ...`, `val_000000.bin ...` (fineweb
format, see shards.py), `progress.json` (updated after every committed shard) and, last,
`manifest.json`. Killed at any moment and started again, it continues from progress.json and the
shards come out byte-identical to an uninterrupted run; a complete dataset is reused as it is.
One datagen writes a dataset at a time: it holds `datasets/.<name>.LEASE` while it builds (checkpoint/lease.one_writer).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from trainpod.atomic import read_json, write_json
from trainpod.checkpoint import Lease
from trainpod.checkpoint.lease import lease_lost, one_writer, release_folder_leases
from trainpod.config.datagen import DatagenConfig
from trainpod.data.encoding import BatchEncoder
from trainpod.data.shards import HEADER_BYTES, shard_header, token_dtype
from trainpod.data.sources import (
    check_sources,
    describe_sources,
    hub_revisions,
    iter_documents,
    source_labels,
)
from trainpod.data.split_writer import SplitProgress, SplitWriter
from trainpod.data.tokenizer import (
    SETTINGS_FILE,
    TOKENIZER_FILE,
    TokenizerInfo,
    prepare_tokenizer,
    trained_hub_revisions,
)
from trainpod.errors import ExitCode, InputError, Preempted, TemporaryError
from trainpod.preemption import PreemptionWatch, exit_now_when_preempted
from trainpod.volume import Volume

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
PROGRESS_FILE = "progress.json"
MANIFEST_FORMAT = "trainpod-datagen/1"
SPECIAL_TOKENS_AS_TEXT = "special_tokens_as_text"  # in progress.json and manifest.json
UTF8_BOM_STRIPPED = "utf8_bom_stripped"  # likewise
SOURCE_FILES = "source_files"  # in progress.json: the files read so far, as sources.file_label names them
HUB_REVISIONS = "hub_revisions"  # in progress.json: the commit each hub dataset is read at, by its name
SHARD_NAME = re.compile(r"^(train|val)_\d{6}\.bin$")  # as SplitWriter names its shards
# A batch is also cut at this many characters, so a corpus of book-length documents does not put
# gigabytes in flight (1000 fineweb documents are ~4 MB).
MAX_BATCH_CHARACTERS = 8_000_000
_MASK64 = (1 << 64) - 1


def settings_hash(config: DatagenConfig) -> str:
    """Identifies what the shards depend on; workers and batch size may change between runs."""
    canonical = json.dumps(config.output_settings(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def is_validation(doc_index: int, val_ratio: float) -> bool:
    """A fixed pseudo-random choice per document index (splitmix64), independent of batching."""
    x = (doc_index + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) < val_ratio * 2**64


def run_datagen(config: DatagenConfig, volume: Volume, watch: PreemptionWatch) -> Path:
    """Build (or reuse, or resume) the dataset `config.name`; returns its folder.

    Raises InputError (exit 2) for missing sources or a folder holding another config's dataset,
    Preempted (exit 143) when `watch` saw SIGTERM: the committed shards and progress stay;
    TemporaryError (exit 75) while another datagen builds the same dataset.
    """
    volume.check_writable()
    folder = volume.dataset(config.name)
    expected_hash = settings_hash(config)
    manifest = _existing_manifest(folder, expected_hash)
    if manifest is None:
        with one_writer(folder, "dataset") as lease:
            # read again under the lease: the writer this one waited out may have finished meanwhile
            manifest = _existing_manifest(folder, expected_hash)
            if manifest is None:
                return _build(config, volume, folder, expected_hash, watch, lease)
    tokenizer = _tokenizer(config, volume)
    _check_same_tokenizer(folder / MANIFEST_FILE, manifest["tokenizer"]["sha256"], tokenizer)
    log.info(
        "dataset %s is complete and matches this config (hash %s): reusing it, nothing to do",
        folder,
        expected_hash,
    )
    return folder


def _tokenizer(
    config: DatagenConfig,
    volume: Volume,
    watch: PreemptionWatch | None = None,
    revisions: dict[str, str] | None = None,
) -> TokenizerInfo:
    """The dataset's tokenizer, trained when needed (hub datasets read at `revisions`); with `watch`, a stop
    asked before or during the training raises Preempted and publishes no tokenizer."""
    documents = itertools.islice(
        iter_documents(config.sources, volume.root, revisions=revisions), config.tokenizer.max_train_documents
    )
    # After the last document the library merges in one Rust call (tens of seconds on a large corpus) where
    # no stop is seen: a thread then lets the dataset's and the tokenizer's leases go and exits 143.
    stuck = (
        contextlib.nullcontext()
        if watch is None
        else watch.ended_when_stuck(_release_leases_and_exit_preempted)
    )
    with stuck:
        if watch is not None:
            # Before the tokenizer's lease, whose takeover after a kill waits 2 s more (TAKEOVER_SETTLE_S).
            _raise_if_stopped(watch, "before the tokenizer")
            documents = _until_stopped(documents, watch)
        return prepare_tokenizer(
            config.tokenizer,
            volume.tokenizer(config.tokenizer_name),
            volume.root,
            documents,
            config.output_settings(),
            revisions,
        )


def _release_leases_and_exit_preempted() -> None:
    log.warning(
        "datagen stopped by a signal while the tokenizer trained in one long call; publishing nothing more"
    )
    release_folder_leases()
    log.warning("exiting %d", ExitCode.PREEMPTED)
    exit_now_when_preempted(ExitCode.PREEMPTED)


def _until_stopped(documents: Iterator[str], watch: PreemptionWatch) -> Iterator[str]:
    """The tokenizer's training documents, ended by a stop: tokenizers reads them all (fineweb-edu.yaml's
    200k, minutes of a hub stream) and trains in one call, and raises what the iterator raises."""
    for document in documents:
        _raise_if_stopped(watch, "while training the tokenizer")
        yield document


def _raise_if_stopped(watch: PreemptionWatch, when: str) -> None:
    if watch.requested:
        raise Preempted(
            f"datagen stopped by {watch.signal_name} {when}; nothing of it is published: run it again"
        )


def _build(
    config: DatagenConfig,
    volume: Volume,
    folder: Path,
    expected_hash: str,
    watch: PreemptionWatch,
    lease: Lease,
) -> Path:
    """Write (or finish) the shards, then the manifest: only under the dataset's lease."""
    # Only a build checks the sources: a finished dataset stays usable after its source files are gone.
    check_sources(config.sources, volume.root)
    revisions = _hub_revisions(folder, config, expected_hash, volume)
    _refuse_empty_sources(config, volume, revisions)
    if folder.is_dir() and not (folder / PROGRESS_FILE).is_file():
        _refuse_files_of_others(folder)
    tokenizer = _tokenizer(config, volume, watch, revisions)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(folder)
    progress = _load_progress(
        folder, config, expected_hash, tokenizer, source_labels(config.sources, volume.root)
    )
    reading = {SPECIAL_TOKENS_AS_TEXT: _begun_since(folder, SPECIAL_TOKENS_AS_TEXT),
               UTF8_BOM_STRIPPED: _begun_since(folder, UTF8_BOM_STRIPPED)}  # fmt: skip
    documents_read = _write_shards(
        config, volume, folder, tokenizer, progress, expected_hash, reading, revisions, watch, lease
    )
    manifest = _manifest(config, volume, tokenizer, progress, expected_hash, documents_read, revisions)
    write_json(folder / MANIFEST_FILE, manifest | reading)
    total = sum(p.tokens for p in progress.values())
    log.info(
        "dataset %s complete: %d documents, %d tokens in %d shards",
        folder,
        documents_read,
        total,
        sum(len(p.shards) for p in progress.values()),
    )
    return folder


def _hub_revisions(folder: Path, config: DatagenConfig, expected_hash: str, volume: Volume) -> dict[str, str]:
    """The commit each hub dataset of the sources is read at: the one progress.json recorded when the dataset
    was begun, else (a fresh start) the one the dataset's tokenizer was trained at, else the one its repository
    is at now (sources.hub_revisions). progress.json is written with the first shard and the tokenizer before
    it: a start killed between the two reads the tokenizer's commits again, not a commit pushed since. A
    dataset begun before progress.json recorded them goes on at each repository's newest commit, as it began,
    recorded then for the resumes after."""
    if all(source.hf is None for source in config.sources):
        return {}
    path = folder / PROGRESS_FILE
    recorded = read_record(path) if path.is_file() else {}
    if recorded.get("config_hash") == expected_hash:
        pinned = recorded.get(HUB_REVISIONS)
        if pinned is None:  # read at a commit nothing names: the newest is the likeliest, held from now on
            revisions = hub_revisions(config.sources)
            log.warning(
                "%s was begun before datagen recorded the commit it reads hub datasets at: it goes on at their "
                "newest commit, %s, recorded for every later resume; if one was pushed to since the dataset was "
                "begun, delete the folder to build it from one commit",
                folder,
                revisions,
            )
            return revisions
        if not isinstance(pinned, dict) or not all(isinstance(v, str) for v in pinned.values()):
            raise damaged_record(path, f"{HUB_REVISIONS} is {pinned!r}, not names and commits")
        log.info("reading hub datasets at the commits recorded when the dataset was begun: %s", pinned)
        return pinned
    tokenizer = volume.tokenizer(config.tokenizer_name)
    trained_at = None if config.tokenizer.path else trained_hub_revisions(tokenizer, config.output_settings())
    if trained_at:
        log.info(
            "reading hub datasets at the commits %s was trained on (its %s), recorded for every resume: %s; "
            "give tokenizer.name a new name to train one on their newest commits",
            tokenizer,
            SETTINGS_FILE,
            trained_at,
        )
        return trained_at
    revisions = hub_revisions(config.sources)
    if revisions:
        log.info("reading hub datasets at their newest commits, recorded for every resume: %s", revisions)
    return revisions


def _refuse_empty_sources(config: DatagenConfig, volume: Volume, revisions: dict[str, str]) -> None:
    """Sources without one non-empty document are bad input, before a tokenizer is trained on nothing.

    Finished, that empty dataset and its byte-only tokenizer would be reused as they are once the
    files were fixed: neither records what the source files held.
    """
    if next(iter_documents(config.sources, volume.root, revisions=revisions), None) is None:
        described = ", ".join(source.describe() for source in config.sources)
        raise InputError(
            f"sources {described} hold no document (text files empty or only whitespace; JSONL, parquet "
            "or hub records whose text_field is null or empty); nothing is written. Point sources[].path "
            "at the data, or set sources[].text_field to the column holding the text"
        )


def _existing_manifest(folder: Path, expected_hash: str) -> dict | None:
    """The manifest of a complete dataset made from this config, None when there is none yet."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    manifest = read_record(path)
    refuse_other_config(folder, "a dataset", manifest.get("config_hash"), expected_hash)
    return manifest if manifest.get("complete") else None


def read_record(path: Path) -> dict:
    """A JSON object that a datagen run wrote (manifest, progress); InputError naming it when damaged.

    They are written atomically, so only a hand edit, a copy cut short or a failing disk damages one.
    What it described cannot be trusted then, and the files beside it are not overwritten either.
    """
    try:
        record = read_json(path)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
        record, problem = None, f"{type(exc).__name__}: {exc}"
    else:
        problem = f"a JSON {type(record).__name__}, not an object"
    if not isinstance(record, dict):
        raise damaged_record(path, problem)
    return record


def damaged_record(path: Path, problem: str) -> InputError:
    return InputError(
        f"{path} is damaged ({problem}); nothing in {path.parent} is overwritten. Restore the file, or "
        "delete the folder to build it again"
    )


def refuse_other_config(folder: Path, what: str, recorded_hash: str | None, expected_hash: str) -> None:
    """Nothing made from another config is ever overwritten: the user picks a name or deletes it."""
    if recorded_hash != expected_hash:
        raise InputError(
            f"{folder} holds {what} made from a different config (hash {recorded_hash}, this config "
            f"{expected_hash}); it is not overwritten. Pick another dataset name, or delete the folder to "
            "build it again"
        )


def _check_same_tokenizer(where: Path, recorded_sha: str, tokenizer: TokenizerInfo) -> None:
    if recorded_sha != tokenizer.sha256:
        raise InputError(
            f"{where} was made with tokenizer sha256 {recorded_sha[:12]}, but {tokenizer.folder} now has "
            f"{tokenizer.sha256[:12]}; its shards do not match this tokenizer and are not overwritten. "
            "Pick another dataset name, or delete the dataset folder to rebuild it"
        )


def _remove_leftovers(folder: Path) -> None:
    for leftover in folder.glob("*.tmp-*"):
        log.info("removing %s left by an interrupted write", leftover.name)
        leftover.unlink()


def _check_same_source_files(folder: Path, recorded: list[str] | None, source_files: list[str]) -> None:
    """A file that joined or left the sources' globs and folders among those read before a kill moved every
    later document to another index: going on from the committed document index would write documents
    twice or never, and put documents of train shards into val. Files joining after those read move none
    of the committed documents (the dataset is then the one an uninterrupted run over them makes). A
    dataset begun before progress.json recorded the files read (None) is not checked."""
    if recorded is None or source_files[: len(recorded)] == recorded:
        return
    added = [f for f in source_files[: len(recorded)] if f not in recorded]
    gone = [f for f in recorded if f not in source_files]
    changes = [
        f"{what} since: {', '.join(files[:5])}" for what, files in (("added", added), ("gone", gone)) if files
    ]
    changed = "; ".join(changes) or "read in another order"
    raise InputError(
        f"{folder} was begun from other source files than the sources name now ({changed}): every document "
        "after the change has another index, so going on would write some documents twice and others never, "
        f"and move some from train to val. Put the files back as they were to resume it, or delete {folder} "
        "to build it from the files there now"
    )


def _load_progress(
    folder: Path, config: DatagenConfig, expected_hash: str, tokenizer: TokenizerInfo, source_files: list[str]
) -> dict[str, SplitProgress]:
    """Committed shards per split from progress.json (empty for a fresh start); drops unlisted shards.
    InputError when the sources name other files than when the committed shards were cut."""
    path = folder / PROGRESS_FILE
    progress = {split: SplitProgress() for split in config.splits}
    if path.is_file():
        recorded = read_record(path)
        refuse_other_config(folder, "a partly written dataset", recorded.get("config_hash"), expected_hash)
        try:
            recorded_sha = str(recorded["tokenizer_sha256"])
            progress = {split: SplitProgress.from_json(recorded["splits"][split]) for split in config.splits}
        except (KeyError, TypeError, ValueError) as exc:
            raise damaged_record(path, f"a field missing or malformed: {type(exc).__name__}: {exc}") from None
        _check_same_tokenizer(path, recorded_sha, tokenizer)
        if not _shards_intact(folder, progress):
            progress = {split: SplitProgress() for split in config.splits}
        else:
            _check_same_source_files(folder, recorded.get(SOURCE_FILES), source_files)
            log.info(
                "resuming: %s",
                ", ".join(f"{split} {len(p.shards)} shards committed" for split, p in progress.items()),
            )
    listed = {s.file for p in progress.values() for s in p.shards}
    for shard in folder.glob("*.bin"):
        # renamed into place but the crash came before progress.json; another program's .bin stays
        if SHARD_NAME.match(shard.name) and shard.name not in listed:
            shard.unlink()
    return progress


def _begun_since(folder: Path, change: str) -> bool:
    """Whether the dataset reads and encodes as `change` says, for a change made to how it does:

    SPECIAL_TOKENS_AS_TEXT: a special token's text inside a document is encoded as text (llm.c's
    encode_ordinary), not as the token's id; UTF8_BOM_STRIPPED: a text file's UTF-8 byte-order mark is no
    part of its first document (kept, it was tokens, and a file holding only the mark before a blank line
    was a document of its own, moving every later document's index and split).

    True for every dataset begun now; a dataset begun before, whose progress.json does not say, goes on
    as it began, so its shards stay those of one uninterrupted run.
    """
    path = folder / PROGRESS_FILE
    return bool(read_record(path).get(change, False)) if path.is_file() else True


def _refuse_files_of_others(folder: Path) -> None:
    """A folder without progress.json holds at most shards that a killed first run committed.

    Anything else was put there by someone else (llm.c shards pushed under this name, a generated
    dataset, notes): it is not deleted or mixed with this dataset's shards.
    """
    others = sorted(
        p.name for p in folder.iterdir() if not SHARD_NAME.match(p.name) and ".tmp-" not in p.name
    )
    if others:
        raise InputError(
            f"{folder} already holds files ({', '.join(others[:5])}) that datagen did not make; they are "
            "not overwritten. Pick another dataset name, or move them away"
        )


def _shards_intact(folder: Path, progress: dict[str, SplitProgress]) -> bool:
    for split_progress in progress.values():
        for shard in split_progress.shards:
            path = folder / shard.file
            if not path.is_file() or path.stat().st_size != shard.bytes:
                log.warning(
                    "progress.json lists %s but it is missing or has another size; starting over", path
                )
                return False
    return True


class DocumentBatcher:
    """Reads documents in order, assigns each a split, and groups them into per-split batches.

    Documents a split has already committed (before its resume point) are counted but never sent
    to the encoder, so resuming costs one read of the skipped text, not its encoding. That read (minutes
    of a hub stream) yields no batch after which the stop flag is looked at, so it looks itself.
    """

    def __init__(
        self,
        config: DatagenConfig,
        volume: Volume,
        writers: dict[str, SplitWriter],
        watch: PreemptionWatch,
        strip_bom: bool = True,
        on_open: Callable[[str], None] | None = None,
        revisions: dict[str, str] | None = None,
    ):
        """`on_open`: told each source file's label as it is opened (sources.iter_source); `revisions`: the
        commit each hub dataset is read at (_hub_revisions)."""
        self.config = config
        self.on_open = on_open
        self.revisions = revisions
        self.volume = volume
        self.writers = writers
        self.strip_bom = strip_bom
        self.watch = watch
        self.documents_read = 0

    def __iter__(self) -> Iterator[tuple[str, np.ndarray, list[str]]]:
        pending: dict[str, tuple[list[int], list[str]]] = {split: ([], []) for split in self.writers}
        characters = dict.fromkeys(self.writers, 0)
        limit = self.config.smoke_documents if self.config.mode == "smoke" else None
        for index, document in enumerate(
            itertools.islice(
                iter_documents(
                    self.config.sources, self.volume.root, self.strip_bom, self.on_open, self.revisions
                ),
                limit,
            )
        ):
            self.documents_read = index + 1
            split = self._split_of(index)
            if not self.writers[split].wants(index):
                if self.watch.requested:
                    raise Preempted(
                        f"datagen stopped by {self.watch.signal_name} while reading past the documents its "
                        "committed shards hold; run it again to continue from there"
                    )
                continue
            indices, documents = pending[split]
            indices.append(index)
            documents.append(document)
            characters[split] += len(document)
            if len(documents) >= self.config.batch_documents or characters[split] >= MAX_BATCH_CHARACTERS:
                yield split, np.array(indices, dtype=np.int64), documents
                pending[split], characters[split] = ([], []), 0
        for split, (indices, documents) in pending.items():
            if documents:
                yield split, np.array(indices, dtype=np.int64), documents

    def _split_of(self, index: int) -> str:
        if len(self.writers) > 1 and is_validation(index, self.config.val_ratio):
            return "val"
        return "train"


def _write_shards(
    config: DatagenConfig,
    volume: Volume,
    folder: Path,
    tokenizer: TokenizerInfo,
    progress: dict[str, SplitProgress],
    expected_hash: str,
    reading: dict[str, bool],
    revisions: dict[str, str],
    watch: PreemptionWatch,
    lease: Lease | None = None,
) -> int:
    """Encode and commit every remaining shard; returns the number of documents read. `reading`: how the
    dataset was begun (_begun_since), recorded in progress.json with the files read so far and `revisions`,
    the commit each hub dataset is read at (_hub_revisions)."""
    files_opened: list[str] = []

    def save_progress() -> None:
        write_json(
            folder / PROGRESS_FILE,
            {
                "config_hash": expected_hash,
                "tokenizer_sha256": tokenizer.sha256,
                **reading,
                SOURCE_FILES: files_opened,
                HUB_REVISIONS: revisions,
                "splits": {split: p.to_json() for split, p in progress.items()},
            },
        )

    dtype = token_dtype(tokenizer.vocab_size)
    writers = {
        split: SplitWriter(split, folder, config.shard_tokens, dtype, p, save_progress)
        for split, p in progress.items()
    }
    batcher = DocumentBatcher(
        config,
        volume,
        writers,
        watch,
        reading[UTF8_BOM_STRIPPED],
        files_opened.append,
        revisions,
    )
    workers = config.workers or _cpu_count()
    started, encoded = time.monotonic(), 0

    def stopped() -> Preempted:
        return Preempted(
            f"datagen stopped by {watch.signal_name}: "
            f"{sum(len(p.shards) for p in progress.values())} shards are committed in {folder}; "
            "run it again to continue from there"
        )

    with BatchEncoder(
        tokenizer.folder / TOKENIZER_FILE,
        tokenizer.eot_id,
        dtype,
        workers,
        special_tokens_as_text=reading[SPECIAL_TOKENS_AS_TEXT],
    ) as encoder:
        try:
            for batch in encoder.map(iter(batcher)):
                writers[batch.split].feed(batch)
                encoded += len(batch.tokens)
                if watch.requested:
                    raise stopped()
                if lease is not None and lease.lost.is_set():
                    raise lease_lost(folder)
        except BrokenProcessPool:
            if watch.requested:  # the SIGTERM reached the encoder workers too (tini -g signals the group)
                raise stopped() from None
            raise TemporaryError(
                "an encoder worker process died without a Python error (killed by the OS, e.g. out of "
                f"memory); {sum(len(p.shards) for p in progress.values())} shards are committed in {folder}: "
                "run again to continue from there (with fewer `workers` if memory is short)"
            ) from None
    for writer in writers.values():
        writer.finish(batcher.documents_read)
    elapsed = max(time.monotonic() - started, 1e-9)
    log.info(
        "encoded %d tokens in %.1f s (%.2f M tokens/s, %d workers)",
        encoded,
        elapsed,
        encoded / elapsed / 1e6,
        workers,
    )
    return batcher.documents_read


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _manifest(
    config: DatagenConfig,
    volume: Volume,
    tokenizer: TokenizerInfo,
    progress: dict[str, SplitProgress],
    expected_hash: str,
    documents_read: int,
    revisions: dict[str, str],
) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    header = shard_header(0, dtype)
    splits = {
        split: {"tokens": p.tokens, "shards": [s.to_json() for s in p.shards]}
        for split, p in progress.items()
    }
    return {
        "format": MANIFEST_FORMAT,
        "complete": True,
        "name": config.name,
        "dtype": dtype.name,
        "shard_format": {"magic": int(header[0]), "version": int(header[1]), "header_bytes": HEADER_BYTES},
        "splits": splits,
        "total_tokens": sum(p.tokens for p in progress.values()),
        "documents": documents_read,
        "tokenizer": tokenizer.to_json(),
        "sources": describe_sources(config.sources, volume.root, revisions),
        "config": config.model_dump(mode="json"),
        "config_hash": expected_hash,
    }


def dataset_shards(dataset_dir: Path, manifest: dict, split: str) -> list[Path]:
    """The shard files of `split` ("train" or "val") in order; empty when the dataset has no such split."""
    return [
        Path(dataset_dir) / shard["file"] for shard in manifest["splits"].get(split, {}).get("shards", [])
    ]


def dataset_vocab(name: str, volume: Volume) -> int | None:
    """The tokenizer's vocabulary in dataset `name`'s manifest (a folder under the volume's datasets/,
    or an absolute path), or None while it is missing or unreadable (its workload's preflight says so)."""
    folder = Path(name) if os.path.isabs(name) else volume.dataset(name)
    try:
        return int(json.loads((folder / MANIFEST_FILE).read_text())["tokenizer"]["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_dataset_manifest(dataset_dir: Path) -> dict:
    """The manifest of a complete dataset (schema: `_manifest`), every listed shard present.

    Raises InputError naming the folder and the command that makes it.
    """
    dataset_dir = Path(dataset_dir)
    make_it = (
        f"make it with `TRAINPOD_CONFIG=<datagen config with name: {dataset_dir.name}> "
        "trainpod run datagen` (e.g. configs/datagen/tiny.yaml)"
    )
    path = dataset_dir / MANIFEST_FILE
    if not dataset_dir.is_dir():
        raise InputError(f"dataset folder {dataset_dir} does not exist; {make_it}")
    if not path.is_file():
        raise InputError(
            f"dataset folder {dataset_dir} has no {MANIFEST_FILE}: datagen has not finished there; "
            f"{make_it} (it resumes where it stopped)"
        )
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"{path} is unreadable ({exc}); delete {dataset_dir} and {make_it}") from None
    if not isinstance(data, dict) or not data.get("complete") or data.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{path} does not describe a complete {MANIFEST_FORMAT} dataset; {make_it}")
    try:  # what pretrain and convert read from it: a manifest cut or edited by hand crashed them (exit 1)
        int(data["tokenizer"]["vocab_size"])
        listed = [
            (shard["file"], int(shard["bytes"]))
            for split in data["splits"].values()
            for shard in split["shards"]
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InputError(
            f"{path} is damaged (a field missing or malformed: {type(exc).__name__}: {exc}); "
            f"delete {dataset_dir} and {make_it}"
        ) from None
    for file, size in listed:
        shard_path = dataset_dir / file
        if not shard_path.is_file() or shard_path.stat().st_size != size:
            raise InputError(
                f"{shard_path} is listed in {path} but is missing or has another size; "
                f"delete {dataset_dir} and {make_it}"
            )
    return data
