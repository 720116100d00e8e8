"""The base model a finetune starts from: found on the volume or downloaded from the hub once into
cache/hf (HF_TOKEN for gated models; a hub outage is exit 75), and loaded in 16/32 bit or 4-bit NF4.

Shared by the finetune workload and whatever else loads an existing model (convert, chat, the
benchmarks), so the hub rules and the quantization settings live in one place.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from trainpod import atomic
from trainpod.config.finetune import BaseModelConfig, QuantizationSettings
from trainpod.diskspace import is_disk_full, volume_full
from trainpod.errors import InputError, TemporaryError
from trainpod.volume import Volume

log = logging.getLogger(__name__)

# What a model folder needs from the hub: weights, configs, tokenizer (no pickles, no other formats).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]
# The weights again in another layout, which transformers never reads (Mistral's repos: as large as the
# model, so a download of twice its size on the volume and on the clock).
HUB_OTHER_FORMATS = ["consolidated*.safetensors"]


def resolve_base_model(
    cfg: BaseModelConfig, volume: Volume, download: bool = True, pin: Path | None = None
) -> Path:
    """The base model's local folder: given as a folder, or downloaded from the hub into cache/hf.

    `pin` (a run's base_model.json): a hub id is taken at the commit the run's first start downloaded, so
    that a resume after a push to the branch trains on the same base as the steps before it."""
    raw = Path(cfg.path).expanduser()
    candidates = [raw] if raw.is_absolute() else [volume.root / raw, Path.cwd() / raw]
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder
    # "org/name" is a hub id unless "org" is a folder here (models/x on the volume is a path, not the hub).
    looks_local = any((root / raw.parts[0]).is_dir() for root in (volume.root, Path.cwd()))
    if raw.is_absolute() or cfg.path.startswith(".") or cfg.path.count("/") != 1 or looks_local:
        shown = " or ".join(str(c) for c in candidates)
        raise InputError(
            f"base_model.path={cfg.path!r}: no model folder (with config.json) at {shown}; point it at a "
            "folder saved with save_pretrained (relative paths start at the volume root), or give a hub id "
            "such as Qwen/Qwen2.5-0.5B"
        )
    if not download:
        return volume.cache() / "hf"  # preflight: a hub id is checked when it is downloaded
    pinned = _pinned_commit(cfg, pin)
    revision = pinned or cfg.revision
    folder = _download(cfg, volume, revision, pin if pinned else None)
    if pin is not None and revision != folder.name:  # hub snapshots are folders named by their commit
        atomic.write_json(pin, {"path": cfg.path, "revision": cfg.revision, "commit": folder.name})
        log.info("base model %s pinned at commit %s for this run (%s)", cfg.path, folder.name, pin)
    return folder


def pinned_commit(cfg: BaseModelConfig, pin: Path | None) -> str | None:
    """The hub commit `pin` holds for this base model and revision, else None."""
    return _pinned_commit(cfg, pin, quiet=True)


def _pinned_commit(cfg: BaseModelConfig, pin: Path | None, quiet: bool = False) -> str | None:
    try:
        pinned = atomic.read_json(pin) if pin is not None else None
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(pinned, dict) or not pinned.get("commit"):
        return None
    if (pinned.get("path"), pinned.get("revision")) != (cfg.path, cfg.revision):
        if not quiet:
            log.warning(
                "base_model is %s (revision %s) but this run started on %s (revision %s, commit %s); using the "
                "configured one",
                cfg.path,
                cfg.revision,
                pinned.get("path"),
                pinned.get("revision"),
                pinned["commit"],
            )
        return None
    return str(pinned["commit"])


def _download(cfg: BaseModelConfig, volume: Volume, revision: str | None, pinned_by: Path | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    log.info("downloading %s from the hub into %s", cfg.path, volume.cache() / "hf")
    try:
        return Path(
            snapshot_download(
                cfg.path,
                revision=revision,
                cache_dir=volume.cache() / "hf",
                allow_patterns=HUB_PATTERNS,
                ignore_patterns=HUB_OTHER_FORMATS,
                token=os.environ.get("HF_TOKEN") or None,
                # Offline, the cache is the hub. huggingface_hub 1.x (the lent GPU machines' 1.33) looks a
                # commit hash up online even then and raises OfflineModeIsEnabled, so a resume on the commit
                # the run pinned failed at every start (exit 75); local_files_only reads the cache in both 1.x
                # and 2.x.
                local_files_only=constants.HF_HUB_OFFLINE,
            )
        )
    except GatedRepoError:
        raise InputError(
            f"base_model.path={cfg.path!r} is gated: accept its licence on the hub and set HF_TOKEN to a token "
            "of that account"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise InputError(
            f"base_model.path={cfg.path!r} (revision {revision or 'main'}) is not on the hub, or is private "
            "and HF_TOKEN is missing; fix the id, or set HF_TOKEN"
            + (
                f" (this run trains on that commit, pinned in {pinned_by} at its first start; if it was removed "
                "from the hub, delete that file to resume on the branch's newest commit)"
                if pinned_by
                else ""
            )
        ) from None
    except Exception as exc:  # network and hub outages: the supervisor starts us again later
        raise failed_download(exc, "base_model.path", cfg.path, revision, volume) from exc


def failed_download(
    exc: BaseException, field: str, reference: str, revision: str | None, volume: Volume
) -> Exception:
    """The error for a hub download of the base model `reference` (set by `field`) that failed with `exc` and was
    neither refused nor gated: the finetune's and convert's rule. A full volume is exit 5 and a model missing from
    the cache offline (HF_HUB_OFFLINE) exit 2, since every start would meet the same volume or the same cache;
    anything else is an outage the next start tries again (75)."""
    from huggingface_hub import constants

    if is_disk_full(exc):
        return volume_full(volume.cache() / "hf", f"the base model {reference}")
    if constants.HF_HUB_OFFLINE:
        return InputError(
            f"{field}={reference!r} (revision {revision or 'main'}) is not in {volume.cache() / 'hf'}, and "
            f"HF_HUB_OFFLINE is set, so the hub is not asked: unset HF_HUB_OFFLINE to download it, or set {field} "
            "to a local folder"
        )
    return TemporaryError(
        f"downloading {field}={reference!r} failed ({type(exc).__name__}); the next start tries again"
    )


ATTENTION_FLAGS = {  # transformers' class flags for the attention implementations a model has
    "flash_attention_2": "_supports_flash_attn",
    "sdpa": "_supports_sdpa",
    "flex_attention": "_supports_flex_attn",
}


def supported_attention(folder: Path, cfg: BaseModelConfig) -> set[str] | None:
    """The attention implementations the model class at `folder` declares (eager always); None when
    unknown: remote code, or a model type transformers' causal-LM and image-text-to-text tables lack."""
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    if cfg.trust_remote_code:
        return None
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None  # loading the model says what is wrong with the folder
    for mapping in (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING,
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    ):
        if type(config) in mapping:
            model_class = mapping[type(config)]
            return {
                "eager",
                *(name for name, flag in ATTENTION_FLAGS.items() if getattr(model_class, flag, False)),
            }
    return None


# Model types whose packed rows leak one sample into the next: their layers carry a state from token to
# token outside attention (Mamba/SSM, linear attention, recurrent blocks), or they read positions from the
# attention mask rather than position_ids (OPT). A restart of position_ids and a block-diagonal mask keep
# samples apart in attention only. Measured on tiny models (a packed row's second sample against the
# sample alone): qwen3_next, falcon_h1, jamba, bamba, granitemoehybrid and opt leak; the pure state-space
# and recurrent types carry their state by construction.
PACKING_MIXES_SAMPLES = frozenset(
    {
        "qwen3_next", "falcon_h1", "jamba", "bamba", "granitemoehybrid", "opt",
        "mamba", "mamba2", "falcon_mamba", "zamba", "zamba2", "nemotron_h", "recurrent_gemma", "rwkv", "xlstm",
    }
)  # fmt: skip


def refuse_packing_that_mixes_samples(folder: Path, asked_by: str) -> None:
    """InputError (exit 2) when packing is asked for on a model type that would train each packed sample
    partly on its neighbour's text: the run would go through, silently worse. `asked_by`: the setting that
    asked for packing, as the message names it (`data.sft.packing=true`)."""
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return  # loading the model says what is wrong with the folder
    if model_type in PACKING_MIXES_SAMPLES:
        raise InputError(
            f"{asked_by}: the base model ({model_type}) carries what it read from one packed sample into the next "
            "(its layers pass a state along the row outside attention, or take positions from the attention "
            "mask), so each sample would be trained partly on its neighbour's text; set data.packing=false"
        )


def stored_quantization(folder: Path) -> str | None:
    """How a model folder saved quantized stores its weights (a hub '-bnb-4bit', GPTQ or AWQ model: its
    config.json's quantization_config): its quant_method, ' 4-bit' added for bitsandbytes' 4 bits; else None."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None  # loading the model says what is wrong with the folder
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    settings = quantization if isinstance(quantization, dict) else {}
    bits = " 4-bit" if settings.get("load_in_4bit") or settings.get("_load_in_4bit") else ""
    return f"{settings.get('quant_method') or 'quantized'}{bits}"


def _from_pretrained_kwargs(cfg: BaseModelConfig, attention: str) -> dict[str, Any]:
    return {
        "attn_implementation": attention,
        "trust_remote_code": cfg.trust_remote_code,
        "local_files_only": True,
    }


def _auto_class(vision: bool):
    """transformers' auto class: causal LMs, or image-text-to-text models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""
    import transformers

    # Its "Loading weights" bar redraws a line per tensor on stderr, which a pod's log keeps as one long
    # line of carriage returns; the run's own log says when the model is loaded.
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM


def load_model(
    folder: Path,
    cfg: BaseModelConfig,
    dtype: torch.dtype,
    attention: str,
    device: torch.device,
    vision: bool = False,
) -> torch.nn.Module:
    """The model at `folder` in `dtype` on `device`."""
    model = _auto_class(vision).from_pretrained(
        str(folder), dtype=dtype, **_from_pretrained_kwargs(cfg, attention)
    )
    return model.to(device)


def load_4bit(
    folder: Path,
    cfg: BaseModelConfig,
    quantization: QuantizationSettings,
    compute_dtype: torch.dtype,
    attention: str,
    device: torch.device,
    vision: bool = False,
    keep_modules: list[str] | None = None,
) -> torch.nn.Module:
    """The model at `folder` with bitsandbytes 4-bit linear layers (QLoRA's frozen base).

    `keep_modules`: module names left unquantized (bitsandbytes' llm_int8_skip_modules), e.g. a VLM's
    vision tower, which is small and loses accuracy in 4 bit; the output head is always kept.
    """
    from transformers import BitsAndBytesConfig

    quantization_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quantization.quant_type,
        bnb_4bit_use_double_quant=quantization.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        llm_int8_skip_modules=[*(keep_modules or []), "lm_head"] if keep_modules else None,
    )
    model = _auto_class(vision).from_pretrained(
        str(folder),
        quantization_config=quantization_config,
        device_map={"": device},
        dtype=compute_dtype,
        **_from_pretrained_kwargs(cfg, attention),
    )
    _keep_cpu_4bit_layout(model)
    return model


def _keep_cpu_4bit_layout(model: torch.nn.Module) -> None:
    """Evaluate 4-bit layers on CPU with the same kernels as training.

    On CPUs with AVX512-BF16, bitsandbytes repacks a Linear4bit's weights in place for an
    inference kernel the first time it runs without grad (our evals). That kernel needs output
    sizes divisible by 32, and the repacked layout would then be what training continues on.
    """
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
