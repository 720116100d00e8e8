"""Preference optimization: each pair's chosen answer made likelier than its rejected one. DPO relative to a
reference model (Rafailov et al. 2023, "Direct Preference Optimization"), as TRL's DPOTrainer computes it; ORPO
(Hong et al. 2024) and SimPO (Meng et al. 2024) with none, as TRL's ORPOTrainer and CPOTrainer compute them.

    losses, chosen_rewards, rejected_rewards = PreferenceLoss(peft_model, beta=0.1)(input_ids, labels, mask)

A micro batch holds 2 x P rows: the P chosen samples, then their P rejected ones (sft/dataset.py,
PreferencePairs). Each row's log-probability is the sum over its trained tokens (the final answer only: the
data stores the prompt untrained), under the policy (the model with its LoRA adapters) and under the reference
(the same model with the adapters off, peft's `disable_adapter`, without gradients): no second copy of the
model, which is why DPO here takes method lora or qlora (config/finetune.py). ORPO and SimPO take each answer's
per-token mean log-probability under the policy alone, so any method.

For the decoders the chunked loss serves (train/loss.py) the log-probabilities are taken from the final hidden
states a chunk of rows at a time, and the backward makes each chunk's logits again (`_TokenLogps`): a chunk's
fp32 logits live only while it is computed, never those of the whole batch (2 x P rows x the answer length x a
152k vocabulary would be gigabytes). The fused SFT loss cannot serve: it takes each row's gradient in the
forward, and the DPO sigmoid weighs a row by a factor known only once every row's log-probability is. Other
models give their logits whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainpod.train.loss import IGNORE_INDEX, _base_model, _compute_dtype, chunk_token_losses, shift_labels
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


def token_logps(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """Each target's log-probability under `hidden @ weight.T`, (rows, tokens) as `targets`, fp32, a chunk of rows
    at a time; under autograd the backward makes each chunk's logits again instead of keeping them."""
    shape = targets.shape
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    rows = chunk_rows or rows_per_chunk(weight.shape[0], hidden.shape[0])
    compute_dtype = _compute_dtype(hidden)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        out = _TokenLogps.apply(hidden, weight, targets, rows, compute_dtype)
    else:
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            out = torch.cat(
                [
                    -chunk_token_losses(h, w, t)[0]
                    for h, t in zip(hidden.split(rows), targets.split(rows), strict=True)
                ]
            )
    return out.reshape(shape)


class _TokenLogps(torch.autograd.Function):
    """The forward keeps each row's log-sum-exp (4 bytes a row), not its logits; the backward, given d loss / d
    log p(target) per row (g), makes a chunk's logits again and takes d / d logits = g (one_hot(target) -
    softmax) on valid rows: three matmuls a chunk (the forward's, its remake, the gradient's), as activation
    checkpointing would do, without autograd's graph of the chunk's log-sum-exp and gather (2x the time on CPU)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, compute_dtype):
        parts, lses = [], []
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            for h, t in zip(hidden.split(rows), targets.split(rows), strict=True):
                losses, _, lse, _ = chunk_token_losses(h.to(compute_dtype), w, t)
                parts.append(-losses)
                lses.append(lse)
        ctx.save_for_backward(hidden, weight, targets, torch.cat(lses))
        ctx.rows, ctx.compute_dtype = rows, compute_dtype
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight, targets, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        )
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(ctx.compute_dtype)
            for start in range(0, hidden.shape[0], ctx.rows):
                stop = start + ctx.rows
                h, t = hidden[start:stop].to(ctx.compute_dtype), targets[start:stop]
                valid = t != IGNORE_INDEX
                scale = grad_output[start:stop].float() * valid
                grad = (h @ w.T).float().sub_(lse[start:stop, None]).exp_().mul_(-scale[:, None])
                grad.scatter_add_(1, t.where(valid, 0)[:, None], scale[:, None])
                grad = grad.to(ctx.compute_dtype)
                if want_hidden:
                    grad_hidden[start:stop] = grad @ w
                if want_weight:
                    grad_weight += (grad.T @ h).float()
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def logits_token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each next-token target's log-probability from a model's whole logits (labels aligned with the inputs)."""
    targets = shift_labels(labels)
    valid = targets != IGNORE_INDEX
    logps = torch.log_softmax(logits.float(), dim=-1)
    return logps.gather(2, targets.where(valid, 0)[..., None]).squeeze(2) * valid


def turn_off_base_dropout(model: torch.nn.Module) -> int:
    """Dropout off in `model` but for its LoRA adapters' own (lora.dropout), as TRL's DPOTrainer turns it off
    (DPOConfig.disable_dropout, on by default); returns how many modules had some.

    The reference is the same model with the adapters off, run in train mode beside the policy: the base's
    dropout drew other masks in the two forwards, so where the policy is the reference (a fresh adapter) a pair's
    margin was noise instead of 0: a tiny GPT-2 with dropout 0.1 began at loss 0.6975, not log 2, with
    rewards_accuracy 37.5%, and every later reward was off by as much. The adapters' dropout stays: it acts on the
    policy alone, since the reference runs without them. Dropout is an nn.Dropout module (GPT-2's) or the float
    `attention_dropout` transformers' attention classes pass to the attention function (Llama's, Qwen2's)."""
    adapters = {
        id(dropout)
        for module in model.modules()
        if isinstance(getattr(module, "lora_dropout", None), torch.nn.ModuleDict)
        for dropout in module.lora_dropout.values()
    }
    turned_off = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p and id(module) not in adapters:
            module.p = 0.0
            turned_off += 1
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout:
            module.attention_dropout = 0.0
            turned_off += 1
    return turned_off


def orpo_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO (Hong et al. 2024) from the answers' per-token mean log-probabilities: the chosen answer's SFT loss
    (its negative mean log-probability) plus beta x -log sigmoid of the log odds ratio, odds(p) = p / (1 - p); the
    rewards beta x the mean log-probabilities, as TRL's ORPOTrainer and LLaMA-Factory compute them."""
    # log(1 - p) from log p, exactly near p = 1 (expm1), clamped off log p = 0, whose 1 - p is 0
    log_one_minus = lambda logp: torch.log(-torch.expm1(logp.clamp(max=-1e-6)))  # noqa: E731
    log_odds = (chosen - rejected) - (log_one_minus(chosen) - log_one_minus(rejected))
    losses = -chosen - beta * F.logsigmoid(log_odds)
    return losses, beta * chosen.detach(), beta * rejected.detach()


def simpo_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, beta: float, gamma: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (Meng et al. 2024) from the answers' per-token mean log-probabilities: -log sigmoid(beta (chosen -
    rejected) - gamma); the rewards beta x the mean log-probabilities (TRL's CPOTrainer, loss_type simpo)."""
    losses = -F.logsigmoid(beta * (chosen - rejected) - gamma)
    return losses, beta * chosen.detach(), beta * rejected.detach()


class PreferenceLoss(torch.nn.Module):
    """A model and the preference loss of its micro batches as one module, so DDP sees every trained parameter
    used in one forward.

    `forward(input_ids, labels, attention_mask)` returns the per-pair losses and the chosen and rejected
    rewards (each of P values, P = rows / 2); the step sums the losses over its pairs and divides by the
    step's pair count, as the SFT step divides by its token count. `objective` dpo compares with the reference,
    the peft model with its adapters off (no gradients); orpo and simpo need none, so their model may be any, a
    full finetune's too. The model's own dropout is turned off (`turn_off_base_dropout`; `dropout_turned_off`
    counts the modules), so that the reference is deterministic, as TRL's trainers do for all three."""

    def __init__(
        self,
        model: torch.nn.Module,
        beta: float,
        loss: str = "sigmoid",
        label_smoothing: float = 0.0,
        chunked: bool = True,
        objective: str = "dpo",
        gamma: float = 0.0,
    ):
        super().__init__()
        self.model = model
        self.objective = objective
        self.beta, self.loss, self.label_smoothing, self.gamma = beta, loss, label_smoothing, gamma
        self.chunked = chunked
        # IPO, ORPO and SimPO score an answer by its per-token mean log-probability, DPO by the sum
        self.averaged = objective in ("orpo", "simpo") or loss == "ipo"
        self.dropout_turned_off = turn_off_base_dropout(model)

    def sequence_logps(self, input_ids: torch.Tensor, labels: torch.Tensor, **inputs) -> torch.Tensor:
        """Each row's log-probability of its trained tokens: summed, or their mean (IPO, ORPO, SimPO)."""
        if self.chunked:
            base = _base_model(self.model)
            hidden = base.get_decoder()(input_ids=input_ids, **inputs).last_hidden_state
            logps = token_logps(hidden, base.get_output_embeddings().weight, shift_labels(labels))
        else:
            logps = logits_token_logps(self.model(input_ids=input_ids, **inputs).logits, labels)
        total = logps.sum(-1)
        if self.averaged:
            return total / (shift_labels(labels) != IGNORE_INDEX).sum(-1).clamp(min=1)
        return total

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, **inputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pairs = input_ids.shape[0] // 2
        policy = self.sequence_logps(input_ids, labels, **inputs)
        chosen, rejected = policy[:pairs], policy[pairs:]
        if self.objective == "orpo":
            return orpo_losses(chosen, rejected, self.beta)
        if self.objective == "simpo":
            return simpo_losses(chosen, rejected, self.beta, self.gamma)
        with torch.no_grad(), self.model.disable_adapter():
            reference = self.sequence_logps(input_ids, labels, **inputs)
        return dpo_losses(
            chosen,
            rejected,
            reference[:pairs],
            reference[pairs:],
            self.beta,
            self.loss,
            self.label_smoothing,
        )
