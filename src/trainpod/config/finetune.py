"""The finetune workload's config: base model, method (QLoRA, LoRA, full), SFT data, optimisation.

TRAINPOD_CONFIG=configs/finetune/tiny.yaml trainpod run finetune

Defaults follow what QLoRA users of axolotl and LLaMA-Factory start from: NF4 with double
quantization, rank 16 / alpha 32 on every linear layer, lr 2e-4 with cosine decay (2e-5 for a full
finetune), gradient checkpointing on.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainpod.config.checkpoint import CheckpointConfig
from trainpod.config.loader import Section
from trainpod.config.pretrain import MAX_SEED, SHARDABLE_OPTIMIZERS, unshardable_optimizer
from trainpod.config.sft import SftDataConfig

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class BaseModelConfig(Section):
    path: str = Field(
        min_length=1,
        description="The model to finetune: a folder (absolute, or relative to the volume root, e.g. "
        "runs/tiny-pretrain/export/hf) or a Hugging Face hub id such as Qwen/Qwen2.5-7B-Instruct "
        "(downloaded once into the volume's cache/, with HF_TOKEN for gated models).",
    )
    revision: str | None = Field(
        None,
        description="Hub branch, tag or commit (hub ids only; default main). The commit it names at the run's "
        "first start is kept in runs/<run>/base_model.json and used by every resume.",
    )
    trust_remote_code: bool = Field(False, description="Allow the model's own Python code from the hub.")
    attention: Literal["auto", "sdpa", "flash_attention_2", "eager"] = Field(
        "auto", description="'auto' uses flash-attn 2 when installed on a GPU, else PyTorch SDPA."
    )


class LoraSettings(Section):
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: float = Field(
        32.0, gt=0, description="LoRA alpha: the update is scaled by alpha/r (alpha/sqrt(r) with rslora)."
    )
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names to adapt (e.g. [q_proj, v_proj]), or 'all-linear' for every linear layer "
        "but the output head.",
    )
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA: scale by alpha/sqrt(r).")


class QuantizationSettings(Section):
    """bitsandbytes 4-bit base weights (method qlora only)."""

    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type: nf4 (QLoRA's) or fp4.")
    double_quant: bool = Field(
        True, description="Quantize the quantization constants too (saves ~0.4 bit/param)."
    )
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Dtype the 4-bit layers compute in; 'auto': bfloat16 on a GPU that has it, else float32.",
    )


class DpoSettings(Section):
    """Direct preference optimization (Rafailov et al. 2023), as TRL's DPOTrainer and LLaMA-Factory's `stage: dpo`
    compute it; the reference model is the base with the adapters off (train/preference.py)."""

    beta: float = Field(
        0.1,
        gt=0,
        description="How far the policy may move from the reference: the implicit reward is beta x the log-ratio "
        "of the policy's and the reference's probability of an answer (TRL's and LLaMA-Factory's default 0.1).",
    )
    loss: Literal["sigmoid", "ipo"] = Field(
        "sigmoid",
        description="'sigmoid': DPO's -log sigmoid(beta x margin); 'ipo': IPO's (margin - 1/(2 beta))^2 on "
        "per-token mean log-probabilities (Azar et al. 2023).",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="sigmoid only: the assumed share of pairs whose labels are flipped (conservative DPO).",
    )

    @model_validator(mode="after")
    def _smoothing_is_sigmoids(self) -> DpoSettings:
        if self.label_smoothing and self.loss != "sigmoid":
            raise ValueError(
                f"dpo.label_smoothing={self.label_smoothing} applies to dpo.loss=sigmoid only, not "
                f"{self.loss!r}; set it to 0, or dpo.loss to sigmoid"
            )
        return self


class OrpoSettings(Section):
    """Odds-ratio preference optimization (Hong et al. 2024): SFT on the chosen answer and a preference term in one
    loss, with no reference model (TRL's ORPOTrainer, LLaMA-Factory's pref_loss: orpo, axolotl's rl: orpo)."""

    beta: float = Field(
        0.1,
        gt=0,
        description="Weight of the odds-ratio term beside the chosen answer's SFT loss (the paper's lambda; TRL's "
        "default 0.1).",
    )


class SimpoSettings(Section):
    """Simple preference optimization (Meng et al. 2024): the length-normalised log-probability as the implicit
    reward, with no reference model (TRL's CPOTrainer loss_type simpo, LLaMA-Factory's pref_loss: simpo)."""

    beta: float = Field(
        2.0,
        gt=0,
        description="Scale of the reward, beta x the per-token mean log-probability (the paper's 2-2.5).",
    )
    gamma: float = Field(
        1.0,
        ge=0,
        description="Target reward margin between the chosen and the rejected answer (the paper's gamma/beta "
        "0.3-0.8, so about half of beta).",
    )


PREFERENCE_OBJECTIVES = (
    "dpo",
    "orpo",
    "simpo",
)  # each trains on preference pairs; each has its settings section
OBJECTIVE_NAMES = {"dpo": "DPO", "orpo": "ORPO", "simpo": "SimPO"}  # as their papers and TRL write them


class FinetuneDataConfig(Section):
    dataset: str | None = Field(
        None,
        description="An SFT dataset made by `trainpod run datagen` with an `sft:` section: its name under "
        "datasets/ or an absolute folder. Give this or `sft`.",
    )
    sft: SftDataConfig | None = Field(
        None,
        description="Or the SFT data itself: tokenized here with the base model's tokenizer and cached on the "
        "volume under cache/sft/<key> (reused while data, tokenizer and settings stay the same; a resume takes the "
        "data its first start tokenized, kept in runs/<run>/sft_data.json).",
    )
    packing: bool | None = Field(
        None,
        description="Pack several samples per row with no attention across them; default: sft.packing "
        "(for a named dataset: the sft.packing of the datagen config that made it).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> FinetuneDataConfig:
        if (self.dataset is None) == (self.sft is None):
            raise ValueError(
                f"data has dataset={self.dataset!r} and sft={'set' if self.sft else None}; give exactly one: "
                "dataset (made by datagen) or sft (prepared here)"
            )
        return self

    @property
    def use_packing(self) -> bool:
        if self.packing is not None:
            return self.packing
        return bool(self.sft and self.sft.packing)


class FinetuneTrainConfig(Section):
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps to train for; or give epochs.")
    epochs: float | None = Field(
        None, gt=0, description="Passes over the training samples; or give max_steps."
    )
    micro_batch_size: int = Field(
        4,
        ge=1,
        description="Rows per GPU per forward pass; under objective dpo, orpo or simpo, preference pairs, each two "
        "rows (its chosen and its rejected answer).",
    )
    grad_accum_steps: int = Field(4, ge=1, description="Micro-batches accumulated per optimizer step.")
    lr: float | None = Field(  # 0 refused as pretrain's (config/pretrain.py): a paid run that changes nothing
        None,
        gt=0,
        description="Peak learning rate; default 2e-4 for lora and qlora, 2e-5 for full (as axolotl's and "
        "LLaMA-Factory's examples: every weight moving at an adapter's 2e-4 forgets much of the base model), "
        "5e-6 for objective dpo, orpo or simpo (1e-6 with method full).",
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate as a fraction of lr.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Share of the steps spent in linear warmup.")
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW weight decay, on weight matrices only (not on norms or biases)."
    )
    # beta1 0 is Adam without momentum (RMSprop with bias correction), which GAN recipes use and torch's and
    # bitsandbytes' AdamW take; beta2 0 would scale each step by its own gradient alone.
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1 (0: no momentum).")
    beta2: float = Field(0.999, gt=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0 disables).")
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"] = Field(
        "adamw",
        description="'adamw' (torch, fused on CUDA), or bitsandbytes' adamw_8bit, paged_adamw_8bit, "
        "paged_adamw_32bit (paged: optimizer state spills to CPU memory instead of running out of GPU memory).",
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="'auto' is bf16 on a GPU that supports it, fp32 on CPU."
    )
    parallel: Literal["auto", "ddp", "fsdp"] = Field(
        "auto",
        description="How several GPUs share a full finetune: 'ddp' replicates the model; 'fsdp' shards weights, "
        "gradients and optimizer state (FSDP2, sharded checkpoints); 'auto' is fsdp for several GPUs and 1B "
        "parameters or more with train.optimizer=adamw, else ddp (bitsandbytes' optimizers cannot step sharded "
        "parameters). LoRA and QLoRA always replicate (their trained state is small).",
    )
    gradient_checkpointing: bool = Field(
        True,
        description="Recompute activations in the backward pass: much less memory, about 30% more compute.",
    )
    seed: int = Field(
        42, ge=0, le=MAX_SEED, description="Seed for adapter init, dropout and data order (0 to 2**32-1)."
    )
    eval_every: int = Field(
        100, ge=0, description="Evaluate on the validation split every N steps (0: never)."
    )
    eval_batches: int | None = Field(
        None, ge=1, description="Micro-batches per evaluation; default: the whole validation split."
    )
    early_stopping_patience: int = Field(
        0,
        ge=0,
        description="Stop after this many evals without improvement (0: never stop early); needs eval_every "
        "and a validation split (sft.val_ratio).",
    )
    early_stopping_metric: Literal["eval_loss", "cer", "wer", "cer_normalized", "wer_normalized"] = Field(
        "eval_loss",
        description="What early stopping and checkpoint.keep_best rank by, lower is better: the eval loss, or a "
        "generation metric (needs generation_eval.every_evals >= 1; measured on those evals only).",
    )
    early_stopping_min_delta: float = Field(
        0.0, ge=0, description="An eval improves only if it beats the best by more than this."
    )
    worst_samples: int = Field(
        10,
        ge=0,
        description="Write this many highest-loss eval samples to eval/step-N.worst.jsonl each eval.",
    )
    log_every: int = Field(10, ge=1, description="Log a line every N steps.")
    cpu_threads: int | None = Field(None, ge=1, description="torch threads on CPU; default: torch's choice.")

    @model_validator(mode="after")
    def _one_length(self) -> FinetuneTrainConfig:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError(
                f"train has max_steps={self.max_steps} and epochs={self.epochs}; give exactly one of them"
            )
        return self

    @model_validator(mode="after")
    def _early_stopping_can_act(self) -> FinetuneTrainConfig:
        if self.early_stopping_patience and not self.eval_every:
            raise ValueError(
                f"train.early_stopping_patience={self.early_stopping_patience} never acts with train.eval_every=0 "
                "(no evals to compare); set eval_every to how often to evaluate, or early_stopping_patience to 0"
            )
        return self


class GenerationEvalConfig(Section):
    """Greedy answers to validation prompts, scored by CER, WER and exact match (train/generation_eval.py)."""

    every_evals: int = Field(
        0, ge=0, description="Generate on every this many-th eval (1: every eval; 0: never)."
    )
    max_samples: int = Field(
        32, ge=1, description="Validation samples answered per generation eval (the first N)."
    )
    max_new_tokens: int = Field(128, ge=1, description="Longest answer generated, in tokens.")
    worst_samples: int = Field(
        10, ge=0, description="Write this many highest-CER samples to eval/step-N.worst-cer.jsonl."
    )


class TrackingConfig(Section):
    wandb_project: str = Field(
        "trainpod",
        min_length=1,
        description="W&B project, used when WANDB_API_KEY is set (or WANDB_MODE=offline).",
    )
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); default: the key's own.")


class FinetuneExportConfig(Section):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights dtype of a full finetune's export; 'auto': bfloat16 for bf16 runs, else float32. "
        "Adapters keep their training dtype.",
    )
    weights: Literal["last", "best"] = Field(
        "last",
        description="Which step's weights the export holds: 'last', the final step's (as HF's Trainer and "
        "axolotl export); 'best', the kept checkpoint with the best eval (by train.early_stopping_metric, lower "
        "is better; needs train.eval_every, checkpoint.keep_best >= 1, checkpoint.every_steps dividing eval_every "
        "and a validation split). The export's manifest.json names the step (`weights`).",
    )


DEFAULT_LR = {"qlora": 2e-4, "lora": 2e-4, "full": 2e-5}  # train.lr when the config gives none
# The preference objectives': LLaMA-Factory's LoRA DPO examples' 5e-6, and for every weight SimPO's and TRL's 1e-6
# (the ORPO and SimPO papers: 5e-7 to 8e-6). An adapter's SFT 2e-4 moves the policy so far in a few steps that the
# loss saturates and the answers degrade.
PREFERENCE_DEFAULT_LR = {"qlora": 5e-6, "lora": 5e-6, "full": 1e-6}


def fsdp_needs_full(method: str) -> str:
    return (
        f"train.parallel=fsdp shards full finetuning; method {method} trains a small adapter that every GPU "
        "holds whole. Set train.parallel=ddp (or auto), or method: full"
    )


FSDP_WITHOUT_GENERATION = (
    "generation_eval runs on rank 0 alone, and a sharded (train.parallel=fsdp) model needs every rank for each "
    "forward: set generation_eval.every_evals=0, or train.parallel=ddp"
)


class FinetuneConfig(Section):
    name: str = Field(
        pattern=NAME_PATTERN,
        description="Run name: the run lives in runs/<name>/ unless TRAINPOD_RUN says otherwise.",
    )
    base_model: BaseModelConfig
    method: Literal["qlora", "lora", "full"] = Field(
        "qlora",
        description="'qlora': LoRA on a 4-bit NF4 base (bitsandbytes); 'lora': LoRA on a 16/32-bit base; "
        "'full': every weight trains.",
    )
    objective: Literal["sft", "dpo", "orpo", "simpo"] = Field(
        "sft",
        description="'sft': learn the answers (supervised finetuning). On preference data (sft.preference), learn "
        "to prefer each pair's chosen answer to its rejected one: 'dpo' (against a reference model, the base with "
        "the adapters off: method qlora or lora), 'orpo' (SFT on the chosen answer plus an odds-ratio term) or "
        "'simpo' (length-normalised rewards and a target margin); orpo and simpo need no reference, so any method.",
    )
    dpo: DpoSettings = DpoSettings()
    orpo: OrpoSettings = OrpoSettings()
    simpo: SimpoSettings = SimpoSettings()
    lora: LoraSettings = LoraSettings()
    quantization: QuantizationSettings = QuantizationSettings()
    data: FinetuneDataConfig
    train: FinetuneTrainConfig
    generation_eval: GenerationEvalConfig = GenerationEvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig(every_steps=100)
    tracking: TrackingConfig = TrackingConfig()
    export: FinetuneExportConfig = FinetuneExportConfig()

    @model_validator(mode="after")
    def _default_lr_of_the_method(self) -> FinetuneConfig:
        if self.train.lr is None:
            self.train.lr = (
                PREFERENCE_DEFAULT_LR[self.method] if self.is_preference else DEFAULT_LR[self.method]
            )
        return self

    @property
    def is_preference(self) -> bool:
        """Whether the objective trains on preference pairs (dpo, orpo, simpo)."""
        return self.objective in PREFERENCE_OBJECTIVES

    @model_validator(mode="after")
    def _preference_objective_can_run(self) -> FinetuneConfig:
        """What the preference objectives here do not do, refused at load (exit 2, nothing written); preference data
        and the objective must agree (a named dataset's kind is known once it is read: workloads/preference.py).
        Before the validators of the SFT settings, whose fixes (a generation metric's generation_eval, fsdp's method:
        full) are what DPO refuses: the user went back and forth between the two refusals."""
        objective = self.objective
        sft = getattr(self.data, "sft", None)  # finetune-vlm's data has none
        if sft is not None and sft.preference != self.is_preference:
            raise ValueError(
                "data.sft.preference=true holds pairs of a chosen and a rejected answer, which only objective dpo, "
                "orpo or simpo trains on (sft would learn the rejected answers too); set objective: dpo, orpo or simpo"
                if sft.preference
                else f"objective={objective} trains on pairs of a chosen and a rejected answer; set "
                "data.sft.preference: true and give each dataset's chosen and rejected columns"
            )
        for section in PREFERENCE_OBJECTIVES:
            if section != objective and section in self.model_fields_set:
                raise ValueError(
                    f"{section}: {getattr(self, section).model_dump(mode='json')} applies to objective={section}, "
                    f"and this config trains objective={objective}; set objective: {section}"
                    f"{' (with preference data)' if not self.is_preference else ''}, or remove the {section} section"
                )
        if not self.is_preference:
            return self
        if objective == "dpo" and self.method == "full":
            raise ValueError(
                "objective=dpo compares the policy with a reference model, which is the base with the LoRA "
                "adapters off; method full would need a second whole copy of the model, which trainpod does not "
                "keep. Set method: lora (or qlora), or objective: orpo or simpo, which need no reference"
            )
        if self.train.parallel == "fsdp":
            raise ValueError(
                f"train.parallel=fsdp shards a full finetune's state, and objective={objective} runs each pair's "
                "two sequences through one replicated model; set train.parallel: ddp (or auto)"
            )
        if self.data.packing:
            raise ValueError(
                f"objective={objective} scores each chosen and rejected answer as a whole sequence; "
                "data.packing=true packs samples for SFT. Remove data.packing (or set it to false)"
            )
        every = self.generation_eval.every_evals
        if self.train.early_stopping_metric != "eval_loss":
            raise ValueError(
                f"train.early_stopping_metric={self.train.early_stopping_metric!r} is measured by generation, which "
                f"objective={objective} does not run (its evals score the validation pairs by the {objective} "
                "loss, eval_loss); set train.early_stopping_metric: eval_loss"
                + (", and generation_eval.every_evals=0" if every else "")
            )
        if every:
            raise ValueError(
                f"generation_eval.every_evals={every} scores answers against one reference, and objective="
                f"{objective}'s validation pairs are scored by its loss and the reward accuracy instead; set "
                "generation_eval.every_evals=0"
            )
        return self

    @model_validator(mode="after")
    def _ranked_metric_is_measured(self) -> FinetuneConfig:
        metric = self.train.early_stopping_metric
        if metric != "eval_loss" and not self.generation_eval.every_evals:
            raise ValueError(
                f"train.early_stopping_metric={metric!r} is measured by generation, which is off; set "
                "generation_eval.every_evals to 1 (or k: every k-th eval), or rank by eval_loss"
            )
        return self

    @model_validator(mode="after")
    def _generation_eval_can_run(self) -> FinetuneConfig:
        """It runs at evals only (every every_evals-th): with none, a run configured to generate never did, silently."""
        every = self.generation_eval.every_evals
        if every and not self.train.eval_every:
            raise ValueError(
                f"generation_eval.every_evals={every} never runs with train.eval_every=0 (it generates at evals); "
                "set train.eval_every to how often to evaluate, or generation_eval.every_evals to 0"
            )
        return self

    @model_validator(mode="after")
    def _best_export_can_be_found(self) -> FinetuneConfig:
        problem = self.checkpoint.best_export_problem(self.export.weights, self.train.eval_every)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _fsdp_can_run_it(self) -> FinetuneConfig:
        """What train.parallel=fsdp cannot do, refused at load (exit 2, nothing written), not once the base
        model has downloaded and loaded on a paid GPU. `auto` picks fsdp only where it can
        (workloads/finetune.py), but for the generation eval, checked there."""
        if self.train.parallel != "fsdp":
            return self
        if self.method != "full":
            raise ValueError(fsdp_needs_full(self.method))
        if self.train.optimizer not in SHARDABLE_OPTIMIZERS:
            raise ValueError(unshardable_optimizer(self.train.optimizer))
        if self.generation_eval.every_evals:
            raise ValueError(FSDP_WITHOUT_GENERATION)
        return self

    @property
    def ranked_metric(self) -> str:
        """The metric name as logged: eval_loss, eval_cer, ..."""
        metric = self.train.early_stopping_metric
        return metric if metric == "eval_loss" else f"eval_{metric}"
