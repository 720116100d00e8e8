"""Segments -> token ids and a trained mask, cut to cutoff_len.

Cutoff ('truncate') follows LLaMA-Factory's `infer_seqlen`: turn by turn, the remaining budget is
shared between the prompt and the answer: a short answer (under half the budget) is kept whole and
the prompt cut; a short prompt is kept whole and the answer cut; otherwise both are cut in
proportion. Turns after the budget is spent are left out. 'drop' leaves over-long samples out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainpod.sft.templates import Segments


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


class SegmentEncoder:
    """Tokenizes many samples' segments in one batched call of the fast tokenizer."""

    def __init__(self, tokenizer, cutoff_len: int, overflow: str, train_on_prompt: bool):
        self.tokenizer = tokenizer
        self.cutoff_len = cutoff_len
        self.overflow = overflow
        self.train_on_prompt = train_on_prompt

    def encode(self, samples: Sequence[Segments]) -> list[Encoded | None]:
        texts = []
        for segments in samples:
            texts.append(segments.prefix)
            for prompt, answer in segments.pairs:
                texts += [prompt, answer]
        ids = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
        out = []
        for segments in samples:
            prefix = next(ids)
            pairs = [(next(ids), next(ids)) for _ in segments.pairs]
            out.append(cut_sample(prefix, pairs, self.cutoff_len, self.overflow, self.train_on_prompt))
        return out
