"""`trainpod run finetune`: QLoRA, LoRA or full finetuning of an existing model on SFT data.

    TRAINPOD_CONFIG=configs/finetune/tiny.yaml TRAINPOD_VOLUME=./demo-volume trainpod run finetune

The loop, commits and the stop protocol are train/trainer.py's, as for pretraining. What is
finetuning's own: the base model (a folder or a hub id, 4-bit NF4 for QLoRA), peft's LoRA on top,
SFT batches (padded or packed), checkpoints of the trainable tensors only, per-sample eval losses,
early stopping, W&B, and the export: a PEFT adapter (or a full HF model) with the tokenizer and a
training summary.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoTokenizer

from trainpod import atomic
from trainpod.card import MODEL_CARD, adapter_model_card, finetuned_model_card
from trainpod.checkpoint.tree import load_state_file
from trainpod.config.finetune import FSDP_WITHOUT_GENERATION, FinetuneConfig, fsdp_needs_full
from trainpod.context import RunContext
from trainpod.errors import InputError
from trainpod.preemption import WorkAbandoned
from trainpod.sft import IGNORE_INDEX, SftBatches, eval_batches, load_sft, prepare_sft, sft_cache_key, sft_key
from trainpod.sft.dataset import is_preference, read_manifest
from trainpod.sft.packing_probe import refuse_packing_that_leaks
from trainpod.train import distributed as D
from trainpod.train.base_model import (
    load_4bit,
    load_model,
    pinned_commit,
    refuse_packing_that_mixes_samples,
    resolve_base_model,
    stored_quantization,
    supported_attention,
)
from trainpod.train.batches import accumulation_note, rescaled_accumulation, to_device
from trainpod.train.export import DTYPES, carry_training_template, export_hf, write_export_manifest
from trainpod.train.loss import (
    CausalLMLoss,
    counts_items_in_batch,
    fits_chunked_loss,
    shift_labels,
    summed_sft_loss,
)
from trainpod.train.memory import checkpoint_bytes
from trainpod.train.model import autocast_dtype, resolve_attention
from trainpod.train.optim import build_optimizer, decay_groups, in_groups_of
from trainpod.train.parallel import resolve_parallel
from trainpod.train.reporting import RunReporter
from trainpod.train.schedule import cosine_with_warmup
from trainpod.train.sharding import (
    decoder_layers,
    gathered_copy,
    gathered_root,
    has_shards,
    load_full_into,
    load_full_weights_into,
    load_sharded,
    load_sharded_weights,
    local_value,
    require_process_group,
    shard_model,
    sharded_state,
)
from trainpod.train.state import load_optimizer_state
from trainpod.train.tracking import WandbTracker, check_wandb_installed, wandb_wanted
from trainpod.train.trainer import EvalInterrupted, StepResult, Trainer, train_and_export
from trainpod.volume import SFT_DATA_PIN, read_cache_pin, write_cache_pin

log = logging.getLogger(__name__)

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "labels")
BASE_MODEL_PIN = "base_model.json"  # runs/<run>/: the hub commit of the base model the run trains on


def disk_estimate(config: FinetuneConfig) -> int | None:
    return None  # the base model's size is known only once it is resolved (it may still be on the hub)


def preflight(ctx: RunContext, config: FinetuneConfig) -> None:
    """Fail with exit 2 before anything is written: the base model and a named dataset must exist, and
    wandb must be installed where the environment asks for tracking."""
    check_wandb_installed()
    resolve_base_model(config.base_model, ctx.volume, download=False)
    if config.data.dataset is not None:
        _dataset_dir(ctx, config.data.dataset)
    _check_validation_for_evals(ctx, config)


def _check_validation_for_evals(ctx: RunContext, config: FinetuneConfig) -> None:
    """Early stopping with no validation split never stops: a run paid to its last step, silently; a best
    export has no checkpoint scored, and exported the last step's weights after the whole run."""
    needed_by = {}  # each setting that needs the split: the fix that drops the need
    if config.train.early_stopping_patience:
        patience = config.train.early_stopping_patience
        needed_by[f"train.early_stopping_patience={patience}"] = "set early_stopping_patience to 0"
    if config.export.weights == "best":
        needed_by["export.weights=best"] = "export.weights=last"
    if not needed_by:
        return
    if config.data.sft is not None:
        held_out = config.data.sft.val_ratio > 0
        fix = "set data.sft.val_ratio (0.02, say)"
    else:
        manifest = atomic.read_json(_dataset_dir(ctx, config.data.dataset) / "manifest.json")
        held_out = manifest.get("counts", {}).get("val_samples", 1) > 0
        fix = f"prepare {config.data.dataset} again with sft.val_ratio > 0 in its datagen config"
    if not held_out:
        raise InputError(
            f"{' and '.join(needed_by)} needs a validation split, and the data has none; {fix}, or "
            f"{' and '.join(needed_by.values())}"
        )


def _dataset_dir(ctx: RunContext, name: str) -> Path:
    path = Path(name) if os.path.isabs(name) else ctx.volume.dataset(name)
    if not (path / "manifest.json").is_file():
        raise InputError(
            f"data.dataset={name!r}: {path}/manifest.json does not exist; make it with `trainpod run datagen` "
            "and a config with an `sft:` section (e.g. configs/datagen/sft-tiny.yaml), or give data.sft instead"
        )
    return path


def _warn_if_tokenized_by_an_earlier_trainpod(folder: Path, name: str) -> None:
    """A datagen dataset is the user's to rebuild (a run in progress on it resumes exactly on it), so its old
    labels are a warning, where finetune's own cache/sft is tokenized anew for a new run."""
    manifest = read_manifest(folder)
    if manifest is not None and "encoding" not in manifest:
        log.warning(
            "data.dataset=%s was tokenized by an earlier trainpod, which under Qwen2's and Llama 3's tokenizers "
            "left an answer's first newline untrained; run its datagen config again under another name (or after "
            "deleting %s) for a new run to train on it",
            name,
            folder,
        )


# ------------------------------------------------------------------------------- trainer
class Finetuner(Trainer):
    model_inputs = MODEL_INPUTS  # the batch keys the model's forward takes

    def __init__(self, ctx: RunContext, config: FinetuneConfig, dist: D.DistContext):
        t = config.train
        super().__init__(ctx, config, config.checkpoint, t.max_steps or 1, t.log_every, t.eval_every, dist)
        self.train_cfg = t
        self.grad_accum_steps = t.grad_accum_steps  # rescaled when a checkpoint of another rank count resumes
        self.method = config.method
        self.improvement_threshold = t.early_stopping_min_delta
        self.ranked_metric = config.ranked_metric
        self.tracker_run_id: str | None = None
        # Rank 0 pins a hub id's commit in the run folder at the first start; the others, and every resume, read it.
        self.base_pin = ctx.run.root / BASE_MODEL_PIN
        self.base_dir = self._on_main_first(
            lambda: resolve_base_model(config.base_model, ctx.volume, pin=self.base_pin)
        )
        self._refuse_full_finetune_of_quantized()
        self.base_attention = supported_attention(self.base_dir, config.base_model)
        if config.data.use_packing:  # before the SFT data is prepared; a datagen dataset's own packing: later
            refuse_packing_that_mixes_samples(self.base_dir, self.packing_asked_by)
        self.attention = self._resolve_attention()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.base_dir), local_files_only=True)
        self._setup_data()
        self._check_held_out_samples()
        with self.abandoning_setup():  # the model's load, minutes for a large one
            self._setup_model()
        self._set_max_steps()

    def _refuse_full_finetune_of_quantized(self) -> None:
        """A base saved quantized trains only its unquantized weights under method full (embeddings, norms, head)
        and fails the export of the rest at the end (NotImplementedError): refused before data and model load."""
        quantized = stored_quantization(self.base_dir)
        if self.method == "full" and quantized:
            raise InputError(
                f"method full trains every weight, but base_model {self.cfg.base_model.path!r} stores its weights "
                f"quantized ({quantized}, its config.json's quantization_config), which neither train nor export; "
                f"use method {'qlora or lora' if quantized.startswith('bitsandbytes') else 'lora'} on it, or point "
                "base_model.path at the unquantized model"
            )

    def _resolve_attention(self) -> str:
        return resolve_attention(
            self.cfg.base_model.attention,
            self.dist.device,
            "base_model.attention",
            supported=self.base_attention,
        )

    def _set_max_steps(self) -> None:
        """From train.max_steps, or train.epochs over the optimizer steps an epoch holds (the same on any
        rank count once the accumulation is rescaled to the checkpoint's)."""
        t = self.train_cfg
        steps_per_epoch = max(self.batches.steps_per_epoch // self.grad_accum_steps, 1)
        self.max_steps = t.max_steps or math.ceil(t.epochs * steps_per_epoch)
        self.warmup_steps = round(t.warmup_ratio * self.max_steps)

    def _on_main_first(self, work: Any) -> Any:
        """Run `work` on rank 0, then on the others (downloads and caches are made once)."""
        result = work() if self.dist.is_main else None
        D.wait_for_main(self.dist)  # a 70B download, a large SFT data build: past a collective's timeout
        return result if self.dist.is_main else work()

    # ------------------------------------------------------------------------------- setup
    def _setup_data(self) -> None:
        data_cfg = self.cfg.data
        if data_cfg.dataset is not None:
            folder = _dataset_dir(self.ctx, data_cfg.dataset)
            _warn_if_tokenized_by_an_earlier_trainpod(folder, data_cfg.dataset)
        else:
            folder = self._on_main_first(self._prepare_sft_cache)
        self.data = load_sft(folder)
        self._check_same_tokenizer(folder)
        self._check_data_kind(folder)
        if self.data.manifest["settings"].get("train_on_prompt") and self.cfg.generation_eval.every_evals:
            # Every token but the first is trained: the stored mask no longer tells prompt from answer.
            raise InputError(
                f"generation_eval answers each validation prompt, but the SFT data at {folder} was made with "
                "train_on_prompt=true, so its prompts and answers cannot be told apart; set "
                "generation_eval.every_evals=0, or train_on_prompt=false"
            )
        self.max_len = int(self.data.manifest["settings"]["cutoff_len"])
        packing = data_cfg.use_packing
        if data_cfg.packing is None and data_cfg.dataset is not None:  # the datagen config's sft.packing
            packing = bool(self.data.manifest.get("packing", False))
            if packing:
                refuse_packing_that_mixes_samples(self.base_dir, self.packing_asked_by)
        self.batches = self._training_batches(packing)

    def _check_data_kind(self, folder: Path) -> None:
        """Preference pairs train under a preference objective only: SFT on them would learn the rejected answers too."""
        if is_preference(self.data.manifest):
            raise InputError(
                f"the dataset at {folder} holds preference pairs (made with sft.preference=true): a chosen and a "
                "rejected answer to each prompt, which objective=sft would both learn; set objective: dpo, orpo or "
                "simpo, or train on a dataset made without preference"
            )

    def _training_batches(self, packing: bool) -> SftBatches:
        t = self.train_cfg
        return SftBatches(
            self.data.train,
            t.micro_batch_size,
            self.max_len,
            packing,
            t.seed,
            self.dist.rank,
            self.dist.world_size,
            self.data.pad_id,
            # flash-attention-2 reads packed samples from one flattened row; SDPA/eager from any shape,
            # and rows keep their attention cost at rows x max_len^2.
            flatten_packed=self.attention == "flash_attention_2",
            pin_memory=self.dist.device.type == "cuda",
            grad_accum_steps=t.grad_accum_steps,
        )

    def _prepare_sft_cache(self) -> Path:
        """cache/sft/<key> of data.sft, keyed by the data files' contents; a resume takes the folder its first
        start pinned in runs/<run>/sft_data.json while it is complete and of the same settings and tokenizer,
        so it trains on the samples it started on though the files were edited or removed since."""
        sft, volume = self.cfg.data.sft, self.ctx.volume
        pin = self.ctx.run.root / SFT_DATA_PIN
        settings_key = sft_key(sft, self.base_dir)
        pinned = read_cache_pin(pin)
        if pinned.get("settings_key") == settings_key:
            folder = volume.cache() / "sft" / str(pinned.get("key"))
            if read_manifest(folder) is not None:
                log.info("SFT data: %s, tokenized at this run's first start (%s)", folder, pin.name)
                return folder
        if pinned.get("settings_key") == sft_key(sft, self.base_dir, encoding=None):
            folder = volume.cache() / "sft" / str(pinned.get("key"))
            if read_manifest(folder) is not None and self.store.committed():
                # Its steps so far trained on these samples in this order; others (a newline token more here and
                # there) would move every later row of its epoch. Before its first checkpoint it tokenizes anew.
                log.warning(
                    "SFT data: %s was tokenized by an earlier trainpod, which under Qwen2's and Llama 3's "
                    "tokenizers left an answer's first newline untrained; this run resumes on it exactly as it "
                    "began, and a new run name tokenizes the data anew",
                    folder,
                )
                return folder
        folder = volume.cache() / "sft" / sft_cache_key(sft, self.base_dir, volume.root)
        prepare_sft(sft, self.base_dir, folder, volume.root, self.ctx.watch, field="data.sft")
        if self.dist.is_main:
            write_cache_pin(pin, settings_key, folder.name)
        return folder

    @property
    def packing_asked_by(self) -> str:
        """The setting that asked for packing, as a refusal names it."""
        data = self.cfg.data
        if data.packing is not None:
            return "data.packing=true"
        if data.dataset is not None:
            return f"data.dataset={data.dataset} (made with sft.packing=true)"
        return "data.sft.packing=true"

    def _check_held_out_samples(self) -> None:
        """Early stopping needs validation samples, and a val_ratio > 0 may hold out none of a small dataset
        (its hash picks no row): the run then never evaluated, never stopped early and trained, silently, to
        its last paid step. Known only once the data is split, so after its preparation."""
        patience = self.train_cfg.early_stopping_patience
        if patience and not len(self.data.val):
            rows, unit = self.split_rows
            raise InputError(
                f"train.early_stopping_patience={patience} needs validation {unit}s, and {self.val_ratio_field} "
                f"held out none of the {rows} {unit}s; raise {self.val_ratio_field} (a share of at least "
                f"1/{rows} holds out one {unit}), or set early_stopping_patience to 0"
            )

    @property
    def split_rows(self) -> tuple[int, str]:
        """The training rows val_ratio picked from (its hash picks rows), and what one is: a sample."""
        return len(self.data.train), "sample"

    @property
    def cutoff_len_field(self) -> str:
        """The setting that cut the samples, with its value."""
        if self.cfg.data.sft is not None:
            return f"data.sft.cutoff_len={self.max_len}"
        return f"the sft.cutoff_len={self.max_len} of the datagen config that made {self.cfg.data.dataset}"

    def _longest_sample(self) -> int:
        """Tokens of the longest sample a training or eval batch holds (cut at cutoff_len)."""
        lengths = [int(split.lengths.max(initial=0)) for split in (self.data.train, self.data.val)]
        return min(max(lengths), self.max_len)

    @property
    def val_ratio_field(self) -> str:
        """The setting that holds samples out for validation."""
        if self.cfg.data.sft is not None:
            return f"data.sft.val_ratio={self.cfg.data.sft.val_ratio}"
        return f"the sft.val_ratio of the datagen config that made {self.cfg.data.dataset}"

    def _check_same_tokenizer(self, folder: Path) -> None:
        """A dataset tokenized with another tokenizer trains garbage; the vocabulary and eos must agree.

        (Not the files' hash: the same tokenizer saved again, e.g. into an export, has other bytes.)
        """
        recorded = self.data.manifest["tokenizer"]
        base = self.tokenizer
        if (recorded["vocab_size"], recorded["eos_id"]) != (len(base), base.eos_token_id):
            raise InputError(
                f"the SFT dataset at {folder} was tokenized with the tokenizer at {recorded.get('path')} "
                f"({recorded['vocab_size']} tokens, eos {recorded['eos_id']}), not the base model's "
                f"({len(base)} tokens, eos {base.eos_token_id}); make the dataset with the base model's folder as "
                "its tokenizer, or give data.sft to tokenize here"
            )

    def _setup_model(self) -> None:
        from peft import prepare_model_for_kbit_training

        t, device = self.train_cfg, self.dist.device
        self.autocast_dtype = autocast_dtype(t.precision, device)
        attention = self.attention
        # Frozen base weights in bf16 on a GPU that has it; trained weights (full) and adapters in fp32.
        base_dtype = torch.float32 if self.method == "full" or self.autocast_dtype is None else torch.bfloat16
        torch.manual_seed(t.seed)  # the LoRA init and everything after it follow the seed
        if self.method == "qlora":
            self.compute_dtype = self._compute_dtype()
            model = self._load_4bit(attention)
            model = prepare_model_for_kbit_training(
                model,
                use_gradient_checkpointing=t.gradient_checkpointing,
                gradient_checkpointing_kwargs={"use_reentrant": False},
            )
        else:
            model = self._load_model(base_dtype, attention)
            if t.gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                if self.method == "lora":
                    model.enable_input_require_grads()  # checkpointed blocks need an input that wants grads
        # The KV cache is for generation; training with it only costs memory. A VLM's language model reads
        # its text_config's (Qwen2-VL, Llava), which the top config's does not reach.
        for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            config.use_cache = False
        self._check_vocabulary(model)
        self._check_positions(model)
        if self.method != "full":
            model = self._with_adapters(model)
        else:
            self._freeze_for_full(model)
        # refuse_packing_that_mixes_samples knew some types; this measures the model as it trains (before FSDP
        # shards it, so each rank runs its whole copy alone)
        if self.batches.packing:
            refuse_packing_that_leaks(
                model, self.batches, device, self._autocast, self.packing_asked_by, attention
            )
        self.model = model
        self.n_params = sum(p.numel() for p in model.parameters())
        self.chunked_loss = fits_chunked_loss(model)
        # Else (remote code) the step's loss is taken from the model's logits.
        self.own_loss_counts_items = counts_items_in_batch(model)
        # The module a step runs: the model, with the chunked loss where it gives the model's own loss.
        self.loss_module: torch.nn.Module = CausalLMLoss(model) if self.chunked_loss else model
        self.parallel = self._parallel()
        if self.parallel == "fsdp":  # before the optimizer: it steps the shards
            require_process_group(self.parallel)
            bf16 = self.autocast_dtype == torch.bfloat16
            shard_model(decoder_layers(model), self.loss_module, device, bf16)
        self.trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.n_trainable = sum(p.numel() for p in self.trainable.values())
        self.optimizer = build_optimizer(
            t.optimizer,
            decay_groups(model, t.weight_decay),
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            device=device,
        )
        log.info(
            "finetune: method %s, %s of %s parameters train, attention %s, precision %s, device %s, %d rank(s) "
            "(%s), %s loss",
            self.method,
            f"{self.n_trainable:,}",
            f"{self.n_params:,}",
            attention,
            self.autocast_dtype or "fp32",
            device,
            self.dist.world_size,
            self.parallel,
            "chunked" if self.chunked_loss else "the model's own",
        )

    def _parallel(self) -> str:
        """DDP or FSDP (train/sharding.py); FSDP shards full finetuning only."""
        requested = self.train_cfg.parallel
        if self.method != "full":
            if requested == "fsdp":  # refused at load already (config/finetune.py); a config built in code
                raise InputError(fsdp_needs_full(self.method))
            return "ddp"
        parallel = resolve_parallel(requested, self.dist.world_size, self.n_params, self.train_cfg.optimizer)
        if parallel == "fsdp" and self.cfg.generation_eval.every_evals:  # `auto` chose fsdp
            raise InputError(FSDP_WITHOUT_GENERATION)
        return parallel

    def _load_4bit(self, attention: str) -> torch.nn.Module:
        cfg = self.cfg
        return load_4bit(
            self.base_dir, cfg.base_model, cfg.quantization, self.compute_dtype, attention, self.dist.device
        )

    def _load_model(self, dtype: torch.dtype, attention: str) -> torch.nn.Module:
        return load_model(self.base_dir, self.cfg.base_model, dtype, attention, self.dist.device)

    def _with_adapters(self, model: torch.nn.Module) -> torch.nn.Module:
        """peft's LoRA on `model`; a name in lora.target_modules that matches no module is a config error
        (exit 2): peft drops it without a word while another name matches, so a typo (o_prj) trained a run
        without the adapters asked for there."""
        from peft import get_peft_model
        from peft.utils.error import NoMatchingPeftModuleError

        targets = self.cfg.lora.target_modules
        if targets != "all-linear":
            # peft's rule for a list: a module's full name, or its name's end after a dot
            modules = [name for name, _ in model.named_modules()]
            unmatched = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in modules)]
            if unmatched:
                raise self._unmatched_targets(model, f"{', '.join(unmatched)} names no module")
        try:
            return get_peft_model(model, self._peft_config(model))
        except NoMatchingPeftModuleError:
            raise self._unmatched_targets(model, "names no module") from None

    def _unmatched_targets(self, model: torch.nn.Module, what: str) -> InputError:
        names = sorted(
            {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        return InputError(
            f"lora.target_modules={self.cfg.lora.target_modules!r}: {what} of base_model "
            f"{self.cfg.base_model.path!r}; its linear layers are: {', '.join(names)}. Pick from those, "
            "or use all-linear"
        )

    def _peft_config(self, model: torch.nn.Module):
        from trainpod.train.lora import peft_lora_config

        return peft_lora_config(self.cfg.lora)

    def _freeze_for_full(self, model: torch.nn.Module) -> None:
        """What a full finetune leaves frozen: nothing for a text model."""

    def _compute_dtype(self) -> torch.dtype:
        name = self.cfg.quantization.compute_dtype
        if name == "auto":
            return self.autocast_dtype or torch.float32
        return DTYPES[name]

    def _check_positions(self, model: torch.nn.Module) -> None:
        positions = getattr(model.config, "max_position_embeddings", None)
        if not positions or self.max_len <= positions:
            return
        longest = self._longest_sample()
        # A table of positions (GPT-2's) cannot be indexed past; RoPE runs on, untrained beyond it.
        if longest > positions and _learned_positions(model, positions):
            raise InputError(
                f"{self.cutoff_len_field}: samples of up to {longest} tokens, but base_model "
                f"{self.cfg.base_model.path!r} has learned position embeddings for {positions} positions only, "
                "and a longer sample fails its step (IndexError; on a GPU a device-side assert); set the "
                f"cutoff_len to {positions} or lower"
            )
        log.warning(
            "cutoff_len %d exceeds the base model's max_position_embeddings %d: positions beyond it were never "
            "trained; lower the SFT cutoff_len unless the model is meant to extrapolate (RoPE scaling)",
            self.max_len,
            positions,
        )

    def _check_vocabulary(self, model: torch.nn.Module) -> None:
        rows = model.get_input_embeddings().num_embeddings
        needed = int(self.data.manifest["tokenizer"]["vocab_size"])
        if needed > rows:
            raise InputError(
                f"the tokenizer has {needed} tokens but base_model {self.cfg.base_model.path!r} embeds only {rows}; "
                "use the tokenizer the model was trained with (tokens added to it need resized embeddings)"
            )

    def wrap_for_training(self) -> torch.nn.Module:
        """The model with the chunked loss (train/loss.py) where it gives the model's own loss: a
        known decoder with a plain head; else the model, whose loss upcasts every logit to fp32.
        Under DDP when several ranks replicate it (FSDP sharded it in place already)."""
        if not self.dist.distributed or self.parallel == "fsdp":
            return self.loss_module
        return DistributedDataParallel(
            self.loss_module,
            device_ids=[self.dist.local_rank] if self.dist.device.type == "cuda" else None,
            gradient_as_bucket_view=True,  # gradients live in the buckets: no second fp32 copy
        )

    def make_reporter(self, start_step: int) -> RunReporter:
        tracker = None
        if self.dist.is_main and wandb_wanted():
            tracking = self.cfg.tracking
            tracker = WandbTracker(
                self.ctx.run,
                tracking.wandb_project,
                tracking.wandb_entity,
                self.tracker_run_id,
                self.cfg.model_dump(mode="json"),
            )
            self.tracker_run_id = tracker.run_id
        return RunReporter(
            self.ctx.run, self.max_steps, start_step, enabled=self.dist.is_main, tracker=tracker
        )

    # ------------------------------------------------------------------------- checkpoints
    def sharded_state(self) -> dict[str, Any] | None:
        return sharded_state(self.model, self.optimizer) if self.parallel == "fsdp" else None

    def checkpoint_files(self) -> dict[str, Any]:
        if self.parallel == "fsdp":
            return {}  # every rank wrote its shards (sharded_state)
        # Only what trains: the adapter (or, for full, every weight); the frozen base is on disk already.
        return {
            "trainable.safetensors": dict(self.trainable),
            "optimizer.safetensors": self.optimizer.state_dict(),
        }

    def load_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        self._load_trained(path)
        groups = self.optimizer.param_groups
        if len(groups) > 1 and groups[-1]["weight_decay"] and self.dist.is_main:  # the group of norms, biases
            log.warning(
                "%s was written with weight decay on every trained weight, norms and biases too "
                "(weight_decay %s, a trainpod before they left it); the run keeps it to resume exactly, and "
                "a new run name trains norms and biases without weight decay",
                path.name,
                groups[-1]["weight_decay"],
            )

    def _load_trained(self, path: Path) -> None:
        """A sharded checkpoint (FSDP, any rank count) or the trainable tensors, into either layout."""
        if has_shards(path):
            load_sharded(self.model, self.optimizer, path)
            return
        tensors = safetensors.torch.load((path / "trainable.safetensors").read_bytes())
        optimizer_state = in_groups_of(
            self.optimizer,
            load_state_file(path, "optimizer", self.dist.device),
            list(self.trainable.values()),
        )
        if self.parallel == "fsdp":
            load_full_into(self.model, self.optimizer, tensors, optimizer_state, aliases=[])
            return
        missing = sorted(set(self.trainable) - set(tensors))
        unexpected = sorted(set(tensors) - set(self.trainable))
        wrong = [n for n in set(tensors) & set(self.trainable) if tensors[n].shape != self.trainable[n].shape]
        if missing or unexpected or wrong:
            # Never go on with freshly initialised adapters as if they were the trained ones.
            raise InputError(
                f"checkpoint {path.name} does not fit this model: {len(missing)} trainable tensors missing "
                f"(e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]}), {len(wrong)} with "
                "other shapes; the method, LoRA settings or base model changed since it was written. Restore "
                "them, or start a new run name"
            )
        self._copy_into_trainable(tensors)
        load_optimizer_state(self.optimizer, optimizer_state)

    def load_checkpoint_weights(self, path: Path, state: dict[str, Any]) -> None:
        if has_shards(path):  # a full finetune's (FSDP shards no adapters): every weight is trainable
            load_sharded_weights(self.model, path)
            return
        tensors = safetensors.torch.load_file(str(path / "trainable.safetensors"))
        if self.parallel == "fsdp":
            load_full_weights_into(self.model, tensors, aliases=[])
            return
        self._copy_into_trainable(tensors)

    def checkpoint_weight_files(self, path: Path) -> tuple[str, ...] | None:
        # A sharded checkpoint's DCP files hold each rank's weights and optimizer state together: all of them.
        return None if has_shards(path) else ("trainable.safetensors", "trainer_state.json")

    def _copy_into_trainable(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.trainable.items():
                param.copy_(tensors[name])

    def data_state(self) -> dict[str, Any]:
        return self.batches.state_dict()

    def load_data_state(self, state: dict[str, Any]) -> None:
        configured = self.train_cfg.grad_accum_steps
        accumulation = rescaled_accumulation(state, self.dist.world_size, configured)
        if accumulation != self.grad_accum_steps:
            if self.dist.is_main:
                log.warning("%s", accumulation_note(state, self.dist.world_size, configured, accumulation))
            self.grad_accum_steps = self.batches.grad_accum_steps = accumulation
            self._set_max_steps()
        self.batches.load_state_dict(state)

    def extra_state(self) -> dict[str, Any]:
        return {"tracker": {"wandb_run_id": self.tracker_run_id}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.tracker_run_id = state.get("tracker", {}).get("wandb_run_id")

    def checkpoint_bytes_estimate(self) -> int:
        # What trains and its optimizer's state: an 8-bit AdamW keeps about a quarter of AdamW's.
        sizes = tuple(p.numel() for p in self.trainable.values())
        return checkpoint_bytes(sizes, self.train_cfg.optimizer)

    # ---------------------------------------------------------------------------- training
    def _begin_step(self, step: int) -> tuple[list[dict[str, torch.Tensor]], int]:
        """Set the step's learning rate and draw its micro batches: (the batches, the real tokens they hold)."""
        t = self.train_cfg
        self.set_lr(cosine_with_warmup(step - 1, self.max_steps, t.lr, self.warmup_steps, t.min_lr_ratio))
        micro_batches, real_tokens = [], 0
        for _ in range(self.grad_accum_steps):
            micro_batches.append(self.batches.next_batch())
            real_tokens += self.batches.last_real_tokens
        return micro_batches, real_tokens

    def train_step(self, model: torch.nn.Module, step: int) -> StepResult:
        t = self.train_cfg
        micro_batches, real_tokens = self._begin_step(step)
        # The loss is a mean over every trained token of the step on every rank, as if there were one
        # big batch: each micro-batch's summed loss is divided by that global count (and multiplied by
        # the rank count, which DDP's gradient averaging divides out again).
        local_items = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches)
        global_items = D.all_reduce_sum(self.dist, float(local_items))
        items = torch.tensor(max(global_items, 1.0), device=self.dist.device)
        total = torch.zeros((), device=self.dist.device)
        for i, batch in enumerate(micro_batches):
            inputs = {k: to_device(batch[k], self.dist.device) for k in self.model_inputs if k in batch}
            last = i == len(micro_batches) - 1
            with self._gradient_sync(model, last), self._autocast():
                if self.chunked_loss:
                    loss = model(inputs.pop("input_ids"), shift_labels(inputs.pop("labels")), items, **inputs)
                elif self.own_loss_counts_items:
                    loss = model(**inputs, num_items_in_batch=items).loss
                else:  # remote code's own loss: no num_items_in_batch, or its micro-batch's mean
                    labels = inputs.pop("labels")
                    loss = summed_sft_loss(model(**inputs).logits, labels) / items
                (loss * self.dist.world_size).backward()
            total += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable.values(), t.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # This rank's own mean, for the log (ranks are averaged there).
        rank_mean = total * global_items / max(local_items, 1)
        return StepResult(rank_mean, local_value(grad_norm), real_tokens)

    @property
    def has_eval_data(self) -> bool:
        return len(self.data.val) > 0

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, step: int) -> float:
        t = self.train_cfg
        model.eval()
        loss_sum = count = 0.0
        per_sample: list[tuple[float, int]] = []
        batches = self._eval_batches()
        mine = batches[self.dist.rank :: self.dist.world_size]
        for batch in self.until_stop(mine):
            if batch is None:  # this rank's batches ran out first
                if self.parallel == "fsdp":  # every rank runs as many forwards: each one gathers weights
                    self._eval_token_losses(batches[0])  # a repeat, not counted
                continue
            token_loss = self._eval_token_losses(batch)
            targets = to_device(batch["labels"][:, 1:], self.dist.device)
            trained = targets != IGNORE_INDEX
            row_sums, row_counts = (token_loss * trained).sum(1), trained.sum(1)
            loss_sum += row_sums.sum().item()
            count += row_counts.sum().item()
            per_sample += [
                (s / n, int(index))
                for s, n, index in zip(
                    row_sums.tolist(), row_counts.tolist(), batch["sample_index"].tolist(), strict=True
                )
                if n
            ]
        loss_sum, count = D.all_reduce_sum(self.dist, loss_sum), D.all_reduce_sum(self.dist, count)
        gathered = D.gather_to_main(self.dist, per_sample)
        if self.dist.is_main and t.worst_samples:
            self._write_worst_samples(step, [s for rank in gathered for s in rank])
        self._generation_eval(step)
        return loss_sum / max(count, 1.0)

    def _eval_token_losses(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of each next-token target of an eval batch, (rows, tokens - 1), 0 where untrained. Through
        the chunked loss where the step trains with it: the model's own forward makes the batch's whole logits,
        which with their fp32 copy and log-softmax take 10 bytes a token per vocabulary entry (12 GB for 4 x 2048
        tokens of Qwen2.5's 152k), an OOM at the first eval of a run whose steps fit the GPU."""
        inputs = self._eval_inputs(batch)
        # The bare model, not the training wrapper: per-sample losses need each token's loss.
        with self._autocast(), gathered_root(self.loss_module):
            if self.chunked_loss:
                labels = to_device(batch["labels"], self.dist.device)
                targets = shift_labels(labels)
                return self.loss_module.token_losses(inputs.pop("input_ids"), targets, **inputs)[:, :-1]
            logits = self.model(**inputs).logits
        targets = to_device(batch["labels"][:, 1:], self.dist.device)
        return F.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none"
        )

    def _eval_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            k: to_device(batch[k], self.dist.device)
            for k in self.model_inputs
            if k in batch and k != "labels"
        }

    def _eval_batches(self) -> list[dict[str, torch.Tensor]]:
        """The validation split's batches in stored order, each with `sample_index`."""
        t = self.train_cfg
        return eval_batches(self.data.val, t.micro_batch_size, self.max_len, self.data.pad_id, t.eval_batches)

    def _generation_eval(self, step: int) -> None:
        """Every k-th eval: greedy answers on rank 0, scored (CER, WER, exact match); every rank gets the
        metrics, since early stopping on them must end every rank's loop at the same step."""
        from trainpod.train.generation_eval import METRICS, generate_and_score, stop_token_ids

        gen = self.cfg.generation_eval
        if not gen.every_evals or (step // self.eval_every) % gen.every_evals:
            return
        metrics: dict[str, float] = {}
        interrupted = False
        if self.dist.is_main:
            prompts = self.generation_prompts(gen.max_samples)
            try:
                metrics = generate_and_score(
                    self.model,
                    self.until_stop(prompts, local=True),
                    self.tokenizer,
                    gen.max_new_tokens,
                    self.dist.device,
                    self.ctx.run.root / "eval",
                    step,
                    gen.worst_samples,
                    self._autocast,
                    stop_token_ids(self.model, self.tokenizer, prompts),
                )
            except EvalInterrupted:  # the other ranks wait for rank 0 below: they stop with it
                interrupted = True
        D.wait_for_main(self.dist)
        if D.broadcast_from_main(self.dist, float(interrupted)):
            raise EvalInterrupted
        for name in METRICS:
            value = D.broadcast_from_main(self.dist, metrics.get(f"eval_{name}", float("nan")))
            if not math.isnan(value):
                self.eval_metrics[f"eval_{name}"] = value

    def generation_prompts(self, limit: int) -> list:
        """The first `limit` validation samples as prompts (up to their first answer) and references."""
        from trainpod.train.generation_eval import Prompt

        prompts = []
        for index in range(min(limit, len(self.data.val))):
            example = self.data.val[index]
            start, end = answer_span(example.labels)
            ids = torch.from_numpy(example.input_ids[:start])[None]
            prompts.append(
                Prompt(
                    {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                    self.tokenizer.decode(example.input_ids[:start].tolist()),
                    self.tokenizer.decode(
                        example.input_ids[start:end].tolist(), skip_special_tokens=True
                    ).strip(),
                    index,
                    answer_ids=example.input_ids[start:end].tolist(),
                )
            )
        return prompts

    def _write_worst_samples(self, step: int, per_sample: list[tuple[float, int]]) -> None:
        """The highest-loss eval samples, prompt and answer decoded, for a look at what the model gets wrong."""
        worst = sorted(per_sample, key=lambda item: (-item[0], item[1]))[: self.train_cfg.worst_samples]
        records = []
        for loss, index in worst:
            example = self.data.val[index]
            trained = example.labels != IGNORE_INDEX
            record = {
                "step": step,
                "loss": loss,
                "val_index": index,
                "source_row": example.row_index,
                "prompt": self.tokenizer.decode(example.input_ids[~trained].tolist()),
                "answer": self.tokenizer.decode(example.input_ids[trained].tolist()),
            }
            records.append(record)
        self._write_worst(step, records)

    def _write_worst(self, step: int, records: list[dict[str, Any]]) -> None:
        """eval/step-<N>.worst.jsonl: one JSON record a line, written whole (atomic)."""
        folder = self.ctx.run.root / "eval"
        folder.mkdir(exist_ok=True)
        text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        atomic.write_text(folder / f"step-{step}.worst.jsonl", text)

    def should_stop_early(self) -> str | None:
        patience = self.train_cfg.early_stopping_patience
        waited = self.progress.evals_without_improvement
        if patience and waited >= patience:
            metric = self.ranked_metric.replace("_", " ")
            return (
                f"{metric} has not improved by more than {self.train_cfg.early_stopping_min_delta} for "
                f"{waited} evals (best {self.progress.best_score:.4f})"
            )
        return None

    # ------------------------------------------------------------------------------ finish
    def export(self) -> Path | None:
        # Sharded: gathered in full on rank 0 (every rank takes part).
        model = gathered_copy(self.model) if self.parallel == "fsdp" else self.model
        if not self.dist.is_main:
            return None
        summary = self.training_summary()
        vision = summary.get("vision") is not None
        if self.method == "full":
            dtype_name = self.cfg.export.dtype
            if dtype_name == "auto":
                dtype_name = "bfloat16" if self.autocast_dtype == torch.bfloat16 else "float32"
            card = finetuned_model_card(summary, self._hub_base_revision(summary), dtype_name, vision)
            return export_hf(
                model,
                self.base_dir,
                self.ctx.run.export / "hf",
                DTYPES[dtype_name],
                extra_json={"training_summary.json": summary, **self.processor_json()},
                template_name=self.data.manifest.get("template"),
                model_card=card,
                weights=self.exported_weights,
                abandoning=self.abandoning_export,
                publishing=self.publishing_export,
            )
        target = self.ctx.run.export / "adapter"
        tmp = atomic.temp_name(target)
        self._name_hub_base_in_adapter_config()
        self._sort_target_modules()
        try:
            with self.abandoning_export():
                self.model.save_pretrained(str(tmp), safe_serialization=True)
                self.save_processor(tmp)
                self._save_generation_config(tmp)
                carry_training_template(tmp, self.data.manifest.get("template"))
                atomic.write_json(tmp / "training_summary.json", summary)
                # In place of the README.md peft's save_pretrained wrote: its template, "[More Information
                # Needed]" in every section, and no base_model where the base was a folder.
                card = adapter_model_card(summary, self._hub_base_revision(summary), vision)
                atomic.write_text(tmp / MODEL_CARD, card)
                write_export_manifest(tmp, self.exported_weights)
            with self.publishing_export():
                atomic.replace_dir(tmp, target)  # a publish begun is never abandoned
        except WorkAbandoned:  # its temp folder goes at the next start, as after a kill (export_hf)
            raise
        except BaseException:  # on a full volume the space comes back at once, not at the next start
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("exported the PEFT adapter to %s", target)
        return target

    def _hub_base_revision(self, summary: dict[str, Any]) -> str | None:
        """The hub commit the model trained on, for its card's base_model; None for a base given as a folder,
        which names nothing on the Hub."""
        return summary["base_model_revision"] if self._base_is_from_hub() else None

    def _base_is_from_hub(self) -> bool:
        return self.base_dir.is_relative_to(self.ctx.volume.cache() / "hf")

    def _save_generation_config(self, folder: Path) -> None:
        """The base's generation config beside the adapter, for carry_training_template to add the template's end
        of turn to its eos_token_id as in the full export: peft and transformers load an adapter's base with the
        base's own, which stops at eos alone (a base Qwen2.5's <|endoftext|>) past the <|im_end|> the answers
        were trained to end with; generate(generation_config=GenerationConfig.from_pretrained(adapter)) and
        vLLM's --generation-config take this one."""
        base = self.model.get_base_model()
        if base.can_generate():
            base.generation_config.save_pretrained(str(folder))

    def _name_hub_base_in_adapter_config(self) -> None:
        """A base from the hub is named in adapter_config.json by its hub id and the commit trained on, as
        axolotl's and LLaMA-Factory's adapters name it: peft records the folder the model was loaded
        from, here the pod's cache/hf download, which no other machine loading the adapter
        (AutoPeftModelForCausalLM, vLLM) has. A base given as a folder stays named by that folder."""
        if not self._base_is_from_hub():
            return
        base = self.cfg.base_model
        for peft_config in self.model.peft_config.values():
            peft_config.base_model_name_or_path = base.path
            peft_config.revision = pinned_commit(base, self.base_pin) or base.revision

    def _sort_target_modules(self) -> None:
        """adapter_config.json lists target_modules as peft holds them, a set (all-linear resolves to one),
        so in the order of Python's string hashing, seeded anew in every process: the same training exported
        other bytes at each start (and another sha256 in the export's manifest). Sorted, they are the same."""
        for peft_config in self.model.peft_config.values():
            if isinstance(peft_config.target_modules, set):
                peft_config.target_modules = sorted(peft_config.target_modules)

    def save_processor(self, folder: Path) -> None:
        """What the adapter folder needs beside the weights to be used: the tokenizer (VLMs: and more)."""
        self.tokenizer.save_pretrained(str(folder))

    def processor_json(self) -> dict[str, Any]:
        """Files of the full export that replace the base model's copies (VLMs: the image processor)."""
        return {}

    def training_summary(self) -> dict[str, Any]:
        """What convert and a reader need beside the weights: method, base model, quantization, results."""
        cfg = self.cfg
        return {
            "method": self.method,
            "base_model": cfg.base_model.path,
            "base_model_folder": str(self.base_dir),
            # The commit trained on, for a hub id (convert fetches that one when the folder is gone).
            "base_model_revision": pinned_commit(cfg.base_model, self.base_pin) or cfg.base_model.revision,
            "quantization": (
                {
                    "quant_type": cfg.quantization.quant_type,
                    "double_quant": cfg.quantization.double_quant,
                    "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                }
                if self.method == "qlora"
                else None
            ),
            "lora": cfg.lora.model_dump(mode="json") if self.method != "full" else None,
            "data": {
                "cutoff_len": self.max_len,
                "packing": self.batches.packing,
                "train_samples": len(self.data.train),
                "val_samples": len(self.data.val),
                "template": self.data.manifest.get("template"),
            },
            "results": self.summary(),
        }

    def summary(self) -> dict[str, Any]:
        return super().summary() | {
            "method": self.method,
            "trainable_parameters": self.n_trainable,
            "parameters": self.n_params,
            "epoch": round(self.batches.epoch, 4),
            "packing_efficiency": round(self.batches.packing_efficiency, 4),
            "wandb_run_id": self.tracker_run_id,
        }


def run(ctx: RunContext, config: FinetuneConfig) -> dict[str, Any]:
    """Train to the configured steps (or an eval plateau), export, and return the summary."""
    if config.is_preference:
        from trainpod.workloads.preference import PreferenceFinetuner

        return train_and_export(PreferenceFinetuner, ctx, config)
    return train_and_export(Finetuner, ctx, config)


def _learned_positions(model: torch.nn.Module, positions: int) -> bool:
    """Whether the model looks its positions up in a table of `positions` rows (GPT-2's wpe; OPT's and
    BioGPT's with an offset of 2), which no position beyond it can index; RoPE and ALiBi have none."""
    tokens = model.get_input_embeddings()
    return any(
        isinstance(m, torch.nn.Embedding)
        and m is not tokens
        and positions <= m.num_embeddings <= positions + 2
        for m in model.modules()
    )


def answer_span(labels) -> tuple[int, int]:
    """[start, end) of a sample's first trained run: its first answer."""
    trained = (labels != IGNORE_INDEX).tolist()
    start = trained.index(True)
    end = start
    while end < len(trained) and trained[end]:
        end += 1
    return start, end
