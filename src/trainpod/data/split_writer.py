"""Cut one split's token stream into fixed-size shards and remember where to resume after each.

Documents spill across shard boundaries (as in fineweb), so the resume point after a shard is a
document index and a token offset inside that document. Feeding the same documents from that
point gives the same next shards byte for byte, which is what makes a killed run resumable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainpod.data.encoding import EncodedBatch
from trainpod.data.shards import ShardInfo, write_shard

log = logging.getLogger(__name__)


@dataclass
class SplitProgress:
    """What is committed for one split: its shards, and the first token not yet in any of them."""

    shards: list[ShardInfo] = field(default_factory=list)
    resume_document: int = 0  # documents before this one (of this split) are fully in shards
    resume_offset: int = 0  # tokens of `resume_document` (its eot counted) already in shards

    def to_json(self) -> dict:
        return {
            "shards": [s.to_json() for s in self.shards],
            "resume": {"document": self.resume_document, "token_offset": self.resume_offset},
        }

    @classmethod
    def from_json(cls, data: dict) -> SplitProgress:
        return cls(
            [ShardInfo(**s) for s in data["shards"]],
            data["resume"]["document"],
            data["resume"]["token_offset"],
        )

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)


class SplitWriter:
    """Buffers one split's tokens and commits a shard each time `shard_tokens` are collected."""

    def __init__(
        self,
        split: str,
        folder: Path,
        shard_tokens: int,
        dtype: np.dtype,
        progress: SplitProgress,
        on_commit: Callable[[], None],
    ):
        self.split = split
        self.folder = folder
        self.progress = progress
        self.on_commit = on_commit
        self.buffer = np.empty(shard_tokens, dtype=dtype)
        self.fill = 0
        # the first document fed after a resume has its first `resume_offset` tokens in a shard already
        self._skip = (progress.resume_document, progress.resume_offset)

    def wants(self, doc_index: int) -> bool:
        """Whether a document of this split still has tokens to write."""
        return doc_index >= self.progress.resume_document

    def feed(self, batch: EncodedBatch) -> None:
        tokens, first_offset = batch.tokens, 0
        if self._skip is not None and len(batch.doc_indices) and batch.doc_indices[0] == self._skip[0]:
            first_offset = self._skip[1]
            tokens = tokens[first_offset:]
        self._skip = None
        doc_ends = np.cumsum(batch.doc_lengths) - first_offset  # where each document ends in `tokens`
        position = 0
        while position < len(tokens):
            taken = min(len(self.buffer) - self.fill, len(tokens) - position)
            self.buffer[self.fill : self.fill + taken] = tokens[position : position + taken]
            self.fill += taken
            position += taken
            if self.fill == len(self.buffer):
                self._commit(*self._resume_point(position, doc_ends, batch))

    @staticmethod
    def _resume_point(position: int, doc_ends: np.ndarray, batch: EncodedBatch) -> tuple[int, int]:
        current = int(np.searchsorted(doc_ends, position, side="right"))  # first document not finished
        if current == len(doc_ends):
            return int(batch.doc_indices[-1]) + 1, 0
        start = doc_ends[current] - batch.doc_lengths[current]
        return int(batch.doc_indices[current]), int(position - start)

    def finish(self, documents_read: int) -> None:
        """Commit the last, shorter shard (if any tokens are left) once every document is read."""
        if self.fill or self.progress.resume_document < documents_read:
            self._commit(documents_read, 0)

    def _commit(self, resume_document: int, resume_offset: int) -> None:
        if self.fill:  # only `finish` can get here with an empty buffer: no empty shard then
            name = f"{self.split}_{len(self.progress.shards):06d}.bin"
            info = write_shard(self.folder / name, self.buffer[: self.fill])
            self.progress.shards.append(info)
            log.info("committed %s: %d tokens", name, info.tokens)
        self.progress.resume_document, self.progress.resume_offset = resume_document, resume_offset
        self.fill = 0
        self.on_commit()
