"""Encode batches of documents on several cores, results back in submission order.

The main process reads and batches documents; an encoder runs the Rust `encode_batch_fast` on a
whole batch (no offsets computed, one Python call per batch instead of per document) and returns
one flat token array with the end-of-text token before every document, plus the document lengths.

The first MAX_THREAD_ENCODERS encoders are threads of the main process, each with its own tokenizer
(no lock shared between them). `encode_batch_fast` releases the GIL for the Rust work. What holds it
is turning each document's id list into the token array (6.5% of the encode time per token) and
reading the files (about 2%), so four encoder threads keep the GIL about a third busy; further
encoders would queue on it and are worker processes instead. Threads cost no process start, no
tokenizer load per process and no pickling of documents and tokens. On 2 cores (50 MB of short
documents, bench/bench_datagen.py), with files read and shards committed included, that took datagen
from 0.90x to 0.99x of the tokenizer's own multi-threaded `encode_batch_fast` on text already in
memory, and its peak memory from 190 to 104 MiB. A fineweb-style `Pool.imap` over single documents
runs at about 0.5x.

At most `2 x workers` batches are in flight, so memory does not grow with the corpus (`Pool.imap`
would read the whole input ahead into its task queue).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_THREAD_ENCODERS = 4
# tokenizers reads this before each batch call: "false" makes `encode_batch_fast` run on the calling
# thread instead of the Rust thread pool. The encoders already fill the cores; more threads contend.
PARALLELISM_VARIABLE = "TOKENIZERS_PARALLELISM"

# Each encoder's tokenizer and settings, set by `_load_encoder` on the thread that encodes: an
# encoder thread, or a worker process's main thread.
_encoder = threading.local()


@dataclass
class EncodedBatch:
    """The tokens of consecutive documents of one split: [eot] + ids for each, concatenated."""

    split: str
    doc_indices: np.ndarray  # int64, ascending
    doc_lengths: np.ndarray  # int64, tokens per document including its eot
    tokens: np.ndarray


def encode_documents(
    tokenizer, documents: list[str], eot_id: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """([eot] + ids for each document, concatenated; tokens per document including the eot)."""
    encodings = tokenizer.encode_batch_fast(documents, add_special_tokens=False)
    lengths = np.fromiter((len(encoding) + 1 for encoding in encodings), np.int64, len(encodings))
    # Straight into the array, each document's id list made and dropped in turn: no list of every id
    # of the batch (a third faster than list.extend + np.array, and less for the GC to scan).
    ids = itertools.chain.from_iterable(itertools.chain((eot_id,), encoding.ids) for encoding in encodings)
    return np.fromiter(ids, dtype, int(lengths.sum())), lengths


def _load_encoder(tokenizer_file: str, eot_id: int, dtype: str, special_tokens_as_text: bool = False) -> None:
    from tokenizers import Tokenizer

    _encoder.tokenizer = Tokenizer.from_file(tokenizer_file)
    # A tokenizer.json saved with truncation or padding enabled (a reused tokenizer.path) applies them to
    # every encode: documents cut to max_length, or padded to their batch's longest. A document is
    # encoded whole, as transformers encodes it unless asked otherwise.
    _encoder.tokenizer.no_truncation()
    _encoder.tokenizer.no_padding()
    # Like llm.c's encode_ordinary: a document holding the text "<|endoftext|>" (or "</s>", an HTML tag)
    # is encoded as that text, so the end-of-text id appears only where the kit puts it, between documents.
    _encoder.tokenizer.encode_special_tokens = special_tokens_as_text
    _encoder.eot_id, _encoder.dtype = eot_id, np.dtype(dtype)


def _start_worker_process(tokenizer_file: str, eot_id: int, dtype: str, special_tokens_as_text: bool) -> None:
    os.environ[PARALLELISM_VARIABLE] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    # The main process decides when to stop (SIGTERM/SIGINT); a Ctrl-C in the terminal reaches the
    # whole process group and must not kill a worker mid-batch with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _load_encoder(tokenizer_file, eot_id, dtype, special_tokens_as_text)


def _encode(split: str, doc_indices: np.ndarray, documents: list[str]) -> EncodedBatch:
    tokens, lengths = encode_documents(_encoder.tokenizer, documents, _encoder.eot_id, _encoder.dtype)
    return EncodedBatch(split, doc_indices, lengths, tokens)


class _ThreadEncoders:
    """Encoder threads in this process, each with a tokenizer of its own."""

    def __init__(
        self, tokenizer_file: Path, eot_id: int, dtype: np.dtype, threads: int, special_tokens_as_text: bool
    ):
        self._executor = concurrent.futures.ThreadPoolExecutor(
            threads,
            thread_name_prefix="encoder",
            initializer=_load_encoder,
            initargs=(str(tokenizer_file), eot_id, np.dtype(dtype).str, special_tokens_as_text),
        )

    def submit(self, split: str, doc_indices: np.ndarray, documents: list[str]) -> Callable[[], EncodedBatch]:
        return self._executor.submit(_encode, split, doc_indices, documents).result

    def close(self) -> None:
        # A batch being encoded finishes (a fraction of a second); queued ones are dropped.
        self._executor.shutdown(wait=True, cancel_futures=True)


class _ProcessEncoders:
    """Encoder worker processes (spawn, not fork: a fork would copy the parent's threads' state,
    the encoder threads' included, and its open shard files).

    concurrent.futures, not multiprocessing.Pool: a Pool replaces a worker that dies (the OOM killer,
    a SIGTERM that `tini -g` sends to the whole group) and never completes the batch it held, so the
    main process waited for it forever. Here every waiting batch raises BrokenProcessPool instead."""

    def __init__(
        self, tokenizer_file: Path, eot_id: int, dtype: np.dtype, processes: int, special_tokens_as_text: bool
    ):
        self._executor = concurrent.futures.ProcessPoolExecutor(
            processes,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker_process,
            initargs=(str(tokenizer_file), eot_id, np.dtype(dtype).str, special_tokens_as_text),
        )

    def submit(self, split: str, doc_indices: np.ndarray, documents: list[str]) -> Callable[[], EncodedBatch]:
        return self._executor.submit(_encode, split, doc_indices, documents).result

    def close(self) -> None:
        processes = list((getattr(self._executor, "_processes", None) or {}).values())
        self._executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:  # a batch in a worker cannot be cancelled: the workers are ended
            process.kill()
        for process in processes:
            process.join()


class BatchEncoder:
    """`workers` encoders with a bounded, ordered queue of batches.

    with BatchEncoder(folder / "tokenizer.json", eot_id, np.uint16, workers=2) as encoder:
        for batch in encoder.map(batches):   # yields EncodedBatch in input order
            ...

    `threads` (default: up to MAX_THREAD_ENCODERS) says how many of the encoders are threads.
    `special_tokens_as_text`: a special token's text inside a document is encoded as text, not as its id.
    """

    def __init__(
        self,
        tokenizer_file: Path,
        eot_id: int,
        dtype: np.dtype,
        workers: int,
        threads: int | None = None,
        special_tokens_as_text: bool = False,
    ):
        threads = min(workers, MAX_THREAD_ENCODERS) if threads is None else threads
        if not 0 <= threads <= workers:
            raise ValueError(f"threads={threads} must be between 0 and workers={workers}")
        self.workers = workers
        self._saved_parallelism = os.environ.get(PARALLELISM_VARIABLE)
        os.environ[PARALLELISM_VARIABLE] = "false"  # before any encoder thread starts reading it
        self._groups: list[_ThreadEncoders | _ProcessEncoders] = []
        self._turns: list[_ThreadEncoders | _ProcessEncoders] = []  # batch i goes to _turns[i % workers]
        try:
            for kind, count in ((_ThreadEncoders, threads), (_ProcessEncoders, workers - threads)):
                if count:
                    self._groups.append(kind(tokenizer_file, eot_id, dtype, count, special_tokens_as_text))
                    self._turns += [self._groups[-1]] * count
        except BaseException:
            self.close()
            raise

    def map(self, batches: Iterator[tuple[str, np.ndarray, list[str]]]) -> Iterator[EncodedBatch]:
        in_flight: collections.deque[Callable[[], EncodedBatch]] = collections.deque()
        max_in_flight = 2 * self.workers
        for turn, (split, doc_indices, documents) in zip(itertools.cycle(self._turns), batches):
            in_flight.append(turn.submit(split, doc_indices, documents))
            if len(in_flight) >= max_in_flight:
                yield in_flight.popleft()()
        while in_flight:
            yield in_flight.popleft()()

    def close(self) -> None:
        for group in self._groups:
            group.close()
        self._groups = []
        if self._saved_parallelism is None:
            os.environ.pop(PARALLELISM_VARIABLE, None)
        else:
            os.environ[PARALLELISM_VARIABLE] = self._saved_parallelism

    def __enter__(self) -> BatchEncoder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
