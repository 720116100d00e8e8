"""Segments -> token ids and a trained mask, cut to cutoff_len.

Cutoff ('truncate') follows LLaMA-Factory's `infer_seqlen`: turn by turn, the remaining budget is
shared between the prompt and the answer: a short answer (under half the budget) is kept whole and
the prompt cut; a short prompt is kept whole and the answer cut; otherwise both are cut in
proportion. Turns after the budget is spent are left out. 'drop' leaves over-long samples out.

A preference pair (sft.preference) is cut once for both answers, by LLaMA-Factory's pairwise rule: the
budget is shared between the prompt (every turn before the last answer) and the longer answer, and both
answers are cut to the same length, so the two samples keep the same prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainpod.sft.templates import Segments

# How samples become ids, in every SFT dataset's manifest and key. 2: each sample's whole text, in two where a
# token would span an answer's start (SegmentEncoder). A dataset without it was tokenized by an earlier trainpod,
# which under Qwen2's and Llama 3's tokenizers merged an answer's first "\n" into the prompt's "\n\n" (that
# newline never trained, the answer after a token inference never gives), and before that encoded each segment
# alone (a ▁ before every answer under Llama 2's and Mistral's).
ENCODING = 2


@dataclass(frozen=True)
class Encoded:
    input_ids: np.ndarray  # int32
    trained: np.ndarray  # bool: the position's token is a training target (label != -100)
    truncated: bool
    full_length: int  # tokens of the whole sample, before the cut


def infer_seqlen(source_len: int, target_len: int, budget: int) -> tuple[int, int]:
    """How many prompt and answer tokens of one turn fit in `budget` (LLaMA-Factory's rule)."""
    if target_len * 2 < budget:
        max_target = budget
    elif source_len * 2 < budget:
        max_target = budget - source_len
    else:
        max_target = int(budget * target_len / (source_len + target_len))
    target = min(max_target, target_len)
    source = min(max(budget - target, 0), source_len)
    return source, target


def cut_sample(
    prefix: list[int],
    pairs: Sequence[tuple[list[int], list[int]]],
    cutoff_len: int,
    overflow: str,
    train_on_prompt: bool,
) -> Encoded | None:
    """Concatenate prefix and turns within cutoff_len; None when nothing trainable is left (or dropped)."""
    total = len(prefix) + sum(len(source) + len(target) for source, target in pairs)
    if total > cutoff_len and overflow == "drop":
        return None
    ids, trained = list(prefix[:cutoff_len]), [train_on_prompt] * min(len(prefix), cutoff_len)
    for source, target in pairs:
        if len(ids) >= cutoff_len:
            break
        source_len, target_len = infer_seqlen(len(source), len(target), cutoff_len - len(ids))
        ids += source[:source_len] + target[:target_len]
        trained += [train_on_prompt] * source_len + [True] * target_len
    if trained:
        trained[0] = False  # nothing precedes a sample's first token, so it is never a target
    if not any(trained):
        return None
    return Encoded(
        np.asarray(ids, dtype=np.int32), np.asarray(trained, dtype=bool), total > cutoff_len, total
    )


def cut_pair(
    prompt: Sequence[list[int]], chosen: list[int], rejected: list[int], cutoff_len: int, overflow: str
) -> tuple[Encoded, Encoded] | None:
    """A preference pair within cutoff_len: the same prompt ids ([prefix, prompt, answer, ..., last prompt]
    groups: every answer but the last, untrained) before each last answer, the only tokens trained. None
    when either sample is over and overflow is drop, or either has nothing trainable left."""
    prefix, rest = list(prompt[0]), [token for group in prompt[1:] for token in group]
    prompt_len = len(prefix) + len(rest)
    if prompt_len + max(len(chosen), len(rejected)) > cutoff_len and overflow == "drop":
        return None
    source_len, target_len = infer_seqlen(prompt_len, max(len(chosen), len(rejected)), cutoff_len)
    if source_len < prompt_len:
        # The prompt's end is kept, not its start (LLaMA-Factory keeps the start): the turns nearest the
        # answer and the generation prompt the answer follows; and the prefix (bos) where there is room.
        kept_prefix = prefix if len(prefix) < source_len else []
        prompt_ids = kept_prefix + rest[max(len(rest) - (source_len - len(kept_prefix)), 0) :]
    else:
        prompt_ids = prefix + rest
    pair = []
    for answer in (chosen, rejected):
        ids = prompt_ids + answer[:target_len]
        trained = [False] * len(prompt_ids) + [True] * len(answer[:target_len])
        if trained:
            trained[0] = False  # nothing precedes a sample's first token, so it is never a target
        if not any(trained):
            return None
        full = prompt_len + len(answer)
        pair.append(
            Encoded(np.asarray(ids, dtype=np.int32), np.asarray(trained, dtype=bool), len(ids) < full, full)
        )
    return pair[0], pair[1]


class SegmentEncoder:
    """Tokenizes many samples in one batched call of the fast tokenizer: each sample's whole text, its
    tokens then grouped by the segment their first character is in.

    The whole text, not each segment alone: a SentencePiece-style tokenizer (Llama 2's, Mistral's) puts
    a space (▁) before the start of every text it encodes, so an answer encoded alone began with one that
    the rendered conversation, as transformers' apply_chat_template or a server tokenizes it, has not.
    But never a token across the start of an answer: generation starts after a prompt tokenized alone, so
    where Qwen2's or Llama 3's tokenizer merges the prompt's last "\n" with an answer's first into "\n\n",
    the text is tokenized in two there (the answer's newline is then trained, after the "\n" a prompt ends
    with at inference), as LLaMA-Factory and axolotl, tokenizing prompt and answer apart, have it.
    """

    def __init__(self, tokenizer, cutoff_len: int, overflow: str, train_on_prompt: bool):
        self.tokenizer = tokenizer
        self.cutoff_len = cutoff_len
        self.overflow = overflow
        self.train_on_prompt = train_on_prompt

    def encode(self, samples: Sequence[Segments]) -> list[Encoded | None]:
        return [self._cut(groups) for groups in segment_ids(self.tokenizer, samples)]

    def encode_pairs(
        self, pairs: Sequence[tuple[Segments, Segments]]
    ) -> list[tuple[Encoded, Encoded] | None]:
        """(chosen, rejected) samples, which differ in their last answer alone -> the pair within cutoff_len.

        Both samples take the chosen one's prompt ids, as LLaMA-Factory encodes a pair's prompt once. They are
        the rejected one's as well wherever the tokenizer splits the prompt's text the same whatever follows it;
        where it would not, the rejected answer's ids, still exactly its text (no token spans an answer's start:
        segment_ids), follow the chosen one's prompt ids. train_on_prompt is refused with preference.
        """
        groups = segment_ids(self.tokenizer, [sample for pair in pairs for sample in pair])
        return [
            cut_pair(chosen[:-1], chosen[-1], rejected[-1], self.cutoff_len, self.overflow)
            for chosen, rejected in zip(groups[0::2], groups[1::2], strict=True)
        ]

    def _cut(self, groups: list[list[int]]) -> Encoded | None:
        """[prefix, prompt, answer, prompt, answer, ...] ids -> the sample within cutoff_len."""
        pairs = list(zip(groups[1::2], groups[2::2], strict=True))
        return cut_sample(groups[0], pairs, self.cutoff_len, self.overflow, self.train_on_prompt)


def segment_ids(tokenizer, samples: Sequence[Segments]) -> list[list[list[int]]]:
    """Each sample's ids by segment, [prefix, prompt, answer, prompt, answer, ...], as SegmentEncoder
    tokenizes them (trainpod chat prompts with them: an empty last answer, the prompt is all before it)."""
    texts = [[segments.prefix, *(text for pair in segments.pairs for text in pair)] for segments in samples]
    if not texts:
        return []
    if not getattr(tokenizer, "is_fast", False):  # no offsets to group by: each segment alone
        ids = iter(
            tokenizer([part for parts in texts for part in parts], add_special_tokens=False)["input_ids"]
        )
        return [[next(ids) for _ in parts] for parts in texts]
    encoded = tokenizer(
        ["".join(parts) for parts in texts], add_special_tokens=False, return_offsets_mapping=True
    )
    return [
        _grouped_by_segment(parts, *_apart_at_answer_starts(tokenizer, parts, ids, offsets))
        for parts, ids, offsets in zip(texts, encoded["input_ids"], encoded["offset_mapping"], strict=True)
    ]


def _apart_at_answer_starts(
    tokenizer, parts: list[str], ids: list[int], offsets: list[tuple[int, int]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """`ids` and `offsets` of the concatenated `parts`, tokenized again in pieces cut where a token
    spans the start of an answer (parts 2, 4, ...), so that none does; as they were where none did."""
    ends = np.cumsum([len(part) for part in parts])
    token_starts, token_ends = np.asarray(offsets, dtype=np.int64).reshape(-1, 2).T
    cuts = [
        int(at)
        for at in ends[1::2]  # the end of each prompt, where its answer starts
        if np.any((token_starts < at) & (token_ends > at))
    ]
    if not cuts:
        return ids, offsets
    text = "".join(parts)
    starts, stops = [0, *cuts], [*cuts, len(text)]
    pieces = tokenizer(
        [text[start:stop] for start, stop in zip(starts, stops, strict=True)],
        add_special_tokens=False,
        return_offsets_mapping=True,
    )
    ids, offsets = [], []
    for start, piece_ids, piece_offsets in zip(
        starts, pieces["input_ids"], pieces["offset_mapping"], strict=True
    ):
        ids += piece_ids
        offsets += [(start + a, start + b) for a, b in piece_offsets]
    return ids, offsets


def _grouped_by_segment(parts: list[str], ids: list[int], offsets: list[tuple[int, int]]) -> list[list[int]]:
    """The ids of each of `parts` (concatenated, they were tokenized as one text): a token belongs to the
    part its first character is in (one spanning a boundary, a merge the parts alone would not make, to the
    earlier part)."""
    ends = np.cumsum([len(part) for part in parts]).tolist()
    groups: list[list[int]] = [[] for _ in parts]
    part = 0
    for token, (start, _) in zip(ids, offsets, strict=True):
        while part < len(parts) - 1 and start >= ends[part]:
            part += 1
        groups[part].append(token)
    return groups
