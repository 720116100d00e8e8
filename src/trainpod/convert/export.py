"""A committed pretrain checkpoint (any step, not only the final one) -> an HF-format model.

The model is rebuilt exactly as the pretrain workload builds it (runs/<run>/config.yaml, the tokenizer the
run kept in runs/<run>/tokenizer/, or for a run older than that the one its dataset's manifest names), the
checkpoint is verified against its manifest, and its weights (model.safetensors, or an FSDP run's DCP
shards) are loaded and exported with the pretrain workload's own export_hf, with the model card of a
pretrain's export (trainpod/card.py) from the checkpoint's progress.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trainpod.card import pretrained_model_card
from trainpod.checkpoint import CheckpointStore
from trainpod.checkpoint.store import LATEST, MANIFEST, step_dir_name
from trainpod.config import load_config
from trainpod.config.convert import ExportTask
from trainpod.config.pretrain import PretrainConfig
from trainpod.context import RunContext
from trainpod.data.datagen import load_dataset_manifest
from trainpod.diskspace import check_room
from trainpod.errors import InputError
from trainpod.preemption import PreemptionWatch
from trainpod.train.export import DTYPES, export_hf
from trainpod.train.model import build_model, llama_config, parameter_count
from trainpod.train.shape import padded_vocab
from trainpod.train.sharding import has_shards, load_sharded_weights
from trainpod.train.state import load_weights
from trainpod.volume import RunDir, Volume


@dataclass(frozen=True)
class CheckpointSource:
    run: RunDir
    step: int
    path: Path
    config: PretrainConfig
    tokenizer_dir: Path
    vocab_size: int

    def files(self) -> dict[str, Path]:
        # The checkpoint's manifest holds the sha256 of every file in it: hashing it covers the weights.
        return {
            "checkpoint/manifest.json": self.path / MANIFEST,
            "run/config.yaml": self.run.config,
            "tokenizer/tokenizer.json": self.tokenizer_dir / "tokenizer.json",
        }

    def dtype(self, requested: str) -> str:
        if requested != "auto":
            return requested
        recorded = self.config.export.dtype
        return "float32" if recorded == "auto" else recorded


def resolve_checkpoint(task: ExportTask, run_name: str, volume: Volume) -> CheckpointSource:
    run = volume.run(task.run or run_name)
    if not run.config.is_file():
        raise InputError(
            f"run {run.name} has no {run.config}: it is not a pretrain run on this volume. Set the export "
            "task's `run` to a pretrain run's name (the folder under runs/)"
        )
    _refuse_a_finetune_run(run)
    config = load_config(PretrainConfig, run.config)
    step = _step(task.step, run)
    path = run.checkpoints / step_dir_name(step)
    ctx = RunContext(volume, run, PreemptionWatch())  # for its dataset and tokenizer lookups alone
    tokenizer_dir, tokenizer_vocab = ctx.carried_tokenizer() or _dataset_tokenizer(ctx, config)
    vocab = config.model.vocab_size or padded_vocab(tokenizer_vocab)
    return CheckpointSource(run, step, path, config, tokenizer_dir, vocab)


def _dataset_tokenizer(ctx: RunContext, config: PretrainConfig) -> tuple[Path, int]:
    """Where a run started before runs kept their tokenizer finds it: through its dataset's manifest."""
    manifest = load_dataset_manifest(ctx.resolve_dataset(config.data.dataset))
    return ctx.resolve_tokenizer(config.data.tokenizer, manifest), manifest["tokenizer"]["vocab_size"]


def _refuse_a_finetune_run(run: RunDir) -> None:
    """A finetune's config read as a pretrain one gave a list of eight unrelated config problems."""
    import yaml

    try:
        tree = yaml.safe_load(run.config.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return  # load_config names what is wrong with it
    if isinstance(tree, dict) and "base_model" in tree:
        raise InputError(
            f"run {run.name} is a finetune run, and `export` converts a pretrain run's checkpoints; a finetune "
            f"exports itself (runs/{run.name}/export/adapter or export/hf): use a `merge` task to fold its "
            "adapter into the base, or set the export task's `run` to a pretrain run"
        )


def _step(requested: int | str, run: RunDir) -> int:
    store = CheckpointStore(run.checkpoints)
    steps = sorted(c.step for c in store.committed())
    if requested == "latest":
        try:
            name = (run.checkpoints / LATEST).read_text(encoding="utf-8").strip()
            latest = int(name.removeprefix("step-"))
        except (FileNotFoundError, ValueError):
            if steps:
                return steps[-1]
            raise InputError(
                f"run {run.name} has no committed checkpoint under {run.checkpoints}; train it first "
                f"(`trainpod run pretrain`) or export another run"
            ) from None
        if latest not in steps:  # its folder deleted by hand, or moved aside as invalid
            raise InputError(
                f"run {run.name}'s checkpoints/LATEST names {name}, which is not among its committed checkpoints "
                f"(committed steps: {', '.join(map(str, steps)) or 'none'}); set step to one of them"
            )
        return latest
    if requested not in steps:
        raise InputError(
            f"run {run.name} has no committed checkpoint step-{requested}; committed steps: "
            f"{', '.join(map(str, steps)) or 'none'} (retention keeps checkpoint.keep_last and keep_best). "
            "Set step to one of them or to latest"
        )
    return int(requested)


def verify_checkpoint(source: CheckpointSource) -> None:
    """The checkpoint's files that write_export reads against its manifest's hashes (exit 2 when one fails): not
    the optimizer state beside the weights (AdamW's, twice them: minutes of reads on the network volume), except
    in a sharded checkpoint, whose DCP files hold each rank's weights and optimizer state together."""
    store = CheckpointStore(source.run.checkpoints)
    read = None if has_shards(source.path) else ("model.safetensors", "trainer_state.json")
    manifest, reason = store.verify(source.path, read)
    if manifest is None:
        raise InputError(
            f"checkpoint {source.path} fails verification ({reason}); export another step "
            f"(committed: {', '.join(str(c.step) for c in store.committed())})"
        )


def write_export(source: CheckpointSource, folder: Path, dtype: str) -> None:
    """Load the checkpoint (verified by verify_checkpoint) and export it to `folder` (made here)."""
    model_config = llama_config(source.config.model, source.vocab_size, source.config.train.seq_len, "sdpa")
    model = build_model(model_config, source.config.train.seed)
    # Checked before the checkpoint's read and the write: a 7B export is about 14 GB, minutes to ENOSPC.
    weight_bytes = sum(p.numel() for p in model.parameters()) * DTYPES[dtype].itemsize
    check_room(folder.parent, weight_bytes, f"the exported model ({dtype})")
    state = json.loads((source.path / "trainer_state.json").read_text(encoding="utf-8"))
    try:
        if has_shards(source.path):  # an FSDP run's: DCP shards, no model.safetensors
            load_sharded_weights(model, source.path)
        else:
            load_weights(model, (source.path / "model.safetensors").read_bytes(), state["aliased_weights"])
    except ValueError as exc:
        raise InputError(f"{source.path}: {exc}") from None
    progress = state.get("progress") or {}
    results = {
        "parameters": parameter_count(model_config),
        "step": source.step,
        "tokens_seen": progress.get("tokens_seen"),
        "loss": progress.get("last_loss"),
        "eval_loss": progress.get("last_eval_loss"),
    }
    card = pretrained_model_card(source.run.name, source.config.data.dataset, model_config, results)
    # No export manifest: the conversion output's own (convert/output.py) covers the folder.
    export_hf(model, source.tokenizer_dir, folder, DTYPES[dtype], model_card=card, manifest=False)
