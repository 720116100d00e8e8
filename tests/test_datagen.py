"""datagen in-process: shards hold exactly the tokenizer's ids, reuse and refusal, modes, source formats."""

from __future__ import annotations

import gzip
import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from trainpod.checkpoint import Lease
from trainpod.config.datagen import SETTINGS_ADDED_LATER, DatagenConfig, SourceConfig, TokenizerSettings
from trainpod.config.loader import load_config, validate_tree
from trainpod.data import sources
from trainpod.data.datagen import (
    dataset_shards,
    is_validation,
    load_dataset_manifest,
    run_datagen,
    settings_hash,
)
from trainpod.data.encoding import MAX_THREAD_ENCODERS, PARALLELISM_VARIABLE, BatchEncoder
from trainpod.data.synthetic_corpus import stories
from trainpod.errors import ConfigError, ExitCode, InputError, Preempted, TemporaryError
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume

REPO = Path(__file__).resolve().parents[1]
STORY_COUNT = 600


def llmc_tokens(path: Path) -> np.ndarray:
    """Reader written from llm.c's data_common.py, independent of trainpod.data.shards."""
    raw = path.read_bytes()
    magic, version, count = struct.unpack_from("<3i", raw)
    dtype = {(20240520, 1): "<u2", (20240801, 7): "<u4"}[(magic, version)]
    tokens = np.frombuffer(raw, dtype=dtype, offset=1024)
    assert len(tokens) == count
    return tokens


def corpus_documents(count: int = STORY_COUNT) -> list[str]:
    generator = stories(seed=7)
    return [next(generator) for _ in range(count)]


@pytest.fixture
def volume(tmp_path) -> Volume:
    root = tmp_path / "volume"
    (root / "corpus").mkdir(parents=True)
    (root / "corpus" / "stories.txt").write_text("\n\n".join(corpus_documents()) + "\n", encoding="utf-8")
    return Volume(root)


def make_config(**changes) -> DatagenConfig:
    tree = {
        "name": "stories",
        "tokenizer": {"vocab_size": 400, "max_train_documents": 300},
        "sources": [{"path": "corpus/stories.txt"}],
        "mode": "split",
        "val_ratio": 0.1,
        "shard_tokens": 3000,
        "workers": 2,
        "batch_documents": 50,
    }
    for key, value in changes.items():
        tree[key] = value
    return validate_tree(DatagenConfig, tree)


def run(config: DatagenConfig, volume: Volume) -> Path:
    return run_datagen(config, volume, PreemptionWatch())


def run_killed_at_a_shard(monkeypatch, killed_at, start) -> None:
    """`start()` killed (KeyboardInterrupt stands for the kill) as it writes the first shard whose file name
    `killed_at` accepts; the shards before it are committed, and the writer is whole again afterwards."""
    import trainpod.data.split_writer as split_writer

    real_write_shard = split_writer.write_shard

    def killed(path, tokens):
        if killed_at(path.name):
            raise KeyboardInterrupt
        return real_write_shard(path, tokens)

    monkeypatch.setattr(split_writer, "write_shard", killed)
    with pytest.raises(KeyboardInterrupt):
        start()
    monkeypatch.setattr(split_writer, "write_shard", real_write_shard)


def split_stream(folder: Path, manifest: dict, split: str) -> np.ndarray:
    shards = dataset_shards(folder, manifest, split)
    return np.concatenate([llmc_tokens(p) for p in shards]) if shards else np.zeros(0, np.uint16)


def expected_stream(tokenizer: Tokenizer, documents: list[str], want_val: bool | None, val_ratio: float):
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for index, document in enumerate(documents):
        if want_val is None or is_validation(index, val_ratio) == want_val:
            ids += [eot] + tokenizer.encode(document).ids
    return np.array(ids)


@pytest.mark.parametrize("workers", [2, MAX_THREAD_ENCODERS + 2], ids=["threads", "threads+processes"])
def test_shards_hold_exactly_the_tokenizer_ids_with_eot_before_each_document(volume, workers):
    folder = run(make_config(workers=workers), volume)
    manifest = json.loads((folder / "manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(volume.tokenizer("stories") / "tokenizer.json"))
    documents = corpus_documents()
    for split, want_val in (("train", False), ("val", True)):
        stream = split_stream(folder, manifest, split)
        assert np.array_equal(stream, expected_stream(tokenizer, documents, want_val, 0.1)), split
        sizes = [s["tokens"] for s in manifest["splits"][split]["shards"]]
        assert all(size == 3000 for size in sizes[:-1]) and 0 < sizes[-1] <= 3000
        assert manifest["splits"][split]["tokens"] == len(stream)
    assert len(manifest["splits"]["train"]["shards"]) >= 3, "the corpus should fill several train shards"
    assert manifest["complete"] is True and manifest["documents"] == STORY_COUNT
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["eot_id"] == tokenizer.token_to_id(
        "<|endoftext|>"
    )
    assert manifest["total_tokens"] == sum(manifest["splits"][s]["tokens"] for s in ("train", "val"))
    assert sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name) == []


@pytest.mark.parametrize("workers, threads", [(2, 2), (2, 0), (3, 1)])
def test_encoders_return_every_batch_in_order_whether_threads_or_processes(
    volume, workers, threads, monkeypatch
):
    run(make_config(), volume)  # for its tokenizer
    tokenizer_file = volume.tokenizer("stories") / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eot = tokenizer.token_to_id("<|endoftext|>")
    documents = corpus_documents()
    # uneven batch sizes, so that a batch returned out of order would show
    batches = [
        ("train", np.arange(start, start + size), documents[start : start + size])
        for start, size in ((0, 5), (5, 120), (125, 1), (126, 200), (326, 274))
    ]
    monkeypatch.setenv(PARALLELISM_VARIABLE, "true")
    with BatchEncoder(tokenizer_file, eot, np.uint16, workers, threads=threads) as encoder:
        assert os.environ[PARALLELISM_VARIABLE] == "false", "each encoder runs its batch on its own thread"
        results = list(encoder.map(iter(batches)))
    assert os.environ[PARALLELISM_VARIABLE] == "true", "the setting is given back"
    assert [list(r.doc_indices) for r in results] == [list(b[1]) for b in batches]
    for result, (_, _, batch_documents) in zip(results, batches, strict=True):
        ids = [[eot] + tokenizer.encode(document).ids for document in batch_documents]
        assert result.tokens.dtype == np.uint16
        assert result.tokens.tolist() == [token for document_ids in ids for token in document_ids]
        assert result.doc_lengths.tolist() == [len(document_ids) for document_ids in ids]


def test_complete_dataset_is_reused_without_rewriting_anything(volume, caplog):
    folder = run(make_config(), volume)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()}
    tokenizer_before = (volume.tokenizer("stories") / "tokenizer.json").stat().st_mtime_ns
    with caplog.at_level("INFO"):
        assert run(make_config(workers=1, batch_documents=7), volume) == folder  # tuning knobs may change
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()} == before
    assert (volume.tokenizer("stories") / "tokenizer.json").stat().st_mtime_ns == tokenizer_before
    assert "reusing it" in caplog.text


def test_different_config_on_the_same_name_is_refused_and_nothing_is_overwritten(volume):
    folder = run(make_config(), volume)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(InputError, match="different config") as caught:
        run(make_config(shard_tokens=5000), volume)
    assert str(folder) in str(caught.value) and "another dataset name" in str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_smoke_mode_reads_only_the_first_documents(volume):
    folder = run(make_config(mode="smoke", smoke_documents=40, val_ratio=0.0), volume)
    manifest = load_dataset_manifest(folder)
    tokenizer = Tokenizer.from_file(str(volume.tokenizer("stories") / "tokenizer.json"))
    assert manifest["documents"] == 40 and list(manifest["splits"]) == ["train"]
    expected = expected_stream(tokenizer, corpus_documents(40), None, 0.0)
    assert np.array_equal(split_stream(folder, manifest, "train"), expected)


def test_validation_share_follows_val_ratio():
    chosen = sum(is_validation(index, 0.05) for index in range(20_000))
    assert 0.04 < chosen / 20_000 < 0.06
    assert [is_validation(i, 0.05) for i in range(50)] == [is_validation(i, 0.05) for i in range(50)]


def test_full_mode_writes_only_train(volume):
    manifest = load_dataset_manifest(run(make_config(mode="full"), volume))
    assert list(manifest["splits"]) == ["train"] and manifest["documents"] == STORY_COUNT


def write_in_other_formats(volume: Volume) -> None:
    documents = corpus_documents()
    data = volume.root / "formats"
    data.mkdir()
    with gzip.open(data / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        for document in documents[:200]:
            f.write(json.dumps({"body": document, "id": 1}) + "\n")
    pq.write_table(pa.table({"body": documents[200:400]}), data / "b.parquet", row_group_size=64)
    with gzip.open(data / "c.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n\n\n".join(documents[400:]))


def test_jsonl_gz_parquet_and_txt_gz_by_glob_give_the_same_shards_as_one_text_file(volume):
    write_in_other_formats(volume)
    text_manifest = load_dataset_manifest(run(make_config(), volume))
    mixed = make_config(
        name="mixed",
        tokenizer={"path": str(volume.tokenizer("stories"))},
        sources=[{"path": "formats/*", "text_field": "body"}],
    )
    mixed_manifest = load_dataset_manifest(run(mixed, volume))
    assert mixed_manifest["splits"] == text_manifest["splits"]
    assert [f["path"].rsplit("/", 1)[-1] for f in mixed_manifest["sources"][0]["files"]] == [
        "a.jsonl.gz",
        "b.parquet",
        "c.txt.gz",
    ]


def decoded_documents(tokenizer: Tokenizer, stream: np.ndarray) -> list[str]:
    """The documents of a token stream: split at each end-of-text token, each piece decoded."""
    eot = tokenizer.token_to_id("<|endoftext|>")
    pieces, current = [], None
    for token in stream.tolist():
        if token == eot:
            current = []
            pieces.append(current)
        else:
            current.append(token)
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in pieces]


VERBATIM = ["def f(x):\n    return x\n", "  indented line and trailing spaces   ", "plain\n\n"]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_structured_documents_round_trip_through_the_shards_verbatim(volume, fmt):
    run(make_config(), volume)  # a tokenizer trained on the stories, reused below
    data = volume.root / "structured"
    data.mkdir()
    if fmt == "jsonl":
        (data / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in VERBATIM))
    else:
        pq.write_table(pa.table({"text": VERBATIM}), data / "docs.parquet")
    config = make_config(
        name=f"verbatim-{fmt}", mode="full", tokenizer={"path": "tokenizers/stories"},
        sources=[{"path": f"structured/docs.{fmt}"}],
    )  # fmt: skip
    folder = run(config, volume)
    manifest = load_dataset_manifest(folder)
    tokenizer = Tokenizer.from_file(str(volume.tokenizer("stories") / "tokenizer.json"))
    assert decoded_documents(tokenizer, split_stream(folder, manifest, "train")) == VERBATIM


def test_plain_text_documents_split_on_blank_lines_are_stripped(volume):
    (volume.root / "corpus" / "padded.txt").write_text("  first story.  \n\n\tsecond story.\n")
    run(make_config(), volume)
    config = make_config(
        name="padded", mode="full", tokenizer={"path": "tokenizers/stories"},
        sources=[{"path": "corpus/padded.txt"}],
    )  # fmt: skip
    folder = run(config, volume)
    tokenizer = Tokenizer.from_file(str(volume.tokenizer("stories") / "tokenizer.json"))
    stream = split_stream(folder, load_dataset_manifest(folder), "train")
    assert decoded_documents(tokenizer, stream) == ["first story.", "second story."]


def test_reused_tokenizer_folder_is_used_as_it_is(volume):
    run(make_config(), volume)
    shared = volume.tokenizer("stories")
    mtime = (shared / "tokenizer.json").stat().st_mtime_ns
    manifest = load_dataset_manifest(
        run(make_config(name="other", tokenizer={"path": "tokenizers/stories"}), volume)
    )
    assert manifest["tokenizer"]["path"] == str(shared) and manifest["tokenizer"]["name"] is None
    assert (shared / "tokenizer.json").stat().st_mtime_ns == mtime
    assert not volume.tokenizer("other").exists()


def test_tokenizer_with_other_training_settings_is_not_overwritten(volume):
    run(make_config(), volume)
    before = (volume.tokenizer("stories") / "tokenizer.json").read_bytes()
    with pytest.raises(InputError, match="not trained with these settings"):
        run(make_config(name="bigger", tokenizer={"name": "stories", "vocab_size": 500}), volume)
    assert (volume.tokenizer("stories") / "tokenizer.json").read_bytes() == before


def test_tokenizer_folder_loads_with_transformers_autotokenizer(volume):
    from transformers import AutoTokenizer

    run(make_config(mode="smoke", smoke_documents=20), volume)
    folder = volume.tokenizer("stories")
    hf = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "Once upon a time, there was a brave fox named Lily."
    assert hf.eos_token == hf.bos_token == "<|endoftext|>"
    assert hf.eos_token_id == raw.token_to_id("<|endoftext|>")
    assert hf(text)["input_ids"] == raw.encode(text).ids
    assert hf.decode(hf(text)["input_ids"]) == text


def test_builtin_tiny_config_loads_and_fineweb_example_validates(tmp_path):
    tiny = load_config(DatagenConfig, REPO / "configs/datagen/tiny.yaml")
    assert tiny.sources[0].path == "builtin:tiny-stories" and tiny.mode == "split"
    fineweb = load_config(DatagenConfig, REPO / "configs/datagen/fineweb-edu.yaml")
    assert fineweb.sources[0].hf and fineweb.shard_tokens == 100_000_000


def test_missing_source_path_names_the_path(volume):
    with pytest.raises(InputError, match=r"corpus/nothing-\*\.jsonl") as caught:
        run(make_config(sources=[{"path": "corpus/nothing-*.jsonl"}]), volume)
    assert "matches no file" in str(caught.value) and caught.value.exit_code == ExitCode.BAD_INPUT
    assert not volume.dataset("stories").exists(), "nothing is written before the inputs are checked"


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"mode": "split", "val_ratio": 0.0}, "val_ratio"),
        ({"shard_tokens": 0}, "shard_tokens"),
        ({"sources": [{"path": "a.txt", "hf": "x/y"}]}, "exactly one"),
        ({"sources": []}, "sources"),
        ({"tokenizer": {"vocab_size": 10}}, "tokenizer.vocab_size"),
        ({"mode": "fast"}, "mode"),
        ({"shard_tokns": 5}, "did you mean 'shard_tokens'"),
    ],
)
def test_bad_field_values_are_config_errors_with_exit_code_2(changes, words):
    with pytest.raises(ConfigError, match=words) as caught:
        make_config(**changes)
    assert caught.value.exit_code == ExitCode.BAD_INPUT == 2


def test_load_dataset_manifest_says_how_to_make_a_missing_dataset(tmp_path):
    with pytest.raises(InputError, match="trainpod run datagen") as caught:
        load_dataset_manifest(tmp_path / "datasets" / "nope")
    assert str(tmp_path / "datasets" / "nope") in str(caught.value)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "progress.json").write_text("{}")
    with pytest.raises(InputError, match="has no manifest.json.*TRAINPOD_CONFIG="):
        load_dataset_manifest(tmp_path / "half")


def test_an_encoder_process_that_dies_fails_the_batch_instead_of_hanging_datagen(volume):
    # The OOM killer (or a SIGTERM that `tini -g` sends to the whole group) ending an encoder process
    # left multiprocessing.Pool waiting forever for the batch it held: a pod billing for nothing.
    import multiprocessing
    import signal
    import threading
    from concurrent.futures.process import BrokenProcessPool

    run(make_config(), volume)  # for its tokenizer
    tokenizer_file = volume.tokenizer("stories") / "tokenizer.json"
    eot = Tokenizer.from_file(str(tokenizer_file)).token_to_id("<|endoftext|>")
    documents = corpus_documents()

    def batches():
        yield "train", np.arange(0, 5), documents[:5]
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGKILL)
        for start in range(5, STORY_COUNT, 20):
            yield "train", np.arange(start, start + 20), documents[start : start + 20]

    outcome: list[BaseException | None] = []

    def encode() -> None:
        try:
            with BatchEncoder(tokenizer_file, eot, np.uint16, workers=1, threads=0) as encoder:
                list(encoder.map(batches()))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=encode, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "datagen hung on a batch its dead encoder process will never return"
    assert isinstance(outcome[0], BrokenProcessPool), outcome


@pytest.mark.parametrize("stopped, code", [(False, ExitCode.TEMPORARY), (True, ExitCode.PREEMPTED)])
def test_a_dead_encoder_process_is_exit_75_or_after_a_sigterm_143(volume, monkeypatch, stopped, code):
    from concurrent.futures.process import BrokenProcessPool

    from trainpod.errors import TrainpodError

    watch = PreemptionWatch()

    def broken(self, batches):
        if stopped:  # the SIGTERM that reached the workers too (tini -g), as the shards are encoded
            watch.request("SIGTERM")
        raise BrokenProcessPool("a worker died")
        yield

    monkeypatch.setattr(BatchEncoder, "map", broken)
    with pytest.raises(TrainpodError) as error:
        run_datagen(make_config(), volume, watch)
    assert error.value.exit_code == code and "shards are committed" in str(error.value)


def test_a_text_field_that_is_not_a_string_is_exit_2_naming_the_file_line_and_field(volume):
    # It crashed inside the tokenizer's training (TypeError, exit 1: a failed start, tried three times).
    (volume.root / "corpus" / "mixed.jsonl").write_text('{"text": "a story"}\n{"text": 123}\n')
    with pytest.raises(InputError, match=r"mixed\.jsonl, line 2: 'text' holds a int") as caught:
        run(make_config(sources=[{"path": "corpus/mixed.jsonl"}]), volume)
    assert caught.value.exit_code == ExitCode.BAD_INPUT


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        (
            "alpaca.json",
            '[\n  {"text": "a story"},\n  {"text": "another"}\n]\n',
            r"alpaca\.json, line 1: a JSON array, not JSON Lines .*jq -c",
        ),
        ("one-line.json", '[{"text": "a story"}]\n', r"one-line\.json, line 1: a JSON array, not JSON Lines"),
        (
            "keys.jsonl",
            '{"text": "a story"}\n{"title": "t", "body": "b"}\n',
            r"keys\.jsonl, line 2: an object without 'text' \(its keys: title, body\); set sources\[\]\.text_field",
        ),
        (
            "cut.jsonl",
            '{"text": "a story"}\n{"text": "a sto\n',
            r"cut\.jsonl, line 2: not valid JSON \(.* column",
        ),
    ],
)
def test_a_jsonl_line_that_is_no_object_with_the_text_field_is_exit_2_saying_what_it_is_and_the_fix(
    volume, name, content, words
):
    # Each was "not a JSON object with a 'text' string; fix the file or set sources[].text_field": a JSON
    # array (.json, as alpaca_data.json is) was sent to text_field, and an object without the field did not
    # say which keys it has.
    (volume.root / "corpus" / name).write_text(content, encoding="utf-8")
    with pytest.raises(InputError, match=words) as caught:
        run(make_config(sources=[{"path": f"corpus/{name}"}]), volume)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert ("text_field" in str(caught.value)) == name.startswith("keys"), "text_field is the fix only there"


def test_an_hf_source_without_the_text_field_is_exit_2_naming_its_columns(volume, monkeypatch):
    # It was a bare KeyError from the stream (exit 1). A local folder is a `datasets` source too.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = volume.root / "hub-like"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(f'{{"content": "story {i}"}}\n' for i in range(20)))
    with pytest.raises(InputError, match=r"has no column 'text' \(columns: content\).*text_field") as caught:
        run(make_config(sources=[{"hf": str(folder)}], mode="full"), volume)
    assert caught.value.exit_code == ExitCode.BAD_INPUT


def test_sources_without_a_document_are_exit_2_and_leave_nothing_to_reuse_once_fixed(volume):
    # It finished (exit 0) with an empty dataset and a byte-only tokenizer, and a run after the files
    # were filled in reused both as "complete and matching this config".
    (volume.root / "corpus" / "empty.txt").write_text("\n\n   \n")
    config = make_config(sources=[{"path": "corpus/empty.txt"}])
    with pytest.raises(InputError, match=r"corpus/empty\.txt hold no document.*text_field") as caught:
        run(config, volume)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert not volume.dataset("stories").exists() and not volume.tokenizer("stories").exists()
    (volume.root / "corpus" / "empty.txt").write_text("\n\n".join(corpus_documents()) + "\n")
    manifest = json.loads((run(config, volume) / "manifest.json").read_text())
    assert manifest["documents"] == STORY_COUNT and manifest["tokenizer"]["vocab_size"] == 400


STORIES_TEXT = "\n\n".join(corpus_documents())


def damaged_parquet(path: Path) -> None:
    pq.write_table(pa.table({"text": corpus_documents()}), path, row_group_size=100)
    raw = bytearray(path.read_bytes())
    raw[200:2000] = b"\x07" * 1800  # pages garbled, footer intact: pyarrow's OSError has no errno
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("name", "write", "words"),
    [
        ("latin1.txt", lambda p: p.write_bytes("un café\n\nñandú".encode("latin-1")), "is not UTF-8 text"),
        (
            "latin1.jsonl",
            lambda p: p.write_bytes('{"text": "café"}\n'.encode("latin-1")),
            "is not UTF-8 text",
        ),
        (
            "cut.txt.gz",
            lambda p: p.write_bytes(gzip.compress(STORIES_TEXT.encode())[:5000]),
            "is not a whole gzip",
        ),
        ("plain.txt.gz", lambda p: p.write_text("not gzip"), "is not a whole gzip"),
        (
            "latin1.txt.gz",
            lambda p: p.write_bytes(gzip.compress("un café".encode("latin-1"))),
            "is not UTF-8",
        ),
        ("cut.parquet", lambda p: p.write_bytes(b"PAR1" + b"\0" * 64), "is not a readable parquet"),
        ("garbled.parquet", damaged_parquet, "is not a readable parquet"),
    ],
)
def test_a_source_file_that_cannot_be_read_as_its_format_is_exit_2_naming_it(volume, name, write, words):
    # Each was a bare UnicodeDecodeError, BadGzipFile, EOFError, ArrowInvalid or OSError: exit 1, a
    # crash retried at every start with the same file, then FAILED without saying which file.
    write(volume.root / "corpus" / name)
    with pytest.raises(InputError, match=rf"source file \S+/corpus/{re.escape(name)} {words}") as caught:
        run(make_config(sources=[{"path": "corpus/stories.txt"}, {"path": f"corpus/{name}"}]), volume)
    assert caught.value.exit_code == ExitCode.BAD_INPUT


COMPRESSED_MAGIC = {
    "zstd": b"\x28\xb5\x2f\xfd",
    "bzip2": b"BZh91AY&SY",
    "xz": b"\xfd7zXZ\x00",
    "zip": b"PK\x03\x04",
}


@pytest.mark.parametrize(
    ("compression", "fmt"), [("zstd", "jsonl"), ("bzip2", "text"), ("xz", "jsonl"), ("zip", "text")]
)
def test_a_source_compressed_other_than_gzip_is_exit_2_saying_so_not_to_convert_it_from_latin1(
    volume, compression, fmt
):
    # A .jsonl.zst (SlimPajama, The Pile) given sources[].format, as the unknown suffix's error said, was
    # "not UTF-8 text ... convert it with iconv -f latin1": compressed bytes made into text, garbage to train on.
    (volume.root / "corpus" / f"stories.{fmt}.data").write_bytes(
        COMPRESSED_MAGIC[compression] + bytes(range(128, 256)) * 64
    )
    config = make_config(sources=[{"path": f"corpus/stories.{fmt}.data", "format": fmt}])
    with pytest.raises(InputError, match=f"is {compression}-compressed") as caught:
        run(config, volume)
    assert "iconv" not in str(caught.value) and "decompress it" in str(caught.value)


@pytest.mark.parametrize("suffix", [".zst", ".bz2", ".xz", ".zip"])
def test_a_compressed_suffix_other_than_gz_is_named_as_compression_not_as_a_format_to_set(volume, suffix):
    (volume.root / "corpus" / f"part-0.jsonl{suffix}").write_bytes(b"\0" * 64)
    with pytest.raises(InputError, match=rf"part-0.jsonl{re.escape(suffix)} is compressed") as caught:
        run(make_config(sources=[{"path": f"corpus/part-0.jsonl{suffix}"}]), volume)
    assert "set sources[].format" not in str(caught.value) and "decompress it" in str(caught.value)


def test_a_gzip_file_without_the_gz_suffix_is_named_as_gzip(volume):
    (volume.root / "corpus" / "stories.txt").write_bytes(gzip.compress(STORIES_TEXT.encode()))
    with pytest.raises(InputError, match=r"stories.txt is gzip-compressed.*name ending in .gz"):
        run(make_config(), volume)


def test_a_gz_suffix_in_capitals_is_read_decompressed_like_gz(volume):
    # _format_of took STORIES.TXT.GZ for gzipped text, but it was opened as plain text: "not UTF-8".
    (volume.root / "corpus" / "STORIES.TXT.GZ").write_bytes(gzip.compress(STORIES_TEXT.encode()))
    capitals = run(make_config(name="capitals", sources=[{"path": "corpus/STORIES.TXT.GZ"}]), volume)
    plain = run(make_config(), volume)
    assert (
        split_stream(capitals, load_dataset_manifest(capitals), "train").tolist()
        == split_stream(plain, load_dataset_manifest(plain), "train").tolist()
    )


@pytest.mark.parametrize(
    ("damaged", "content", "words"),
    [
        ("manifest.json", '{"complete": tr', "JSONDecodeError"),
        ("manifest.json", "[]", "a JSON list, not an object"),
        ("progress.json", "", "JSONDecodeError"),
        ("progress.json", "drop splits", "KeyError: 'splits'"),
    ],
)
def test_a_damaged_manifest_or_progress_file_is_exit_2_and_the_shards_stay(volume, damaged, content, words):
    # It was a bare JSONDecodeError or KeyError (exit 1): a crash at every start until FAILED.
    folder = run(make_config(), volume)
    if damaged == "progress.json":
        (folder / "manifest.json").unlink()  # as if killed before the manifest
    path = folder / damaged
    if content == "drop splits":
        content = json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "splits"})
    path.write_text(content)
    shards = {p.name: p.read_bytes() for p in folder.glob("*.bin")}
    with pytest.raises(
        InputError, match=rf"{re.escape(str(path))} is damaged \(.*{re.escape(words)}"
    ) as caught:
        run(make_config(), volume)
    assert caught.value.exit_code == ExitCode.BAD_INPUT and "delete the folder" in str(caught.value)
    assert {p.name: p.read_bytes() for p in folder.glob("*.bin")} == shards


def test_a_tokenizer_with_an_id_beyond_its_token_count_gets_uint32_shards_and_its_id_space(volume):
    # Its 400 tokens fitted uint16, but the end-of-text id 70000 did not: OverflowError, exit 1. The
    # manifest's vocab_size (the model's embedding rows in pretrain) was the count, 400, too.
    run(make_config(mode="full"), volume)
    folder = volume.root / "sparse-tokenizer"
    folder.mkdir()
    tree = json.loads((volume.tokenizer("stories") / "tokenizer.json").read_text())
    old_id = tree["model"]["vocab"].pop("<|endoftext|>")
    tree["added_tokens"][0]["id"] = 70000
    tree["model"]["vocab"]["<|endoftext|>"] = 70000
    (folder / "tokenizer.json").write_text(json.dumps(tree))
    dataset = run(make_config(name="sparse", mode="full", tokenizer={"path": str(folder)}), volume)
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["dtype"] == "uint32" and manifest["tokenizer"]["vocab_size"] == 70001
    reference = json.loads((volume.dataset("stories") / "manifest.json").read_text())
    expected = split_stream(volume.dataset("stories"), reference, "train").astype(np.int64)
    expected[expected == old_id] = 70000
    assert np.array_equal(split_stream(dataset, manifest, "train"), expected)


@pytest.mark.parametrize("workers", [1, MAX_THREAD_ENCODERS + 1], ids=["thread", "thread+process"])
def test_a_reused_tokenizer_saved_with_truncation_and_padding_encodes_whole_documents(volume, workers):
    # A tokenizer.json saved after enable_truncation/enable_padding (a sentence-transformers or a
    # fine-tuning script's tokenizer) carries them, and encode_batch_fast applied them: every document
    # was cut to 16 tokens in the shards, or padded to its batch's longest, silently.
    run(make_config(mode="full"), volume)
    trained = Tokenizer.from_file(str(volume.tokenizer("stories") / "tokenizer.json"))
    saved_with_limits = Tokenizer.from_str(trained.to_str())
    saved_with_limits.enable_truncation(16)
    saved_with_limits.enable_padding(pad_id=0, pad_token="!")
    folder = volume.root / "tokenizer-with-limits"
    folder.mkdir()
    saved_with_limits.save(str(folder / "tokenizer.json"))
    dataset = run(
        make_config(name="limited", mode="full", workers=workers, tokenizer={"path": str(folder)}), volume
    )
    reference = volume.dataset("stories")
    assert np.array_equal(
        split_stream(dataset, load_dataset_manifest(dataset), "train"),
        split_stream(reference, load_dataset_manifest(reference), "train"),
    )


def test_a_folder_holding_files_datagen_did_not_make_is_refused_and_kept(volume):
    # Shards from llm.c pushed under this name were deleted (every unlisted *.bin was taken for a
    # shard of a killed run), and a generated dataset's folder got token shards mixed into it.
    folder = volume.dataset("stories")
    folder.mkdir(parents=True)
    (folder / "fineweb_train_000001.bin").write_bytes(b"\0" * 2048)
    (folder / "train.jsonl").write_text('{"instruction": "x"}\n')
    with pytest.raises(
        InputError, match=r"holds files \(fineweb_train_000001\.bin, train\.jsonl\)"
    ) as caught:
        run(make_config(), volume)
    assert caught.value.exit_code == ExitCode.BAD_INPUT and "not overwritten" in str(caught.value)
    assert sorted(p.name for p in folder.iterdir()) == ["fineweb_train_000001.bin", "train.jsonl"]
    assert not volume.tokenizer("stories").exists(), "refused before a tokenizer is trained"


def test_a_shard_committed_before_the_first_progress_file_is_made_again(volume):
    # A kill between the first shard's rename and progress.json leaves that shard alone in the folder.
    folder = run(make_config(), volume)
    expected = {p.name: p.read_bytes() for p in folder.glob("*.bin")}
    for path in folder.iterdir():
        if path.name not in ("train_000000.bin",):
            path.unlink()
    (folder / "train_000000.bin").write_bytes(b"partial")
    (folder / "progress.json.tmp-1a2b").write_text("{")
    run(make_config(), volume)
    assert {p.name: p.read_bytes() for p in folder.glob("*.bin")} == expected


def test_pretrain_refuses_a_tokenizer_replaced_under_the_datasets_recorded_name(volume):
    # The folder under the recorded name was taken as it was: pretrain and its export paired shards
    # of one tokenizer with another (here 300 tokens for shards of 400), and the model shipped with it.
    from trainpod.context import RunContext

    folder = run(make_config(), volume)
    manifest = json.loads((folder / "manifest.json").read_text())
    context = RunContext(volume, None, PreemptionWatch())
    assert context.resolve_tokenizer(None, manifest) == volume.tokenizer("stories")
    kept = volume.root / "kept-tokenizer"
    volume.tokenizer("stories").rename(kept)
    run(make_config(name="other", tokenizer={"name": "stories", "vocab_size": 300}), volume)
    with pytest.raises(InputError, match=r"tokenizers/stories is not the one the dataset's shards") as caught:
        context.resolve_tokenizer(None, manifest)
    assert caught.value.exit_code == ExitCode.BAD_INPUT and "data.tokenizer" in str(caught.value)
    assert context.resolve_tokenizer(str(kept), manifest) == kept


def test_a_datasets_tokenizer_path_on_the_volume_is_found_where_the_volume_is_mounted_now(volume, tmp_path):
    # tokenizer.path (fineweb-edu.yaml's way to reuse one: tokenizers/my-32k) was recorded by its absolute
    # path alone: a dataset made under ./demo-volume and pushed, or read where the volume is mounted
    # elsewhere (/runpod-volume), had pretrain and export fail with "tokenizer not found at <old path>".
    from trainpod.context import RunContext

    run(make_config(), volume)
    folder = run(make_config(name="other", tokenizer={"path": "tokenizers/stories"}), volume)
    manifest = json.loads((folder / "manifest.json").read_text())
    remounted = Volume(volume.root.rename(tmp_path / "remounted"))
    context = RunContext(remounted, None, PreemptionWatch())
    assert context.resolve_tokenizer(None, manifest) == remounted.tokenizer("stories")


def test_a_hub_lost_in_the_middle_of_a_stream_is_exit_75_and_keeps_the_committed_shards(volume, monkeypatch):
    # `datasets` fetches a streamed dataset while it is iterated and, after its own retries, raises
    # ConnectionError("Server Disconnected"); that was a crash (exit 1) where a lost hub is temporary.
    import datasets

    from trainpod.errors import TemporaryError

    def disconnecting_stream(*args, **kwargs):
        for document in corpus_documents()[:200]:
            yield {"text": document}
        raise ConnectionError("Server Disconnected")

    monkeypatch.setattr(datasets, "load_dataset", disconnecting_stream)
    monkeypatch.setattr(sources, "hub_revision", lambda source: "a-commit")  # the hub's answer, at the start
    config = make_config(
        sources=[{"hf": "someone/stories"}],
        mode="full",
        tokenizer={"vocab_size": 300, "max_train_documents": 50},
    )
    with pytest.raises(
        TemporaryError, match=r"hf:someone/stories\[train\] \(ConnectionError: Server Disconnected\)"
    ) as caught:
        run(config, volume)
    assert caught.value.exit_code == ExitCode.TEMPORARY
    progress = json.loads((volume.dataset("stories") / "progress.json").read_text())
    assert len(progress["splits"]["train"]["shards"]) >= 2, "the shards committed before the loss stay"


def test_a_jsonl_file_starting_with_a_byte_order_mark_is_read_like_one_without(volume):
    # Its first line was refused (exit 2) as "not a JSON object with a 'text' string", though it is one.
    lines = "".join(json.dumps({"text": document}) + "\n" for document in corpus_documents())
    (volume.root / "corpus" / "plain.jsonl").write_text(lines, encoding="utf-8")
    (volume.root / "corpus" / "bom.jsonl").write_text(lines, encoding="utf-8-sig")
    plain = run(make_config(name="plain", sources=[{"path": "corpus/plain.jsonl"}]), volume)
    tokenizer = {"path": str(volume.tokenizer("plain"))}
    bom = run(make_config(name="bom", tokenizer=tokenizer, sources=[{"path": "corpus/bom.jsonl"}]), volume)
    assert {p.name: p.read_bytes() for p in bom.glob("*.bin")} == {
        p.name: p.read_bytes() for p in plain.glob("*.bin")
    }


@pytest.mark.parametrize("suffix", [".txt", ".txt.gz"])
def test_a_text_files_byte_order_mark_is_no_part_of_its_first_document(volume, suffix):
    # The mark (U+FEFF, which str.strip keeps) was read as text: tokens at the start of the first document.
    text = "\n\n".join(corpus_documents()) + "\n"
    plain = run(make_config(name="plain"), volume)
    data = text.encode("utf-8-sig")
    (volume.root / "corpus" / f"bom{suffix}").write_bytes(
        gzip.compress(data) if suffix.endswith(".gz") else data
    )
    tokenizer = {"path": str(volume.tokenizer("plain"))}
    bom = run(make_config(name="bom", tokenizer=tokenizer, sources=[{"path": f"corpus/bom{suffix}"}]), volume)
    assert {p.name: p.read_bytes() for p in bom.glob("*.bin")} == {
        p.name: p.read_bytes() for p in plain.glob("*.bin")
    }
    assert json.loads((bom / "manifest.json").read_text())["utf8_bom_stripped"] is True


def test_a_dataset_begun_reading_the_byte_order_mark_as_text_goes_on_so(volume, monkeypatch):
    # Begun by a kit that kept the mark, the dataset's first shards hold it, and a file holding only the mark
    # before a blank line made a document of its own, moving every later document's index and split. Resumed
    # reading the new way, its shards would be those of no single run.
    import trainpod.data.datagen as datagen

    documents = ["\ufeff", *corpus_documents()]  # the file's first "document": the mark alone
    (volume.root / "corpus" / "stories.txt").write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    real_begun_since = datagen._begun_since

    monkeypatch.setattr(datagen, "_begun_since", lambda folder, change: change != datagen.UTF8_BOM_STRIPPED)
    # as the kit before read it
    run_killed_at_a_shard(
        monkeypatch, lambda name: name != "train_000000.bin", lambda: run(make_config(mode="full"), volume)
    )
    monkeypatch.setattr(datagen, "_begun_since", real_begun_since)
    folder = volume.dataset("stories")
    progress = json.loads((folder / "progress.json").read_text())
    assert progress.pop("utf8_bom_stripped") is False
    (folder / "progress.json").write_text(json.dumps(progress))  # as the kit before wrote it
    run(make_config(mode="full"), volume)
    tokenizer = Tokenizer.from_file(str(volume.tokenizer("stories") / "tokenizer.json"))
    assert np.array_equal(full_stream(folder), expected_stream(tokenizer, documents, None, 0.1))
    assert json.loads((folder / "manifest.json").read_text())["utf8_bom_stripped"] is False


def documents_quoting_the_end_of_text_token() -> list[str]:
    """The corpus with the eot token's text inside every 10th document from the 300th on."""
    return [
        f"{document[:40]} <|endoftext|> {document[40:]}" if index >= 300 and index % 10 == 0 else document
        for index, document in enumerate(corpus_documents())
    ]


def full_stream(folder: Path) -> np.ndarray:
    return split_stream(folder, json.loads((folder / "manifest.json").read_text()), "train")


@pytest.mark.parametrize("workers", [2, MAX_THREAD_ENCODERS + 2], ids=["threads", "threads+processes"])
def test_a_documents_own_end_of_text_text_is_encoded_as_text_not_as_a_boundary(volume, workers):
    # The tokenizer matched the special token's text inside a document, so "<|endoftext|>" (or "</s>",
    # an HTML tag, with eot_token "</s>") in a web page split it in two for the model. llm.c's
    # fineweb.py encodes with encode_ordinary for that reason.
    documents = documents_quoting_the_end_of_text_token()
    (volume.root / "corpus" / "stories.txt").write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    folder = run(make_config(mode="full", workers=workers), volume)
    tokenizer = Tokenizer.from_file(str(volume.tokenizer("stories") / "tokenizer.json"))
    eot = tokenizer.token_to_id("<|endoftext|>")
    stream = full_stream(folder)
    assert int((stream == eot).sum()) == len(documents), "one end-of-text per document, none inside one"
    tokenizer.encode_special_tokens = True
    assert np.array_equal(stream, expected_stream(tokenizer, documents, None, 0.1))
    assert json.loads((folder / "manifest.json").read_text())["special_tokens_as_text"] is True


def test_a_dataset_begun_before_goes_on_encoding_special_token_text_as_it_began(volume, monkeypatch):
    # Its first shards hold the eot id where a document quoted it; resumed, it must go on so, or its
    # shards would be those of no single run.

    documents = documents_quoting_the_end_of_text_token()
    (volume.root / "corpus" / "stories.txt").write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    run_killed_at_a_shard(
        monkeypatch, lambda name: name != "train_000000.bin", lambda: run(make_config(mode="full"), volume)
    )
    folder = volume.dataset("stories")
    progress = json.loads((folder / "progress.json").read_text())
    assert (
        progress.pop("special_tokens_as_text") is True
        and progress["splits"]["train"]["resume"]["document"] < 300
    )
    (folder / "progress.json").write_text(json.dumps(progress))  # as the version before wrote it
    run(make_config(mode="full"), volume)
    tokenizer = Tokenizer.from_file(str(volume.tokenizer("stories") / "tokenizer.json"))
    assert np.array_equal(full_stream(folder), expected_stream(tokenizer, documents, None, 0.1))
    assert json.loads((folder / "manifest.json").read_text())["special_tokens_as_text"] is False


def test_the_settings_hash_of_todays_settings_is_pinned():
    # Every dataset made so far is recognised by this hash; a new setting that changes it makes every resume
    # after an upgrade refuse a half-made dataset. Add the setting to SETTINGS_ADDED_LATER with its value of
    # before (config/datagen.py), instead of changing this number.
    assert settings_hash(make_config()) == "37e14cbededff287"


class UpgradedTokenizer(TokenizerSettings):
    byte_fallback: bool = False


class UpgradedSource(SourceConfig):
    strip_html: bool = False


class UpgradedConfig(DatagenConfig):
    """A later kit's config: one new setting per level, each with a value that changes nothing."""

    tokenizer: UpgradedTokenizer = UpgradedTokenizer()
    sources: list[UpgradedSource]
    dedupe: str = "off"


def test_a_half_made_dataset_resumes_after_an_upgrade_that_adds_settings_at_their_old_values(
    volume, monkeypatch
):
    for path, before in {
        ("tokenizer", "byte_fallback"): False,
        ("sources", "*", "strip_html"): False,
        ("dedupe",): "off",
    }.items():
        monkeypatch.setitem(SETTINGS_ADDED_LATER, path, before)
    tree = make_config().model_dump(mode="json")
    folder = run(make_config(), volume)
    made = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").unlink()  # killed before its manifest: progress.json and the tokenizer stay

    upgraded = validate_tree(UpgradedConfig, tree)
    assert run(upgraded, volume) == folder  # was exit 2: "made from a different config", delete the folder
    resumed = json.loads((folder / "manifest.json").read_text())
    assert resumed["splits"] == made["splits"] and resumed["config_hash"] == made["config_hash"]

    changed = validate_tree(UpgradedConfig, {**tree, "dedupe": "exact"})
    with pytest.raises(InputError, match="made from a different config"):
        run(changed, volume)


def blank_line_documents(path: Path) -> list[str]:
    return list(sources._text_documents(path, "blank_line"))


def test_blank_line_documents_are_the_same_whatever_the_read_blocks_cut(tmp_path, monkeypatch):
    # The documents of one split of the whole text (what every dataset so far was made from), with blocks
    # cutting separators, CRLFs and runs of blank lines at every place.
    rng = np.random.default_rng(5)
    path = tmp_path / "t.txt"
    for _ in range(200):
        text = "".join(
            rng.choice(["a", "b", "\n", "\n", " ", "\t", "\r\n", "\r"], size=int(rng.integers(0, 60)))
        )
        path.write_bytes(text.encode())
        whole = sources.BLANK_LINE.split(path.read_text(encoding="utf-8"))
        for block in (1, 2, 3, 5, 8):
            monkeypatch.setattr(sources, "READ_BLOCK_CHARS", block)
            assert blank_line_documents(path) == whole, (repr(text), block)


class CountingScans:
    """BLANK_LINE that adds up the characters the splitter scans."""

    def __init__(self, pattern: re.Pattern):
        self.pattern = pattern
        self.scanned = 0

    def split(self, text: str) -> list[str]:
        self.scanned += len(text)
        return self.pattern.split(text)


def test_blank_line_reading_holds_one_block_and_one_document_and_scans_each_block_once(tmp_path, monkeypatch):
    # A long stretch without a blank line (a one-line-per-sentence file left at the default separator) was
    # scanned again with every block: quadratic, and held twice (rest + block) while it grew.
    path = tmp_path / "t.txt"
    long_document = "".join(f"sentence {i}.\n" for i in range(5000))  # ~70 000 characters, 700 blocks
    path.write_text("short one\n\n" + long_document + "\nlast one\n")
    expected = sources.BLANK_LINE.split(path.read_text())
    monkeypatch.setattr(sources, "READ_BLOCK_CHARS", 100)
    counting = CountingScans(sources.BLANK_LINE)
    monkeypatch.setattr(sources, "BLANK_LINE", counting)
    documents = sources._text_documents(path, "blank_line")
    assert next(documents) == "short one"
    assert counting.scanned <= 200, "the first document comes after at most two blocks, not the whole file"
    assert [next(documents), *documents] == expected[1:] == [long_document[:-1], "last one\n"]
    assert counting.scanned <= path.stat().st_size * 1.1, (
        "each block is scanned once (the text since the last blank line is not scanned again)"
    )


def test_a_file_without_blank_lines_at_the_blank_line_separator_is_exit_2_before_memory_runs_out(
    volume, monkeypatch
):
    # A 20 GB file of single lines at the default separator is one 20 GB document: it was held whole until
    # the OOM killer ended the pod (a crash, retried), after hours of reading.
    monkeypatch.setattr(sources, "READ_BLOCK_CHARS", 100)
    monkeypatch.setattr(sources, "MAX_DOCUMENT_CHARS", 5000)
    (volume.root / "corpus" / "lines.txt").write_text("".join(f"sentence {i}.\n" for i in range(1000)))
    with pytest.raises(InputError, match=r"source file \S+/lines.txt: a document runs past 5,000") as caught:
        run(make_config(sources=[{"path": "corpus/lines.txt"}]), volume)
    assert "sources[].separator: line" in str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert not any((volume.root / "datasets").iterdir()), "nothing written, the lease released"
    folder = run(make_config(sources=[{"path": "corpus/lines.txt", "separator": "line"}]), volume)
    assert load_dataset_manifest(folder)["documents"] == 1000


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda m: [m], "does not describe a complete"),
        (
            lambda m: {k: v for k, v in m.items() if k != "splits"},
            "is damaged (a field missing or malformed: KeyError",
        ),
        (lambda m: {**m, "tokenizer": None}, "is damaged (a field missing or malformed: TypeError"),
        (
            lambda m: {**m, "splits": {"train": {"shards": [{"file": "train_000000.bin"}]}}},
            "is damaged (a field missing or malformed: KeyError: 'bytes'",
        ),
    ],
)
def test_a_dataset_manifest_cut_or_edited_by_hand_is_exit_2_for_its_readers(volume, change, words):
    # pretrain, convert and push read it: a list or a missing key was an AttributeError or KeyError (exit 1).
    folder = run(make_config(), volume)
    path = folder / "manifest.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    with pytest.raises(InputError, match=re.escape(f"{path} {words}")) as caught:
        load_dataset_manifest(folder)
    assert caught.value.exit_code == ExitCode.BAD_INPUT and "trainpod run datagen" in str(caught.value)


def test_a_tokenizer_another_writer_is_training_is_left_to_it_then_reused(volume):
    # Two datasets naming one tokenizer on two pods at once removed each other's temp folder, and the second
    # rename onto the first's folder crashed (exit 1). The second exits 75 now, and reuses it afterwards.
    (volume.root / "tokenizers").mkdir()
    training = Lease(volume.root / "tokenizers" / ".shared.LEASE", ttl_seconds=600)  # another live writer's
    training.acquire()
    try:
        with pytest.raises(TemporaryError, match="tokenizer shared is leased by another writer") as caught:
            run(make_config(name="first", tokenizer={"name": "shared", "vocab_size": 400}), volume)
        assert caught.value.exit_code == ExitCode.TEMPORARY
        assert sorted(p.name for p in (volume.root / "tokenizers").iterdir()) == [".shared.LEASE"]
    finally:
        training.release()
    run(make_config(name="first", tokenizer={"name": "shared", "vocab_size": 400}), volume)
    made = (volume.tokenizer("shared") / "tokenizer.json").read_bytes()
    training.acquire()
    try:  # a trained tokenizer is reused without its lease
        run(
            make_config(name="second", tokenizer={"name": "shared", "vocab_size": 400}, shard_tokens=5000),
            volume,
        )
    finally:
        training.release()
    assert (volume.tokenizer("shared") / "tokenizer.json").read_bytes() == made


def test_a_stop_while_a_resume_reads_past_its_committed_documents_ends_it_there(volume, monkeypatch):
    # A resume reads the documents its committed shards hold without encoding them: on a large corpus
    # (a hub stream) minutes with no batch to look at the stop flag after, so a SIGTERM ran on into the
    # SIGKILL with the dataset's lease held, which a new pod on another host then waited out (90 s).

    run_killed_at_a_shard(
        monkeypatch, lambda name: name == "train_000010.bin", lambda: run(make_config(), volume)
    )
    folder = volume.dataset("stories")
    resume_at = json.loads((folder / "progress.json").read_text())["splits"]["train"]["resume"]["document"]
    assert resume_at > 100, "the first run should commit shards past the first hundred documents"

    watch = PreemptionWatch()
    read_after_the_stop = stop_at_document(monkeypatch, watch, 50)
    with pytest.raises(Preempted, match="run it again"):
        run_datagen(make_config(), volume, watch)
    assert len(read_after_the_stop) <= 1, (
        f"after the stop at document 50 it read {len(read_after_the_stop)} more (its shards resume at "
        f"{resume_at}): the skip of committed documents must look at the stop flag"
    )
    assert (
        not (folder / "manifest.json").exists() and not (volume.root / "datasets" / ".stories.LEASE").exists()
    )
    run(make_config(), volume)  # and it resumes from there


def test_a_resume_after_a_file_joined_its_glob_before_those_read_is_exit_2_not_shards_of_two_orders(
    volume, monkeypatch
):
    # A file landing among the glob's (a download still running into the folder) between a kill and the
    # resume moved every later document's index: the resume went on at its committed document index in
    # the new order, so documents were written twice or never, and ones in train shards became val ones.

    documents = corpus_documents()
    parts = {"part-0": documents[400:], "part-1": documents[:200], "part-2": documents[200:400]}
    for part, texts in parts.items():
        (volume.root / "corpus" / f"{part}.txt").write_text("\n\n".join(texts), encoding="utf-8")
    late = (volume.root / "corpus" / "part-0.txt").rename(volume.root / "late-part-0.txt")
    config = make_config(sources=[{"path": "corpus/part-*.txt"}])
    run_killed_at_a_shard(monkeypatch, lambda name: name == "train_000005.bin", lambda: run(config, volume))
    folder = volume.dataset("stories")
    committed = {p.name: p.read_bytes() for p in folder.glob("*.bin")}

    late.rename(volume.root / "corpus" / "part-0.txt")  # sorts before the files read
    with pytest.raises(InputError, match=r"added since: corpus/part-0.txt") as caught:
        run(config, volume)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert {p.name: p.read_bytes() for p in folder.glob("*.bin")} == committed
    assert not (folder / "manifest.json").exists()

    # Put back as it was, the resume goes on; a file sorting after those read moves no committed document
    # and is read after them, as in an uninterrupted run over all three.
    (volume.root / "corpus" / "part-0.txt").rename(volume.root / "corpus" / "part-3.txt")
    resumed = run(config, volume)
    (volume.root / "corpus" / "all.txt").write_text("\n\n".join(documents), encoding="utf-8")
    reference = run(make_config(name="reference", sources=[{"path": "corpus/all.txt"}]), volume)
    for split in ("train", "val"):
        assert np.array_equal(
            split_stream(resumed, load_dataset_manifest(resumed), split),
            split_stream(reference, load_dataset_manifest(reference), split),
        )


def hub_of_two_commits(volume: Volume, monkeypatch) -> list[str]:
    """org/stories on a stand-in hub: a folder per commit, served by datasets.load_dataset at the revision
    asked for (its newest without one); sources.hub_revision, the one function that asks the hub for the
    newest commit, is replaced to name it. commit-2 is commit-1 with one document pushed at the front.
    Returns the newest commit's name in a list, for a test to push commit-2 by setting it."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    documents = corpus_documents()
    for commit, texts in {
        "commit-1": documents,
        "commit-2": ["A document pushed later.", *documents],
    }.items():
        (volume.root / "hub" / commit).mkdir(parents=True)
        lines = "".join(json.dumps({"text": text}) + "\n" for text in texts)
        (volume.root / "hub" / commit / "train.jsonl").write_text(lines, encoding="utf-8")
    newest = ["commit-1"]
    real_load_dataset = datasets.load_dataset

    def hub(name, config=None, split=None, streaming=False, revision=None):
        assert (name, streaming) == ("org/stories", True)
        return real_load_dataset(
            str(volume.root / "hub" / (revision or newest[0])), split=split, streaming=True
        )

    monkeypatch.setattr(datasets, "load_dataset", hub)
    monkeypatch.setattr(sources, "hub_revision", lambda source: newest[0], raising=False)
    return newest


def assert_shards_of_one_run_over_commit_1(resumed: Path, volume: Volume) -> None:
    reference = run(make_config(name="reference", sources=[{"path": "hub/commit-1/train.jsonl"}]), volume)
    for split in ("train", "val"):
        assert np.array_equal(
            split_stream(resumed, load_dataset_manifest(resumed), split),
            split_stream(reference, load_dataset_manifest(reference), split),
        ), f"the resumed {split} shards are not those of one run over the commit the dataset began at"
    assert load_dataset_manifest(resumed)["sources"][0]["revision"] == "commit-1"


def test_a_resume_after_a_push_to_a_hub_datasets_repository_reads_the_commit_the_dataset_began_at(
    volume, monkeypatch
):
    # A hub dataset was streamed at its branch's newest commit at every start: a push between a kill and the
    # resume (one document added at the front) moved every later document's index, and the resume went on at
    # its committed index in the new order, writing documents twice and moving train ones into val, silently.
    newest = hub_of_two_commits(volume, monkeypatch)
    config = make_config(sources=[{"hf": "org/stories"}])
    run_killed_at_a_shard(monkeypatch, lambda name: name == "train_000005.bin", lambda: run(config, volume))

    newest[0] = "commit-2"  # the push
    assert_shards_of_one_run_over_commit_1(run(config, volume), volume)


def test_a_dataset_killed_before_its_first_shard_reads_the_commit_its_tokenizer_was_trained_on(
    volume, monkeypatch
):
    # The commit was recorded with the first shard (progress.json), so a kill after the tokenizer was trained
    # and before that shard looked it up again: after a push meanwhile the shards were cut from commit-2 with
    # a tokenizer trained on commit-1, not the shards of one run, and nothing recorded the tokenizer's commit.
    newest = hub_of_two_commits(volume, monkeypatch)
    config = make_config(sources=[{"hf": "org/stories"}])
    run_killed_at_a_shard(monkeypatch, lambda name: True, lambda: run(config, volume))
    assert not (volume.dataset("stories") / "progress.json").exists(), "the kill came before the first shard"
    record = json.loads((volume.tokenizer("stories") / "trainpod_tokenizer.json").read_text())
    assert record["hub_revisions"] == {"org/stories": "commit-1"}, "the tokenizer notes the commit it read"

    newest[0] = "commit-2"  # the push
    assert_shards_of_one_run_over_commit_1(run(config, volume), volume)


def test_a_dataset_begun_before_commits_were_recorded_is_held_to_the_commit_of_its_first_resume_since(
    volume, monkeypatch, caplog
):
    # A dataset begun by a kit that recorded no commit goes on at the newest one, with a warning: its shards
    # were read at a commit nothing names. That resume recorded none either ({}, read as 'pinned to nothing'),
    # so every later resume read the newest again, and a push after the upgrade moved its documents as before.
    newest = hub_of_two_commits(volume, monkeypatch)
    config = make_config(sources=[{"hf": "org/stories"}])
    run_killed_at_a_shard(monkeypatch, lambda name: name == "train_000003.bin", lambda: run(config, volume))
    tokenizer_record = volume.tokenizer("stories") / "trainpod_tokenizer.json"
    for record in (volume.dataset("stories") / "progress.json", tokenizer_record):
        as_an_older_kit_wrote_it = json.loads(record.read_text())
        del as_an_older_kit_wrote_it["hub_revisions"]
        record.write_text(json.dumps(as_an_older_kit_wrote_it))
    with caplog.at_level("WARNING"):
        run_killed_at_a_shard(
            monkeypatch, lambda name: name == "train_000006.bin", lambda: run(config, volume)
        )
    assert "was begun before datagen recorded the commit" in caplog.text

    newest[0] = "commit-2"  # the push, after the upgrade
    assert_shards_of_one_run_over_commit_1(run(config, volume), volume)


def test_a_stop_while_the_tokenizer_reads_its_training_documents_ends_it_there(volume, monkeypatch):
    # Training reads up to max_train_documents (fineweb-edu.yaml: 200k, minutes of a hub stream) in one
    # call of the tokenizers library: a SIGTERM then ran on through the training into the SIGKILL with the
    # dataset's and the tokenizer's leases held, which a new pod on another host then waited out (90 s).
    import trainpod.data.datagen as datagen

    real_iter_documents = datagen.iter_documents
    watch = PreemptionWatch()
    read_after_the_stop = stop_at_document(monkeypatch, watch, 20)
    with pytest.raises(Preempted, match="run it again"):
        run_datagen(make_config(), volume, watch)
    assert len(read_after_the_stop) <= 1, (
        f"after the stop at document 20 the tokenizer's training read {len(read_after_the_stop)} more "
        "documents: it must look at the stop flag"
    )
    assert not volume.tokenizer("stories").exists(), "a training cut short publishes no tokenizer"
    assert [p.name for p in volume.root.glob("*/.*LEASE")] == [], "both leases are released"
    monkeypatch.setattr(datagen, "iter_documents", real_iter_documents)
    run(make_config(), volume)  # and the next start trains it


def test_a_stop_that_came_while_the_lease_was_taken_over_trains_no_tokenizer(volume, monkeypatch):
    # Taking over a killed start's lease waits 2 s for a rival (TAKEOVER_SETTLE_S), then the tokenizer's
    # own another 2 s: a stop in the first, run on into the second and the training, outlasted the window.
    from trainpod.checkpoint import lease

    watch = PreemptionWatch()
    real_acquire = lease.Lease.acquire

    def stopped_while_acquiring(self):
        real_acquire(self)
        watch.request("SIGTERM")

    monkeypatch.setattr(lease.Lease, "acquire", stopped_while_acquiring)
    with pytest.raises(Preempted, match="run it again"):
        run_datagen(make_config(), volume, watch)
    assert not volume.tokenizer("stories").exists()
    assert [p.name for p in volume.root.glob("*/.*LEASE")] == [], "both leases are released"


def stop_at_document(monkeypatch, watch: PreemptionWatch, at: int) -> list[int]:
    """Datagen's documents, with a stop asked for as document `at` is read; returns the list the indexes of
    documents read after the stop go into (a reader that looks at the stop flag reads at most one more)."""
    import trainpod.data.datagen as datagen

    real_iter_documents = datagen.iter_documents
    read_after_the_stop: list[int] = []

    def stopped_there(*args, **kwargs):
        for index, document in enumerate(real_iter_documents(*args, **kwargs)):
            if watch.requested:
                read_after_the_stop.append(index)
            elif index == at:
                watch.request("SIGTERM")
            yield document

    monkeypatch.setattr(datagen, "iter_documents", stopped_there)
    return read_after_the_stop
