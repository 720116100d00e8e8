"""The embedded demo instructions (demo_corpus/sft_tiny.jsonl): short alpaca rows a tiny model can learn.

Arithmetic, string reversal, upper-casing, counting letters and sorting numbers, drawn from a fixed
seed. demo_corpus/dpo_tiny.jsonl holds the same rows as preference data: the right answer chosen, and
rejected a wrong one of the same kind (a sum off by one, the word not reversed, ...). Regenerate the
shipped files (tests check they match) with:

    python -m trainpod.sft.demo_rows > src/trainpod/demo_corpus/sft_tiny.jsonl
    python -m trainpod.sft.demo_rows dpo > src/trainpod/demo_corpus/dpo_tiny.jsonl
"""

from __future__ import annotations

import json
import random
import sys

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "lemon",
    "garden",
    "window",
    "rocket",
    "candle",
    "forest",
    "pencil",
    "silver",
    "bridge",
    "orange",
    "planet",
    "violin",
    "marble",
    "castle",
    "dragon",
]
ROWS = 400


def _row(rng: random.Random) -> dict[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return {"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)}
    if kind == 1:
        word = rng.choice(WORDS)
        return {"instruction": "Reverse the word.", "input": word, "output": word[::-1]}
    if kind == 2:
        words = " ".join(rng.sample(WORDS, 2))
        return {"instruction": "Write the text in upper case.", "input": words, "output": words.upper()}
    if kind == 3:
        word, letter = rng.choice(WORDS), rng.choice("aeior")
        return {
            "instruction": f"How many times does the letter {letter} occur in the word?",
            "input": word,
            "output": str(word.count(letter)),
        }
    numbers = [rng.randrange(50) for _ in range(4)]
    return {
        "instruction": "Sort the numbers from smallest to largest.",
        "input": ", ".join(map(str, numbers)),
        "output": ", ".join(map(str, sorted(numbers))),
    }


def demo_rows(count: int = ROWS, seed: int = 1234) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [_row(rng) for _ in range(count)]


def demo_jsonl(count: int = ROWS, seed: int = 1234) -> str:
    return "".join(json.dumps(row) + "\n" for row in demo_rows(count, seed))


def _wrong(row: dict[str, str]) -> str:
    """A wrong answer to a demo row, of the kind a half-trained model gives (never the right one)."""
    instruction, given, right = row["instruction"], row["input"], row["output"]
    if instruction.startswith(("Add", "How many")):
        return str(int(right) + 1)  # off by one
    if instruction.startswith("Reverse"):
        return given  # not reversed (no demo word is a palindrome)
    if instruction.startswith("Write the text in upper case"):
        return given  # left in lower case
    return ", ".join(right.split(", ")[::-1])  # largest to smallest


def preference_rows(count: int = ROWS, seed: int = 1234) -> list[dict[str, str]]:
    """demo_rows as preference data: instruction and input, the right answer chosen, a wrong one rejected."""
    return [
        {
            "instruction": row["instruction"],
            "input": row["input"],
            "chosen": row["output"],
            "rejected": _wrong(row),
        }
        for row in demo_rows(count, seed)
    ]


def preference_jsonl(count: int = ROWS, seed: int = 1234) -> str:
    return "".join(json.dumps(row) + "\n" for row in preference_rows(count, seed))


if __name__ == "__main__":
    print(preference_jsonl() if sys.argv[1:] == ["dpo"] else demo_jsonl(), end="")
