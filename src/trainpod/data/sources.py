"""Documents from the configured sources, streamed in a fixed order so a document's index is stable.

A document's index (its position in the concatenation of all sources, empty documents skipped)
is what the train/val choice and the resume point refer to, so the order here must never depend
on timing: globs are sorted, files are read front to back.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import importlib.resources
import io
import json
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from trainpod.config.datagen import BUILTIN_TINY_STORIES, SourceConfig
from trainpod.errors import InputError, TemporaryError

SUFFIX_FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
}
BLANK_LINE = re.compile(r"\n[ \t\r]*\n")
READ_BLOCK_CHARS = 4 << 20  # text files are split in 4 Mi-character blocks: memory stays flat
# A document is held whole to be encoded; one this long split on blank lines is a file without any (one
# sentence per line, at the default separator), which would be held whole until the pod runs out of memory.
MAX_DOCUMENT_CHARS = 1 << 30
PARQUET_BATCH_ROWS = 1024
# Compressions that are not read (only gzip is, by a .gz suffix): by suffix and by their files' first bytes.
# Read as text they fail as "not UTF-8", and converting them from latin1 as that error advised made
# compressed bytes into text to train on.
OTHER_COMPRESSION_SUFFIXES = {".zst": "zstd", ".zstd": "zstd", ".bz2": "bzip2", ".xz": "xz", ".zip": "zip"}
COMPRESSION_MAGIC = {
    "gzip": re.compile(rb"\x1f\x8b"),
    "zstd": re.compile(rb"\x28\xb5\x2f\xfd"),
    "bzip2": re.compile(rb"BZh[1-9]"),
    "xz": re.compile(rb"\xfd7zXZ\x00"),
    "zip": re.compile(rb"PK\x03\x04"),
}


def builtin_corpus_path() -> Path:
    return Path(str(importlib.resources.files("trainpod") / "demo_corpus" / "tiny_stories.txt.gz"))


def expand_path(raw: str, volume_root: Path, is_data_file: Callable[[Path], bool]) -> tuple[Path, list[Path]]:
    """(the pattern, the sorted files it names): a file, a folder searched recursively for data files, or a
    glob; relative to the volume root unless absolute."""
    pattern = Path(raw).expanduser()
    if not pattern.is_absolute():
        pattern = volume_root / pattern
    if pattern.is_dir():
        return pattern, sorted(p for p in pattern.rglob("*") if p.is_file() and is_data_file(p))
    return pattern, sorted(Path(p) for p in glob.glob(str(pattern), recursive=True) if Path(p).is_file())


def resolve_files(source: SourceConfig, volume_root: Path) -> list[Path]:
    """The files a path/glob/folder source names, sorted; InputError when it names nothing."""
    if source.path == BUILTIN_TINY_STORIES:
        return [builtin_corpus_path()]
    pattern, files = expand_path(
        source.path, volume_root, lambda p: bool(_format_of(p, "auto", strict=False))
    )
    if not files:
        what = "folder holds no .txt/.jsonl/.parquet files" if pattern.is_dir() else "matches no file"
        raise InputError(
            f"source path {source.path!r} ({pattern}) {what}; relative paths are taken from the volume "
            f"root {volume_root}: fix sources[].path or copy the files there"
        )
    return files


def _format_of(path: Path, declared: str, strict: bool = True) -> str | None:
    if declared != "auto":
        return declared
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    fmt = SUFFIX_FORMATS.get(suffixes[-1]) if suffixes else None
    if fmt is None and strict and suffixes[-1:] and suffixes[-1] in OTHER_COMPRESSION_SUFFIXES:
        raise InputError(
            f"source file {path} is compressed ({OTHER_COMPRESSION_SUFFIXES[suffixes[-1]]}), which is not read: "
            f"{_DECOMPRESS_HINT}"
        )
    if fmt is None and strict:
        raise InputError(
            f"source file {path} has no known suffix (.txt, .jsonl, .parquet, optionally .gz); "
            "set sources[].format to text, jsonl or parquet"
        )
    return fmt


def _open_text(path: Path, encoding: str = "utf-8") -> io.TextIOBase:
    if path.suffix.lower() == ".gz":  # as _format_of reads the suffix: a .GZ file was read as text
        return gzip.open(path, "rt", encoding=encoding)
    return open(path, encoding=encoding)


def _text_documents(path: Path, separator: str, strip_bom: bool = True) -> Iterator[str]:
    # utf-8-sig: the byte-order mark Windows tools put first is no text; read as text, it became tokens at the
    # start of the file's first document. `strip_bom=False` reads it as a dataset begun before did.
    with _open_text(path, "utf-8-sig" if strip_bom else "utf-8") as f:
        if separator == "file":
            yield f.read()
        elif separator == "line":
            yield from f
        else:
            yield from _blank_line_documents(f, path)


def _blank_line_documents(f: io.TextIOBase, path: Path) -> Iterator[str]:
    """BLANK_LINE.split of the whole text, read in blocks: one block and the document in progress are held,
    and each block is scanned once. Scanning the document in progress again with every block made a long one
    quadratic (a 20 GB file of single lines at the default separator never finished)."""
    pieces: list[str] = []  # the document in progress, less `tail`
    held = 0  # characters in `pieces`
    tail = ""  # its end, when a separator can begin there and end in the next block: "\n" then [ \t\r]*
    while block := f.read(READ_BLOCK_CHARS):
        parts = BLANK_LINE.split(tail + block)
        if len(parts) > 1:
            pieces.append(parts[0])
            yield "".join(pieces)
            yield from parts[1:-1]
            pieces, held = [], 0
        rest = parts[-1]
        # Nothing before the last "\n" of `rest` can begin a separator (it would have matched in `rest`).
        start = rest.rfind("\n")
        cut = start if start >= 0 and not rest[start + 1 :].strip(" \t\r") else len(rest)
        pieces.append(rest[:cut])
        held += cut
        tail = rest[cut:]
        if held > MAX_DOCUMENT_CHARS:
            raise InputError(
                f"source file {path}: a document runs past {MAX_DOCUMENT_CHARS:,} characters without a blank line "
                "ending it (sources[].separator: blank_line, the default); if the file holds one document per "
                "line, set sources[].separator: line"
            )
    pieces.append(tail)
    yield "".join(pieces)


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    # utf-8-sig: a byte-order mark that Windows tools put before the first line is not JSON, and the
    # first line was refused as "not a JSON object" though it reads as one.
    with _open_text(path, "utf-8-sig") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}, line {line_number}"
            yield _text(_json_line_field(line, where, field), where, field)


def _json_line_field(line: str, where: str, field: str) -> object:
    """The `field` of one JSON Lines record; InputError saying what the line is instead and the fix."""
    array = (
        f"{where}: a JSON array, not JSON Lines (one object per line); convert it, e.g. "
        "`jq -c '.[]' data.json > data.jsonl`"
    )
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        if line.lstrip().startswith("["):  # a pretty-printed .json array (alpaca_data.json) opens with "["
            raise InputError(array) from None
        raise InputError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); fix that line"
        ) from None
    if isinstance(record, list):
        raise InputError(array)
    if not isinstance(record, dict):
        raise InputError(f"{where}: {json.dumps(record)[:40]}, not a JSON object with a {field!r} string")
    if field not in record:
        raise InputError(
            f"{where}: an object without {field!r} (its keys: {', '.join(list(record)[:10]) or 'none'}); set "
            "sources[].text_field to the one holding the text"
        )
    return record[field]


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    if path.suffix.lower() == ".gz":
        raise InputError(
            f"{path}: gzip-compressed parquet cannot be streamed; decompress it "
            "(parquet compresses its own columns)"
        )
    parquet = pq.ParquetFile(path)
    if field not in parquet.schema_arrow.names:
        raise InputError(
            f"{path} has no column {field!r} (columns: {', '.join(parquet.schema_arrow.names)}); "
            "set sources[].text_field"
        )
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
        for text in batch.column(0).to_pylist():
            yield _text(text, str(path), field)


def hub_revision(source: SourceConfig) -> str | None:
    """The commit the hub dataset `source.hf` is at now. A dataset begun from it reads it at that commit on
    every start: a push to its repository between a stop and the resume would move every document after the
    change to another index (written twice or never, train ones into val). None where there is nothing to
    pin: a `datasets` folder here, or the hub offline (HF_HUB_OFFLINE: the cache is read as it is)."""
    if Path(source.hf).expanduser().exists():
        return None
    try:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import RepositoryNotFoundError
    except ImportError:
        raise InputError("an hf source needs the `datasets` package: pip install 'trainpod[hub]'") from None
    if constants.HF_HUB_OFFLINE:
        return None
    try:
        return HfApi().dataset_info(source.hf).sha
    except RepositoryNotFoundError:
        raise InputError(
            f"Hugging Face dataset {source.describe()} is not on the hub, or is private or gated and HF_TOKEN "
            "is missing; check sources[].hf, or set HF_TOKEN"
        ) from None
    except Exception as exc:  # network and hub outages: the supervisor starts us again later
        raise TemporaryError(
            f"could not reach the Hugging Face hub for {source.describe()}: {type(exc).__name__}; the pod will retry"
        ) from None


def hub_revisions(sources: list[SourceConfig]) -> dict[str, str]:
    """The commit each hub dataset of `sources` is at now, by its name (hub_revision); none for a local one."""
    revisions = {}
    for name in dict.fromkeys(source.hf for source in sources if source.hf is not None):
        revision = hub_revision(next(source for source in sources if source.hf == name))
        if revision is not None:
            revisions[name] = revision
    return revisions


def _hf_documents(source: SourceConfig, revision: str | None) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise InputError("an hf source needs the `datasets` package: pip install 'trainpod[hub]'") from None
    at = f" at commit {revision} (pinned when this dataset was begun)" if revision else ""
    try:
        stream = datasets.load_dataset(
            source.hf, source.hf_config, split=source.hf_split, streaming=True, revision=revision
        )
    except (ConnectionError, TimeoutError) as exc:
        raise TemporaryError(
            f"could not reach the Hugging Face hub for {source.describe()}: "
            f"{type(exc).__name__}; the pod will retry"
        ) from None
    except (FileNotFoundError, ValueError) as exc:
        raise InputError(
            f"Hugging Face dataset {source.describe()}{at} could not be opened ({exc}); "
            "check sources[].hf, hf_config and hf_split"
            + (
                "; if that commit is gone from the hub, delete the dataset folder to build it anew"
                if at
                else ""
            )
        ) from None
    for row in _rows_or_temporary_error(stream, source):
        if source.text_field not in row:
            raise InputError(
                f"Hugging Face dataset {source.describe()} has no column {source.text_field!r} (columns: "
                f"{', '.join(row)}); set sources[].text_field"
            )
        yield _text(row[source.text_field], source.describe(), source.text_field)


def _rows_or_temporary_error(stream: Iterable[dict], source: SourceConfig) -> Iterator[dict]:
    """The rows of a streamed dataset; a hub lost mid-stream is temporary (exit 75), like one lost at
    the start: `datasets` fetches the data while it is iterated, and after its own retries raises
    ConnectionError("Server Disconnected")."""
    rows = iter(stream)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except (ConnectionError, TimeoutError) as exc:
            raise TemporaryError(
                f"lost the Hugging Face hub while streaming {source.describe()} ({type(exc).__name__}: {exc}); "
                "the committed shards are kept and the pod will retry from them"
            ) from None
        yield row


def _text(value: object, where: str, field: str) -> str | None:
    """A document's text; None (a null) is skipped like an empty text; anything else is bad input."""
    if value is None or isinstance(value, str):
        return value
    raise InputError(
        f"{where}: {field!r} holds a {type(value).__name__} ({str(value)[:40]!r}), not a string; "
        "fix the data or set sources[].text_field to the column holding the text"
    )


def iter_source(
    source: SourceConfig,
    volume_root: Path,
    strip_bom: bool = True,
    on_open: Callable[[str], None] | None = None,
    revision: str | None = None,
) -> Iterator[str]:
    """Every non-empty document of one source; `on_open` is told each file's label (file_label) as it is
    opened, a hub dataset's name as its stream starts; a hub dataset is read at commit `revision` (None: its
    default branch as it is now).

    A record of a structured source (JSONL, parquet, a hub dataset) is kept verbatim: a trailing
    newline or indentation is part of the text (it matters for code). Only plain text split on blank
    lines or lines is stripped, since there the whitespace around a piece is the separator's.
    """
    on_open = on_open or (lambda label: None)
    if source.hf is not None:
        on_open(source.describe())
        raw: Iterator[str] = _hf_documents(source, revision)
    else:
        raw = _iter_files(source, resolve_files(source, volume_root), strip_bom, volume_root, on_open)
    for document in raw:
        if document:
            yield document


def _stripped(documents: Iterator[str]) -> Iterator[str]:
    for document in documents:
        if document := document.strip():
            yield document


def _iter_files(
    source: SourceConfig,
    files: list[Path],
    strip_bom: bool,
    volume_root: Path,
    on_open: Callable[[str], None],
) -> Iterator[str]:
    for path in files:
        on_open(file_label(source, path, volume_root))
        fmt = _format_of(path, "text" if source.path == BUILTIN_TINY_STORIES else source.format)
        try:
            if fmt == "text":
                yield from _stripped(_text_documents(path, source.separator, strip_bom))
            elif fmt == "jsonl":
                yield from _jsonl_documents(path, source.text_field)
            else:
                yield from _parquet_documents(path, source.text_field)
        except Exception as exc:
            problem = unreadable_file_problem(exc, fmt, path, "sources[].path")
            if problem is None:
                raise
            # A damaged or mis-encoded file fails the same way at every start: exit 2, not a crash retried.
            raise InputError(f"source file {path} {problem}") from None


def unreadable_file_problem(exc: Exception, fmt: str, path: Path, listed_in: str) -> str | None:
    """What is wrong with a source file whose bytes cannot be read as its format; None for anything else.

    `listed_in` is the config field that names the file, for the fix (`sources[].path`).
    """
    if isinstance(exc, UnicodeDecodeError):
        compression = _compression_of(path)
        if compression == "gzip" and path.suffix.lower() != ".gz":
            return "is gzip-compressed: give it a name ending in .gz, which is read decompressed"
        if compression not in (None, "gzip"):
            return f"is {compression}-compressed, which is not read: {_DECOMPRESS_HINT}"
        line, utf16 = _where_not_utf8(path)
        if utf16:  # Windows' "Unicode" (PowerShell's > and Out-File, Notepad): latin1 advice would garble it
            return (
                "is UTF-16 text, not UTF-8 (it starts with a UTF-16 byte-order mark); convert it (e.g. "
                f"`iconv -f utf-16 -t utf-8`) or drop it from {listed_in}"
            )
        return (
            f"is not UTF-8 text ({f'line {line}, ' if line else ''}byte {exc.object[exc.start : exc.start + 1]!r}: "
            f"{exc.reason}); convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or drop it from {listed_in}"
        )
    if isinstance(exc, (gzip.BadGzipFile, EOFError, zlib.error)):
        return f"is not a whole gzip file ({exc}); copy it again or decompress it to check it"
    if fmt == "parquet" and isinstance(exc, (ValueError, OSError)) and getattr(exc, "errno", None) is None:
        # pyarrow reports a non-parquet or truncated file as ArrowInvalid and a damaged page as an
        # OSError without errno; an OSError from the kernel (a volume's I/O error) always has one.
        return f"is not a readable parquet file ({exc}); copy it again or rewrite it"
    return None


_DECOMPRESS_HINT = (
    "decompress it (e.g. `zstd -d`, `bunzip2`, `xz -d`, `unzip`) or recompress it with gzip (.gz), the one "
    "compression read"
)


def _compression_of(path: Path) -> str | None:
    """The compression the file's first bytes say it holds (COMPRESSION_MAGIC); None for anything else."""
    try:
        with open(path, "rb") as f:
            start = f.read(8)
    except OSError:
        return None
    return next((name for name, magic in COMPRESSION_MAGIC.items() if magic.match(start)), None)


def _where_not_utf8(path: Path) -> tuple[int | None, bool]:
    """(the line, from 1, holding the first bytes of `path` that are not UTF-8; whether it starts with a
    UTF-16 byte-order mark), read again to say where: a text reader decodes blocks ahead of the line it
    hands out, so its error does not know the line."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines, utf16 = 0, False
    try:
        with gzip.open(path, "rb") if path.suffix.lower() == ".gz" else open(path, "rb") as f:
            while block := f.read(1 << 20):
                utf16 = utf16 or (lines == 0 and block.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)))
                try:
                    decoder.decode(block)
                except (
                    UnicodeDecodeError
                ) as exc:  # exc.object: the block behind a cut character's first bytes
                    return lines + exc.object[: exc.start].count(b"\n") + 1, utf16
                lines += block.count(b"\n")
    except (OSError, EOFError, zlib.error):
        pass
    return None, utf16


def iter_documents(
    sources: list[SourceConfig],
    volume_root: Path,
    strip_bom: bool = True,
    on_open: Callable[[str], None] | None = None,
    revisions: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """All documents of all sources, in config order. `strip_bom`: a text file's UTF-8 byte-order mark is no
    part of its first document (False only for a dataset begun by a kit that kept it: datagen.py). `on_open`:
    told each file's label as it is opened (iter_source). `revisions`: the commit to read each hub dataset
    at, by its name (hub_revisions)."""
    revisions = revisions or {}
    for source in sources:
        revision = revisions.get(source.hf) if source.hf is not None else None
        yield from iter_source(source, volume_root, strip_bom, on_open, revision)


def file_label(source: SourceConfig, path: Path, volume_root: Path) -> str:
    """How a source file is named in progress.json: relative to the volume root where under it (a remount
    moves the root), the builtin corpus by its config name (its path is the installed package's)."""
    if source.path == BUILTIN_TINY_STORIES:
        return BUILTIN_TINY_STORIES
    return str(path.relative_to(volume_root)) if path.is_relative_to(volume_root) else str(path)


def source_labels(sources: list[SourceConfig], volume_root: Path) -> list[str]:
    """The labels of every file the sources name now, in reading order (a hub dataset by its name)."""
    labels = []
    for source in sources:
        if source.hf is not None:
            labels.append(source.describe())
        else:
            labels += [file_label(source, path, volume_root) for path in resolve_files(source, volume_root)]
    return labels


def check_sources(sources: list[SourceConfig], volume_root: Path) -> None:
    """Fail before any work when a local source names no file (hf sources are checked on reading)."""
    for source in sources:
        if source.path is not None:
            for path in resolve_files(source, volume_root):
                _format_of(path, "text" if source.path == BUILTIN_TINY_STORIES else source.format)


def describe_sources(
    sources: list[SourceConfig], volume_root: Path, revisions: Mapping[str, str] | None = None
) -> list[dict]:
    """What the manifest records about the inputs: files with sizes and mtimes, or hf ids with the commit
    read (`revisions`, None where none was pinned)."""
    described = []
    for source in sources:
        if source.hf is not None:
            revision = (revisions or {}).get(source.hf)
            described.append(
                {"hf": source.hf, "config": source.hf_config, "split": source.hf_split, "revision": revision}
            )
            continue
        files = [
            {"path": str(p), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
            for p in resolve_files(source, volume_root)
        ]
        described.append({"path": source.path, "files": files})
    return described
