"""Evaluation by generation: greedy answers to validation prompts, scored by CER, WER and exact match.

    TRAINPOD_CONFIG=configs/finetune/tiny-vlm.yaml TRAINPOD_VOLUME=./demo-volume trainpod run finetune-vlm

The finetune workloads (text and vision) call `generate_and_score` every k-th eval
(`generation_eval.every_evals`) on up to `generation_eval.max_samples` validation samples. Scores
come from jiwer (the edit distances OCR and ASR papers report): per sample for the predictions
file, and over the whole set for the metrics (edits summed over characters summed, not a mean of
per-sample rates, so a long line weighs more than a short one). "normalized" variants compare
lower-cased text with whitespace runs collapsed and trimmed.

Writes runs/<run>/eval/step-<N>.predictions.jsonl (prompt, reference, prediction, per-sample
scores, image paths) and step-<N>.worst-cer.jsonl (the highest-CER samples).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jiwer
import torch

from trainpod import atomic

log = logging.getLogger(__name__)

NORMALIZE = jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemoveMultipleSpaces(), jiwer.Strip()])
METRICS = ("cer", "wer", "exact_match", "cer_normalized", "wer_normalized", "exact_match_normalized")


@dataclass
class Prompt:
    """One validation sample to answer: the model inputs of its prompt and the answer it should give."""

    inputs: dict[str, torch.Tensor]  # input_ids (1, n), attention_mask, and for VLMs pixel_values, ...
    prompt_text: str
    reference: str
    val_index: int
    images: list[str] = field(default_factory=list)
    answer_ids: list[int] = field(default_factory=list)  # the reference answer's tokens, its end of turn too


def stop_token_ids(model: torch.nn.Module, tokenizer, prompts: Sequence[Prompt]) -> list[int]:
    """The tokens that end an answer: eos (the tokenizer's and the model's generation_config's) and the
    special tokens in the reference answers, i.e. the end of turn the answers were trained to end with.

    That is not always eos: a base model's tokenizer (Qwen2.5-7B's <|endoftext|>, Llama-3-8B's
    <|end_of_text|>) under a chat template whose answers end with <|im_end|> or <|eot_id|>.
    """
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = [tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])]
    special = set(tokenizer.all_special_ids)
    ends = [token for prompt in prompts for token in prompt.answer_ids if token in special]
    return list(dict.fromkeys(token for token in [*eos, *ends] if token is not None))


def _normalized(text: str) -> str:
    return NORMALIZE(text)


def sample_scores(reference: str, prediction: str) -> dict[str, float]:
    """CER, WER and exact match of one prediction, raw and normalized (an empty reference scores 1.0
    against any non-empty prediction, 0.0 against an empty one)."""
    out = {}
    for suffix, ref, hyp in (
        ("", reference, prediction),
        ("_normalized", *map(_normalized, (reference, prediction))),
    ):
        out[f"cer{suffix}"] = _rate(jiwer.cer, ref, hyp)
        out[f"wer{suffix}"] = _rate(jiwer.wer, ref, hyp)
        out[f"exact_match{suffix}"] = float(ref == hyp)
    return out


def _rate(measure: Callable[..., float], reference: str, prediction: str) -> float:
    if not reference.strip():
        return float(bool(prediction.strip()))
    return float(measure(reference, prediction))


def corpus_scores(references: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """The set's CER and WER (edits over all samples / reference length over all samples) and the
    share of exact matches; raw and normalized."""
    out = {}
    for suffix, refs, hyps in (
        ("", list(references), list(predictions)),
        ("_normalized", [_normalized(r) for r in references], [_normalized(p) for p in predictions]),
    ):
        scored = [(r, h) for r, h in zip(refs, hyps, strict=True) if r.strip()]
        if scored:
            out[f"cer{suffix}"] = float(jiwer.cer([r for r, _ in scored], [h for _, h in scored]))
            out[f"wer{suffix}"] = float(jiwer.wer([r for r, _ in scored], [h for _, h in scored]))
        out[f"exact_match{suffix}"] = sum(r == h for r, h in zip(refs, hyps, strict=True)) / max(len(refs), 1)
    return out


@torch.no_grad()
def greedy_answer(
    model: torch.nn.Module,
    prompt: Prompt,
    tokenizer,
    max_new_tokens: int,
    device,
    stop_ids: Sequence[int] | None = None,
) -> str:
    """The model's greedy continuation of the prompt up to the first of `stop_ids` (default: eos),
    decoded without special tokens."""
    inputs = {key: value.to(device) for key, value in prompt.inputs.items()}
    output = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
        eos_token_id=list(stop_ids) if stop_ids else tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new_tokens, skip_special_tokens=True).strip()


def generate_and_score(
    model: torch.nn.Module,
    prompts: Iterable[Prompt],
    tokenizer,
    max_new_tokens: int,
    device: torch.device,
    eval_dir: Path,
    step: int,
    worst: int,
    autocast: Callable[[], Any],
    stop_ids: Sequence[int] | None = None,
) -> dict[str, float]:
    """Answer every prompt (each answer ends at the first of `stop_ids`, see `stop_token_ids`), write the
    predictions (and the worst by CER), return eval_<metric> values."""
    records, started = [], time.perf_counter()
    for prompt in prompts:
        with autocast():
            prediction = greedy_answer(model, prompt, tokenizer, max_new_tokens, device, stop_ids)
        records.append(
            {
                "step": step,
                "val_index": prompt.val_index,
                "prompt": prompt.prompt_text,
                "reference": prompt.reference,
                "prediction": prediction,
                "images": prompt.images,
                "scores": sample_scores(prompt.reference, prediction),
            }
        )
    metrics = corpus_scores([r["reference"] for r in records], [r["prediction"] for r in records])
    _write_jsonl(eval_dir / f"step-{step}.predictions.jsonl", records)
    ranked = sorted(records, key=lambda r: (-r["scores"]["cer"], r["val_index"]))
    _write_jsonl(eval_dir / f"step-{step}.worst-cer.jsonl", ranked[:worst])
    log.info(
        "generation eval at step %d on %d samples in %.1f s: %s",
        step,
        len(records),
        time.perf_counter() - started,
        ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
    )
    return {f"eval_{k}": v for k, v in metrics.items()}


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
