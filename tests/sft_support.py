"""Builders for SFT tests (also for the finetune trainer's tests): a tiny tokenizer and tiny datasets.

No model hub: the tokenizer is a byte-level BPE trained here on a few sentences, wrapped in
transformers' PreTrainedTokenizerFast and saved with save_pretrained, so AutoTokenizer loads it.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from trainpod.sft.demo_rows import WORDS as DEMO_WORDS

EOS = "<|endoftext|>"
PAD = "<|pad|>"
CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# A chat template unlike any built-in one, to show `auto` really uses the tokenizer's own.
CUSTOM_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>' + m['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>' }}{% endif %}"
)

SENTENCES = [
    "Add the two numbers and write the sum.",
    "Reverse the word and write it backwards.",
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer the question.",
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction: ### Response: system user assistant",
    "apple river stone cloud tiger lemon garden window rocket candle forest pencil",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 plus minus equals",
]
# The demo rows' first twelve words: the ones the test tokenizer's SENTENCES spell out.
WORDS = DEMO_WORDS[:12]


def make_tiny_tokenizer(
    path: Path, chat_template: str | None = None, vocab_size: int = 400, llama3_tokens: bool = True
) -> Path:
    """A byte-level BPE tokenizer folder at `path` with chatml (and llama3) special tokens; returns `path`.

    eos = bos = <|endoftext|>, pad = <|pad|> (a token of its own, so pad mix-ups show in tests).
    """
    extra = [*CHATML_TOKENS, *(LLAMA3_TOKENS if llama3_tokens else [])]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return _trained_and_saved(tokenizer, SENTENCES * 4, extra, vocab_size, path, chat_template)


def _trained_and_saved(
    tokenizer: Tokenizer,
    corpus: list[str],
    extra: list[str],
    vocab_size: int,
    path: Path,
    chat_template: str | None = None,
) -> Path:
    """`tokenizer` trained on `corpus` (byte-level BPE, EOS, PAD and `extra` special) and saved at `path` as
    transformers loads it: eos = bos = <|endoftext|>, pad = <|pad|>."""
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD, *extra],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=extra,
    )
    if chat_template is not None:
        wrapped.chat_template = chat_template
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(path))
    return path


# Qwen2's pre-tokenizer pattern (Llama 3's keeps newlines together the same way): a run of newlines is one
# piece, so "\n\n" can be one token.
QWEN2_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def make_newline_merging_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer folder like Qwen2's and Llama 3's: newlines run together are one token
    ("\n\n", "\n\n\n"), so a prompt ending in "\n" and an answer starting with one merge when
    tokenized as one text. chatml and llama3 special tokens; eos = bos = <|endoftext|>."""
    extra = [*CHATML_TOKENS, *LLAMA3_TOKENS]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [s + "\n\n" + s + "\n\n\n" for s in SENTENCES] * 4
    return _trained_and_saved(tokenizer, corpus, extra, 400, path)


def make_bos_adding_tokenizer(path: Path) -> Path:
    """A tokenizer folder like Llama's, Mistral's or Gemma's: bos <s> and eos </s> differ, and the
    tokenizer puts bos before every text it encodes with its special tokens (a TemplateProcessing)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SENTENCES * 4, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return _save_with_bos_and_eos(tokenizer, path)


def make_metaspace_tokenizer(path: Path) -> Path:
    """A tokenizer folder like Llama 2's and Mistral's in transformers 5: SentencePiece-style BPE whose
    Metaspace pre-tokenizer writes a space as ▁ and puts one before the start of every text it encodes
    (prepend_scheme "first"); bos <s>, eos </s>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", PAD], initial_alphabet=["\n"], show_progress=False
    )
    tokenizer.train_from_iterator(SENTENCES * 4, trainer=trainer)
    return _save_with_bos_and_eos(tokenizer, path)


def _save_with_bos_and_eos(tokenizer: Tokenizer, path: Path) -> Path:
    """`tokenizer` as a transformers tokenizer folder at `path`: bos <s>, eos </s>, pad PAD."""
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token=PAD
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(path))
    return path


def alpaca_rows(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(20), rng.randrange(20)
        if i % 2:
            word = rng.choice(WORDS)
            rows.append({"instruction": "Reverse the word.", "input": word, "output": word[::-1]})
        else:
            rows.append(
                {"instruction": "Add the two numbers.", "input": f"{a} plus {b}", "output": str(a + b)}
            )
    return rows


def write_alpaca_jsonl(path: Path, n: int, seed: int) -> Path:
    """`n` short instruction/input/output rows as JSON Lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in alpaca_rows(n, seed)), encoding="utf-8")
    return path


def messages_rows(n: int, seed: int) -> list[dict]:
    """OpenAI-style conversations of one or two turns, some with a system message."""
    rows = []
    for i, row in enumerate(alpaca_rows(2 * n, seed)[:n]):
        messages = [{"role": "system", "content": "You are a helpful assistant."}] if i % 3 == 0 else []
        messages += [
            {"role": "user", "content": f"{row['instruction']} {row['input']}"},
            {"role": "assistant", "content": row["output"]},
        ]
        if i % 2:
            messages += [
                {"role": "user", "content": "Reverse the word. apple"},
                {"role": "assistant", "content": "elppa"},
            ]
        rows.append({"messages": messages})
    return rows


def write_messages_jsonl(path: Path, n: int, seed: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in messages_rows(n, seed)), encoding="utf-8")
    return path


def key_before_encodings_were_recorded(manifest: dict, tokenizer_dir: Path) -> str:
    """The key of an SFT dataset as a trainpod before the "\\n" fix gave it (sft/encode.py's ENCODING: it put none
    in the manifest): hashed from the dataset's format, settings and tokenizer files alone."""
    from trainpod.sft.prepare import tokenizer_files_hash

    record = {
        "format": manifest["format"],
        "settings": manifest["settings"],
        "tokenizer": tokenizer_files_hash(tokenizer_dir),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
