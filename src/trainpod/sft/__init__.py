"""Supervised finetuning data: instruction/chat datasets -> chat-templated ids with answer-only labels.

    TRAINPOD_CONFIG=configs/datagen/sft-tiny.yaml TRAINPOD_VOLUME=./demo-volume trainpod run datagen

prepare_sft / run_sft_datagen build (or reuse) datasets/<name>/; load_sft reads it; SftBatches and
eval_batches turn its samples into the batches the finetune trainer feeds to a transformers model.
"""

from trainpod.sft.batches import SftBatches, eval_batches
from trainpod.sft.dataset import IGNORE_INDEX, SftData, SftExample, SftExamples, load_sft
from trainpod.sft.prepare import prepare_sft, run_sft_datagen, sft_cache_key, sft_key

__all__ = [
    "IGNORE_INDEX",
    "SftBatches",
    "SftData",
    "SftExample",
    "SftExamples",
    "eval_batches",
    "load_sft",
    "prepare_sft",
    "run_sft_datagen",
    "sft_cache_key",
    "sft_key",
]
