"""Build (or reuse) a tokenized SFT dataset: rows -> samples -> template -> ids + trained mask -> files.

    TRAINPOD_CONFIG=configs/datagen/sft-tiny.yaml TRAINPOD_VOLUME=./demo-volume trainpod run datagen

The whole dataset is written into a temp folder beside the target and renamed into place, so a
reader sees all of it or nothing. SFT datasets are small (minutes to tokenize at most), so a build
interrupted by SIGTERM starts over rather than resuming. A complete dataset is reused when its key
(the stored settings, the tokenizer files, the format version) and its source files match.

Preference data (sft.preference) stores each row's chosen and rejected answers as two samples, one after
the other in the row's split (sft/dataset.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

from safetensors.numpy import save

from trainpod.atomic import json_bytes, publish_dir, temp_name, write_bytes
from trainpod.checkpoint import Lease
from trainpod.checkpoint.lease import lease_lost, one_writer
from trainpod.config.sft import SftDataConfig, SftDatagenConfig
from trainpod.errors import InputError, Preempted
from trainpod.preemption import PreemptionWatch
from trainpod.sft.dataset import MANIFEST_FILE, MANIFEST_FORMAT, read_manifest, split_arrays
from trainpod.sft.encode import ENCODING, Encoded, SegmentEncoder
from trainpod.sft.formats import RowReader
from trainpod.sft.sources import describe_files, iter_rows
from trainpod.sft.templates import Segments, Template, build_template, text_format
from trainpod.volume import Volume

log = logging.getLogger(__name__)

# Files that decide how text becomes ids (and which chat template applies); model weights are not hashed.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
ENCODE_CHUNK = 512  # samples per batched tokenizer call
_MASK64 = (1 << 64) - 1


def tokenizer_files_hash(tokenizer_dir: Path) -> str:
    digest = hashlib.sha256()
    found = [name for name in TOKENIZER_FILES if (Path(tokenizer_dir) / name).is_file()]
    if not found:
        raise InputError(
            f"tokenizer folder {tokenizer_dir} holds none of {', '.join(TOKENIZER_FILES[:3])}; point the "
            "config's tokenizer at a folder saved with save_pretrained (e.g. a model folder)"
        )
    for name in found:
        digest.update(name.encode() + b"\0" + (Path(tokenizer_dir) / name).read_bytes() + b"\0")
    return digest.hexdigest()


def sft_key(data: SftDataConfig, tokenizer_dir: Path, encoding: int | None = ENCODING) -> str:
    """Identifies a stored dataset: its settings, the tokenizer's files, the storage format and how text became
    ids (encode.ENCODING; None: the key an earlier trainpod, which recorded none, gave it)."""
    record = {
        "format": MANIFEST_FORMAT,
        "settings": data.stored_settings(),
        "tokenizer": tokenizer_files_hash(tokenizer_dir),
        **({"encoding": encoding} if encoding is not None else {}),
    }
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def sft_cache_key(data: SftDataConfig, tokenizer_dir: Path, volume_root: Path) -> str:
    """Names finetune's cache/sft/<key>: the dataset's key and its files' contents, so data edited since an
    earlier run is tokenized anew beside that run's (as cache/vlm/<key> is), not refused as a named
    dataset built from other contents is."""
    contents = [_contents(describe_files(source, volume_root, "data.sft")) for source in data.datasets]
    record = json.dumps([sft_key(data, tokenizer_dir), contents], separators=(",", ":"))
    return hashlib.sha256(record.encode()).hexdigest()[:16]


def is_validation(row_index: int, val_ratio: float, seed: int) -> bool:
    """A fixed pseudo-random choice per (seed, row index) (splitmix64), independent of chunking."""
    x = (row_index + seed * 0x632BE59BD9B4E019 + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) < val_ratio * 2**64


def load_tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise InputError(
            f"tokenizer folder {tokenizer_dir} cannot be loaded by transformers.AutoTokenizer ({exc}); point the "
            "config's tokenizer at a folder saved with save_pretrained"
        ) from None


def prepare_sft(
    data: SftDataConfig,
    tokenizer_dir: Path,
    out_dir: Path,
    volume_root: Path,
    watch: PreemptionWatch | None = None,
    field: str = "sft",
) -> Path:
    """Build the dataset into `out_dir`, or reuse it there when it is complete and has the same key. `field` is
    where `data` sits in its config, as the warnings and errors name its settings: a datagen config's `sft`, a
    finetune's `data.sft` (a finetune's user told to raise sft.cutoff_len passed a key the finetune refuses).

    Raises InputError (exit 2, nothing overwritten) when `out_dir` holds anything else, or the same
    settings made from source files that have changed since; Preempted (exit 143) when `watch` saw
    SIGTERM during the build (nothing published; the next start builds again).
    """
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    watch = watch or PreemptionWatch()
    key = sft_key(data, tokenizer_dir)
    if not _reusable(out_dir, key, data, volume_root):
        # A stop that came while this start imported (torch and transformers: seconds) or hashed the sources
        # takes no lease; one that came while the lease was taken over (2 s after a kill) loads no tokenizer.
        _raise_if_stopped(watch, "before it took the dataset's lease")
        with one_writer(out_dir, "SFT dataset") as lease:
            # read again under the lease: the writer this one waited out may have finished meanwhile
            if not _reusable(out_dir, key, data, volume_root):
                _raise_if_stopped(watch, "as it took the dataset's lease")
                return _build_and_publish(data, tokenizer_dir, out_dir, volume_root, key, watch, lease, field)
    log.info("SFT dataset %s is complete and matches (key %s): reusing it", out_dir, key)
    return out_dir


def _build_and_publish(
    data: SftDataConfig,
    tokenizer_dir: Path,
    out_dir: Path,
    volume_root: Path,
    key: str,
    watch: PreemptionWatch,
    lease: Lease,
    field: str,
) -> Path:
    sources = [
        {"path": source.path, "format": source.format, "files": describe_files(source, volume_root, field)}
        for source in data.datasets
    ]
    tokenizer = load_tokenizer(tokenizer_dir)
    # Plain text is wrapped in no template: a base model's tokenizer (no chat_template, so auto is chatml,
    # whose tokens it lacks) must not be refused for one it will never use.
    chats = any(source.format != "text" for source in data.datasets)
    template = build_template(data.template, tokenizer) if chats else None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for leftover in out_dir.parent.glob(f"{out_dir.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = temp_name(out_dir)
    tmp.mkdir()
    try:
        manifest = _build(data, tokenizer, template, volume_root, tmp, watch, lease, field)
        manifest.update(key=key, sources=sources, tokenizer=_tokenizer_record(tokenizer, tokenizer_dir))
        write_bytes(tmp / MANIFEST_FILE, json_bytes(manifest))
        if out_dir.exists():
            out_dir.rmdir()  # _reusable let only an empty folder through
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    counts = manifest["counts"]
    unit = "pairs" if data.preference else "samples"
    log.info(
        "SFT dataset %s: %d train / %d val %s, %d trained of %d tokens, %d truncated, %d dropped (template %s)",
        out_dir,
        counts[f"train_{unit}"],
        counts[f"val_{unit}"],
        "preference pairs (each a chosen and a rejected sample)" if data.preference else unit,
        counts["train_trained_tokens"],
        counts["train_tokens"],
        counts["truncated"],
        counts["dropped"],
        manifest["template"] or "none: plain text",
    )
    if counts["truncated"]:
        _warn_truncated(counts, data.cutoff_len, field)
    return out_dir


def _warn_truncated(counts: dict, cutoff_len: int, field: str) -> None:
    """What the cut left out, where a run would otherwise never learn the ends of its long samples unseen."""
    kept = counts["train_tokens"] + counts.get("val_tokens", 0)
    unit = "pairs" if "train_pairs" in counts else "samples"  # preference data counts its cuts per pair
    log.warning(
        "%d of %d %s were longer than %s.cutoff_len=%d and were cut: %d of their tokens (%.1f%% of the "
        "data's) left out, the longest sample has %d; raise %s.cutoff_len to train on them whole, or set "
        "%s.overflow=drop to leave them out",
        counts["truncated"],
        counts[f"train_{unit}"] + counts[f"val_{unit}"],
        unit,
        field,
        cutoff_len,
        counts["truncated_tokens"],
        100 * counts["truncated_tokens"] / max(kept + counts["truncated_tokens"], 1),
        counts["longest_sample_tokens"],
        field,
        field,
    )


def _reusable(out_dir: Path, key: str, data: SftDataConfig, volume_root: Path) -> bool:
    if not out_dir.exists():
        return False
    manifest = read_manifest(out_dir)
    if manifest is None:
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            return False
        raise InputError(
            f"{out_dir} exists but holds no complete SFT dataset (no {MANIFEST_FILE} of {MANIFEST_FORMAT}); "
            "it is not overwritten. Pick another dataset name, or delete the folder"
        )
    if manifest.get("key") != key and "encoding" not in manifest:
        raise InputError(
            f"{out_dir} holds an SFT dataset tokenized by an earlier trainpod (no encoding in its {MANIFEST_FILE}), "
            "whose labels under Qwen2's and Llama 3's tokenizers leave an answer's first newline untrained; it is "
            "not overwritten. Pick another dataset name for the new samples (a finetune in progress on this one "
            "resumes exactly on it), or delete the folder to build it again"
        )
    if manifest.get("key") != key:
        raise InputError(
            f"{out_dir} holds an SFT dataset made with other settings or another tokenizer (key "
            f"{manifest.get('key')}, this config {key}; see its {MANIFEST_FILE}); it is not overwritten. Pick "
            "another dataset name, or delete the folder to build it again"
        )
    _check_sources_unchanged(out_dir, manifest, data, volume_root)
    return True


def _check_sources_unchanged(out_dir: Path, manifest: dict, data: SftDataConfig, volume_root: Path) -> None:
    """Reuse needs the same source files; a finished dataset stays usable once its sources are gone."""
    for recorded, source in zip(manifest["sources"], data.datasets, strict=True):
        try:
            current = describe_files(source, volume_root)
        except InputError:
            log.info("sources of %s are gone; the finished dataset is used as it is", source.path)
            continue
        if _contents(current) != _contents(recorded["files"]):
            raise InputError(
                f"{out_dir} was built from other contents of {source.path!r} (files, sizes or sha256 differ from "
                f"its {MANIFEST_FILE}); it is not overwritten. Pick another dataset name, or delete the folder "
                "to build it from the current files"
            )


def _contents(files: list[dict]) -> list[tuple[int, str]]:
    """Files by content only: the volume may be mounted elsewhere, the package installed elsewhere."""
    return [(f["bytes"], f["sha256"]) for f in files]


def _segments(
    data: SftDataConfig, template: Template | None, tokenizer, volume_root: Path, field: str
) -> Iterator[Segments | tuple[Segments, Segments]]:
    """Each row's segments: one sample's, or with preference a (chosen, rejected) pair's."""
    text = text_format(tokenizer)
    for index, source in enumerate(data.datasets):
        reader = RowReader(source, index, field)
        for row in iter_rows(source, volume_root, field):
            if data.preference:
                assert template is not None  # preference refuses the text format
                chosen, rejected = reader.pair(row)
                yield template.segments(chosen), template.segments(rejected)
                continue
            sample = reader.sample(row)
            if sample.text is not None:
                yield text.segments(sample.text)
            else:
                assert template is not None  # built wherever a dataset is not plain text
                yield template.segments(sample)


def _encoded_rows(
    encoder: SegmentEncoder, chunk: list, preference: bool
) -> list[tuple[Encoded, Encoded] | tuple[Encoded] | None]:
    """The samples of each row of `chunk` (one; with preference the pair, chosen then rejected); None for a
    row left out (over cutoff_len with overflow drop, or no answer token left)."""
    if preference:
        return encoder.encode_pairs(chunk)
    return [None if encoded is None else (encoded,) for encoded in encoder.encode(chunk)]


def _chunks(items: Iterator, size: int) -> Iterator[list]:
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _build(
    data: SftDataConfig,
    tokenizer,
    template: Template | None,
    volume_root: Path,
    tmp: Path,
    watch,
    lease: Lease,
    field: str,
) -> dict:
    encoder = SegmentEncoder(tokenizer, data.cutoff_len, data.overflow, data.train_on_prompt)
    splits: dict[str, list] = {"train": [], "val": []}
    rows = dropped = truncated = cut_tokens = longest = 0
    for chunk in _chunks(_segments(data, template, tokenizer, volume_root, field), ENCODE_CHUNK):
        _raise_if_stopped(watch, f"after {rows} rows")
        if lease.lost.is_set():
            raise lease_lost(tmp)
        for samples in _encoded_rows(encoder, chunk, data.preference):
            # chosen per row, so a preference pair's two samples are in the same split, one after the other
            split = "val" if data.val_ratio and is_validation(rows, data.val_ratio, data.seed) else "train"
            if samples is None:
                dropped += 1
            else:
                truncated += any(encoded.truncated for encoded in samples)
                for encoded in samples:
                    cut_tokens += encoded.full_length - len(encoded.input_ids)
                    longest = max(longest, encoded.full_length)
                    splits[split].append((rows, encoded.input_ids, encoded.trained))
            rows += 1
    if not splits["train"]:
        held_out = len({row for row, _, _ in splits["val"]})  # rows: a preference pair is two samples
        fix = (
            f"lower {field}.val_ratio={data.val_ratio} or add data"
            if held_out
            else f"add data, raise {field}.cutoff_len or set {field}.overflow=truncate"
        )
        raise InputError(
            f"no training samples: {rows} rows read, {dropped} dropped (over cutoff_len={data.cutoff_len} or no "
            f"answer tokens left), {held_out} held out for validation (a hash of each row's index picks them); {fix}"
        )
    files = {}
    counts = {
        "rows": rows,
        "dropped": dropped,
        "truncated": truncated,  # rows (with preference: pairs) with a sample cut
        "truncated_tokens": cut_tokens,  # cut off the truncated samples
        "longest_sample_tokens": longest,  # of the samples kept, before any cut
    }
    for split, examples in splits.items():
        if split == "val" and not data.val_ratio:
            continue
        blob = save(split_arrays(examples))
        write_bytes(tmp / f"{split}.safetensors", blob)
        files[split] = {"file": f"{split}.safetensors", "bytes": len(blob), "samples": len(examples)}
        counts[f"{split}_samples"] = len(examples)
        if data.preference:
            counts[f"{split}_pairs"] = len(examples) // 2  # samples 2k and 2k+1: chosen and rejected
        counts[f"{split}_tokens"] = int(sum(len(ids) for _, ids, _ in examples))
        counts[f"{split}_trained_tokens"] = int(sum(int(m.sum()) for _, _, m in examples))
        counts[f"{split}_max_len"] = max((len(ids) for _, ids, _ in examples), default=0)
    counts.setdefault("val_samples", 0)
    if data.preference:
        counts.setdefault("val_pairs", 0)
    return {
        "format": MANIFEST_FORMAT,
        "complete": True,
        "encoding": ENCODING,
        # None: every dataset is plain text, which no template wraps; the model continues text (trainpod chat)
        "template": template.name if template else None,
        "packing": data.packing,  # not a setting of the ids (not in the key): the trainer's default for them
        "settings": data.stored_settings(),
        "splits": files,
        "counts": counts,
    }


def _raise_if_stopped(watch: PreemptionWatch, when: str) -> None:
    if watch.requested:
        raise Preempted(f"SFT datagen stopped by {watch.signal_name} {when}; run it again to rebuild")


def _tokenizer_record(tokenizer, tokenizer_dir: Path) -> dict:
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    return {
        "path": str(tokenizer_dir),
        "files_sha256": tokenizer_files_hash(tokenizer_dir),
        "vocab_size": len(tokenizer),
        "eos_id": eos_id,
        "pad_id": pad_id if pad_id is not None else 0,
    }


def resolve_tokenizer_dir(raw: str, volume_root: Path) -> Path:
    folder = Path(raw).expanduser()
    folder = folder if folder.is_absolute() else Path(volume_root) / folder
    if not folder.is_dir():
        raise InputError(
            f"tokenizer folder {folder} (tokenizer: {raw!r}) does not exist; relative paths are taken from the "
            f"volume root {volume_root}: run the datagen that trains it, or point tokenizer at a model folder"
        )
    return folder


def run_sft_datagen(config: SftDatagenConfig, volume: Volume, watch: PreemptionWatch) -> Path:
    """Prepare `config.sft` with `config.tokenizer` into $TRAINPOD_VOLUME/datasets/<name>/."""
    volume.check_writable()
    tokenizer_dir = resolve_tokenizer_dir(config.tokenizer, volume.root)
    return prepare_sft(config.sft, tokenizer_dir, volume.dataset(config.name), volume.root, watch)
