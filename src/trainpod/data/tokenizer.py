"""The dataset's tokenizer: a byte-level BPE trained on the sources, or an existing folder reused.

The folder holds `tokenizer.json` (the `tokenizers` library's format), a `tokenizer_config.json` and
`special_tokens_map.json` that make `transformers.AutoTokenizer.from_pretrained(folder)` load it as
a `PreTrainedTokenizerFast` with bos/eos = `<|endoftext|>`, and `trainpod_tokenizer.json` with the
training settings, so a second run with the same settings reuses it instead of training again, and the
commit each hub dataset was read at, which a dataset begun with it reads too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from trainpod.atomic import publish_dir, read_json, temp_name, write_json
from trainpod.checkpoint.lease import one_writer
from trainpod.config.datagen import TokenizerSettings
from trainpod.errors import InputError

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
SETTINGS_FILE = "trainpod_tokenizer.json"
HUB_REVISIONS = "hub_revisions"  # in SETTINGS_FILE: the commit each hub dataset was read at, by its name
MODEL_MAX_LENGTH = (
    1_000_000  # transformers' "no limit" sentinel is a huge int; the model config sets the real one
)


@dataclass(frozen=True)
class TokenizerInfo:
    """A tokenizer folder ready to encode with, as the manifest records it."""

    folder: Path
    name: str | None  # the folder's name under tokenizers/ on the volume; None for a tokenizer.path
    sha256: str
    vocab_size: int
    eot_token: str
    eot_id: int
    # A tokenizer.path on the volume, relative to its root: found again where the volume is mounted now
    # (the recorded absolute path is where it was mounted when datagen ran, or a laptop's before a push).
    volume_path: str | None = None

    def to_json(self) -> dict:
        return {
            "path": str(self.folder),
            "name": self.name,
            "volume_path": self.volume_path,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eot_token": self.eot_token,
            "eot_id": self.eot_id,
        }


def tokenizer_hash(folder: Path) -> str:
    """sha256 of the folder's tokenizer.json: what identifies a tokenizer in manifests."""
    digest = hashlib.sha256()
    with open(Path(folder) / TOKENIZER_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_tokenizer(folder: Path) -> Tokenizer:
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        raise InputError(
            f"tokenizer folder {folder} has no {TOKENIZER_FILE}; point tokenizer.path at a folder "
            "saved by `tokenizers` or `transformers` (save_pretrained), or drop tokenizer.path to train one"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust loader raises a bare Exception for any malformed file
        raise InputError(
            f"{path} is not a valid tokenizers file ({exc}); re-save it or train a new one"
        ) from None


def describe_tokenizer(
    folder: Path, eot_token: str, name: str | None = None, volume_path: str | None = None
) -> TokenizerInfo:
    tokenizer = load_tokenizer(folder)
    eot_id = tokenizer.token_to_id(eot_token)
    if eot_id is None:
        raise InputError(
            f"tokenizer {folder} has no token {eot_token!r}; set tokenizer.eot_token to its "
            "end-of-text token (e.g. '</s>')"
        )
    # The id space, not the token count: a tokenizer.json may leave ids unused (an added token at
    # 70000 after 400 others), and both the shards' dtype and the model's embedding rows need the top id.
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    return TokenizerInfo(
        Path(folder),
        name,
        tokenizer_hash(folder),
        max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True)),
        eot_token,
        eot_id,
        volume_path,
    )


def eot_id(folder: Path, eot_token: str = "<|endoftext|>") -> int:
    return describe_tokenizer(folder, eot_token).eot_id


def train_bpe(documents: Iterable[str], settings: TokenizerSettings) -> Tokenizer:
    """A GPT-2-style byte-level BPE: every byte is in the alphabet, so no text is unknown."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=settings.vocab_size,
        min_frequency=settings.min_frequency,
        special_tokens=[settings.eot_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def _transformers_files(eot_token: str) -> dict[str, dict]:
    """tokenizer_config.json and special_tokens_map.json as PreTrainedTokenizerFast.save_pretrained writes them."""
    special = {"bos_token": eot_token, "eos_token": eot_token, "unk_token": eot_token}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        **special,
    }
    return {"tokenizer_config.json": config, "special_tokens_map.json": special}


def save_tokenizer_folder(tokenizer: Tokenizer, target: Path, settings_record: dict, eot_token: str) -> None:
    """Write every file into a temp folder and rename it into place: a reader never sees half of it."""
    tmp = temp_name(target)
    tmp.mkdir(parents=True)
    try:
        tokenizer.save(str(tmp / TOKENIZER_FILE))
        for name, content in _transformers_files(eot_token).items():
            (tmp / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        write_json(tmp / SETTINGS_FILE, settings_record)
        publish_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare_tokenizer(
    settings: TokenizerSettings,
    target: Path,
    volume_root: Path,
    training_documents: Iterable[str],
    output_settings: dict,
    hub_revisions: dict[str, str] | None = None,
) -> TokenizerInfo:
    """Reuse `settings.path`, or the folder at `target` when it was trained the same way; else train it.

    `output_settings` is the dataset config's (DatagenConfig.output_settings): its tokenizer settings
    and sources are what a tokenizer trained here records and is recognised by. `hub_revisions`: the commit
    each hub dataset of the sources is read at, recorded beside them (trained_hub_revisions) but no part of
    what recognises the tokenizer: one trained before they were recorded is reused as it was."""
    if settings.path is not None:
        folder = Path(settings.path).expanduser()
        folder = folder if folder.is_absolute() else volume_root / folder
        log.info("using the existing tokenizer %s (tokenizer.path)", folder)
        on_volume = folder.is_relative_to(volume_root)
        return describe_tokenizer(
            folder,
            settings.eot_token,
            volume_path=str(folder.relative_to(volume_root)) if on_volume else None,
        )
    record = _training_record(output_settings)
    if hub_revisions:
        record[HUB_REVISIONS] = hub_revisions
    if not target.exists():
        # Two datasets naming one tokenizer, made at once on two pods, removed each other's temp folder and
        # the second rename hit the first's folder (a crash): one trains it, the other exits 75 and reuses it.
        with one_writer(target, "tokenizer"):
            if not target.exists():  # read again under the lease: the writer waited out may have made it
                return _train(settings, target, training_documents, record)
    _check_same_training(target, record)
    log.info("reusing tokenizer %s: trained earlier with the same settings", target)
    return describe_tokenizer(target, settings.eot_token, target.name)


def _train(
    settings: TokenizerSettings, target: Path, training_documents: Iterable[str], record: dict
) -> TokenizerInfo:
    for leftover in target.parent.glob(f"{target.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    log.info(
        "training a byte-level BPE (vocab %d) on up to %d documents",
        settings.vocab_size,
        settings.max_train_documents,
    )
    save_tokenizer_folder(train_bpe(training_documents, settings), target, record, settings.eot_token)
    info = describe_tokenizer(target, settings.eot_token, target.name)
    log.info("tokenizer saved to %s (vocab %d, sha256 %s)", target, info.vocab_size, info.sha256[:12])
    return info


def _training_record(output_settings: dict) -> dict:
    """What a tokenizer trained here is recognised by: its training settings and the sources it read."""
    return {
        "settings": {k: v for k, v in output_settings["tokenizer"].items() if k not in ("name", "path")},
        "sources": output_settings["sources"],
    }


def trained_hub_revisions(folder: Path, output_settings: dict) -> dict[str, str] | None:
    """The commits the hub datasets were read at to train the tokenizer in `folder`, when it was trained here
    on these settings and sources and recorded them; else None (no such tokenizer yet, another one, or one
    trained before they were recorded)."""
    try:
        previous = read_json(folder / SETTINGS_FILE)
    except (OSError, ValueError):
        return None
    if not isinstance(previous, dict) or _without_revisions(previous) != _training_record(output_settings):
        return None
    revisions = previous.get(HUB_REVISIONS)
    if not isinstance(revisions, dict) or not all(isinstance(v, str) for v in revisions.values()):
        return None
    return revisions


def _without_revisions(record: dict | None) -> dict | None:
    return {k: v for k, v in record.items() if k != HUB_REVISIONS} if isinstance(record, dict) else record


def _check_same_training(folder: Path, record: dict) -> None:
    settings_path = folder / SETTINGS_FILE
    previous = read_json(settings_path) if settings_path.is_file() else None
    if _without_revisions(previous) != _without_revisions(record):
        raise InputError(
            f"tokenizer folder {folder} exists but was not trained with these settings and sources "
            f"(see {settings_path.name}); it is not overwritten. Set tokenizer.name to a new name, "
            f"set tokenizer.path={folder} to use it as it is, or delete the folder"
        )
