"""An example data generator: small edit-instruction records in alpaca form (instruction/input/output).

Copy this file into your own repo and change it. trainpod calls it once per chunk and kind:

    generate(seed=..., chunk=..., kind="single" | "compound" | "noop", count=..., **params)

and it yields exactly `count` dicts made only from `seed`, so a rerun after an interruption, or a
run with another worker count, makes the same records. Run it with configs/datagen/generator-tiny.yaml:

    trainpod run datagen --config configs/datagen/generator-tiny.yaml --volume ./demo-volume

Kinds: `single` applies one edit, `compound` two or three in a row, `noop` asks for an edit that
does not apply to the text (a word that is not there), so the output is the input unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

WORDS = [
    "the",
    "a",
    "small",
    "quiet",
    "old",
    "bright",
    "red",
    "green",
    "river",
    "stone",
    "garden",
    "window",
    "lamp",
    "letter",
    "train",
    "city",
    "forest",
    "morning",
    "evening",
    "friend",
    "teacher",
    "child",
    "bird",
    "cat",
    "dog",
    "boat",
    "road",
    "bridge",
    "village",
    "market",
    "song",
    "story",
    "walks",
    "sings",
    "waits",
    "reads",
    "carries",
    "finds",
    "opens",
    "paints",
    "watches",
    "follows",
    "slowly",
    "gently",
    "often",
    "never",
]
# Words a noop instruction names: never in WORDS, so never in a text.
ABSENT_WORDS = ["zebra", "violin", "glacier", "cactus", "lantern", "pepper", "comet", "harbor"]

OPERATIONS = 5  # replace, delete, capitalise, append, swap
Edit = tuple[str, Callable[[list[str]], list[str]]]


def generate(
    *, seed: int, chunk: int, kind: str | None, count: int, min_words: int = 6, max_words: int = 14
) -> Iterator[dict]:
    """Yield `count` alpaca records of `kind` (None is treated as "single")."""
    rng = random.Random(seed)
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
        if kind == "noop":
            yield {"instruction": _noop_instruction(rng), "input": " ".join(words), "output": " ".join(words)}
            continue
        instructions, edited = _edits(rng, words, steps=rng.randint(2, 3) if kind == "compound" else 1)
        later = [text[0].lower() + text[1:] for text in instructions[1:]]
        instruction = " Then ".join(instructions[:1] + later)
        yield {"instruction": instruction, "input": " ".join(words), "output": " ".join(edited)}


def _edits(rng: random.Random, words: list[str], steps: int) -> tuple[list[str], list[str]]:
    """`steps` edits that change the text: an edit and its undoing (add "x", delete "x") are drawn again."""
    while True:
        instructions, edited = [], words
        # Distinct operations, so a compound edit never repeats one (two swaps would be a no-op).
        for operation in rng.sample(range(OPERATIONS), steps):
            # Each edit names words of the text as the previous edits left it.
            text, apply = _edit(rng, edited, operation)
            instructions.append(text)
            edited = apply(edited)
        if edited != words:
            return instructions, edited


def _noop_instruction(rng: random.Random) -> str:
    absent = rng.choice(ABSENT_WORDS)
    return rng.choice(
        [
            f'Replace every "{absent}" with "{rng.choice(WORDS)}".',
            f'Delete every "{absent}".',
            f'Write every "{absent}" in capital letters.',
        ]
    )


def _edit(rng: random.Random, words: list[str], operation: int) -> Edit:
    if not words:  # everything was deleted: only adding a word still changes the text
        other = rng.choice(WORDS)
        return f'Add "{other}" at the end.', lambda ws: [*ws, other]
    present = rng.choice(words)
    other = rng.choice([w for w in WORDS if w != present])
    if operation == 0:
        return f'Replace every "{present}" with "{other}".', lambda ws: [
            other if w == present else w for w in ws
        ]
    if operation == 1:
        return f'Delete every "{present}".', lambda ws: [w for w in ws if w != present]
    if operation == 2:
        return (
            f'Write every "{present}" in capital letters.',
            lambda ws: [w.upper() if w == present else w for w in ws],
        )
    if operation == 3:
        return f'Add "{other}" at the end.', lambda ws: [*ws, other]
    if words[0] == words[-1]:  # a swap would change nothing
        return f'Add "{other}" at the end.', lambda ws: [*ws, other]
    return "Swap the first and the last word.", lambda ws: [ws[-1], *ws[1:-1], ws[0]]
