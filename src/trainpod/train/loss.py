"""Cross-entropy from the final hidden states and the output head, a chunk of rows at a time.

    loss = linear_cross_entropy(hidden, lm_head.weight, targets)          # hidden (N, H), targets (N,)
    python bench/bench_loss.py                                           # its memory and speed vs the plain loss

The plain loss (`F.cross_entropy(lm_head(hidden).float(), targets)`) keeps the logits of every token
alive for the backward: at the 125m preset (16 x 1024 tokens, vocabulary 32768) that is 1 GiB of
bf16 logits, 2 GiB for their fp32 copy and 2 GiB more for each of the log-softmax and its gradient.
Here each chunk of rows computes its logits (upcast to fp32 inside the chunk only), its loss and,
when gradients are wanted, the gradients of its hidden rows and of the head weight at once, in the
forward pass, as Liger-Kernel's fused linear cross-entropy does: no logits outlive their chunk,
nothing is recomputed (the same three matmuls as the plain loss), and the backward only scales the
stored gradients by the incoming one. What stays alive: one chunk's logits a few times over, the
gradient of the hidden states (N x H) and of the head weight (V x H, accumulated in fp32). A micro-batch
is cut into at most MAX_CHUNKS chunks, each between 64 and 512 MiB of fp32 logits (see MAX_CHUNKS in
train/loss_chunks.py, which the estimates on paper read without torch).

It is plain torch, so it runs on CPU, and torch.compile traces it with the model (see
`CausalLMLoss`): inductor fuses each chunk's softmax, target pick and gradient into few kernels. It also
fuses the head gradient's running sum into one kernel after the last chunk, so under compile each chunk's
vocab x width term of it stays alive until then (train/memory.py counts it; tests/test_memory_compiled.py
measures it): one more reason to keep the chunks few (MAX_CHUNKS).
Liger-Kernel's Triton version is not used: it is CUDA-only, a graph break under compile, and with
no GPU to measure it against this one it could not be chosen by measurement.
"""

from __future__ import annotations

import torch

from trainpod.train.loss_chunks import PLAIN_HEAD_MODEL_TYPES, rows_per_chunk

IGNORE_INDEX = -100  # targets with this value add nothing to the loss (padding, prompts in SFT)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    divisor: torch.Tensor | float | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T` against `targets`, summed over the rows whose target is not
    `ignore_index` and divided by `divisor` (default: the count of those rows, i.e. the mean).

    Under autocast the matmuls run in the autocast dtype and the softmax in fp32, as the plain
    `F.cross_entropy(logits.float(), ...)` would.
    """
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if divisor is None:
        divisor = (targets != ignore_index).sum().clamp(min=1)
    divisor = torch.as_tensor(divisor, dtype=torch.float32, device=hidden.device)
    rows = chunk_rows or rows_per_chunk(weight.shape[0], hidden.shape[0])
    compute_dtype = _compute_dtype(hidden)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, targets, divisor, ignore_index, rows, compute_dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        total = sum(
            _chunk_loss(h, weight.to(compute_dtype), t, ignore_index)[0]
            for h, t in zip(hidden.split(rows), targets.split(rows), strict=True)
        )
    return total / divisor


def token_losses(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """The cross-entropy of each row of `hidden @ weight.T` against `targets` (0 where the target is
    `ignore_index`), in `targets`' shape, fp32, without gradients: an eval's per-token losses computed a chunk
    of rows at a time, as the training loss is, so the fp32 logits of a whole batch (and their log-softmax)
    never exist."""
    shape = targets.shape
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    rows = rows_per_chunk(weight.shape[0], hidden.shape[0])
    compute_dtype = _compute_dtype(hidden)
    losses = []
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(compute_dtype)
        for h, t in zip(hidden.split(rows), targets.split(rows), strict=True):
            losses.append(chunk_token_losses(h, w, t, ignore_index)[0])
    return torch.cat(losses).reshape(shape)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def chunk_token_losses(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's cross-entropy, 0 where its target is ignored; the fp32 logits; their log-sum-exp; the valid-row
    mask) of one chunk of `hidden @ weight.T`: the chunked SFT loss's, its eval's and DPO's log-probabilities'
    (train/preference.py) one computation."""
    logits = (hidden.to(weight.dtype) @ weight.T).float()
    lse = torch.logsumexp(logits, dim=-1)
    valid = targets != ignore_index
    picked = logits.gather(1, targets.where(valid, 0)[:, None]).squeeze(1)
    return (lse - picked) * valid, logits, lse, valid


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed loss, fp32 logits, log-sum-exp, valid-row mask) of one chunk."""
    losses, logits, lse, valid = chunk_token_losses(hidden, weight, targets, ignore_index)
    return losses.sum(), logits, lse, valid


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, divisor, ignore_index, rows, compute_dtype):
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        )
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            for start in range(0, hidden.shape[0], rows):
                h = hidden[start : start + rows].to(compute_dtype)
                t = targets[start : start + rows]
                loss, logits, lse, valid = _chunk_loss(h, w, t, ignore_index)
                total += loss
                # d loss / d logits = (softmax - one_hot(target)) / divisor on valid rows, 0 elsewhere.
                grad = logits.sub_(lse[:, None]).exp_()
                grad.scatter_add_(1, t.where(valid, 0)[:, None], -valid[:, None].float())
                grad = grad.mul_((valid / divisor)[:, None]).to(compute_dtype)
                if want_hidden:
                    grad_hidden[start : start + rows] = grad @ w
                if want_weight:
                    grad_weight += (grad.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / divisor

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        if grad_hidden is not None:
            grad_hidden = (grad_hidden * grad_output).to(hidden_dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_output).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


class CausalLMLoss(torch.nn.Module):
    """A causal LM (transformers' *ForCausalLM, or a peft model around one) and its chunked loss as one
    module.

    `forward(input_ids, targets, divisor=None, **inputs)` returns the loss over `targets`, which are
    already shifted (targets[:, i] is the token after input_ids[:, i], as the pretraining batches
    are; `shift_labels` makes them from SFT labels): their mean, or their sum / `divisor`. One
    module, so torch.compile traces the model and the loss together and DDP sees every parameter
    used; the wrapped model's weights are the ones that train.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, targets: torch.Tensor, divisor: torch.Tensor | None = None, **inputs
    ) -> torch.Tensor:
        base = _base_model(self.model)
        hidden = base.get_decoder()(input_ids=input_ids, **inputs).last_hidden_state
        return linear_cross_entropy(hidden, base.get_output_embeddings().weight, targets, divisor)

    def token_losses(self, input_ids: torch.Tensor, targets: torch.Tensor, **inputs) -> torch.Tensor:
        """Each target's loss (0 where ignored), chunked (`token_losses`): an eval's, with no gradients."""
        base = _base_model(self.model)
        hidden = base.get_decoder()(input_ids=input_ids, **inputs).last_hidden_state
        return token_losses(hidden, base.get_output_embeddings().weight, targets)


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    get_base_model = getattr(model, "get_base_model", None)  # a peft model: LoRA layers sit inside it
    return get_base_model() if get_base_model else model


def fits_chunked_loss(model: torch.nn.Module) -> bool:
    """Whether `CausalLMLoss` gives this model's own loss: a known decoder whose head is a plain bias-free
    Linear (not quantized, not a LoRA layer)."""
    base = _base_model(model)
    head = base.get_output_embeddings()
    model_type = getattr(base.config, "model_type", None)
    return type(head) is torch.nn.Linear and head.bias is None and model_type in PLAIN_HEAD_MODEL_TYPES


def counts_items_in_batch(model: torch.nn.Module) -> bool:
    """Whether the model's own loss is its summed loss / num_items_in_batch when given that: the forward of
    transformers' classes passes it to their loss_function. A forward in remote code (loaded as
    transformers_modules.*) may take no such argument (a TypeError) or take it in **kwargs and return its
    micro-batch's mean."""
    forward = type(_base_model(model)).forward
    return getattr(forward, "__module__", "").startswith("transformers.")


def summed_sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The cross-entropy summed over the trained tokens of SFT labels (aligned with the inputs), in fp32 as
    transformers' own loss computes it."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), labels[:, 1:], ignore_index=IGNORE_INDEX, reduction="sum"
    )


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """SFT labels (aligned with the inputs) as next-token targets, as transformers' loss shifts them."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
