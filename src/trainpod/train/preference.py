"""Direct preference optimization: each pair's chosen answer made likelier than its rejected one, relative to a
reference model (Rafailov et al. 2023, "Direct Preference Optimization"), as TRL's DPOTrainer computes it.

    losses, chosen_rewards, rejected_rewards = PreferenceLoss(peft_model, beta=0.1)(input_ids, labels, mask)

A micro batch holds 2 x P rows: the P chosen samples, then their P rejected ones (sft/dataset.py,
PreferencePairs). Each row's log-probability is the sum over its trained tokens (the final answer only: the
data stores the prompt untrained), under the policy (the model with its LoRA adapters) and under the reference
(the same model with the adapters off, peft's `disable_adapter`, without gradients): no second copy of the
model, which is why DPO here takes method lora or qlora (config/finetune.py).

For the decoders the chunked loss serves (train/loss.py) the log-probabilities are taken from the final hidden
states a chunk of rows at a time, each chunk under activation checkpointing: its fp32 logits live only while
the chunk is computed, in the forward and again in the backward, never those of the whole batch (2 x P rows x
the answer length x a 152k vocabulary would be gigabytes). Other models give their logits whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainpod.train.loss import IGNORE_INDEX, _base_model, _compute_dtype, shift_labels
from trainpod.train.loss_chunks import rows_per_chunk


def dpo_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the implicit rewards beta x (policy - reference) of the chosen and rejected answers,
    from the answers' log-probabilities (summed; for `ipo`, the caller passes per-token means, as TRL does).

    sigmoid: -(1 - s) log sigmoid(beta m) - s log sigmoid(-beta m), m the margin of the log-ratios, s the label
    smoothing (conservative DPO); ipo: (m - 1 / (2 beta))^2 (Azar et al. 2023)."""
    margin = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    if loss == "sigmoid":
        losses = (
            -F.logsigmoid(beta * margin) * (1 - label_smoothing)
            - F.logsigmoid(-beta * margin) * label_smoothing
        )
    elif loss == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss!r}")
    chosen_rewards = beta * (policy_chosen - reference_chosen).detach()
    rejected_rewards = beta * (policy_rejected - reference_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def _chunk_token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) of each row of `hidden @ weight.T` (0 where the target is ignored), in fp32."""
    logits = (hidden.to(weight.dtype) @ weight.T).float()
    valid = targets != IGNORE_INDEX
    picked = logits.gather(1, targets.where(valid, 0)[:, None]).squeeze(1)
    return (picked - torch.logsumexp(logits, dim=-1)) * valid


def token_logps(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """Each target's log-probability under `hidden @ weight.T`, (rows, tokens) as `targets`, chunked; under
    autograd each chunk is checkpointed, so its logits are made again in the backward instead of kept."""
    shape = targets.shape
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    rows = chunk_rows or rows_per_chunk(weight.shape[0], hidden.shape[0])
    compute_dtype = _compute_dtype(hidden)
    keep_graph = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts = []
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(compute_dtype)
        for h, t in zip(hidden.split(rows), targets.split(rows), strict=True):
            if keep_graph:
                parts.append(checkpoint(_chunk_token_logps, h, w, t, use_reentrant=False))
            else:
                parts.append(_chunk_token_logps(h, w, t))
    return torch.cat(parts).reshape(shape)


def logits_token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each next-token target's log-probability from a model's whole logits (labels aligned with the inputs)."""
    targets = shift_labels(labels)
    valid = targets != IGNORE_INDEX
    logps = torch.log_softmax(logits.float(), dim=-1)
    return logps.gather(2, targets.where(valid, 0)[..., None]).squeeze(2) * valid


class PreferenceLoss(torch.nn.Module):
    """A peft model and the DPO loss of its micro batches as one module, so DDP sees every trained parameter
    used in one forward.

    `forward(input_ids, labels, attention_mask)` returns the per-pair losses and the chosen and rejected
    rewards (each of P values, P = rows / 2); the step sums the losses over its pairs and divides by the
    step's pair count, as the SFT step divides by its token count."""

    def __init__(
        self,
        model: torch.nn.Module,
        beta: float,
        loss: str = "sigmoid",
        label_smoothing: float = 0.0,
        chunked: bool = True,
    ):
        super().__init__()
        self.model = model
        self.beta, self.loss, self.label_smoothing = beta, loss, label_smoothing
        self.chunked = chunked

    def sequence_logps(self, input_ids: torch.Tensor, labels: torch.Tensor, **inputs) -> torch.Tensor:
        """Each row's log-probability of its trained tokens: summed, or for IPO their mean."""
        if self.chunked:
            base = _base_model(self.model)
            hidden = base.get_decoder()(input_ids=input_ids, **inputs).last_hidden_state
            logps = token_logps(hidden, base.get_output_embeddings().weight, shift_labels(labels))
        else:
            logps = logits_token_logps(self.model(input_ids=input_ids, **inputs).logits, labels)
        total = logps.sum(-1)
        if self.loss == "ipo":
            return total / (shift_labels(labels) != IGNORE_INDEX).sum(-1).clamp(min=1)
        return total

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, **inputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pairs = input_ids.shape[0] // 2
        policy = self.sequence_logps(input_ids, labels, **inputs)
        with torch.no_grad(), self.model.disable_adapter():
            reference = self.sequence_logps(input_ids, labels, **inputs)
        return dpo_losses(
            policy[:pairs],
            policy[pairs:],
            reference[:pairs],
            reference[pairs:],
            self.beta,
            self.loss,
            self.label_smoothing,
        )
