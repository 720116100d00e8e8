"""The pretrain workload's config: data, model shape, optimisation, checkpoints, export."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainpod.config.checkpoint import CheckpointConfig
from trainpod.config.loader import Section

# The optimizers that can step FSDP's sharded (DTensor) parameters (train/sharding.py, for pretrain and
# finetune). bitsandbytes' 8-bit and paged ones cannot: their kernels take plain tensors, and the first
# optimizer step fails ("got mixed torch.Tensor and DTensor").
SHARDABLE_OPTIMIZERS = ("adamw",)
# train.seed's range, numpy's and most tools': the data order is numpy.random.default_rng([seed, epoch]), which
# refuses a negative seed (ValueError), and a resume reseeds torch with seed * 1_000_003 + step + rank, which
# overflows torch's 64 bits from about 1.8e13.
MAX_SEED = 2**32 - 1


def unshardable_optimizer(optimizer: str) -> str:
    return (
        f"train.optimizer={optimizer} cannot step the sharded parameters of train.parallel=fsdp (bitsandbytes' "
        "kernels take plain tensors); set train.optimizer=adamw (FSDP shards its state across the GPUs), "
        "or train.parallel=ddp (or auto)"
    )


class PretrainDataConfig(Section):
    dataset: str = Field(
        description="Dataset name under $TRAINPOD_VOLUME/datasets/ (written by `trainpod run datagen`), "
        "or an absolute path to a dataset folder."
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer folder name under tokenizers/ or an absolute path; "
        "default: the tokenizer recorded in the dataset's manifest.",
    )


class ModelConfig(Section):
    """A Llama-architecture decoder (transformers' LlamaForCausalLM), randomly initialised."""

    vocab_size: int | None = Field(
        None, ge=2, description="Embedding rows; default: the tokenizer's vocabulary size (padded to 64)."
    )
    hidden_size: int = Field(768, ge=8, description="Model width.")
    num_layers: int = Field(12, ge=1, description="Number of decoder layers.")
    num_heads: int = Field(12, ge=1, description="Attention heads; must divide hidden_size.")
    num_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads for grouped-query attention; default: num_heads."
    )
    intermediate_size: int | None = Field(
        None, ge=1, description="MLP width; default: 8/3 x hidden_size rounded up to a multiple of 256."
    )
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    tie_embeddings: bool = Field(True, description="Share input embedding and output head weights.")
    init_std: float = Field(0.02, gt=0, description="Standard deviation of the normal weight init.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Attention dropout probability.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}; "
                "pick a head count that divides the width"
            )
        head_dim = self.hidden_size // self.num_heads
        if head_dim % 2:  # RoPE rotates pairs of a head's dimensions: an odd one fails at the first step
            raise ValueError(
                f"model.hidden_size={self.hidden_size} / model.num_heads={self.num_heads} gives heads of "
                f"{head_dim} dimensions; rotary embeddings need an even head size: pick a head count that "
                "leaves an even number of dimensions per head (e.g. hidden_size / 64)"
            )
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={kv}; "
                "pick a kv head count that divides the head count"
            )
        return self

    @property
    def mlp_width(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 256) * 256


class TrainConfig(Section):
    max_steps: int = Field(description="Optimizer steps to train for.", ge=1)
    seq_len: int = Field(1024, ge=8, description="Tokens per sequence.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per GPU per forward pass.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    # lr 0 is refused: the run would pay for GPU hours to write checkpoints of the initial weights (AdamW scales
    # weight decay by lr too); an evaluation of fixed weights needs no training run.
    lr: float = Field(6e-4, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of lr.")
    warmup_steps: int = Field(100, ge=0, description="Linear warmup steps before the cosine decay.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (not applied to norms).")
    # beta1 0 is Adam without momentum (RMSprop with bias correction), which GAN recipes use and torch's and
    # bitsandbytes' AdamW take; beta2 0 would scale each step by its own gradient alone.
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1 (0: no momentum).")
    beta2: float = Field(0.95, gt=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0 disables).")
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = Field(
        "adamw",
        description="'adamw': torch AdamW (fused on CUDA), 8 bytes of state per parameter; 'adamw_8bit': "
        "bitsandbytes' blockwise 8-bit AdamW, 2 bytes (what lets the 4b preset fit one 80 GB GPU); "
        "'paged_adamw_8bit': the same in unified memory that spills to the host under pressure.",
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="'auto' is bf16 autocast on a GPU that supports it, fp32 on CPU."
    )
    attention: Literal["auto", "sdpa", "flash_attention_2", "eager"] = Field(
        "auto", description="'auto' uses flash-attn 2 when installed on a GPU, else PyTorch SDPA."
    )
    parallel: Literal["auto", "ddp", "fsdp"] = Field(
        "auto",
        description="How several GPUs share the model: 'ddp' replicates it on each GPU; 'fsdp' shards weights, "
        "gradients and optimizer state across them (FSDP2; checkpoints sharded through "
        "torch.distributed.checkpoint, resumable on another GPU count); 'auto' is fsdp for several GPUs "
        "and 1B parameters or more with train.optimizer=adamw, else ddp (bitsandbytes' optimizers cannot "
        "step sharded parameters).",
    )
    compile: bool = Field(False, description="Wrap the model in torch.compile (GPU runs; slow to start).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory, about 30% more compute."
    )
    seed: int = Field(
        1337, ge=0, le=MAX_SEED, description="Seed for weights init, dropout and data order (0 to 2**32-1)."
    )
    eval_every: int = Field(
        200, ge=0, description="Evaluate on the validation split every N steps (0: never)."
    )
    eval_batches: int = Field(
        20,
        ge=1,
        description="Micro-batches per evaluation, over all GPUs together: the same validation windows on any "
        "GPU count.",
    )
    log_every: int = Field(10, ge=1, description="Log a line every N steps.")
    cpu_threads: int | None = Field(None, ge=1, description="torch threads on CPU; default: torch's choice.")

    @property
    def tokens_per_step_per_rank(self) -> int:
        return self.seq_len * self.micro_batch_size * self.grad_accum_steps

    @model_validator(mode="after")
    def _optimizer_steps_shards(self) -> TrainConfig:
        if self.parallel == "fsdp" and self.optimizer not in SHARDABLE_OPTIMIZERS:
            raise ValueError(unshardable_optimizer(self.optimizer))
        return self

    @model_validator(mode="after")
    def _warmup_fits(self) -> TrainConfig:
        if self.warmup_steps > self.max_steps:
            raise ValueError(
                f"train.warmup_steps={self.warmup_steps} exceeds train.max_steps={self.max_steps}; "
                "lower warmup_steps"
            )
        return self


class ExportConfig(Section):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype of the HF export; 'auto' is bfloat16 for bf16 runs, else float32."
    )
    weights: Literal["last", "best"] = Field(
        "last",
        description="Which step's weights the export holds: 'last', the final step's (as HF's Trainer and "
        "axolotl export); 'best', the kept checkpoint with the lowest eval loss (needs train.eval_every, "
        "checkpoint.keep_best >= 1, checkpoint.every_steps dividing eval_every and a validation split). The "
        "export's manifest.json names the step (`weights`).",
    )


class PretrainConfig(Section):
    name: str = Field(
        description="Run name: the run lives in runs/<name>/ unless TRAINPOD_RUN says otherwise.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
    )
    data: PretrainDataConfig
    model: ModelConfig = ModelConfig()
    train: TrainConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    export: ExportConfig = ExportConfig()

    @model_validator(mode="after")
    def _best_export_can_be_found(self) -> PretrainConfig:
        problem = self.checkpoint.best_export_problem(self.export.weights, self.train.eval_every)
        if problem:
            raise ValueError(problem)
        return self
