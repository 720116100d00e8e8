"""Preference (DPO) data in the SFT pipeline: rows with a chosen and a rejected answer -> pairs of samples.

    PYTHONPATH=src:tests python -m pytest -q tests/test_preference_data.py

Expected texts are written out here from the templates' definitions, and trained positions found by tokenizing
the answers alone, never by calling trainpod's own masking code. A tiny tokenizer trained here, no hub.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from trainpod.config.loader import validate_tree
from trainpod.config.sft import SftDataConfig, SftDatagenConfig
from trainpod.errors import ConfigError, ExitCode, InputError
from trainpod.preemption import PreemptionWatch
from trainpod.sft import IGNORE_INDEX, PreferencePairs, is_preference, load_sft, prepare_sft, run_sft_datagen
from trainpod.sft.batches import PreferenceBatches
from trainpod.sft.dataset import SftExamples
from trainpod.sft.demo_rows import demo_rows, preference_jsonl
from trainpod.sft.sources import builtin_path
from trainpod.volume import Volume

from sft_support import CUSTOM_CHAT_TEMPLATE, make_newline_merging_tokenizer, make_tiny_tokenizer

SYSTEM = "Be brief."
HISTORY = ("Add 2 and 3.", "5")
QUESTION = "Reverse\ncloud"
CHOSEN, REJECTED = "duolc", "cloud"

CONVERSATION = [  # the prompt's turns as OpenAI-style messages
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": HISTORY[0]},
    {"role": "assistant", "content": HISTORY[1]},
    {"role": "user", "content": QUESTION},
]

# One preference row in each format, with each form an answer may take; every one must give the same pair.
ROWS = {
    "alpaca": (
        "alpaca",
        {
            "instruction": "Reverse",
            "input": "cloud",
            "system": SYSTEM,
            "history": [list(HISTORY)],
            "chosen": CHOSEN,
            "rejected": REJECTED,
        },
    ),
    "sharegpt, answers as turns": (
        "sharegpt",
        {
            "conversations": [
                {"from": "human", "value": HISTORY[0]},
                {"from": "gpt", "value": HISTORY[1]},
                {"from": "human", "value": QUESTION},
            ],
            "system": SYSTEM,
            "chosen": {"from": "gpt", "value": CHOSEN},
            "rejected": {"from": "gpt", "value": REJECTED},
        },
    ),
    "messages, answers as strings": (
        "messages",
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": HISTORY[0]},
                {"role": "assistant", "content": HISTORY[1]},
                {"role": "user", "content": QUESTION},
            ],
            "chosen": CHOSEN,
            "rejected": REJECTED,
        },
    ),
    "messages, answers as lists of one turn (TRL)": (
        "messages",
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": HISTORY[0]},
                {"role": "assistant", "content": HISTORY[1]},
                {"role": "user", "content": QUESTION},
            ],
            "chosen": [{"role": "assistant", "content": CHOSEN}],
            "rejected": [{"role": "assistant", "content": REJECTED}],
        },
    ),
    # TRL's implicit prompt (trl-lib/ultrafeedback_binarized): no prompt column, the turns the two share are it;
    # HuggingFaceH4/ultrafeedback_binarized adds the prompt as a string and the chosen conversation as messages.
    "messages, whole conversations sharing the prompt (TRL's implicit prompt)": (
        "messages",
        {
            "chosen": [*CONVERSATION, {"role": "assistant", "content": CHOSEN}],
            "rejected": [*CONVERSATION, {"role": "assistant", "content": REJECTED}],
        },
    ),
    "messages, whole conversations beside a prompt string (HuggingFaceH4's)": (
        "messages",
        {
            "prompt": QUESTION,
            "messages": [*CONVERSATION, {"role": "assistant", "content": CHOSEN}],
            "chosen": [*CONVERSATION, {"role": "assistant", "content": CHOSEN}],
            "rejected": [*CONVERSATION, {"role": "assistant", "content": REJECTED}],
        },
    ),
}

# The chosen sample's text and the token that ends every answer, written from each template's definition; the
# rejected sample's is the same with REJECTED for CHOSEN at its end.
EXPECTED = {
    "chatml": (
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
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def data_config(datasets: list[dict], **settings) -> SftDataConfig:
    return validate_tree(SftDataConfig, {"datasets": datasets, **settings})


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def prepare(
    tmp_path: Path,
    tokenizer_dir: Path,
    rows: list[dict],
    fmt: str = "alpaca",
    columns: dict | None = None,
    **settings,
):
    write_jsonl(tmp_path / "vol" / "data.jsonl", rows)
    source = {"path": "data.jsonl", "format": fmt, "columns": columns or {}}
    config = data_config([source], preference=True, **settings)
    return load_sft(
        prepare_sft(config, tokenizer_dir, tmp_path / "vol" / "datasets" / "pairs", tmp_path / "vol")
    )


def trained_positions(example) -> list[int]:
    return [i for i, label in enumerate(example.labels.tolist()) if label != IGNORE_INDEX]


def prompt_ids(example) -> list[int]:
    """The ids before the first trained token: in a preference sample, the whole prompt."""
    return example.input_ids.tolist()[: trained_positions(example)[0]]


@pytest.mark.parametrize("template", list(EXPECTED))
@pytest.mark.parametrize("row", list(ROWS))
def test_a_preference_row_is_stored_as_chosen_then_rejected_with_the_same_prompt_and_only_its_answer_trained(
    tmp_path, tokenizer_dir, tokenizer, row, template
):
    fmt, record = ROWS[row]
    data = prepare(tmp_path, tokenizer_dir, [record], fmt, template=template)
    assert len(data.train) == 2, "a pair is two samples"
    chosen, rejected = data.train[0], data.train[1]
    text, end = EXPECTED[template]
    assert tokenizer.decode(chosen.input_ids) == text
    assert tokenizer.decode(rejected.input_ids) == text.removesuffix(CHOSEN + end) + REJECTED + end
    assert chosen.row_index == rejected.row_index == 0
    assert prompt_ids(chosen) == prompt_ids(rejected), "the prompt must be token-identical in the two samples"
    for example, answer in ((chosen, CHOSEN), (rejected, REJECTED)):
        answer_ids = tokenizer.encode(answer + end, add_special_tokens=False)
        ids = example.input_ids.tolist()
        # only the last answer: the history's "5" and its end-of-turn token stay untrained
        assert trained_positions(example) == list(range(len(ids) - len(answer_ids), len(ids)))
        assert ids[-len(answer_ids) :] == answer_ids


TRL_ROWS = {  # TRL's preference datasets: "standard" (strings) and "conversational" (lists of turns)
    "standard": (
        "alpaca",
        {"prompt": "prompt"},
        {"prompt": "Reverse\ncloud", "chosen": CHOSEN, "rejected": REJECTED},
    ),
    "conversational": (
        "messages",
        {"messages": "prompt"},
        {
            "prompt": [{"role": "user", "content": "Reverse\ncloud"}],
            "chosen": [{"role": "assistant", "content": CHOSEN}],
            "rejected": [{"role": "assistant", "content": REJECTED}],
        },
    ),
}


@pytest.mark.parametrize("kind", list(TRL_ROWS))
def test_trls_preference_rows_read_with_their_prompt_column_mapped(tmp_path, tokenizer_dir, tokenizer, kind):
    fmt, columns, row = TRL_ROWS[kind]
    data = prepare(tmp_path, tokenizer_dir, [row], fmt, columns, template="chatml")
    prompt = "<|im_start|>user\nReverse\ncloud<|im_end|>\n<|im_start|>assistant\n"
    assert [tokenizer.decode(example.input_ids) for example in data.train] == [
        prompt + CHOSEN + "<|im_end|>",
        prompt + REJECTED + "<|im_end|>",
    ]


def test_the_prompt_is_token_identical_where_one_answer_would_merge_into_it(tmp_path, tokenizer):
    """Under Qwen2's and Llama 3's tokenizers "\\n" + "\\n" is one token: an answer starting with a newline
    would take the prompt's last newline if the text were tokenized whole."""
    merging = make_newline_merging_tokenizer(tmp_path / "tok")
    row = {"instruction": "Reverse", "input": "cloud", "chosen": "duolc", "rejected": "\nduolc"}
    data = prepare(tmp_path, merging, [row], template="chatml")
    chosen, rejected = data.train[0], data.train[1]
    assert prompt_ids(chosen) == prompt_ids(rejected)
    decode = AutoTokenizer.from_pretrained(str(merging)).decode
    assert decode(prompt_ids(rejected)).endswith("<|im_start|>assistant\n")
    assert decode(rejected.input_ids[len(prompt_ids(rejected)) :]) == "\nduolc<|im_end|>"


def test_a_long_pair_is_cut_once_within_cutoff_len_keeping_the_end_of_the_prompt(
    tmp_path, tokenizer_dir, tokenizer
):
    row = {
        "instruction": "The quick brown fox jumps over the lazy dog. " * 8 + "Answer the question.",
        "chosen": "42",
        "rejected": "apple river stone cloud tiger lemon garden window " * 4,
    }
    data = prepare(tmp_path, tokenizer_dir, [row], template="chatml", cutoff_len=40)
    chosen, rejected = data.train[0], data.train[1]
    assert len(rejected.input_ids) == 40 and len(chosen.input_ids) < 40
    prompt = prompt_ids(chosen)
    assert prompt == prompt_ids(rejected)
    # The end of the prompt is kept: the last words of the question and the generation prompt the answer follows.
    assert tokenizer.decode(prompt).endswith("Answer the question.<|im_end|>\n<|im_start|>assistant\n")
    assert not tokenizer.decode(prompt).startswith("<|im_start|>user")
    # The short answer is whole, the long one cut to what the budget left it.
    assert chosen.input_ids.tolist()[len(prompt) :] == tokenizer.encode(
        "42<|im_end|>", add_special_tokens=False
    )
    full_rejected = tokenizer.encode(row["rejected"] + "<|im_end|>", add_special_tokens=False)
    assert rejected.input_ids.tolist()[len(prompt) :] == full_rejected[: 40 - len(prompt)]
    assert trained_positions(rejected) == list(range(len(prompt), 40))
    counts = data.manifest["counts"]
    assert counts["rows"] == 1 and counts["truncated"] == 1 and counts["train_pairs"] == 1


def test_drop_leaves_out_a_pair_whose_rejected_answer_alone_is_over(tmp_path, tokenizer_dir):
    rows = [
        {"instruction": "Hi", "chosen": "Yo", "rejected": "apple river stone cloud " * 20},
        {"instruction": "Hi", "chosen": "Yo", "rejected": "No"},
    ]
    data = prepare(tmp_path, tokenizer_dir, rows, template="chatml", cutoff_len=32, overflow="drop")
    assert [example.row_index for example in data.train] == [1, 1]
    counts = data.manifest["counts"]
    assert (counts["rows"], counts["dropped"], counts["train_pairs"], counts["train_samples"]) == (2, 1, 1, 2)


def test_the_validation_split_keeps_each_pair_together(tmp_path, tokenizer_dir):
    rows = [
        {"instruction": f"Add {i} and 1.", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(60)
    ]
    data = prepare(tmp_path, tokenizer_dir, rows, template="chatml", val_ratio=0.3, seed=3)
    seen = []
    for split in (data.train, data.val):
        pairs = PreferencePairs(split)
        assert len(pairs) * 2 == len(split)
        for chosen, rejected in pairs:
            assert chosen.row_index == rejected.row_index
            assert prompt_ids(chosen) == prompt_ids(rejected)
            seen.append(chosen.row_index)
    assert sorted(seen) == list(range(60))
    assert 5 <= len(data.val) // 2 <= 35
    counts = data.manifest["counts"]
    assert counts["train_pairs"] + counts["val_pairs"] == counts["rows"] == 60
    assert (counts["train_samples"], counts["val_samples"]) == (
        2 * counts["train_pairs"],
        2 * counts["val_pairs"],
    )


def test_the_manifest_records_preference_and_pairs_read_as_chosen_and_rejected(
    tmp_path, tokenizer_dir, tokenizer
):
    rows = [
        {"instruction": "Reverse", "input": "cloud", "chosen": "duolc", "rejected": "cloud"},
        {"instruction": "Add 2 and 3.", "chosen": "5", "rejected": "apple river stone"},
    ]
    data = prepare(tmp_path, tokenizer_dir, rows, template="chatml")
    assert data.manifest["settings"]["preference"] is True and is_preference(data.manifest)
    pairs = PreferencePairs(data.train)
    assert len(pairs) == 2 and pairs.flat is data.train
    chosen, rejected = pairs[1]
    assert tokenizer.decode(chosen.input_ids).endswith("5<|im_end|>")
    assert tokenizer.decode(rejected.input_ids).endswith("apple river stone<|im_end|>")
    assert pairs.lengths.tolist() == [max(len(a.input_ids), len(b.input_ids)) for a, b in pairs]
    with pytest.raises(IndexError):
        pairs[2]


def test_sft_data_is_not_preference_data_and_keeps_its_stored_settings(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "vol" / "data.jsonl", [{"instruction": "Hi", "output": "Yo"}])
    config = data_config([{"path": "data.jsonl"}], template="chatml")
    settings = config.stored_settings()
    assert "preference" not in settings and set(settings["datasets"][0]["columns"]).isdisjoint(
        {"chosen", "rejected"}
    )
    data = load_sft(prepare_sft(config, tokenizer_dir, tmp_path / "out", tmp_path / "vol"))
    assert not is_preference(data.manifest) and "train_pairs" not in data.manifest["counts"]
    preference = data_config([{"path": "data.jsonl"}], template="chatml", preference=True).stored_settings()
    assert preference["preference"] is True, "preference changes the samples, so it is in the dataset's key"


# Refusals: exit 2 naming the setting or the row, the field, the value and the fix.

CONFIG_REFUSALS = {
    "packing": (
        {"datasets": [{"path": "a.jsonl"}], "preference": True, "packing": True},
        "preference: true with packing: true: .*set packing: false",
    ),
    "train_on_prompt": (
        {"datasets": [{"path": "a.jsonl"}], "preference": True, "train_on_prompt": True},
        "preference: true with train_on_prompt: true: .*set train_on_prompt: false",
    ),
    "text format": (
        {"datasets": [{"path": "a.jsonl"}, {"path": "b.jsonl", "format": "text"}], "preference": True},
        "datasets entry 'b.jsonl' has format 'text', .*preference: true needs format alpaca, sharegpt or messages",
    ),
    "response column": (
        {"datasets": [{"path": "a.jsonl", "columns": {"response": "out"}}], "preference": True},
        "datasets entry 'a.jsonl': columns response means nothing with preference: true",
    ),
    "chosen column without preference": (
        {"datasets": [{"path": "a.jsonl", "format": "messages", "columns": {"chosen": "good"}}]},
        "datasets entry 'a.jsonl': columns chosen mean something for preference data only; set preference: true",
    ),
    "chosen column of text": (
        {"datasets": [{"path": "a.jsonl", "format": "text", "columns": {"rejected": "bad"}}]},
        "columns rejected mean nothing for format 'text'",
    ),
    "builtin:dpo-tiny without preference": (
        {"datasets": [{"path": "builtin:dpo-tiny"}]},
        "'builtin:dpo-tiny' is preference data .*set preference: true",
    ),
    "builtin:sft-tiny with preference": (
        {"datasets": [{"path": "builtin:sft-tiny"}], "preference": True},
        "'builtin:sft-tiny' holds one answer per row, .*use 'builtin:dpo-tiny'",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_settings_preference_cannot_go_with_are_refused_at_load_naming_them_and_the_fix(case):
    tree, match = CONFIG_REFUSALS[case]
    with pytest.raises(ConfigError, match=match) as error:
        validate_tree(SftDataConfig, tree)
    assert error.value.exit_code == ExitCode.BAD_INPUT


MESSAGES = [{"role": "user", "content": "Hi"}]
ROW_REFUSALS = {
    "no rejected column": (
        "alpaca",
        {"instruction": "Hi", "chosen": "Yo"},
        r"data.jsonl, line 1: dataset 'data.jsonl' \(alpaca format\) has no column 'rejected'.*columns.rejected",
    ),
    "a number for an answer": (
        "alpaca",
        {"instruction": "Hi", "chosen": "Yo", "rejected": 7},
        r"data.jsonl, line 1: field 'rejected' = 7 is not a string \(the answer\); fix the row",
    ),
    "the same answer twice": (
        "alpaca",
        {"instruction": "Hi", "chosen": "Yo", "rejected": "Yo"},
        r"data.jsonl, line 1: fields 'chosen' and 'rejected' hold the same answer 'Yo', a pair that teaches nothing",
    ),
    "turns ending with the answer": (
        "messages",
        {"messages": [*MESSAGES, {"role": "assistant", "content": "Yo"}], "chosen": "Yo", "rejected": "No"},
        r"line 1: field 'messages' has turns in the order user, assistant; a preference row needs .*ending with user",
    ),
    "a list of two turns": (
        "messages",
        {
            "messages": MESSAGES,
            "chosen": [{"role": "assistant", "content": "Yo"}] * 2,
            "rejected": "No",
        },
        r"line 1: field 'chosen' = .* is not a string, one 'assistant' turn or a list of exactly one",
    ),
    "a user turn for an answer": (
        "sharegpt",
        {
            "conversations": [{"from": "human", "value": "Hi"}],
            "chosen": {"from": "human", "value": "Yo"},
            "rejected": {"from": "gpt", "value": "No"},
        },
        r"line 1: field 'chosen.from' = 'human' is not 'gpt' \(an answer\)",
    ),
    "whole conversations that differ before their answers": (
        "messages",
        {
            "chosen": [*MESSAGES, {"role": "assistant", "content": "Yo"}],
            "rejected": [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "No"}],
        },
        r"line 1: fields 'chosen' and 'rejected' hold whole conversations that differ before their last turn "
        r"\(at turn 0\); .*or put the prompt in its own column \(sft.datasets\[0\].columns.messages\)",
    ),
    "whole conversations ending with a user turn": (
        "messages",
        {
            "chosen": [*MESSAGES, {"role": "assistant", "content": "Yo"}],
            "rejected": [*MESSAGES, {"role": "user", "content": "No"}],
        },
        r"line 1: field 'rejected\[1\].role' = 'user' is not 'assistant' \(the answer\)",
    ),
    "a turn without content": (
        "messages",
        {"messages": MESSAGES, "chosen": "Yo", "rejected": [{"role": "assistant"}]},
        r"line 1: field 'rejected\[0\]' = .* is not an object with 'role' and 'content'",
    ),
}


@pytest.mark.parametrize("case", list(ROW_REFUSALS))
def test_a_bad_preference_row_is_exit_2_naming_file_line_field_and_fix(tmp_path, tokenizer_dir, case):
    fmt, row, match = ROW_REFUSALS[case]
    good = {"alpaca": {"instruction": "Hi", "chosen": "Yo", "rejected": "No"}}.get(fmt)
    rows = [row] if good is None else [row, good]
    with pytest.raises(InputError, match=match) as error:
        prepare(tmp_path, tokenizer_dir, rows, fmt, template="chatml")
    assert error.value.exit_code == ExitCode.BAD_INPUT
    assert not (tmp_path / "vol" / "datasets" / "pairs").exists(), "a refused build publishes nothing"


# The built-in demo preference data.


def test_shipped_demo_preference_data_matches_its_generator_and_prefers_the_right_answer():
    assert builtin_path("builtin:dpo-tiny").read_text(encoding="utf-8") == preference_jsonl()
    shipped = [json.loads(line) for line in builtin_path("builtin:dpo-tiny").read_text().splitlines()]
    right = demo_rows()
    assert [row["chosen"] for row in shipped] == [row["output"] for row in right]
    assert all(row["chosen"] != row["rejected"] for row in shipped)


def test_a_datagen_config_of_builtin_dpo_tiny_builds_pairs_of_every_row(tmp_path):
    config = validate_tree(
        SftDatagenConfig,
        {
            "kind": "sft",
            "name": "dpo-tiny",
            "tokenizer": "tokenizers/tiny",
            "sft": {
                "datasets": [{"path": "builtin:dpo-tiny"}],
                "template": "alpaca",
                "cutoff_len": 256,
                "val_ratio": 0.05,
                "preference": True,
            },
        },
    )
    volume = Volume(tmp_path / "vol")
    make_tiny_tokenizer(volume.root / config.tokenizer)
    data = load_sft(run_sft_datagen(config, volume, PreemptionWatch()))
    counts = data.manifest["counts"]
    assert counts["rows"] == 400 and counts["train_pairs"] + counts["val_pairs"] == 400
    assert 0 < counts["val_pairs"] < 60 and counts["dropped"] == 0
    pairs = PreferencePairs(data.train)
    rows_of_pairs = np.array([[chosen.row_index, rejected.row_index] for chosen, rejected in pairs])
    assert (rows_of_pairs[:, 0] == rows_of_pairs[:, 1]).all()


def _pairs_of_lengths(lengths: list[tuple[int, int]]) -> PreferencePairs:
    """Pairs whose chosen and rejected samples have these token counts (ids 1.., the first token untrained)."""
    samples = [n for pair in lengths for n in pair]
    return PreferencePairs(
        SftExamples(
            {
                "input_ids": np.concatenate([np.arange(1, n + 1, dtype=np.int32) for n in samples]),
                "trained": np.concatenate([np.r_[0, np.ones(n - 1)].astype(np.uint8) for n in samples]),
                "offsets": np.r_[0, np.cumsum(samples)].astype(np.int64),
                "row_index": np.repeat(np.arange(len(lengths)), 2).astype(np.int64),
            }
        )
    )


def test_the_batches_real_token_share_is_that_of_the_chosen_and_rejected_rows_they_hold():
    """A long chosen answer and a short rejected one: the pair's batch holds two rows padded to the longer. The
    log's 'x% of the batch tokens are real' (and the summary's packing_efficiency) took a pair for one row of its
    longer sample: 100% here, where two of the four rows are mostly padding."""
    batches = PreferenceBatches(_pairs_of_lengths([(10, 2), (10, 2)]), 2, 64, 0, 0, 1, pad_id=0)
    batch = batches.next_batch()
    real = batch["attention_mask"].float().mean().item()
    assert real == pytest.approx(24 / 40)
    assert batches.packing_efficiency == pytest.approx(real)
    assert batches.last_real_tokens == 24
