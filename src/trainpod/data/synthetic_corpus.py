"""A seeded story grammar that writes simple English short stories, one per blank-line block.

It makes the embedded demo corpus (`trainpod/demo_corpus/tiny_stories.txt.gz`) and the larger
corpora the datagen benchmark needs; the same seed always gives the same bytes.

    python -m trainpod.data.synthetic_corpus OUT.txt --megabytes 50
    python -m trainpod.data.synthetic_corpus src/trainpod/demo_corpus/tiny_stories.txt.gz --stories 2500
"""

from __future__ import annotations

import argparse
import gzip
import random
from collections.abc import Iterator
from pathlib import Path

NAMES = [
    "Lily",
    "Tom",
    "Mia",
    "Ben",
    "Sara",
    "Max",
    "Anna",
    "Leo",
    "Zoe",
    "Sam",
    "Ella",
    "Jack",
    "Ruby",
    "Finn",
    "Lucy",
    "Noah",
    "Ava",
    "Oscar",
    "Nina",
    "Hugo",
    "Ivy",
    "Theo",
    "Rosa",
    "Eli",
]
CREATURES = [
    "cat",
    "dog",
    "bunny",
    "bird",
    "fox",
    "bear",
    "duck",
    "frog",
    "mouse",
    "turtle",
    "owl",
    "squirrel",
    "puppy",
    "kitten",
    "lion",
    "pig",
    "horse",
    "fish",
    "bee",
    "dragon",
]
ADJECTIVES = [
    "little",
    "happy",
    "brave",
    "shy",
    "silly",
    "kind",
    "tiny",
    "big",
    "curious",
    "sleepy",
    "clever",
    "gentle",
    "funny",
    "quiet",
    "proud",
    "lonely",
    "friendly",
    "busy",
]
PLACES = [
    "a small house",
    "the big forest",
    "a sunny park",
    "the blue lake",
    "a quiet farm",
    "the tall mountain",
    "a busy town",
    "the green garden",
    "a warm cave",
    "the sandy beach",
    "an old castle",
    "the school",
    "a red barn",
    "the deep sea",
    "a snowy village",
]
THINGS = [
    "ball",
    "kite",
    "red hat",
    "toy car",
    "book",
    "cake",
    "flower",
    "shiny stone",
    "balloon",
    "box",
    "blanket",
    "apple",
    "drum",
    "map",
    "boat",
    "key",
    "cookie",
    "sock",
    "star",
]
WANTS = [
    "play with a {thing}",
    "find a {thing}",
    "climb a tree",
    "swim in the water",
    "go on a trip",
    "make a new friend",
    "bake a {thing}",
    "fly high in the sky",
    "sing a song",
    "build a {thing}",
    "paint a picture",
    "help {friend}",
    "look for treasure",
    "run very fast",
]
PROBLEMS = [
    "it started to rain",
    "the {thing} was lost",
    "{friend} was sad",
    "a loud noise came",
    "the path was too long",
    "the {thing} broke",
    "it got very dark",
    "the wind was strong",
    "{friend} did not want to share",
    "a big rock was in the way",
]
FIXES = [
    "{name} asked {friend} for help",
    "{name} tried again and again",
    "{name} said sorry",
    "they worked together",
    "{name} shared the {thing}",
    "{name} found a new way",
    "mom came and helped",
    "{name} was brave and did not give up",
    "they laughed and waited",
]
ENDINGS = [
    "In the end, {name} and {friend} were very happy.",
    "From that day on, they were best friends.",
    "{name} learned that sharing is good.",
    "They played until the sun went down.",
    "{name} went home and had a big nap.",
    "Everyone cheered for {name}.",
    '{name} smiled and said, "Thank you!"',
    "It was the best day ever.",
]
FEELINGS = ["happy", "sad", "scared", "excited", "surprised", "tired", "proud", "worried"]


def _story(rng: random.Random) -> str:
    """One story: setup, wish, trouble, fix, ending; 4 to 12 sentences of simple words."""
    name, friend = rng.sample(NAMES, 2)
    slots = {"name": name, "friend": friend, "thing": rng.choice(THINGS)}
    creature = f"{rng.choice(ADJECTIVES)} {rng.choice(CREATURES)}"
    sentences = [
        f"Once upon a time, there was a {creature} named {name}.",
        f"{name} lived in {rng.choice(PLACES)}.",
        f"One day, {name} wanted to {rng.choice(WANTS).format(**slots)}.",
    ]
    for _ in range(rng.randint(0, 4)):
        sentences.append(
            f"But {rng.choice(PROBLEMS).format(**slots)}, and {name} felt {rng.choice(FEELINGS)}."
        )
        sentences.append(f"Then {rng.choice(FIXES).format(**slots)}.")
    if rng.random() < 0.5:
        sentences.append(f'"Look, {friend}!" said {name}. "I have a {slots["thing"]}!"')
    sentences.append(rng.choice(ENDINGS).format(**slots))
    return " ".join(sentences)


def stories(seed: int = 0) -> Iterator[str]:
    """An endless, deterministic stream of stories."""
    rng = random.Random(seed)
    while True:
        yield _story(rng)


def write_corpus(
    path: Path, *, stories_count: int | None = None, megabytes: float | None = None, seed: int = 0
) -> int:
    """Write stories separated by blank lines until `stories_count` or `megabytes` is reached.

    A `.gz` suffix writes gzip with no file name and mtime 0 in its header, so the bytes are reproducible. Returns the story count.
    """
    limit_bytes = int(megabytes * 1_000_000) if megabytes is not None else None
    written = count = 0
    with (
        open(path, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) if path.suffix == ".gz" else raw as out,
    ):
        for story in stories(seed):
            if stories_count is not None and count >= stories_count:
                break
            if limit_bytes is not None and written >= limit_bytes:
                break
            data = (story + "\n\n").encode("utf-8")
            out.write(data)
            written += len(data)
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--stories", type=int, help="number of stories")
    parser.add_argument("--megabytes", type=float, help="approximate size in MB (10^6 bytes)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.stories is None and args.megabytes is None:
        parser.error("give --stories or --megabytes")
    count = write_corpus(args.out, stories_count=args.stories, megabytes=args.megabytes, seed=args.seed)
    print(f"wrote {count} stories to {args.out}")


if __name__ == "__main__":
    main()
