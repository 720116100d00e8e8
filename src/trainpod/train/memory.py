"""Peak GPU memory of a pretraining config, estimated on paper before a GPU is paid for.

    from trainpod.train.memory import estimate_training_memory
    print(estimate_training_memory(config, vocab_size=32768, gpu_bytes=80 * 10**9).report())

Preflight (workloads/pretrain.py and `trainpod boot`) logs this estimate and refuses, with exit 2, a
config whose estimate exceeds the GPU it sees, naming the knobs that lower it; `trainpod estimate` prints it
on a laptop, so this module imports no torch (the model's sizes are train/shape.py's arithmetic). What is counted, per
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
  residual stream, SDPA or flash attention, which save no attention matrix). Eager PyTorch: both
  RMSNorms' input and output (4 x 4h), the bf16 casts of the norms' outputs for q/k/v and gate/up
  (5 x 2h), q, k, v, the attention output and o_proj's input (3 x 2h + 2 x 2 kv_h), the MLP's gate,
  SiLU, up and product (4 x 2 mlp): 32h + 4 kv_h + 8 mlp bytes. With gradient checkpointing, each
  layer's fp32 input only, plus one layer in full while it is recomputed;
- the chunked loss (train/loss.py): the final norm's activations, the gradients of the hidden states
  and of the head (fp32), the head's bf16 cast and three fp32 copies of one chunk's logits;
- the CUDA context (about 1 GiB with cuBLAS and NCCL workspaces; not in max_memory_allocated) and
  5% of the rest for the caching allocator's fragmentation.

With train.compile (all the shipped presets), torch.compile's partitioner saves less and inductor's
schedule holds other things, so the activations and the loss follow the compiled graph instead, as
tests/test_memory_compiled.py measures it on CPU (the partitioner and inductor's lowering do not depend
on the device; CPU SDPA saves what CUDA's flash and cuDNN attention save; docs/design.md, "Workloads"):

- per token and layer, the two fp32 residuals the norms read (2 x 4h), the bf16 inputs of the q/k/v
  and gate/up matmuls, q and the attention output (4 x 2h), k and v (2 x 2 kv_h), gate, up and their
  SiLU product (3 x 2 mlp), attention's log-sum-exp (4 bytes a head) and each norm's 1/rms (2 x 4):
  16h + 4 kv_h + 6 mlp bytes, where eager saves 32h + 4 kv_h + 8 mlp. The fp32 norm outputs, RoPE's
  fp32 products and the SiLU output are recomputed. With gradient checkpointing each layer's fp32
  input only; the bf16 weight copies are then recomputed with their layer, not kept;
- the loss: the head's fp32 gradient and the hidden states' gradient in its bf16 chunks, and, at the
  end of the forward, every chunk's bf16 vocab x h term of the head's gradient: inductor fuses the
  running sum `grad_weight += (grad.T @ h).float()` into one kernel after the last chunk, so all its
  terms wait for it (16 of 134 MB at the 1b preset: 2.1 GB; on some graphs it holds every chunk's
  logits instead, and the larger of the two is counted);
- on one GPU with train.grad_accum_steps over 1, the end of the backward of each micro-batch after the
  first can be the peak instead: the single compiled backward returns every gradient at once (fp32),
  beside the ones accumulated so far, before autograd adds them in (eager adds each as it is made; DDP
  splits the graph at its buckets). The estimate is the larger moment, named in its `peak` setting:
  the end of the backward for the 4b preset, the end of the forward for the others.

Against torch.cuda.max_memory_allocated on an NVIDIA H100 80GB HBM3 (torch 2.11, compile on, fused AdamW,
3 steps of the real Pretrainer: bench/results/gpu-2026-11-27), with the loss's chunks of that day (512
rows: 128 a micro-batch at the 125m preset, 32 at the 1b), the estimate's allocated bytes land 2.0% high
at the 125m preset (31.12 GB against 30.50; with one micro-batch a step its gradients, counted here, are
freed before the forward) and 0.5% high at the 1b preset (47.92 GB against 47.69). The eager terms it used
before were 24% and 25% high there. The loss now cuts a micro-batch into at most 16 chunks (train/loss_chunks.py,
MAX_CHUNKS), which this estimate puts at 29.68 and 45.88 GB: not measured yet, nor are the 2b and 4b.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from trainpod.config.pretrain import PretrainConfig, TrainConfig
from trainpod.errors import InputError
from trainpod.train.loss_chunks import rows_per_chunk
from trainpod.train.parallel import resolve_parallel
from trainpod.train.shape import ModelShape, model_shape

log = logging.getLogger(__name__)

GiB = 2**30
CUDA_CONTEXT_BYTES = GiB
FRAGMENTATION = 0.05
BNB_BLOCK = 256  # values per absmax in bitsandbytes' blockwise 8-bit optimizer states
BNB_MIN_8BIT_SIZE = 4096  # smaller tensors keep 32-bit states in bitsandbytes' optimizers
EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")


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
        width = max(34, *(len(name) for name in self.parts))
        rows = [f"  {name:<{width}} {size / GiB:7.2f} GiB" for name, size in self.parts.items()]
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
    moments = (
        compiled_moments(shape, t, tokens, bf16, parallel, world_size)
        if t.compile
        else {"end of the forward": eager_forward_parts(shape, t, tokens, bf16, parallel)}
    )
    peak = max(moments, key=lambda moment: sum(moments[moment].values()))
    parts |= moments[peak]
    parts["CUDA context"] = CUDA_CONTEXT_BYTES
    parts["fragmentation (5%)"] = math.ceil(FRAGMENTATION * sum(parts.values()))
    settings = {
        "micro_batch_size": t.micro_batch_size,
        "seq_len": t.seq_len,
        "gradient_checkpointing": t.gradient_checkpointing,
        "optimizer": t.optimizer,
        "precision": "bf16" if bf16 else "fp32",
        "compile": t.compile,
        "ranks": world_size,
        "parallel": parallel,
        # A tiny model's 0.14M was "0M"; a 125m preset's stays "135M".
        "parameters": f"{shape.params / 1e6:,.0f}M" if shape.params >= 1e6 else f"{shape.params:,}",
        "peak": peak,
    }
    return MemoryEstimate(parts, gpu_bytes, settings)


def eager_forward_parts(
    shape: ModelShape, t: TrainConfig, tokens: int, bf16: bool, parallel: str
) -> dict[str, int]:
    """What eager PyTorch holds beyond the model's state at the end of the forward."""
    parts = {}
    if parallel != "fsdp" and bf16:
        parts["bf16 weight copies (autocast)"] = 2 * (shape.params - shape.embedding_params)
    checkpointing = "on" if t.gradient_checkpointing else "off"
    parts[f"activations (checkpointing {checkpointing})"] = activation_bytes(
        shape, tokens, bf16, t.gradient_checkpointing
    )
    parts["loss (chunked)"] = loss_bytes(shape, tokens, bf16)
    return parts


def compiled_moments(
    shape: ModelShape, t: TrainConfig, tokens: int, bf16: bool, parallel: str, world_size: int
) -> dict[str, dict[str, int]]:
    """Under torch.compile, what is held beyond the model's state at each moment that can be the peak
    (module docstring): the end of the forward; with checkpointing, the start of the backward, where the
    last layer is recomputed; with accumulation on one unsharded GPU, the end of a backward after the first."""
    c = 2 if bf16 else 4
    # Once, not per layer: the final norm's input and 1/rms, and the hidden states' gradient, which the
    # loss made in the forward and keeps in its chunks, in the matmuls' dtype, until the backward.
    once = (4 * shape.hidden + 4 + c * shape.hidden) * tokens
    head_gradient = 4 * shape.vocab * shape.hidden  # fp32, made in the forward (train/loss.py)
    forward: dict[str, int] = {}
    if t.gradient_checkpointing:  # each layer's fp32 input; its bf16 weight copies are recomputed with it
        inputs = shape.layers * 4 * shape.hidden * tokens
        forward["activations (compiled, checkpointing on)"] = inputs + once
    else:
        if bf16 and parallel != "fsdp":  # FSDP's gathered units stand in for them
            forward["bf16 weight copies (autocast)"] = 2 * (shape.params - shape.embedding_params)
        layers = shape.layers * compiled_layer_activation_bytes(shape, bf16) * tokens
        forward["activations (compiled, checkpointing off)"] = layers + once
    forward["loss (chunked, compiled)"] = compiled_loss_bytes(shape, tokens, bf16)
    moments = {"end of the forward": forward}
    # A layer recomputed inside the compiled backward keeps more of itself alive than the forward's partition
    # saves: counted as eager saves it (about 60% more), with its weights' bf16 copy, which covers it on CPU.
    layer_params = (shape.params - shape.embedding_params) // shape.layers
    recomputed = layer_activation_bytes(shape, bf16) * tokens + (2 * layer_params if bf16 else 0)
    if t.gradient_checkpointing:
        moments["start of the backward"] = {
            "activations (compiled, checkpointing on)": inputs + once + recomputed,
            "loss (chunked, compiled)": 2 * head_gradient,  # saved, and its product with the loss's gradient
        }
    # Under DDP the compiled graph is split at its gradient buckets (dynamo's optimize_ddp) and FSDP's
    # units break it too, so each backward returns a bucket's or a unit's gradients, not all of them.
    if t.grad_accum_steps > 1 and world_size == 1 and parallel != "fsdp":
        moments["end of the backward"] = {"gradients of a micro-batch (compiled)": 4 * shape.params}
        if t.gradient_checkpointing:  # the first layer, recomputed last, and its input
            moments["end of the backward"]["activations (compiled, first layer)"] = (
                4 * shape.hidden * tokens + recomputed
            )
    return moments


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
    return total + (quantization_maps if max(tensor_sizes, default=0) >= BNB_MIN_8BIT_SIZE else 0)


def checkpoint_bytes(tensor_sizes: tuple[int, ...], optimizer: str) -> int:
    """Bytes of a full-weights checkpoint of parameter tensors of these sizes: fp32 weights and the optimizer's
    state as it stepped (`optimizer_bytes`: 8 bytes a parameter for AdamW, about 2 for an 8-bit one)."""
    return 4 * sum(tensor_sizes) + optimizer_bytes(tensor_sizes, optimizer)


def layer_activation_bytes(shape: ModelShape, bf16: bool) -> int:
    """Bytes one decoder layer saves for the backward, per token (see the module docstring)."""
    h, kv, mlp = shape.hidden, shape.kv_hidden, shape.mlp
    c = 2 if bf16 else 4  # the matmuls' dtype; the residual stream and the norms stay fp32
    norms = 2 * 2 * 4 * h
    casts = 5 * c * h if bf16 else 0
    return norms + casts + 3 * c * h + 2 * c * kv + 4 * c * mlp


def compiled_layer_activation_bytes(shape: ModelShape, bf16: bool) -> int:
    """Bytes one decoder layer's compiled graph saves for the backward, per token (module docstring;
    tests/test_memory_compiled.py measures it). The same on CUDA: the partitioner and inductor's lowering
    do not depend on the device, and CPU SDPA (its flash kernel) saves what CUDA's flash and cuDNN
    attention save: q, k, v, the output (whose layout o_proj reads without a copy) and a log-sum-exp."""
    h, kv, mlp = shape.hidden, shape.kv_hidden, shape.mlp
    c = 2 if bf16 else 4  # the matmuls' dtype; the residual stream stays fp32
    residuals = 2 * 4 * h  # the layer's input and the sum after attention, read by the two norms
    matmul_inputs = 4 * c * h  # the normed inputs of q/k/v and gate/up, q, the attention output
    return residuals + matmul_inputs + 2 * c * kv + 3 * c * mlp + 4 * shape.heads + 2 * 4


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


def compiled_loss_bytes(shape: ModelShape, tokens: int, bf16: bool) -> int:
    """The compiled chunked loss at the end of the forward, beyond the hidden states' gradient (counted
    with the activations): the head's fp32 gradient, saved, and what inductor's schedule keeps of the
    chunks at once. It fuses the head gradient's running sum (`grad_weight += (grad.T @ h).float()`)
    into one kernel after the last chunk, so each chunk's vocab x h term in the matmul dtype waits for
    it. On some graphs every chunk's logits wait instead, freed as those terms are made, so the larger
    of the two is counted: bf16 logits (on CPU some graphs keep them in fp32; on CUDA the 125m preset's
    H100 peak rules that out, it would be 2.1 GB over what was measured)."""
    c = 2 if bf16 else 4
    rows = min(tokens, rows_per_chunk(shape.vocab, tokens))
    chunks = math.ceil(tokens / rows)
    head = shape.vocab * shape.hidden
    grad_head = 4 * head
    held = max(chunks * c * head, c * tokens * shape.vocab)
    one_chunk = (4 + c) * rows * shape.vocab  # its fp32 softmax gradient and that cast for the matmuls
    head_cast = c * head if bf16 else 0
    return grad_head + held + one_chunk + head_cast


def visible_gpu_bytes() -> int | None:
    """Total memory of the GPU this process uses, or None without CUDA."""
    import torch  # here, not at the top: `trainpod estimate` reads this module on a laptop without torch

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
        accumulating = (
            "Its peak is where a compiled backward that accumulates returns a second set of fp32 gradients: "
            f"train.compile=false or train.grad_accum_steps=1 (now {t.grad_accum_steps}) removes it. "
            if estimate.settings["peak"] == "end of the backward"
            else ""
        )
        raise InputError(
            f"this config needs about {estimate.total / GiB:.1f} GiB per GPU, more than this GPU's "
            f"{gpu / GiB:.1f} GiB:\n{estimate.report()}\n{accumulating}"
            f"Lower train.micro_batch_size (now {t.micro_batch_size}, "
            f"raising train.grad_accum_steps to keep the tokens per step) or train.seq_len (now {t.seq_len}), "
            f"set train.gradient_checkpointing=true (now {str(t.gradient_checkpointing).lower()}), or "
            f"train.optimizer=adamw_8bit (now {t.optimizer})"
            + ("" if world_size == 1 else f", or train.parallel=fsdp (now {t.parallel}) to shard the state")
        )
    return estimate
