"""Where a conversion's inputs are: the adapter folder (a path or `run:<name>`) and its base model."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from trainpod.config.convert import RUN_PREFIX
from trainpod.errors import InputError
from trainpod.volume import Volume

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a merge needs from a hub model: weights, configs, tokenizer with its chat template (transformers
# writes that to chat_template.jinja), not other formats' copies.
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def on_volume(raw: str, volume: Volume) -> Path:
    return Path(raw) if os.path.isabs(raw) else volume.root / raw


def resolve_adapter(ref: str, volume: Volume) -> Path:
    if ref.startswith(RUN_PREFIX):
        name = ref.removeprefix(RUN_PREFIX)
        if not name:
            raise InputError(f"adapter={ref!r} names no run; write it as {RUN_PREFIX}<run name>")
        return volume.run(name).export / "adapter"
    return on_volume(ref, volume)


def base_reference(configured: str | None, summary: dict | None, adapter_config: dict) -> str:
    """The base model as the user or the training run named it (a path or a hub id)."""
    folder = (summary or {}).get("base_model_folder")  # where the finetune found a hub id's download
    for candidate in (
        configured,
        folder if folder and (Path(folder) / "config.json").is_file() else None,
        (summary or {}).get("base_model"),
        adapter_config.get("base_model_name_or_path"),
    ):
        if candidate:
            return str(candidate)
    raise InputError(
        "the base model is unknown: the config has no base_model, the adapter folder no "
        "training_summary.json naming one, and adapter_config.json no base_model_name_or_path. "
        "Set base_model to the folder of the model the adapter was trained on"
    )


def local_base(reference: str, volume: Volume) -> Path | None:
    """The base model's folder when it is on this machine, else None (a hub id not fetched yet)."""
    path = on_volume(reference, volume)
    if (path / "config.json").is_file():
        return path
    # "org/name" is a hub id unless "org" is a folder on the volume, as the finetune reads it: a misspelt
    # models/<name> asked the hub for it (exit 75 offline), or became an mlx adapter naming it as its base.
    looks_local = (volume.root / reference.split("/")[0]).is_dir()
    if _HUB_ID.match(reference) and not path.exists() and not looks_local:
        return None
    raise InputError(
        f"base model {reference!r}: {path} is not a model folder (no config.json there). Set base_model "
        "to the folder of the model the adapter was trained on (absolute or relative to the volume root), "
        "or to a Hugging Face id like org/name"
    )


def fetch_base(reference: str, volume: Volume, revision: str | None = None) -> Path:
    """A local folder as it is; a hub id downloaded (once) at `revision` (the finetune's
    base_model.revision) into the volume's cache/hf/, where the finetune downloads it too."""
    path = local_base(reference, volume)
    if path is not None:
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # the finetune's rules: both fill cache/hf
    from trainpod.train.base_model import HUB_OTHER_FORMATS, failed_download

    log.info(
        "fetching the base model %s (revision %s) from the Hugging Face hub into %s",
        reference,
        revision or "main",
        volume.cache() / "hf",
    )
    try:
        return Path(
            snapshot_download(
                reference,
                revision=revision,
                cache_dir=volume.cache() / "hf",
                allow_patterns=_HUB_PATTERNS,
                ignore_patterns=HUB_OTHER_FORMATS,
                token=os.environ.get("HF_TOKEN") or None,
                # Offline (HF_HUB_OFFLINE), the cache is the hub. huggingface_hub 1.x (the lent GPU machines'
                # 1.33) looks the commit the finetune pinned up online even then and raises OfflineModeIsEnabled;
                # local_files_only reads the cache in 1.x and 2.x alike, as the finetune's download does.
                local_files_only=constants.HF_HUB_OFFLINE,
            )
        )
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError):
        raise InputError(
            f"base model {reference!r} (revision {revision or 'main'}) is not on the Hugging Face hub or needs "
            "access: check the name and revision, accept its license on the hub and set HF_TOKEN, or set "
            "base_model to a local folder"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise failed_download(exc, "base_model", reference, revision, volume) from exc
