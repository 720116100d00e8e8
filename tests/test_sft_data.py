"""SFT data preparation: formats, templates, answer-only labels, cutoff, bad rows, cache reuse and refusal.

Expected texts and label positions are written out here by hand (the template strings) and found by
tokenizing the answers alone, never by calling trainpod's own masking code.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from trainpod.chat import Conversation
from trainpod.checkpoint import Lease
from trainpod.config.loader import load_config, validate_tree
from trainpod.config.sft import SftDataConfig, SftDatagenConfig
from trainpod.errors import ConfigError, ExitCode, InputError, Preempted, TemporaryError
from trainpod.preemption import PreemptionWatch
from trainpod.sft import IGNORE_INDEX, load_sft, prepare_sft, run_sft_datagen, sft_key
from trainpod.sft.demo_rows import demo_jsonl
from trainpod.sft.sources import builtin_sft_tiny_path
from trainpod.volume import Volume

from sft_support import (
    CUSTOM_CHAT_TEMPLATE,
    key_before_encodings_were_recorded,
    make_bos_adding_tokenizer,
    make_metaspace_tokenizer,
    make_newline_merging_tokenizer,
    make_tiny_tokenizer,
    write_alpaca_jsonl,
    write_messages_jsonl,
)
from support import CONFIGS, tree_snapshot

SYSTEM = "Be brief."
TURNS = [("Add 2 and 3.", "5"), ("Reverse\ncloud", "duolc")]

# One conversation in each format; every one must come out as the same samples.
ROWS = {
    "alpaca": {
        "instruction": "Reverse",
        "input": "cloud",
        "output": "duolc",
        "system": SYSTEM,
        "history": [["Add 2 and 3.", "5"]],
    },
    "sharegpt": {
        "conversations": [
            {"from": "human", "value": "Add 2 and 3."},
            {"from": "gpt", "value": "5"},
            {"from": "human", "value": "Reverse\ncloud"},
            {"from": "gpt", "value": "duolc"},
        ],
        "system": SYSTEM,
    },
    "messages": {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "Reverse\ncloud"},
            {"role": "assistant", "content": "duolc"},
        ]
    },
}

# (full text, the token that ends every answer), written from each template's definition.
EXPECTED = {
    "chatml": (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n"
        "5<|im_end|>\n<|im_start|>user\nReverse\ncloud<|im_end|>\n<|im_start|>assistant\nduolc<|im_end|>",
        "<|im_end|>",
    ),
    "qwen": (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n"
        "5<|im_end|>\n<|im_start|>user\nReverse\ncloud<|im_end|>\n<|im_start|>assistant\nduolc<|im_end|>",
        "<|im_end|>",
    ),
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAdd 2 and 3.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nReverse\ncloud<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nduolc<|eot_id|>",
        "<|eot_id|>",
    ),
    "alpaca": (
        "Be brief.\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n5<|endoftext|>\n\n"
        "### Instruction:\nReverse\ncloud\n\n### Response:\nduolc<|endoftext|>",
        "<|endoftext|>",
    ),
    "auto": (  # the tokenizer's own CUSTOM_CHAT_TEMPLATE
        "<|start_header_id|>system<|end_header_id|>Be brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>Add 2 and 3.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>5<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>Reverse\ncloud<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>duolc<|eot_id|>",
        "<|eot_id|>",
    ),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny", chat_template=CUSTOM_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def plain_tokenizer_dir(tmp_path_factory) -> Path:
    """No chat_template: `auto` falls back to chatml."""
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "plain")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def data_config(datasets: list[dict], **settings) -> SftDataConfig:
    return validate_tree(SftDataConfig, {"datasets": datasets, **settings})


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def prepare(tmp_path: Path, tokenizer_dir: Path, rows: list[dict], fmt: str = "alpaca", **settings):
    write_jsonl(tmp_path / "vol" / "data.jsonl", rows)
    config = data_config([{"path": "data.jsonl", "format": fmt}], **settings)
    return load_sft(
        prepare_sft(config, tokenizer_dir, tmp_path / "vol" / "datasets" / "sft", tmp_path / "vol")
    )


def answer_positions(ids: list[int], answers: list[list[int]]) -> list[int]:
    """Positions of each answer's ids, found in order as contiguous runs of `ids`."""
    positions, start = [], 0
    for answer in answers:
        at = next(i for i in range(start, len(ids) - len(answer) + 1) if ids[i : i + len(answer)] == answer)
        positions += range(at, at + len(answer))
        start = at + len(answer)
    return positions


@pytest.mark.parametrize("template", list(EXPECTED))
@pytest.mark.parametrize("fmt", list(ROWS))
def test_labels_are_exactly_the_answer_tokens_with_their_end_of_turn(
    tmp_path, tokenizer_dir, tokenizer, fmt, template
):
    data = prepare(tmp_path, tokenizer_dir, [ROWS[fmt]], fmt, template=template)
    example = data.train[0]
    text, end = EXPECTED[template]
    ids = example.input_ids.tolist()
    assert tokenizer.decode(ids) == text
    answers = [tokenizer.encode(answer + end, add_special_tokens=False) for _, answer in TURNS]
    expected = answer_positions(ids, answers)
    trained = [i for i, label in enumerate(example.labels.tolist()) if label != IGNORE_INDEX]
    assert trained == expected, f"{template}/{fmt}: trained {trained}, answers at {expected}"
    assert all(example.labels[i] == example.input_ids[i] for i in trained), "labels must not be shifted"


def test_a_sample_has_the_ids_of_its_whole_text_under_a_sentencepiece_style_tokenizer(tmp_path):
    """Llama 2's and Mistral's tokenizers put ▁ (a space) before the start of every text they encode: each
    segment encoded alone began with one, so every answer was trained as " 5" where the rendered text
    (and a prompt rendered whole, by any server) reads "5"."""
    folder = make_metaspace_tokenizer(tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    example = prepare(tmp_path, folder, [ROWS["alpaca"]], template="alpaca").train[0]
    text = (
        f"<s>{SYSTEM}\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n5</s>\n\n"
        "### Instruction:\nReverse\ncloud\n\n### Response:\nduolc</s>"
    )
    assert example.input_ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    trained = example.input_ids[example.labels != IGNORE_INDEX].tolist()
    assert "".join(tokenizer.convert_ids_to_tokens(trained)) == "5</s>duolc</s>"


@pytest.mark.parametrize("template", ["chatml", "llama3", "alpaca"])
def test_an_answer_starting_with_a_newline_is_trained_from_where_generation_starts(tmp_path, template):
    """Under Qwen2's and Llama 3's tokenizers "\n\n" is one token: the prompt's last newline and an answer's
    first, tokenized as one text, made one token given to the prompt, so the answer's newline was never
    trained and the model learnt to answer after a token that a prompt rendered alone (as trainpod chat,
    apply_chat_template or a server tokenize it, ending in "\n") never has."""
    folder = make_newline_merging_tokenizer(tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert len(tokenizer.encode("\n\n", add_special_tokens=False)) == 1, "the test needs a merged \\n\\n"
    row = {"instruction": "Reverse", "output": "\nduolc", "history": [["Add 2 and 3.", "\n5"]]}
    example = prepare(tmp_path, folder, [row], template=template).train[0]
    prompt = Conversation(tokenizer, template).prompt_ids("Add 2 and 3.")
    end = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "alpaca": "<|endoftext|>"}[template]
    answers = [tokenizer.encode(answer + end, add_special_tokens=False) for answer in ("\n5", "\nduolc")]
    assert example.input_ids[: len(prompt) + len(answers[0])].tolist() == prompt + answers[0]
    trained = example.input_ids[example.labels != IGNORE_INDEX].tolist()
    assert trained == answers[0] + answers[1], f"trained {tokenizer.convert_ids_to_tokens(trained)}"


def test_text_format_trains_every_token_but_the_first_and_ends_with_eos(tmp_path, tokenizer_dir, tokenizer):
    data = prepare(tmp_path, tokenizer_dir, [{"text": "The quick brown fox."}], "text", template="chatml")
    example = data.train[0]
    expected = tokenizer.encode("The quick brown fox.<|endoftext|>", add_special_tokens=False)
    assert example.input_ids.tolist() == expected
    assert example.labels.tolist() == [IGNORE_INDEX, *expected[1:]]


def test_text_format_starts_with_the_bos_a_tokenizer_puts_before_every_text(tmp_path):
    """Llama, Mistral and Gemma were pretrained (and are prompted by trainpod chat) with bos before every
    text; a text sample without it trained the model on documents it never sees (Gemma falls apart)."""
    folder = make_bos_adding_tokenizer(tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    data = prepare(tmp_path, folder, [{"text": "The quick brown fox."}], "text", template="alpaca")
    example = data.train[0]
    expected = tokenizer("The quick brown fox.")["input_ids"] + [tokenizer.eos_token_id]
    assert expected[0] == tokenizer.bos_token_id
    assert example.input_ids.tolist() == expected
    assert example.labels.tolist() == [IGNORE_INDEX, *expected[1:]]


def test_plain_text_needs_no_chat_template_of_a_base_tokenizer(tmp_path):
    """A base model's tokenizer (no chat_template, no chatml tokens) and plain text, which no template
    wraps: the default template (auto, so chatml) was checked anyway and refused the continued pretraining."""
    folder = make_bos_adding_tokenizer(tmp_path / "tok")
    data = prepare(tmp_path, folder, [{"text": "The quick brown fox."}], "text")
    assert len(data.train) == 1 and data.manifest["template"] is None


def test_a_dataset_of_plain_text_alone_records_no_template_and_one_with_chats_records_its_template(
    tmp_path, tokenizer_dir
):
    """trainpod chat and generate wrap prompts in the recorded template: a model trained on plain text
    (format text, which no template wraps) was prompted as a chat it never saw."""
    text = prepare(
        tmp_path / "text", tokenizer_dir, [{"text": "The quick brown fox."}], "text", template="chatml"
    )
    assert text.manifest["template"] is None
    (tmp_path / "mixed/vol").mkdir(parents=True)
    write_jsonl(tmp_path / "mixed/vol/text.jsonl", [{"text": "The quick brown fox."}])
    write_jsonl(tmp_path / "mixed/vol/chat.jsonl", [ROWS["alpaca"]])
    config = data_config(
        [{"path": "text.jsonl", "format": "text"}, {"path": "chat.jsonl", "format": "alpaca"}],
        template="chatml",
    )
    out = prepare_sft(config, tokenizer_dir, tmp_path / "mixed/vol/datasets/sft", tmp_path / "mixed/vol")
    assert load_sft(out).manifest["template"] == "chatml"


def test_train_on_prompt_trains_the_prompt_too(tmp_path, tokenizer_dir):
    data = prepare(tmp_path, tokenizer_dir, [ROWS["alpaca"]], template="chatml", train_on_prompt=True)
    example = data.train[0]
    assert example.labels.tolist() == [IGNORE_INDEX, *example.input_ids.tolist()[1:]]


def test_auto_without_a_chat_template_uses_chatml(tmp_path, plain_tokenizer_dir, tokenizer):
    data = prepare(tmp_path, plain_tokenizer_dir, [ROWS["messages"]], "messages", template="auto")
    assert tokenizer.decode(data.train[0].input_ids) == EXPECTED["chatml"][0]
    assert data.manifest["template"] == "chatml"


def test_qwen_adds_its_default_system_prompt_when_the_sample_has_none(tmp_path, tokenizer_dir, tokenizer):
    data = prepare(tmp_path, tokenizer_dir, [{"instruction": "Hi", "output": "Hello"}], template="qwen")
    assert tokenizer.decode(data.train[0].input_ids).startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    )


def test_template_missing_special_tokens_is_refused_naming_them(tmp_path):
    folder = make_tiny_tokenizer(tmp_path / "tok", llama3_tokens=False)
    with pytest.raises(InputError, match=r"'llama3' needs the special tokens <\|begin_of_text\|>, "):
        prepare(tmp_path, folder, [ROWS["alpaca"]], template="llama3")


def test_truncate_keeps_short_answers_whole_and_cuts_the_prompt(tmp_path, tokenizer_dir, tokenizer, caplog):
    long_prompt = {"instruction": "apple river stone cloud " * 20, "output": "42"}
    with caplog.at_level(logging.WARNING, logger="trainpod.sft.prepare"):
        data = prepare(tmp_path, tokenizer_dir, [long_prompt], template="chatml", cutoff_len=32)
    example = data.train[0]
    assert len(example.input_ids) == 32
    answer = tokenizer.encode("42<|im_end|>", add_special_tokens=False)
    assert example.input_ids.tolist()[-len(answer) :] == answer
    assert example.labels.tolist()[-len(answer) :] == answer
    counts = data.manifest["counts"]
    assert counts["truncated"] == 1
    assert (
        counts["longest_sample_tokens"] > 32
        and counts["truncated_tokens"] == counts["longest_sample_tokens"] - 32
    )
    # A run that never learns the ends of its long samples, unless the log says so where it is read.
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned and "1 of 1 samples were longer than sft.cutoff_len=32" in warned[0], warned
    assert f"the longest sample has {counts['longest_sample_tokens']}" in warned[0]


def test_drop_leaves_long_samples_out_and_counts_them(tmp_path, tokenizer_dir):
    rows = [
        {"instruction": "apple river stone cloud " * 20, "output": "42"},
        {"instruction": "Hi", "output": "Yo"},
    ]
    data = prepare(tmp_path, tokenizer_dir, rows, template="chatml", cutoff_len=32, overflow="drop")
    assert len(data.train) == 1 and data.train[0].row_index == 1
    assert data.manifest["counts"]["dropped"] == 1


def test_validation_split_is_a_deterministic_share_by_row(tmp_path, tokenizer_dir):
    write_alpaca_jsonl(tmp_path / "vol" / "a.jsonl", 200, seed=1)
    config = data_config([{"path": "a.jsonl"}], template="chatml", val_ratio=0.2)
    first = load_sft(prepare_sft(config, tokenizer_dir, tmp_path / "one", tmp_path / "vol"))
    second = load_sft(prepare_sft(config, tokenizer_dir, tmp_path / "two", tmp_path / "vol"))
    val_rows = [e.row_index for e in first.val]
    assert val_rows == [e.row_index for e in second.val]
    assert 20 <= len(val_rows) <= 60
    assert sorted(val_rows + [e.row_index for e in first.train]) == list(range(200))


def test_a_val_ratio_that_holds_out_every_row_is_named_as_the_cause(tmp_path, tokenizer_dir):
    """The error blamed cutoff_len and overflow, which dropped nothing, and never named val_ratio."""
    rows = [{"instruction": "Hi", "output": "Yo"}] * 3
    with pytest.raises(InputError, match=r"3 held out for validation .*lower sft.val_ratio=0.5"):
        prepare(tmp_path, tokenizer_dir, rows, template="chatml", val_ratio=0.5, seed=1)


def test_json_array_gzip_parquet_and_globs_read_the_same_rows_as_jsonl(tmp_path, tokenizer_dir):
    rows = [ROWS["alpaca"], {"instruction": "Hi", "input": "", "output": "Yo"}]
    volume = tmp_path / "vol"
    write_jsonl(volume / "ref" / "data.jsonl", rows)
    (volume / "other").mkdir()
    with gzip.open(volume / "other" / "part-0.json.gz", "wt") as f:
        json.dump(rows[:1], f)
    pq.write_table(pa.Table.from_pylist(rows[1:]), volume / "other" / "part-1.parquet")

    def ids(path: str, name: str) -> list[list[int]]:
        config = data_config([{"path": path}], template="chatml")
        data = load_sft(prepare_sft(config, tokenizer_dir, tmp_path / name, volume))
        return [e.input_ids.tolist() for e in data.train]

    expected = ids("ref/data.jsonl", "ref")
    assert ids("other", "folder") == expected
    assert ids(str(volume / "other" / "part-*"), "glob") == expected


def test_max_samples_takes_the_first_rows_of_each_dataset(tmp_path, tokenizer_dir):
    write_alpaca_jsonl(tmp_path / "vol" / "a.jsonl", 10, seed=1)
    write_messages_jsonl(tmp_path / "vol" / "m.jsonl", 10, seed=1)
    config = data_config(
        [{"path": "a.jsonl", "max_samples": 3}, {"path": "m.jsonl", "format": "messages", "max_samples": 2}],
        template="chatml",
    )
    data = load_sft(prepare_sft(config, tokenizer_dir, tmp_path / "out", tmp_path / "vol"))
    assert [e.row_index for e in data.train] == [0, 1, 2, 3, 4]
    assert data.manifest["counts"]["rows"] == 5


# Bad input: file, line and field in the message, exit code 2.


@pytest.mark.parametrize("name", ["data.jsonl", "data.json", "data.jsonl.gz"])
def test_a_file_starting_with_a_byte_order_mark_reads_like_one_without(tmp_path, tokenizer_dir, name):
    # Windows tools and pandas' encoding='utf-8-sig' write one; line 1 was refused as "not valid JSON".
    rows = [ROWS["alpaca"], {"instruction": "Hi", "input": "", "output": "Yo"}]
    text = json.dumps(rows) if name == "data.json" else "".join(json.dumps(row) + "\n" for row in rows)
    volume = tmp_path / "vol"
    write_jsonl(volume / "plain" / "data.jsonl", rows)
    raw = ("\ufeff" + text).encode("utf-8")
    (volume / "bom").mkdir()
    (volume / "bom" / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)

    def ids(path: str) -> list[list[int]]:
        config = data_config([{"path": path}], template="chatml")
        data = load_sft(prepare_sft(config, tokenizer_dir, tmp_path / path.replace("/", "-"), volume))
        return [e.input_ids.tolist() for e in data.train]

    assert ids(f"bom/{name}") == ids("plain/data.jsonl")


def test_a_json_array_after_blank_lines_reads_like_one_without(tmp_path, tokenizer_dir):
    # A pretty-printed .json whose "[" came after a blank line (a generated or hand-edited file) was read as
    # JSON Lines: "line 2: not valid JSON ... fix that line" for a file that is valid JSON.
    rows = [ROWS["alpaca"], {"instruction": "Hi", "input": "", "output": "Yo"}]
    volume = tmp_path / "vol"
    write_jsonl(volume / "plain" / "data.jsonl", rows)
    (volume / "array").mkdir()
    (volume / "array" / "data.json").write_text(
        "\n  \n" + json.dumps(rows, indent=2) + "\n", encoding="utf-8"
    )

    def ids(path: str) -> list[list[int]]:
        config = data_config([{"path": path}], template="chatml")
        data = load_sft(prepare_sft(config, tokenizer_dir, tmp_path / path.replace("/", "-"), volume))
        return [e.input_ids.tolist() for e in data.train]

    assert ids("array/data.json") == ids("plain/data.jsonl")


def test_a_bad_json_array_after_blank_lines_names_the_line_in_the_file(tmp_path, tokenizer_dir):
    (tmp_path / "vol").mkdir()
    (tmp_path / "vol" / "data.json").write_text(
        '\n\n[\n{"instruction": "a", "output": "b"},\n{"instruction": }\n]\n'
    )
    config = data_config([{"path": "data.json"}], template="chatml")
    with pytest.raises(InputError, match=r"data\.json, line 5: not valid JSON") as caught:
        prepare_sft(config, tokenizer_dir, tmp_path / "out", tmp_path / "vol")
    assert caught.value.exit_code == ExitCode.BAD_INPUT


def test_a_generator_runs_folder_as_a_source_is_refused_naming_its_train_jsonl(tmp_path, tokenizer_dir):
    # Read whole, it failed on the run's generation.json, "not valid JSON ... fix that line", a file of the
    # kit's own; its chunks/ repeat every record and val.jsonl and test.jsonl are held out.
    from trainpod.data.generate import CHUNKS_DIR, GENERATION_FILE, METADATA_FILE

    folder = tmp_path / "vol" / "datasets" / "gen"
    rows = [{"id": f"gen/000000/{i}", "instruction": "Hi", "output": str(i)} for i in range(4)]
    write_jsonl(folder / CHUNKS_DIR / "chunk-000000.jsonl", rows)
    for split, part in (("train", rows[:2]), ("val", rows[2:3]), ("test", rows[3:])):
        write_jsonl(folder / f"{split}.jsonl", part)
    for name in (GENERATION_FILE, METADATA_FILE):
        (folder / name).write_text(json.dumps({"format": "trainpod-generate/1"}, indent=2) + "\n")
    config = data_config([{"path": "datasets/gen"}], template="chatml")
    with pytest.raises(InputError, match=r"is the folder of a generator run") as caught:
        prepare_sft(config, tokenizer_dir, tmp_path / "out", tmp_path / "vol")
    assert f"{folder / 'train.jsonl'}" in str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    data = load_sft(
        prepare_sft(
            data_config([{"path": "datasets/gen/train.jsonl"}], template="chatml"),
            tokenizer_dir,
            tmp_path / "out",
            tmp_path / "vol",
        )
    )
    assert len(data.train) == 2


LATIN1_ROWS = '{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": "d"}\n{"instruction": "café", "output": "e"}\n'


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("latin1.jsonl", LATIN1_ROWS.encode("latin-1"), r"is not UTF-8 text \(line 3, byte b'\\xe9'"),
        (
            "latin1.json",
            f"[{LATIN1_ROWS.strip().replace(chr(10), ',' + chr(10))}]".encode("latin-1"),
            r"is not UTF-8 text \(line 3,",
        ),
        ("windows.jsonl", LATIN1_ROWS.encode("utf-16"), r"is UTF-16 text, not UTF-8 .* `iconv -f utf-16"),
        ("cut.jsonl.gz", gzip.compress(LATIN1_ROWS.encode(), mtime=0)[:-12], "is not a whole gzip file"),
        ("plain.jsonl.gz", LATIN1_ROWS.encode(), "is not a whole gzip file"),
        ("cut.parquet", b"PAR1" + b"\0" * 64, "is not a readable parquet file"),
    ],
)
def test_a_file_that_cannot_be_read_as_its_format_is_exit_2_naming_it(
    tmp_path, tokenizer_dir, name, content, words
):
    # Each was a bare UnicodeDecodeError, BadGzipFile, EOFError or ArrowInvalid: exit 1, a crash retried at
    # every start with the same file until FAILED, naming neither the file nor the fix.
    (tmp_path / "vol").mkdir()
    (tmp_path / "vol" / name).write_bytes(content)
    config = data_config([{"path": name}], template="chatml")
    with pytest.raises(InputError, match=rf"sft dataset file \S+/vol/{re.escape(name)} {words}") as caught:
        prepare_sft(config, tokenizer_dir, tmp_path / "out", tmp_path / "vol")
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert not (tmp_path / "out").exists()


def test_building_again_a_dataset_an_earlier_trainpod_tokenized_is_exit_2_naming_that_and_the_fix(
    tmp_path, tokenizer_dir
):
    """Its key did not change with the "\\n" fix (sft/encode.py), so datagen reused it with its old labels, an
    answer's first newline untrained, and said it was complete and matched."""
    write_jsonl(tmp_path / "vol" / "data.jsonl", [{"instruction": "List two.", "output": "\\n- a\\n- b"}] * 4)
    config = data_config([{"path": "data.jsonl"}], template="chatml")
    out = tmp_path / "vol" / "datasets" / "sft"
    prepare_sft(config, tokenizer_dir, out, tmp_path / "vol")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("encoding", None)
    manifest["key"] = key_before_encodings_were_recorded(manifest, tokenizer_dir)
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="tokenized by an earlier trainpod") as caught:
        prepare_sft(config, tokenizer_dir, out, tmp_path / "vol")
    assert "delete the folder to build it again" in str(caught.value)


def test_invalid_json_line_names_file_and_line(tmp_path, tokenizer_dir):
    path = tmp_path / "vol" / "data.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "a", "output": \n')
    config = data_config([{"path": "data.jsonl"}], template="chatml")
    with pytest.raises(InputError) as error:
        prepare_sft(config, tokenizer_dir, tmp_path / "out", tmp_path / "vol")
    assert f"{path}, line 3: not valid JSON" in str(error.value)
    assert error.value.exit_code == ExitCode.BAD_INPUT == 2
    assert not (tmp_path / "out").exists()


def test_wrong_type_names_file_line_field_and_value(tmp_path, tokenizer_dir):
    rows = [{"instruction": "a", "output": "b"}, {"instruction": "a", "output": 5}]
    with pytest.raises(InputError) as error:
        prepare(tmp_path, tokenizer_dir, rows, template="chatml")
    assert "data.jsonl, line 2: field 'output' = 5 is not a string" in str(error.value)


def test_bad_role_names_the_turn(tmp_path, tokenizer_dir):
    row = {"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}
    with pytest.raises(InputError, match=r"line 1: field 'conversations\[1\]\.from' = 'bot' is not one of"):
        prepare(tmp_path, tokenizer_dir, [row], "sharegpt", template="chatml")


def test_turns_out_of_order_are_refused(tmp_path, tokenizer_dir):
    row = {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}
    with pytest.raises(InputError, match=r"line 1: field 'messages' has turns in the order assistant, user"):
        prepare(tmp_path, tokenizer_dir, [row], "messages", template="chatml")


def test_missing_column_names_column_dataset_and_existing_columns(tmp_path, tokenizer_dir):
    rows = [{"question": "2+3?", "answer": "5"}]
    with pytest.raises(InputError) as error:
        prepare(tmp_path, tokenizer_dir, rows, template="chatml")
    message = str(error.value)
    assert "dataset 'data.jsonl' (alpaca format) has no column 'instruction'" in message
    assert "columns are: answer, question" in message
    assert "sft.datasets[0].columns.prompt" in message


def test_column_mapping_reads_other_names(tmp_path, tokenizer_dir, tokenizer):
    write_jsonl(tmp_path / "vol" / "qa.jsonl", [{"question": "Add 2 and 3.", "answer": "5"}])
    config = data_config(
        [{"path": "qa.jsonl", "columns": {"prompt": "question", "response": "answer"}}], template="chatml"
    )
    data = load_sft(prepare_sft(config, tokenizer_dir, tmp_path / "out", tmp_path / "vol"))
    assert tokenizer.decode(data.train[0].input_ids).endswith(
        "Add 2 and 3.<|im_end|>\n<|im_start|>assistant\n5<|im_end|>"
    )


def test_columns_that_do_not_fit_the_format_are_a_config_error():
    with pytest.raises(ConfigError, match="columns role_tag mean nothing for format 'alpaca'") as error:
        data_config([{"path": "a.jsonl", "columns": {"role_tag": "from"}}])
    assert error.value.exit_code == 2


def test_missing_files_name_the_path_and_volume_root(tmp_path, tokenizer_dir):
    config = data_config([{"path": "nowhere/*.jsonl"}])
    with pytest.raises(
        InputError, match=r"'nowhere/\*.jsonl' .* matches no file; relative paths are taken from"
    ):
        prepare_sft(config, tokenizer_dir, tmp_path / "out", tmp_path)


# Cache: reuse, refusal, atomicity.


def test_second_prepare_reuses_without_rewriting(tmp_path, tokenizer_dir):
    write_alpaca_jsonl(tmp_path / "vol" / "a.jsonl", 30, seed=2)
    config = data_config([{"path": "a.jsonl"}], template="chatml", val_ratio=0.1)
    out = prepare_sft(config, tokenizer_dir, tmp_path / "vol" / "datasets" / "sft", tmp_path / "vol")
    before = tree_snapshot(out)
    assert prepare_sft(config, tokenizer_dir, out, tmp_path / "vol") == out
    assert tree_snapshot(out) == before
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["key"] == sft_key(config, tokenizer_dir)
    assert manifest["sources"][0]["files"][0]["sha256"]
    assert manifest["tokenizer"]["files_sha256"]
    # packing is applied at batch time: changing it reuses the same stored dataset
    assert (
        prepare_sft(config.model_copy(update={"packing": True}), tokenizer_dir, out, tmp_path / "vol") == out
    )
    assert tree_snapshot(out) == before


def test_other_settings_are_refused_without_overwriting(tmp_path, tokenizer_dir):
    write_alpaca_jsonl(tmp_path / "vol" / "a.jsonl", 30, seed=2)
    config = data_config([{"path": "a.jsonl"}], template="chatml")
    out = prepare_sft(config, tokenizer_dir, tmp_path / "out", tmp_path / "vol")
    before = tree_snapshot(out)
    with pytest.raises(InputError, match="made with other settings or another tokenizer .* not overwritten"):
        prepare_sft(config.model_copy(update={"cutoff_len": 64}), tokenizer_dir, out, tmp_path / "vol")
    write_alpaca_jsonl(tmp_path / "vol" / "a.jsonl", 31, seed=2)
    with pytest.raises(InputError, match="built from other contents of 'a.jsonl'"):
        prepare_sft(config, tokenizer_dir, out, tmp_path / "vol")
    assert tree_snapshot(out) == before


def test_a_dataset_another_writer_is_building_is_left_to_it_and_a_complete_one_is_reused_meanwhile(
    tmp_path, tokenizer_dir
):
    # Two pods (or two finetune runs sharing cache/sft/<key>) deleted each other's temp folder mid-build,
    # and the second rename onto the published one crashed: the second exits 75 now.
    write_jsonl(tmp_path / "vol" / "data.jsonl", [ROWS["alpaca"]])
    config = data_config([{"path": "data.jsonl"}], template="chatml")
    out = tmp_path / "vol" / "datasets" / "sft"
    out.parent.mkdir()
    lease = Lease(out.with_name(".sft.LEASE"), ttl_seconds=600)  # another live writer's
    lease.acquire()
    try:
        with pytest.raises(TemporaryError, match="SFT dataset sft is leased by another writer") as caught:
            prepare_sft(config, tokenizer_dir, out, tmp_path / "vol")
        assert caught.value.exit_code == ExitCode.TEMPORARY
        assert sorted(p.name for p in out.parent.iterdir()) == [".sft.LEASE"]
    finally:
        lease.release()
    prepare_sft(config, tokenizer_dir, out, tmp_path / "vol")
    lease.acquire()
    try:
        assert prepare_sft(config, tokenizer_dir, out, tmp_path / "vol") == out
    finally:
        lease.release()


def test_a_folder_holding_something_else_is_not_overwritten(tmp_path, tokenizer_dir):
    write_alpaca_jsonl(tmp_path / "vol" / "a.jsonl", 5, seed=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "train_000000.bin").write_bytes(b"pretraining shard")
    with pytest.raises(InputError, match="holds no complete SFT dataset"):
        prepare_sft(data_config([{"path": "a.jsonl"}]), tokenizer_dir, out, tmp_path / "vol")
    assert (out / "train_000000.bin").read_bytes() == b"pretraining shard"


def test_finished_dataset_is_reused_after_its_sources_are_gone(tmp_path, tokenizer_dir):
    source = write_alpaca_jsonl(tmp_path / "vol" / "a.jsonl", 5, seed=2)
    config = data_config([{"path": "a.jsonl"}], template="chatml")
    out = prepare_sft(config, tokenizer_dir, tmp_path / "out", tmp_path / "vol")
    source.unlink()
    assert len(load_sft(prepare_sft(config, tokenizer_dir, out, tmp_path / "vol")).train) == 5


def test_dataset_is_reused_when_the_volume_is_mounted_elsewhere(tmp_path, tokenizer_dir):
    write_alpaca_jsonl(tmp_path / "vol" / "a.jsonl", 5, seed=2)
    config = data_config([{"path": "a.jsonl"}], template="chatml")
    prepare_sft(config, tokenizer_dir, tmp_path / "vol" / "datasets" / "sft", tmp_path / "vol")
    shutil.copytree(tmp_path / "vol", tmp_path / "moved", copy_function=shutil.copy2)
    out = tmp_path / "moved" / "datasets" / "sft"
    before = tree_snapshot(out)
    assert prepare_sft(config, tokenizer_dir, out, tmp_path / "moved") == out
    assert tree_snapshot(out) == before


def test_preempted_build_publishes_nothing(tmp_path, tokenizer_dir):
    write_alpaca_jsonl(tmp_path / "vol" / "a.jsonl", 5, seed=2)
    watch = PreemptionWatch()
    watch.request("SIGTERM")
    with pytest.raises(Preempted):
        prepare_sft(
            data_config([{"path": "a.jsonl"}]), tokenizer_dir, tmp_path / "out", tmp_path / "vol", watch
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vol"]


def test_a_stop_before_the_build_takes_no_lease_and_one_while_taking_it_loads_no_tokenizer(
    tmp_path, tokenizer_dir, monkeypatch
):
    # SFT datagen imports torch and transformers (seconds) after its stop handler is installed, then takes
    # the lease (2 s more to take a killed start's over) and loads the tokenizer: a SIGTERM early in a start
    # was looked at only at the first rows, past the 5 s window (6 s measured), the lease held at the SIGKILL.
    import trainpod.sft.prepare as prepare

    write_alpaca_jsonl(tmp_path / "vol" / "a.jsonl", 5, seed=2)
    leases, tokenizers_loaded = [], []
    real_acquire, real_load_tokenizer = Lease.acquire, prepare.load_tokenizer
    monkeypatch.setattr(
        prepare, "load_tokenizer", lambda d: tokenizers_loaded.append(d) or real_load_tokenizer(d)
    )
    watch = PreemptionWatch()

    def stopped_while_acquiring(self):
        leases.append(self.path)
        real_acquire(self)
        watch.request("SIGTERM")

    monkeypatch.setattr(Lease, "acquire", stopped_while_acquiring)
    with pytest.raises(Preempted, match="run it again"):
        prepare_sft(
            data_config([{"path": "a.jsonl"}]), tokenizer_dir, tmp_path / "out", tmp_path / "vol", watch
        )
    assert len(leases) == 1 and tokenizers_loaded == [], (
        "a stop asked as the lease was taken loads no tokenizer"
    )
    with pytest.raises(Preempted, match="run it again"):  # the stop is still asked: no lease now
        prepare_sft(
            data_config([{"path": "a.jsonl"}]), tokenizer_dir, tmp_path / "out", tmp_path / "vol", watch
        )
    assert len(leases) == 1, "a stop asked before the build must not take the dataset's lease"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vol"]


def test_load_refuses_a_folder_without_a_dataset(tmp_path):
    with pytest.raises(InputError, match="holds no complete SFT dataset .*`trainpod run datagen`"):
        load_sft(tmp_path)


# The shipped config and demo data.


def test_shipped_demo_instructions_match_their_generator():
    assert builtin_sft_tiny_path().read_text(encoding="utf-8") == demo_jsonl()
    assert builtin_sft_tiny_path().stat().st_size < 100_000


def test_shipped_sft_tiny_config_builds_from_the_builtin_data(tmp_path):
    config = load_config(SftDatagenConfig, CONFIGS / "datagen" / "sft-tiny.yaml")
    volume = Volume(tmp_path / "vol")
    make_tiny_tokenizer(volume.root / config.tokenizer)
    out = run_sft_datagen(config, volume, PreemptionWatch())
    assert out == volume.dataset("sft-tiny")
    data = load_sft(out)
    counts = data.manifest["counts"]
    assert counts["rows"] == 400 and counts["train_samples"] + counts["val_samples"] == 400
    assert 0 < len(data.val) < 60
    assert data.pad_id == AutoTokenizer.from_pretrained(str(volume.root / config.tokenizer)).pad_token_id


def test_missing_tokenizer_folder_is_named(tmp_path):
    config = load_config(SftDatagenConfig, CONFIGS / "datagen" / "sft-tiny.yaml")
    volume = Volume(tmp_path)
    with pytest.raises(InputError, match="tokenizer folder .*tokenizers/tiny-stories-1k .* does not exist"):
        run_sft_datagen(config, volume, PreemptionWatch())


def test_the_stored_settings_of_todays_config_are_pinned():
    # They are hashed into every SFT dataset's key; a new setting that changes them makes the reuse of every
    # dataset made before refused after an upgrade. Add the setting to SETTINGS_ADDED_LATER with its value of
    # before (config/sft.py), instead of changing this number.
    settings = data_config([{"path": "data.jsonl", "format": "alpaca"}], template="chatml").stored_settings()
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    assert hashlib.sha256(canonical.encode()).hexdigest()[:16] == "203f97ae52eb6b75"
