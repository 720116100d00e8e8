"""Rows of an SFT dataset in a fixed order: files sorted, each read front to back.

A row comes with where it is (`file, line N` for JSON Lines, `file, row N` for a JSON array or
parquet), so a bad row's error can say exactly where to look.
"""

from __future__ import annotations

import gzip
import importlib.resources
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainpod import atomic
from trainpod.config.sft import BUILTIN_DPO_TINY, BUILTIN_SFT_TINY, SftSourceConfig
from trainpod.data.sources import expand_path, unreadable_file_problem
from trainpod.errors import InputError

SUFFIXES = (".jsonl", ".json", ".parquet")
PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Row:
    record: dict
    where: str  # "path, line 12" or "path, row 3"


# The embedded demo datasets a dataset's path may name, and their files in the package.
BUILTIN_FILES = {BUILTIN_SFT_TINY: "sft_tiny.jsonl", BUILTIN_DPO_TINY: "dpo_tiny.jsonl"}


def builtin_path(name: str) -> Path:
    return Path(str(importlib.resources.files("trainpod") / "demo_corpus" / BUILTIN_FILES[name]))


def builtin_sft_tiny_path() -> Path:
    return builtin_path(BUILTIN_SFT_TINY)


def _data_suffix(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return suffixes[-1] if suffixes and suffixes[-1] in SUFFIXES else None


def resolve_files(source: SftSourceConfig, volume_root: Path, section: str = "sft") -> list[Path]:
    """The files a dataset's path names (a file, a folder searched recursively, or a glob), sorted. `section` is
    the config section that lists the datasets, as the errors name its fields: a datagen config's `sft`, a
    finetune's `data.sft`, a finetune-vlm's `data`."""
    if source.path in BUILTIN_FILES:
        return [builtin_path(source.path)]
    pattern, files = expand_path(source.path, volume_root, lambda p: _data_suffix(p) is not None)
    _refuse_generated_dataset_folder(source, pattern, section)
    if not files:
        what = "folder holds no .json/.jsonl/.parquet files" if pattern.is_dir() else "matches no file"
        raise InputError(
            f"sft dataset path {source.path!r} ({pattern}) {what}; relative paths are taken from the volume "
            f"root {volume_root}: fix {section}.datasets[].path or copy the files there"
        )
    for path in files:
        if _data_suffix(path) is None:
            raise InputError(
                f"sft dataset file {path} is not .json, .jsonl or .parquet (optionally .gz); "
                f"convert it or point {section}.datasets[].path at the data files only"
            )
    return files


def _refuse_generated_dataset_folder(source: SftSourceConfig, pattern: Path, section: str) -> None:
    """A generator run's folder (data/generate.py) holds each record three times over: in its chunks/, in one
    of train/val/test.jsonl, and its generation.json and metadata.json are no rows. Read whole, it failed on
    generation.json, 'not valid JSON ... fix that line', a file of the kit's own; README says to point at
    train.jsonl, which the error now names."""
    from trainpod.data.generate import GENERATION_FILE

    if pattern.is_dir() and (pattern / GENERATION_FILE).is_file():
        raise InputError(
            f"sft dataset path {source.path!r} ({pattern}) is the folder of a generator run: its chunks/ hold "
            f"every record again and val.jsonl and test.jsonl are held out; point {section}.datasets[].path at "
            f"{pattern / 'train.jsonl'} (and hold out with {section}.val_ratio, or a second dataset entry for val)"
        )


def describe_files(source: SftSourceConfig, volume_root: Path, section: str = "sft") -> list[dict]:
    """What the manifest records to recognise the inputs: each file's path, size and sha256."""
    return [
        {"path": str(p), "bytes": p.stat().st_size, "sha256": atomic.file_sha256(p)}
        for p in resolve_files(source, volume_root, section)
    ]


def _open_text(path: Path) -> io.TextIOBase:
    # utf-8-sig: the byte-order mark Windows tools (and pandas' to_json with encoding='utf-8-sig') put
    # first is not JSON; the first row was refused for it though it reads as one.
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def _json_lines(path: Path, f: io.TextIOBase, first_line: str, first_number: int) -> Iterator[Row]:
    yield from _json_line(path, first_number, first_line)
    for line_number, line in enumerate(f, first_number + 1):
        yield from _json_line(path, line_number, line)


def _json_line(path: Path, line_number: int, line: str) -> Iterator[Row]:
    if not line.strip():
        return
    where = f"{path}, line {line_number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); fix that line"
        ) from None
    yield Row(_object(record, where), where)


def _object(record: object, where: str) -> dict:
    if not isinstance(record, dict):
        raise InputError(
            f"{where}: expected a JSON object (one sample), got {type(record).__name__}; fix the row"
        )
    return record


def _json_rows(path: Path) -> Iterator[Row]:
    """A JSON array of objects (LLaMA-Factory's .json) or JSON Lines, told apart by the first character
    that is not whitespace (blank lines before an array's "[" made it JSON Lines, refused as invalid)."""
    with _open_text(path) as f:
        blank = 0
        first_line = f.readline()
        while first_line and not first_line.strip():
            blank, first_line = blank + 1, f.readline()
        if not first_line.lstrip().startswith("["):
            yield from _json_lines(path, f, first_line, blank + 1)
            return
        try:  # the blank lines put back as newlines, so that an error's line is the file's
            records = json.loads("\n" * blank + first_line + f.read())
        except json.JSONDecodeError as exc:
            raise InputError(
                f"{path}, line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}); fix the file"
            ) from None
    for index, record in enumerate(records):
        where = f"{path}, row {index}"
        yield Row(_object(record, where), where)


def _parquet_rows(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    if path.suffix.lower() == ".gz":
        raise InputError(
            f"{path}: gzip-compressed parquet cannot be read; decompress it (parquet compresses itself)"
        )
    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for record in batch.to_pylist():
            yield Row(record, f"{path}, row {index}")
            index += 1


def rows_of_file(path: Path) -> Iterator[Row]:
    """Every row of one data file (.json, .jsonl, .parquet, optionally .gz) in order.

    A file that is not UTF-8, a cut gzip or a damaged parquet fails the same way at every start: exit 2
    naming it, not a crash retried until the pod is FAILED.
    """
    fmt = "parquet" if _data_suffix(path) == ".parquet" else "json"
    try:
        yield from _parquet_rows(path) if fmt == "parquet" else _json_rows(path)
    except Exception as exc:
        problem = unreadable_file_problem(exc, fmt, path, "the datasets[].path that names it")
        if problem is None:
            raise
        raise InputError(f"sft dataset file {path} {problem}") from None


def iter_rows(source: SftSourceConfig, volume_root: Path, section: str = "sft") -> Iterator[Row]:
    """Every row of one dataset in order, at most `max_samples`."""
    count = 0
    for path in resolve_files(source, volume_root, section):
        for row in rows_of_file(path):
            if source.max_samples is not None and count >= source.max_samples:
                return
            count += 1
            yield row
