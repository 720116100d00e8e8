"""Supervised finetuning data: instruction/chat datasets -> chat-templated ids with answer-only labels.

    TRAINPOD_CONFIG=configs/datagen/sft-tiny.yaml TRAINPOD_VOLUME=./demo-volume trainpod run datagen

prepare_sft / run_sft_datagen build (or reuse) datasets/<name>/; load_sft reads it; SftBatches and
eval_batches turn its samples into the batches the finetune trainer feeds to a transformers model.

The names below are imported from their modules when first asked for: `trainpod estimate` reads
sft.sources (to count a finetune's samples) and sft.dataset (a dataset's cutoff_len) on a laptop, and
importing this package used to import sft.batches, hence torch (seconds on two cores), first.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULE_OF = {
    "SftBatches": "trainpod.sft.batches",
    "eval_batches": "trainpod.sft.batches",
    "IGNORE_INDEX": "trainpod.sft.dataset",
    "SftData": "trainpod.sft.dataset",
    "SftExample": "trainpod.sft.dataset",
    "SftExamples": "trainpod.sft.dataset",
    "PreferencePairs": "trainpod.sft.dataset",
    "is_preference": "trainpod.sft.dataset",
    "load_sft": "trainpod.sft.dataset",
    "prepare_sft": "trainpod.sft.prepare",
    "run_sft_datagen": "trainpod.sft.prepare",
    "sft_cache_key": "trainpod.sft.prepare",
    "sft_key": "trainpod.sft.prepare",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
