"""Whether the loaded model keeps packed samples apart, measured before the first step.

    leak = packing_leak(model, batches, device, autocast)   # ~0 where the samples are kept apart

Packed rows restart position_ids at each sample and carry no attention mask; transformers turns that
into a block-diagonal mask (flash-attention-2: varlen), which keeps samples apart in attention only. A
model whose layers carry a state along the row (Mamba-like hybrids) or take positions from the mask
(OPT) reads each sample's neighbour, and trains on it, silently. base_model.PACKING_MIXES_SAMPLES refuses
the types known to do so before the data is prepared; this probe catches the rest (remote code, a model
type transformers adds later, an attention implementation that drops the sample boundaries): two
training samples packed into one row exactly as the run packs them, against the second sample alone,
through the model as it will train (its attention, dtype, 4-bit layers and adapters).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from trainpod.errors import InputError
from trainpod.sft.batches import SftBatches, unpacked_batch
from trainpod.sft.dataset import SftExample

log = logging.getLogger(__name__)

PROBE_TOKENS = 32  # per sample: one forward pass of at most 64 tokens and one of 32, no grad
# The criterion: at each position of the second sample, how far its next-token log-probabilities moved
# from the sample alone (RMS over the vocabulary, each side's per-position constant removed), over the
# spread of the alone ones (their RMS the same way); the largest over the positions. Relative, so that a
# random tiny model (logits of ~0.1) and a trained one (~10) are judged alike. Measured on CPU with SDPA
# and eager, two samples of 20 tokens:
# - kept apart (Llama, Qwen2; 2 to 48 layers): 1e-6 in fp32; up to 0.013 with bf16 weights or bf16
#   autocast, and 0.019 for the bf16 result against the fp32 one at 48 layers. Two bf16 kernels (flash-attn
#   varlen on the packed row, SDPA on the sample alone) are each a bf16 rounding of the same result, so
#   they differ by about that much, twice at most: ~0.04.
# - leaking: OPT 0.77 (2 layers) to 1.07 (8), Bamba 0.64, a Llama attending across its samples 1.3 to
#   1.6, Jamba 1.2 (weights at 0.1 scale; at its init's 0.02 its Mamba layers barely add to the residual
#   stream and it moves 0.003, as a random model only: it is on the list above).
# The limit sits 6x above the noise of two bf16 kernels (13x above the measured bf16 noise) and 2.5x below
# the weakest leak measured.
LEAK_LIMIT = 0.25


def packing_leak(
    model: torch.nn.Module,
    batches: SftBatches,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager],
) -> float:
    """How far the second of two packed training samples moves from itself alone (see LEAK_LIMIT).

    `batches` lays the row out as training does; `autocast`: the training step's mixed precision. The model
    runs in eval mode without grad and every module's mode is put back after (no copy of it is made)."""
    pool = batches.examples
    first, second = (_cut(pool[index % len(pool)], batches.max_len) for index in (0, 1))
    packed = batches.micro_batch([first, second], [[0, 1]])
    alone = unpacked_batch([first, second], [1], batches.max_len, batches.pad_id)
    start, end = len(first.input_ids), len(first.input_ids) + len(second.input_ids)
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad(), autocast():
            packed_logits = _logits(model, packed, device)[0, start:end]
            alone_logits = _logits(model, alone, device)[0]
    finally:
        for module, training in modes.items():
            module.training = training
    return _moved(packed_logits, alone_logits)


def refuse_packing_that_leaks(
    model: torch.nn.Module,
    batches: SftBatches,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager],
    asked_by: str,
    attention: str,
) -> None:
    """InputError (exit 2) when the model reads one packed sample into the next; `asked_by` names the
    setting that asked for packing (`data.sft.packing=true`)."""
    leak = packing_leak(model, batches, device, autocast)
    model_type = getattr(model.config, "model_type", None) or type(model).__name__
    log.info(
        "packing check: a packed sample moves %.4f from itself alone (%s, attention %s; the limit is %s)",
        leak,
        model_type,
        attention,
        LEAK_LIMIT,
    )
    if leak > LEAK_LIMIT:  # NaN passes: a model with NaN outputs fails at its first step, saying so
        raise InputError(
            f"{asked_by}: the base model ({model_type}, attention {attention}) reads one packed sample into "
            f"the next: packed behind another sample, a sample's next-token log-probabilities moved {leak:.2f} "
            f"of their spread from the sample alone (kept apart, rounding moves them by under 0.04; the limit "
            f"is {LEAK_LIMIT}), so each sample would be trained partly on its neighbour's text; set "
            # flex attention is only ever auto's pick for a model without SDPA (Gemma 2, gpt-oss), which
            # refuses base_model.attention=sdpa; eager, which every model has, gets the same block mask
            + ("base_model.attention=eager or " if attention == "flex_attention" else "")
            + "data.packing=false"
        )


def _cut(example: SftExample, max_len: int) -> SftExample:
    keep = max(1, min(PROBE_TOKENS, max_len // 2))  # both fit one packed row of max_len
    return SftExample(example.input_ids[:keep], example.labels[:keep], example.row_index)


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    return model(**{key: value.to(device) for key, value in batch.items() if key != "labels"}).logits.float()


def _moved(packed: torch.Tensor, alone: torch.Tensor) -> float:
    """The largest per-position move of `packed`'s log-probabilities from `alone`'s, over the latter's spread."""
    packed, alone = packed.log_softmax(-1), alone.log_softmax(-1)
    moved = packed - alone
    moved = moved - moved.mean(-1, keepdim=True)
    spread = alone - alone.mean(-1, keepdim=True)
    ratio = _rms(moved) / _rms(spread).clamp_min(torch.finfo(torch.float32).tiny)
    return float(ratio.max())


def _rms(values: torch.Tensor) -> torch.Tensor:
    return values.pow(2).mean(-1).sqrt()
