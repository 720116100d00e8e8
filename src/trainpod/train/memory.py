"""Peak GPU memory of a pretraining config, estimated on paper before a GPU is paid for.

    from trainpod.train.memory import estimate_training_memory
    print(estimate_training_memory(config, vocab_size=32768, gpu_bytes=80 * 10**9).report())

Preflight (workloads/pretrain.py and `trainpod boot`) logs this estimate and refuses, with exit 2, a
config whose estimate exceeds the GPU it sees, naming the knobs that lower it. What is counted, per
GPU, for one rank of DDP (every rank holds everything) or of FSDP (train.parallel, train/sharding.py:
each rank holds 1/N of the weights, gradients and optimizer states, plus the units it gathers):

- weights, gradients: fp32, 4 bytes per parameter each (DDP's buckets are the gradients themselves,
  with gradient_as_bucket_view);
- FSDP's gathered units: the root's (embeddings, head, final norm) for the whole step and two
  decoder layers at a time (the one running and the one prefetched), in bf16 under bf16 autocast
  (its MixedPrecisionPolicy), which also stands in for autocast's own bf16 copies;
- optimizer states: AdamW 8 bytes per parameter (+ a 4-byte step per tensor); bitsandbytes'
  8-bit AdamW 2 bytes, plus one fp32 absmax per 256-value block per moment, tensors under 4096
  values kept in 32-bit (its min_8bit_size); the paged variant's states live in unified memory
  that the driver may move to the host under pressure, counted here as if they stayed;
- bf16 copies of the decoder's weights, which autocast makes once per forward and the backward needs
  (2 bytes per parameter outside the embedding and head);
- activations saved for the backward, per token and layer (Llama, bf16 autocast over an fp32
  residual stream, SDPA or flash attention, which save no attention matrix): both RMSNorms' input
  and output (4 x 4h), the bf16 casts of the norms' outputs for q/k/v and gate/up (5 x 2h), q, k,
  v, the attention output and o_proj's input (3 x 2h + 2 x 2 kv_h), the MLP's gate, SiLU, up and
  product (4 x 2 mlp); with gradient checkpointing, each layer's fp32 input only, plus one layer in
  full while it is recomputed. This is eager PyTorch; torch.compile fuses some of it away, so the
  estimate errs high;
- the chunked loss (train/loss.py): the final norm's activations, the gradients of the hidden states
  and of the head (fp32), the head's bf16 cast and three fp32 copies of one chunk's logits;
- the CUDA context (about 1 GiB with cuBLAS and NCCL workspaces; not in max_memory_allocated) and
  5% of the rest for the caching allocator's fragmentation.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from trainpod.config.pretrain import PretrainConfig
from trainpod.errors import InputError
from trainpod.train.loss import rows_per_chunk
from trainpod.train.sharding import resolve_parallel

log = logging.getLogger(__name__)

GiB = 2**30
CUDA_CONTEXT_BYTES = GiB
FRAGMENTATION = 0.05
BNB_BLOCK = 256  # values per absmax in bitsandbytes' blockwise 8-bit optimizer states
BNB_MIN_8BIT_SIZE = 4096  # smaller tensors keep 32-bit states in bitsandbytes' optimizers
EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know of a model: its parameter tensors and widths."""

    tensor_sizes: tuple[int, ...]  # numel of each parameter tensor (tied ones once)
    hidden: int
    kv_hidden: int
    mlp: int
    layers: int
    vocab: int
    embedding_params: int  # input embedding + output head (once when tied)

    @property
    def params(self) -> int:
        return sum(self.tensor_sizes)


def model_shape(config: PretrainConfig, vocab_size: int) -> ModelShape:
    from transformers import LlamaForCausalLM

    from trainpod.train.model import llama_config

    llama = llama_config(config.model, vocab_size, config.train.seq_len)
    with torch.device("meta"):
        model = LlamaForCausalLM(llama)
    head_dim = llama.hidden_size // llama.num_attention_heads
    embedding = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return ModelShape(
        tensor_sizes=tuple(p.numel() for p in model.parameters()),
        hidden=llama.hidden_size,
        kv_hidden=llama.num_key_value_heads * head_dim,
        mlp=llama.intermediate_size,
        layers=llama.num_hidden_layers,
        vocab=vocab_size,
        embedding_params=sum(p.numel() for p in model.parameters() if id(p) in embedding),
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU by part, in the order they are reported; `gpu_bytes` is the GPU's size if known."""

    parts: dict[str, int]
    gpu_bytes: int | None = None
    settings: dict[str, object] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def allocated(self) -> int:
        """What torch.cuda.max_memory_allocated should see: the total without context and fragmentation."""
        return self.total - self.parts["CUDA context"] - self.parts["fragmentation (5%)"]

    @property
    def fits(self) -> bool:
        return self.gpu_bytes is None or self.total <= self.gpu_bytes

    def report(self) -> str:
        rows = [f"  {name:<34} {size / GiB:7.2f} GiB" for name, size in self.parts.items()]
        gpu = f" of {self.gpu_bytes / GiB:.1f} GiB on this GPU" if self.gpu_bytes else ""
        shown = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        return "\n".join([f"estimated peak GPU memory {self.total / GiB:.1f} GiB{gpu} ({shown}):", *rows])


def estimate_training_memory(
    config: PretrainConfig,
    vocab_size: int,
    gpu_bytes: int | None = None,
    world_size: int = 1,
    bf16: bool | None = None,
) -> MemoryEstimate:
    """Peak memory per GPU of pretraining `config` with `vocab_size` embedding rows on `world_size`
    DDP ranks; `bf16` (default: unless train.precision is fp32) is autocast's dtype on the GPU."""
    t = config.train
    bf16 = t.precision != "fp32" if bf16 is None else bf16
    shape = model_shape(config, vocab_size)
    tokens = t.micro_batch_size * t.seq_len
    parallel = resolve_parallel(t.parallel, world_size, shape.params, t.optimizer)
    shards = world_size if parallel == "fsdp" else 1
    where = f" / {shards} ranks" if shards > 1 else ""
    parts = {
        f"weights (fp32{where})": math.ceil(4 * shape.params / shards),
        f"gradients (fp32{where})": math.ceil(4 * shape.params / shards),
        f"optimizer states ({t.optimizer}{where})": math.ceil(
            optimizer_bytes(shape.tensor_sizes, t.optimizer) / shards
        ),
    }
    if parallel == "fsdp":
        layer_params = (shape.params - shape.embedding_params) / shape.layers
        gathered = shape.embedding_params + min(2, shape.layers) * layer_params
        parts["FSDP gathered units (root + 2 layers)"] = math.ceil((2 if bf16 else 4) * gathered)
    elif bf16:
        parts["bf16 weight copies (autocast)"] = 2 * (shape.params - shape.embedding_params)
    checkpointing = "on" if t.gradient_checkpointing else "off"
    parts[f"activations (checkpointing {checkpointing})"] = activation_bytes(
        shape, tokens, bf16, t.gradient_checkpointing
    )
    parts["loss (chunked)"] = loss_bytes(shape, tokens, bf16)
    parts["CUDA context"] = CUDA_CONTEXT_BYTES
    parts["fragmentation (5%)"] = math.ceil(FRAGMENTATION * sum(parts.values()))
    settings = {
        "micro_batch_size": t.micro_batch_size,
        "seq_len": t.seq_len,
        "gradient_checkpointing": t.gradient_checkpointing,
        "optimizer": t.optimizer,
        "precision": "bf16" if bf16 else "fp32",
        "ranks": world_size,
        "parallel": parallel,
        "parameters": f"{shape.params / 1e6:,.0f}M",
    }
    return MemoryEstimate(parts, gpu_bytes, settings)


def optimizer_bytes(tensor_sizes: tuple[int, ...], optimizer: str) -> int:
    """Bytes of the optimizer's state once it has stepped, for parameter tensors of these sizes."""
    if optimizer not in EIGHT_BIT_OPTIMIZERS:
        return sum(8 * n + 4 for n in tensor_sizes)  # two fp32 moments and a fp32 step tensor
    total = 0
    for n in tensor_sizes:
        if n < BNB_MIN_8BIT_SIZE:
            total += 8 * n
        else:  # two uint8 moments and an fp32 absmax per block of each
            total += 2 * (n + math.ceil(n / BNB_BLOCK) * 4)
    quantization_maps = 2 * 256 * 4  # one 256-entry fp32 map per moment, shared by every tensor
    return total + (quantization_maps if max(tensor_sizes) >= BNB_MIN_8BIT_SIZE else 0)


def layer_activation_bytes(shape: ModelShape, bf16: bool) -> int:
    """Bytes one decoder layer saves for the backward, per token (see the module docstring)."""
    h, kv, mlp = shape.hidden, shape.kv_hidden, shape.mlp
    c = 2 if bf16 else 4  # the matmuls' dtype; the residual stream and the norms stay fp32
    norms = 2 * 2 * 4 * h
    casts = 5 * c * h if bf16 else 0
    return norms + casts + 3 * c * h + 2 * c * kv + 4 * c * mlp


def activation_bytes(shape: ModelShape, tokens: int, bf16: bool, checkpointing: bool) -> int:
    layer = layer_activation_bytes(shape, bf16) * tokens
    if not checkpointing:
        return shape.layers * layer
    return shape.layers * 4 * shape.hidden * tokens + layer


def loss_bytes(shape: ModelShape, tokens: int, bf16: bool) -> int:
    c = 2 if bf16 else 4
    final_norm = 2 * 4 * shape.hidden * tokens
    grad_hidden = 4 * shape.hidden * tokens
    grad_head = 4 * shape.vocab * shape.hidden
    head_cast = c * shape.vocab * shape.hidden if bf16 else 0
    chunk = 3 * 4 * min(tokens, rows_per_chunk(shape.vocab, tokens)) * shape.vocab
    return final_norm + grad_hidden + grad_head + head_cast + chunk


def visible_gpu_bytes() -> int | None:
    """Total memory of the GPU this process uses, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def check_fits(config: PretrainConfig, vocab_size: int, world_size: int = 1) -> MemoryEstimate:
    """Log the estimate; on a GPU, raise InputError (exit 2) if it exceeds the GPU, naming the knobs."""
    gpu = visible_gpu_bytes()
    estimate = estimate_training_memory(config, vocab_size, gpu, world_size)
    log.info("%s", estimate.report())
    if gpu is None:
        log.info("no GPU visible: the estimate is what a GPU would need; nothing is refused here")
    elif not estimate.fits:
        t = config.train
        raise InputError(
            f"this config needs about {estimate.total / GiB:.1f} GiB per GPU, more than this GPU's "
            f"{gpu / GiB:.1f} GiB:\n{estimate.report()}\nLower train.micro_batch_size (now {t.micro_batch_size}, "
            f"raising train.grad_accum_steps to keep the tokens per step) or train.seq_len (now {t.seq_len}), "
            f"set train.gradient_checkpointing=true (now {str(t.gradient_checkpointing).lower()}), or "
            f"train.optimizer=adamw_8bit (now {t.optimizer})"
            + ("" if world_size == 1 else f", or train.parallel=fsdp (now {t.parallel}) to shard the state")
        )
    return estimate
