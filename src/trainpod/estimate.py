"""`trainpod estimate CONFIG`: what a training run will take before any money is spent.

    trainpod estimate configs/pretrain/1b.yaml --gpu "NVIDIA H100 80GB HBM3"
    trainpod estimate configs/deploy/finetune-spot.yaml --spot

CONFIG is a workload config (pretrain, finetune) or a deploy config (its workload config is read
from the repo). The estimate gives tokens and FLOPs, hours at an MFU (measured by a previous run of
the same name on the volume, else assumed: the assumption is printed), the GPU memory fit, the
checkpoint's size and commit time at network-volume speed (200-400 MB/s), and dollars from RunPod's
v2 catalog (GET /v2/catalog/gpus) when a RunPod key is at hand, else from TRAINPOD_GPU_HOURLY_USD; a deploy
config's budget.hourly_usd, the price its pod counts its cost with, comes first (`_hourly_price`).
`trainpod deploy` prints the same estimate and refuses one over the budget unless --force.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainpod import cost, workloads
from trainpod.config import load_config, parse_overrides
from trainpod.config.deploy import DeployConfig
from trainpod.config.finetune import FinetuneConfig
from trainpod.config.finetune_vlm import VisionDataConfig, VisionSourceConfig, VlmFinetuneConfig
from trainpod.config.loader import OverrideRoute
from trainpod.config.pretrain import PretrainConfig
from trainpod.config.sft import SftDataConfig
from trainpod.errors import ConfigError, InputError
from trainpod.train.decoder_shape import DecoderShape, decoder_shape
from trainpod.train.loss_chunks import PLAIN_HEAD_MODEL_TYPES
from trainpod.train.reporting import PEAK_BF16_FLOPS, peak_flops_of
from trainpod.volume import Volume

DEFAULT_GPU = "NVIDIA H100 80GB HBM3"
VOLUME_BYTES_PER_S = (200e6, 400e6)  # network volumes write 200-400 MB/s (runpod-platform.md)
# Hardware FLOPs executed / peak, for runs with no measurement yet. bf16 Llama pretraining with
# torch.compile reaches 40-50% on H100 (torchtitan, nanoGPT reports); LoRA runs are smaller matmuls
# plus adapter overhead; QLoRA also dequantizes every 4-bit weight on each use (~30% slower than LoRA).
ASSUMED_MFU = {"pretrain": 0.40, "full": 0.35, "lora": 0.30, "qlora": 0.22}
# GPU memory in GB by a part of the type id, for when the catalog cannot be asked. The first part the id
# contains wins, so a longer name comes before its prefix: "A100-SXM4-80GB" before "A100", "A4000" before "A40".
GPU_MEMORY_GB = {"H200": 141, "H100": 80, "A100 80GB": 80, "A100-SXM4-80GB": 80, "A100": 40, "L40": 48,
                 "A6000": 48, "6000 Ada": 48, "A4000": 16, "A40": 48, "4090": 24, "A5000": 24, "L4": 24,
                 "3090": 24}  # fmt: skip
HUB_TIMEOUT_S = 5.0
CUDA_CONTEXT_BYTES = 1.0e9  # CUDA context, cuBLAS workspaces and the allocator's fragmentation


@dataclass
class Sizing:
    """What a run trains: parameters, tokens and the FLOPs a GPU executes for them."""

    workload: str  # pretrain, or the finetune method (qlora, lora, full)
    run: str
    parameters: int
    trainable: int
    steps: int
    tokens: int
    flops_per_token: float
    checkpoint_bytes: int
    memory: dict[str, float]  # bytes per GPU, by part
    notes: list[str] = field(default_factory=list)
    recompute: float = (
        1.0  # FLOPs executed over the model's: 4/3 with gradient checkpointing's second forward
    )

    @property
    def flops(self) -> float:
        return self.flops_per_token * self.tokens


@dataclass
class Estimate:
    sizing: Sizing
    gpu: str
    gpu_count: int
    gpu_memory_gb: float | None
    mfu: float
    mfu_source: str
    hours: float
    hourly_usd: float | None
    price_source: str
    budget_usd: float | None = None

    @property
    def dollars(self) -> float | None:
        return None if self.hourly_usd is None else self.hours * self.hourly_usd

    @property
    def over_budget(self) -> bool:
        return self.budget_usd is not None and self.dollars is not None and self.dollars > self.budget_usd


# The way to a volume's data and models, named with its command: deploy, whose "estimate not made" line shows
# these messages too, has no --volume.
WITH_A_VOLUME = "`trainpod estimate CONFIG --volume DIR`"


# ---------------------------------------------------------------------------------- configs
def load_target(
    path: str, overrides: list[str] | None = None, route: OverrideRoute | None = None
) -> tuple[Any, DeployConfig | None]:
    """The workload config CONFIG names (directly, or through a deploy config) and the deploy config; a problem's
    fix names `route`, the caller's way to override a field (`trainpod estimate`'s --set, deploy's env.set)."""
    tree = _yaml(Path(path))
    deploy = None
    if "workload" in tree and "image" in tree:
        deploy = load_config(DeployConfig, path)
        if workloads.get(deploy.workload).kind is not workloads.Kind.TRAINING:
            raise InputError(
                f"{path}: workload {deploy.workload!r} trains nothing; estimate covers pretrain, finetune and finetune-vlm"
            )
        workload_path = find_workload_config(deploy.config, Path(path))
        if workload_path is None:
            raise InputError(
                f"{path}: config={deploy.config!r} is not a file here (looked beside the deploy config "
                "and in "
                "this repo); run the estimate on the workload config itself"
            )
        # What the pod runs: the YAML with env.set (its TRAINPOD_SET) applied, then this command's --set.
        pod_overrides = [*parse_overrides(deploy.env.set), *(overrides or [])]
        return load_config(_config_type(deploy.workload), workload_path, pod_overrides, route), deploy
    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    workload = None  # a convert config (its `task`) names a base_model too, and trains nothing
    if "base_model" in tree and "task" not in tree:
        workload = "finetune-vlm" if "datasets" in data else "finetune"  # VLM data lists its datasets itself
    elif "model" in tree or "train" in tree:
        workload = "pretrain"
    if workload is None:
        raise InputError(
            f"{path}: neither a pretrain, a finetune nor a deploy config; estimate needs one of them"
        )
    return load_config(_config_type(workload), path, overrides or [], route), None


def find_workload_config(raw: str, deploy_path: Path) -> Path | None:
    """A deploy config's workload config as the repo holds it (the pod sees the same path in the image)."""
    relative = Path(raw)
    if relative.is_absolute():
        return relative if relative.is_file() else None
    roots = [Path.cwd(), *deploy_path.resolve().parents]
    return next((root / relative for root in roots if (root / relative).is_file()), None)


def _config_type(workload: str) -> type:
    return workloads.get(workload).config_type({})


def _yaml(path: Path) -> dict:
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(
            f"{path}: no such file; give a configs/pretrain, configs/finetune or configs/deploy YAML"
        ) from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError([f"{path}: not readable YAML ({type(exc).__name__})"]) from None
    return tree if isinstance(tree, dict) else {}


# ------------------------------------------------------------------------------- sizing
def size_pretrain(config: PretrainConfig, gpu_count: int, volume: Volume | None) -> Sizing:
    # On paper, no torch nor transformers (train/shape.py): the sizes the trainer's model has, in a laptop's second.
    from trainpod.train.memory import checkpoint_bytes
    from trainpod.train.shape import flops_per_token, model_shape, padded_vocab

    t, notes = config.train, []
    from trainpod.data.datagen import dataset_vocab

    vocab = config.model.vocab_size or (dataset_vocab(config.data.dataset, volume) if volume else None)
    if vocab is None:
        vocab = 32768
        notes.append("vocabulary assumed 32768 (set model.vocab_size, or have the dataset on the volume)")
    shape = model_shape(config, padded_vocab(vocab))
    n = shape.params
    tokens = t.max_steps * t.tokens_per_step_per_rank * gpu_count
    per_token = flops_per_token(shape, t.seq_len) * (4 / 3 if t.gradient_checkpointing else 1)
    memory = preflight_memory(config, shape.vocab, gpu_count)
    recompute = 4 / 3 if t.gradient_checkpointing else 1.0
    checkpoint = checkpoint_bytes(shape.tensor_sizes, t.optimizer)
    return Sizing(
        "pretrain", config.name, n, n, t.max_steps, tokens, per_token, checkpoint, memory, notes, recompute
    )


def size_finetune(
    config: FinetuneConfig, gpu_count: int, volume: Volume | None, route: OverrideRoute | None = None
) -> Sizing:
    from trainpod.train.memory import checkpoint_bytes
    from trainpod.train.parallel import resolve_parallel

    t, notes = config.train, []
    shape = base_model_shape(config, volume, notes)
    n, width, layers, vocab = shape["parameters"], shape["width"], shape["layers"], shape["vocab"]
    trainable = shape.get("full_parameters", n) if config.method == "full" else shape["lora_parameters"]
    # finetune-vlm's data section holds its datasets and cutoff_len itself; a text finetune's holds them
    # in `sft`, or names a datagen-made `dataset` instead.
    samples = config.data if isinstance(config, VlmFinetuneConfig) else config.data.sft
    cutoff = samples.cutoff_len if samples else _dataset_cutoff(config.data.dataset, volume, notes)
    rows_per_step = t.micro_batch_size * t.grad_accum_steps * gpu_count
    steps = t.max_steps or _steps_for_epochs(config, samples, rows_per_step, volume, notes, route)
    # A preference objective: a row of the data is a pair, run as two sequences (its chosen and rejected answers);
    # DPO's also go through the reference (the base with the adapters off: one more forward, 2N) (train/preference.py).
    pairs = config.objective != "sft"  # dpo, orpo, simpo; finetune-vlm's objective is sft
    reference = config.objective == "dpo"  # orpo and simpo need no reference forward
    sequences = 2 if pairs else 1
    tokens = steps * rows_per_step * sequences * cutoff
    notes.append(f"tokens counted as full rows of {cutoff} (an upper bound: unpacked rows are shorter)")
    if pairs:
        notes.append(
            f"{config.objective}: each pair is two sequences"
            + (", each also run once through the reference model" if reference else "")
        )
    # Forward 2N; backward 2N for activation gradients, plus 2N weight gradients only when every
    # weight trains; gradient checkpointing runs the forward twice.
    per_token = (
        2
        + 2
        + (2 if config.method == "full" else 0)
        + (2 if t.gradient_checkpointing else 0)
        + (2 if reference else 0)
    ) * n
    # NF4 with double quantization is 4.15 bits a weight. What 4-bit loading leaves alone (the embeddings and
    # output head, norms) peft's prepare_model_for_kbit_training upcasts to fp32, 4 bytes: 4.4 GB of Qwen2.5-7B,
    # counted at 2 they were 2.2 GB short; a VLM's frozen vision tower alone goes back to the compute dtype
    # (finetune_vlm.py).
    quantized = shape.get("quantized_parameters", n)
    tower = shape.get("vision_tower_parameters", 0)
    qlora = 0.52 * quantized + 2 * tower + 4 * (n - quantized - tower)
    weights = {"qlora": qlora, "lora": 2 * n, "full": 4 * n}[config.method]
    optimizer = 2 if "8bit" in t.optimizer else 8
    memory = simple_training_memory(
        weights=weights, trainable=trainable, optimizer_bytes_per_param=optimizer, layers=layers, width=width,
        vocab=vocab, rows=t.micro_batch_size * sequences, seq_len=cutoff, recompute=t.gradient_checkpointing,
    )  # fmt: skip
    if shape.get("chunked_loss"):
        # The chunked loss keeps one chunk's fp32 logits a few times over, the hidden states' gradient and, when
        # the head trains, its fp32 gradient; the 3 fp32 copies of a micro-batch's whole logits counted for other
        # models (15 GB for 4 x 2048 tokens of Qwen2.5's vocabulary) never exist.
        from trainpod.train.loss_chunks import rows_per_chunk

        rows = t.micro_batch_size * sequences * cutoff
        chunk = 3 * 4 * min(rows, rows_per_chunk(vocab, rows)) * vocab
        head = 4 * vocab * width if config.method == "full" else 0
        memory["logits"] = float(chunk + 4 * rows * width + head)
    # A full finetune under FSDP (train.parallel, chosen as the trainer chooses it) keeps 1/N of the weights,
    # gradients and optimizer states per GPU, plus the units it gathers: counted whole, an 8B full finetune on
    # 8 GPUs read as not fitting them.
    # A preference objective replicates the model (workloads/preference.py), a full ORPO or SimPO finetune too.
    replicated = config.method != "full" or config.objective != "sft"
    parallel = "ddp" if replicated else resolve_parallel(t.parallel, gpu_count, n, t.optimizer)
    if parallel == "fsdp" and gpu_count > 1:
        for part in ("weights", "gradients", "optimizer"):
            memory[part] /= gpu_count
        memory["fsdp gathered"] = 2.0 * 2 * n / layers  # two decoder layers at a time, in bf16
        notes.append(f"FSDP: weights, gradients and optimizer states sharded across the {gpu_count} GPUs")
    # What trains in fp32 and its optimizer's state, as the trainer sizes its checkpoint (an 8-bit AdamW keeps about a
    # quarter of AdamW's); taken as one tensor, which the adapters' tensors (above bitsandbytes' 4096) are like.
    checkpoint = checkpoint_bytes((trainable,), t.optimizer)
    return Sizing(
        config.method, config.name, n, trainable, steps, tokens, per_token, checkpoint, memory, notes
    )


def _dataset_cutoff(name: str, volume: Volume | None, notes: list[str]) -> int:
    """The cutoff_len a datagen-made dataset (data.dataset) was cut at, which the trainer takes as its
    row length: from its manifest, found as the trainer finds it; 2048 (noted) when it is not at hand."""
    from trainpod.sft.dataset import read_manifest

    folder = Path(name) if Path(name).is_absolute() else volume.dataset(name) if volume else None
    manifest = read_manifest(folder) if folder is not None else None
    if manifest is None:
        notes.append(
            f"data.dataset={name!r} not found ({WITH_A_VOLUME} reads it where it lives): "
            "its cutoff_len assumed 2048"
        )
        return 2048
    return int(manifest["settings"]["cutoff_len"])


def preflight_memory(config: PretrainConfig, vocab: int, world_size: int) -> dict[str, float]:
    """Pretraining's memory per GPU as its preflight estimates it (train/memory.py), by part."""
    from trainpod.train.memory import estimate_training_memory

    estimate = estimate_training_memory(config, vocab, world_size=world_size)
    return {part: float(size) for part, size in estimate.parts.items()}


def simple_training_memory(
    *,
    weights: float,
    trainable: int,
    optimizer_bytes_per_param: int,
    layers: int,
    width: int,
    vocab: int,
    rows: int,
    seq_len: int,
    recompute: bool,
) -> dict[str, float]:
    """GPU bytes: weights + fp32 gradients + optimizer moments + activations + logits + CUDA context.

    The simple estimate, finetuning's (pretraining has its preflight's, preflight_memory).
    Activations: 34 bytes x tokens x width per layer in bf16 with fused attention (Korthikanti et al.
    2022); with recomputation only each layer's input (2 bytes) stays, plus one layer's worth.
    """
    tokens = rows * seq_len
    per_layer = 34 * tokens * width
    activations = layers * 2 * tokens * width + per_layer if recompute else layers * per_layer
    return {
        "weights": weights,
        "gradients": 4.0 * trainable,
        "optimizer": float(optimizer_bytes_per_param * trainable),
        "activations": float(activations),
        "logits": 3.0 * 4 * tokens * vocab,  # fp32 logits, their softmax and gradient
        "cuda": CUDA_CONTEXT_BYTES,
    }


def base_model_shape(config: FinetuneConfig, volume: Volume | None, notes: list[str]) -> dict[str, int]:
    """Parameters, width, layers, vocabulary, LoRA parameters and the parameters a full finetune trains, of the
    base model: on paper from its config.json for a decoder train/decoder_shape.py knows, else built on the meta
    device with transformers, else read from its name."""
    found = _base_model_config(config, volume)
    if found is None:
        return _shape_from_name(config, notes)
    data, folder = found
    shape = None if isinstance(config, VlmFinetuneConfig) else decoder_shape(data)
    if shape is not None:
        return _decoder_shape_numbers(config, shape)
    model_config = _transformers_config(config, data, folder)
    if model_config is None:
        return _shape_from_name(config, notes)
    return _meta_model_shape(config, model_config)


def _decoder_shape_numbers(config: FinetuneConfig, shape: DecoderShape) -> dict[str, int]:
    """base_model_shape's numbers of a text decoder on paper: what the meta-device build gives for it."""
    return {
        "parameters": shape.parameters,
        "quantized_parameters": shape.linear_weights,
        "vision_tower_parameters": 0,
        "full_parameters": shape.parameters,
        "width": shape.width,
        "layers": shape.layers,
        "vocab": shape.vocab,
        "lora_parameters": shape.lora_parameters(config.lora.r, config.lora.target_modules),
        "chunked_loss": int(shape.model_type in PLAIN_HEAD_MODEL_TYPES),
    }


def _meta_model_shape(config: FinetuneConfig, model_config: Any) -> dict[str, int]:
    """base_model_shape's numbers of the model transformers builds from `model_config` on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from trainpod.train.loss import fits_chunked_loss
    from trainpod.workloads.finetune_vlm import PROJECTORS, VISION_TOWERS, _under, frozen_in_vlm_training

    vlm = isinstance(config, VlmFinetuneConfig)

    def frozen(name: str) -> bool:
        return vlm and frozen_in_vlm_training(name, config.lora.train_projector)

    with torch.device("meta"):  # a vision-language model is no AutoModelForCausalLM
        model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_config(model_config)
    targets = config.lora.target_modules
    lora = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.endswith("lm_head") or frozen(name):
            continue
        if (
            targets == "all-linear"
            or name.rsplit(".", 1)[-1] in targets
            or (vlm and _under(name, PROJECTORS))
        ):
            lora += config.lora.r * (module.in_features + module.out_features)
    text = model_config.get_text_config()  # a VLM's config holds the language model's in text_config
    # What 4-bit loading quantizes: the linear layers, but not the output head (transformers keeps it) nor a
    # VLM's vision tower and projector (finetune_vlm.py keeps them); embeddings and norms stay 16-bit too.
    quantized = sum(
        module.weight.numel()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and not name.endswith("lm_head")
        and not (vlm and _under(name, VISION_TOWERS + PROJECTORS))
    )
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "quantized_parameters": quantized,
        "vision_tower_parameters": sum(
            p.numel() for name, p in model.named_parameters() if vlm and _under(name, VISION_TOWERS)
        ),
        "full_parameters": sum(p.numel() for name, p in model.named_parameters() if not frozen(name)),
        "width": text.hidden_size,
        "layers": text.num_hidden_layers,
        "vocab": text.vocab_size,
        "lora_parameters": lora,
        # The trainer's chunked loss (train/loss.py): no logits of a whole micro-batch, in the step or the eval.
        "chunked_loss": int(fits_chunked_loss(model)),
    }


def _base_model_config(config: FinetuneConfig, volume: Volume | None) -> tuple[dict, Path | None] | None:
    """The base model's config.json and the folder it was read from: its folder here or on the volume, or (None)
    the hub's, config.json alone. Read as JSON: transformers is imported only for a model the arithmetic does not
    know (_transformers_config)."""
    raw = Path(config.base_model.path).expanduser()
    folders = [raw] if raw.is_absolute() else [Path.cwd() / raw] + ([volume.root / raw] if volume else [])
    for folder in folders:
        if (folder / "config.json").is_file():
            try:
                data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                data = None  # transformers reads it and says what is wrong with it
            return (data if isinstance(data, dict) else {}), folder
    if config.base_model.path.count("/") != 1:
        return None
    data = _hub_config(config.base_model.path, config.base_model.revision or "main")
    return None if data is None else (data, None)


def _transformers_config(config: FinetuneConfig, data: dict, folder: Path | None) -> Any:
    """The base model's transformers config: from its folder, else from the hub's config.json; None for an
    architecture transformers lacks (then the name sizes it)."""
    from transformers import AutoConfig

    if folder is not None:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=config.base_model.trust_remote_code)
    try:
        return AutoConfig.for_model(**data)
    except Exception:  # a model_type transformers lacks, a malformed config: use the name, as before
        return None


def _hub_config(repo: str, revision: str) -> dict | None:
    """config.json alone from the hub, one request with a short timeout (no weights, no retries)."""
    import os
    import urllib.parse
    import urllib.request

    hub = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")  # a mirror, as huggingface_hub
    url = f"{hub}/{repo}/resolve/{urllib.parse.quote(revision, safe='')}/config.json"
    request = urllib.request.Request(url)
    token = os.environ.get("HF_TOKEN")
    if token:  # unredirected: urllib hands a redirect every other header, to whatever host it names
        request.add_unredirected_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=HUB_TIMEOUT_S) as response:  # noqa: S310 - the hub's https
            data = json.loads(response.read())
    except Exception:  # offline, gated, not on the hub: use the name
        return None
    return data if isinstance(data, dict) else None


def _shape_from_name(config: FinetuneConfig, notes: list[str]) -> dict[str, int]:
    import re

    match = re.search(r"(\d+(?:\.\d+)?)[bB]\b", config.base_model.path)
    if match is None:
        raise InputError(
            f"base_model.path={config.base_model.path!r}: its config.json could not be read (no such folder "
            f"here or on the volume, hub not reachable); {WITH_A_VOLUME} reads it where the model lives, or "
            "estimate online"
        )
    n = int(float(match.group(1)) * 1e9)
    notes.append(
        f"{config.base_model.path}: config.json not reachable; {n / 1e9:g}B parameters read from the name"
    )
    # Llama-like shapes: n ~ 12 x layers x width^2 with layers ~ width / 128.
    width = max(128 * round((n * 128 / 12) ** (1 / 3) / 128), 128)
    layers = max(n // (12 * width * width), 1)
    # All-linear LoRA r16 on Llama/Qwen-like 7B models: 0.53% of the parameters, linear in r.
    return {"parameters": n, "width": width, "layers": layers, "vocab": 150000,
            "lora_parameters": int(n * 0.0053 * config.lora.r / 16)}  # fmt: skip


def _steps_for_epochs(
    config: FinetuneConfig,
    sft: SftDataConfig | VisionDataConfig | None,
    rows_per_step: int,
    volume: Volume | None,
    notes: list[str],
    route: OverrideRoute | None,
) -> int:
    if sft is None:
        raise InputError(
            f"train.epochs={config.train.epochs} with data.dataset: estimate cannot count its samples; "
            f"{_by_steps_instead(route)}"
        )
    root = volume.root if volume else Path.cwd()
    try:
        samples = sum(_count_rows(source, root) for source in sft.datasets)
    except InputError as exc:
        where = "" if volume else (
            f" (no volume given, so the current directory {root} stood for the volume: {WITH_A_VOLUME} "
            "counts the data where it lives)"
        )  # fmt: skip
        raise InputError(
            f"train.epochs needs the data's size: {exc}{where}; or {_by_steps_instead(route)}"
        ) from None
    train_samples = samples * (1 - sft.val_ratio)
    if config.objective != "sft":  # a row of preference data is a pair: two rows of a micro batch
        notes.append(
            f"{samples:,} preference pairs counted, {train_samples:,.0f} train, each two rows (its chosen and "
            "rejected answers)"
        )
    else:
        notes.append(
            f"{samples:,} samples counted, {train_samples:,.0f} train one row each (packing fits more per row)"
        )
    return max(math.ceil(config.train.epochs * train_samples / rows_per_step), 1)


def _count_rows(source: Any, root: Path) -> int:
    """Samples of one of a finetune's datasets; sft.vision, which imports torch, only for a VLM's."""
    if isinstance(source, VisionSourceConfig):
        from trainpod.sft.vision import count_rows

        return count_rows(source, root)
    from trainpod.sft.sources import iter_rows

    return sum(1 for _ in iter_rows(source, root, "data.sft"))


def _by_steps_instead(route: OverrideRoute | None) -> str:
    """The way to give the run's length in steps, which needs no count of the data."""
    if route is None:
        return "set train.epochs to null and train.max_steps to N in the config"
    return route.fix("train.epochs=null", "train.max_steps=N")


# -------------------------------------------------------------------------------- estimate
def measured_mfu(run: str, volume: Volume | None) -> tuple[float, str] | None:
    """The MFU a run of this name reported (status.json on the volume), if any, and what it covers: the whole
    run's (`run_mfu`: evals, commits and startup in its time, as the bill has them) where the run wrote it,
    else its last log window's (`mfu`, from runs before run_mfu: one window, with or without an eval)."""
    if volume is None:
        return None
    try:
        status = json.loads(volume.run(run).status.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(status, dict):
        return None
    for name, covers in (("run_mfu", "over the whole run"), ("mfu", "of its last log window")):
        value = status.get(name)
        if isinstance(value, (int, float)) and 0 < value <= 1:
            return float(value), covers
    return None


def estimate(
    config: Any,
    deploy: DeployConfig | None = None,
    gpu: str | None = None,
    spot: bool | None = None,
    mfu: float | None = None,
    catalog: list | None = None,
    volume: Volume | None = None,
    route: OverrideRoute | None = None,
) -> Estimate:
    """The estimate for `config`; `catalog` (RunPodClient.catalog_gpus) gives prices and memory; a problem's fix
    names `route`, the caller's way to override a field."""
    # Hours divide by the MFU: 0 would crash, a negative one would make the cost negative.
    if mfu is not None and not 0 < mfu <= 1:
        raise InputError(f"--mfu {mfu:g}: a share of the GPU's peak, above 0 and at most 1; e.g. --mfu 0.4")
    gpu = gpu or (deploy.pod.gpu_types[0] if deploy and deploy.pod.gpu_types else DEFAULT_GPU)
    nodes = deploy.nodes if deploy else 1  # an Instant Cluster: every node's GPUs train one run
    gpu_count = (deploy.pod.gpu_count if deploy else 1) * nodes
    spot = spot if spot is not None else (deploy.pod.spot if deploy else False)
    cloud = deploy.pod.cloud if deploy else "SECURE"
    if isinstance(config, PretrainConfig):
        sizing = size_pretrain(config, gpu_count, volume)
    else:
        sizing = size_finetune(config, gpu_count, volume, route)
    offer = next((o for o in catalog or [] if o.id == gpu), None)
    peak = peak_flops_of(gpu)
    if peak is None:
        raise InputError(
            f"--gpu {gpu!r}: no bf16 peak known for it; use a RunPod GPU type id containing one of "
            f"{', '.join(PEAK_BF16_FLOPS)}"
        )
    measured = measured_mfu(sizing.run, volume)
    flops = sizing.flops
    if mfu is not None:
        mfu_source = "given with --mfu"
    elif measured:
        mfu, covers = measured
        mfu_source = f"measured by run {sizing.run} {covers} (status.json)"
        # A run's MFU counts the model's FLOPs (train/reporting.py), not the forward gradient checkpointing runs
        # again: applied to the FLOPs executed, the 4b preset's time and cost read 4/3 of what its run measured.
        flops /= sizing.recompute
    else:
        mfu = ASSUMED_MFU[sizing.workload]
        mfu_source = f"assumed for {sizing.workload} (no run measured it yet; --mfu to change)"
    hours = flops / (peak * mfu * gpu_count) / 3600
    hourly, source = _hourly_price(offer, gpu_count, cloud, spot, deploy, nodes)
    # Over either budget is over: the pod stops at the deploy config's, whatever this shell's says.
    budgets = [b for b in (cost.budget_usd(), deploy.budget.budget_usd if deploy else None) if b is not None]
    budget = min(budgets, default=None)
    memory_gb = offer.memory_gb if offer else next((gb for k, gb in GPU_MEMORY_GB.items() if k in gpu), None)
    return Estimate(sizing, gpu, gpu_count, memory_gb, mfu, mfu_source, hours, hourly, source, budget)


def _hourly_price(
    offer: Any, gpu_count: int, cloud: str, spot: bool, deploy: DeployConfig | None, nodes: int = 1
) -> tuple[float | None, str]:
    """$/hour of the pod (of all `nodes` of a cluster: `gpu_count` counts them all), as the pod counts it.

    The precedence, the pod's own (cost.py reads TRAINPOD_GPU_HOURLY_USD in the pod): the price a deploy
    config sends it (runpod/deploy.pod_env: budget.hourly_usd x nodes, or env.extra's), which its budget is
    counted with; else what RunPod bills, which a pod without one reads at boot: the catalog's list price;
    else this shell's TRAINPOD_GPU_HOURLY_USD, per pod, a guess for what the catalog does not list (spot).
    The shell's price never reaches a deployed pod, so it never overrides the deploy config's."""
    sent = deploy_hourly_usd(deploy) if deploy is not None else None
    if sent is not None:
        return sent, "the deploy config's budget.hourly_usd, which the pod counts its cost with"
    guessed = cost.hourly_usd()
    if guessed is not None:
        guessed *= nodes
    listed = offer.price(cloud) if offer else None
    if spot and guessed is not None:
        return guessed, "TRAINPOD_GPU_HOURLY_USD (RunPod's catalog lists no spot price)"
    if listed is not None:
        why = f"RunPod catalog, {cloud.lower()} cloud on-demand list price"
        if spot:
            why += " (the catalog lists no spot price: an upper bound; set budget.hourly_usd for spot)"
        return listed * gpu_count, why
    if guessed is not None:
        return guessed, "TRAINPOD_GPU_HOURLY_USD"
    return (
        None,
        "no price: no RunPod key for the catalog, no budget.hourly_usd, TRAINPOD_GPU_HOURLY_USD unset",
    )


def deploy_hourly_usd(deploy: DeployConfig) -> float | None:
    """The run's price per hour the deploy config sends its pod (None: the pod reads RunPod's at boot)."""
    from trainpod.runpod.deploy import pod_env

    sent = pod_env(deploy).get("TRAINPOD_GPU_HOURLY_USD")
    return None if sent is None else cost.hourly_usd({"TRAINPOD_GPU_HOURLY_USD": sent})


# ---------------------------------------------------------------------------------- report
def report(est: Estimate) -> list[str]:
    """The estimate as lines a person reads."""
    s = est.sizing
    memory = sum(s.memory.values())
    lines = [
        f"run {s.run}: {s.workload}, {s.parameters / 1e6:,.1f}M parameters"
        + (f" ({s.trainable / 1e6:,.2f}M trainable)" if s.trainable != s.parameters else ""),
        f"tokens     {s.tokens:,} in {s.steps:,} steps; {s.flops:.3g} FLOPs "
        f"({s.flops_per_token:.3g} per token)",
        f"time       {_hours(est.hours)} on {est.gpu_count} x {est.gpu} at {est.mfu:.0%} MFU, "
        f"{est.mfu_source}",
        "memory     " + _fit(memory, est.gpu_memory_gb) + " = "
        + " + ".join(f"{part} {value / 1e9:.1f}" for part, value in s.memory.items() if value >= 0.05e9),
        f"checkpoint {s.checkpoint_bytes / 1e9:.2f} GB, commits in {_commit_seconds(s.checkpoint_bytes)} "
        "at 200-400 MB/s (network volume)",
    ]  # fmt: skip
    if est.dollars is None:
        lines.append(f"cost       unknown: {est.price_source}")
    else:
        lines.append(f"cost       ${est.dollars:,.2f} at ${est.hourly_usd:.2f}/h ({est.price_source})")
    if est.budget_usd is not None:
        verdict = "not checked (no price)" if est.dollars is None else "OVER" if est.over_budget else "within"
        lines.append(f"budget     ${est.budget_usd:,.2f}: {verdict}")
    lines += [f"note       {note}" for note in s.notes]
    return lines


def _commit_seconds(size: int) -> str:
    """Seconds a commit takes at the fast and the slow volume speed, plus 0.5 s of fsyncs and renames."""
    fast, slow = (0.5 + size / speed for speed in sorted(VOLUME_BYTES_PER_S, reverse=True))
    return f"{fast:.1f}-{slow:.1f} s" if slow < 10 else f"{fast:.0f}-{slow:.0f} s"


def _hours(hours: float) -> str:
    minutes = round(hours * 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{max(minutes, 1)}m"


def _fit(total: float, gpu_gb: float | None) -> str:
    if gpu_gb is None:
        return f"{total / 1e9:.1f} GB per GPU (GPU memory unknown)"
    verdict = "fits" if total <= gpu_gb * 1e9 * 0.95 else "DOES NOT FIT"  # 5% for the allocator's reserve
    return f"{total / 1e9:.1f} GB of {gpu_gb:g} GB per GPU: {verdict}"
