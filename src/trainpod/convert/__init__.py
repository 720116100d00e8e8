"""`trainpod run convert`: a finetune's PEFT adapter to an mlx-lm adapter or merged into its base model,
and pretrain checkpoints to HF models; outputs in runs/<name>/export/<output>/, pushed to the Hugging
Face Hub by `hub` tasks (convert/hub.py).

    TRAINPOD_CONFIG=configs/convert/tiny.yaml TRAINPOD_VOLUME=/tmp/vol trainpod run convert

Every input is checked before anything is written (a refused adapter or a base model that does
not fit is exit 2). Each output is published atomically with a manifest.json; an output whose
inputs and settings are unchanged is skipped, so running the same config again does nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainpod.config.convert import ConvertConfig, ExportTask, HubTask, MergeTask, MlxTask, Task
from trainpod.convert import adapter as peft_adapter
from trainpod.convert import export, hub, inputs, merge, mlx, output
from trainpod.errors import InputError, Preempted
from trainpod.preemption import PreemptionWatch, WorkAbandoned
from trainpod.volume import RunDir, Volume

log = logging.getLogger(__name__)

__all__ = ["ConvertPlan", "plan_convert", "run_convert"]


@dataclass
class AdapterInputs:
    adapter: peft_adapter.PeftAdapter
    base_ref: str  # as the user or the training run named it
    base_dir: Path | None  # None: a hub id not fetched (an mlx task alone does not need it)
    base_name: str  # as the user or the training named it: a hub id rather than the volume's download of it
    base_revision: str | None  # the commit of the hub id base_name that the finetune trained on

    @classmethod
    def resolve(cls, config: ConvertConfig, volume: Volume, need_base: bool) -> AdapterInputs:
        adapter = peft_adapter.load_adapter(inputs.resolve_adapter(config.adapter_ref, volume))
        base_ref = inputs.base_reference(config.base_model, adapter.summary, adapter.config)
        summary = adapter.summary or {}
        # The revision the finetune pinned, when the base is the hub id it trained on (not one set here).
        revision = summary.get("base_model_revision") if base_ref == summary.get("base_model") else None
        base_dir = (
            inputs.fetch_base(base_ref, volume, revision)
            if need_base
            else inputs.local_base(base_ref, volume)
        )
        vision = merge.vision_settings(adapter.summary) is not None
        if base_dir is not None and (need_base or vision):  # mlx-lm may build what transformers cannot
            merge.check_base_buildable(base_dir, vision)
        if base_dir is not None:
            peft_adapter.check_against_base(adapter, base_dir)
        base_name = config.base_model or (adapter.summary or {}).get("base_model") or base_ref
        base_revision = summary.get("base_model_revision") if base_name == summary.get("base_model") else None
        return cls(adapter, base_ref, base_dir, str(base_name), base_revision)

    def base_files(self) -> dict[str, Path]:
        return _folder_files(self.base_dir, "base")

    def merge_files(self) -> dict[str, Path]:
        """Every input a merge reads: the adapter, the files beside it (the tokenizer and processor the merged
        model takes from there, so that a chat template fixed in them is merged again) and the base."""
        return self.adapter.files() | _folder_files(self.adapter.folder, "adapter") | self.base_files()

    def base_layers(self) -> int | None:
        if self.base_dir is None:
            return None
        return peft_adapter.base_layer_count(peft_adapter.base_config(self.base_dir))

    def base_model_type(self) -> str | None:
        """The base's config.json model_type, None where the base is no local folder."""
        if self.base_dir is None:
            return None
        return peft_adapter.base_config(self.base_dir).get("model_type")


def _folder_files(folder: Path, label: str) -> dict[str, Path]:
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    return {f"{label}/{p.name}": p for p in files}


def run_convert(config: ConvertConfig, volume: Volume, watch: PreemptionWatch) -> list[Path]:
    """Make every task's output (or find it finished) and return their folders, in task order.

    Raises InputError (exit 2) for inputs that are missing, refused or do not fit, and Preempted
    (exit 143) when a stop is requested: between tasks, or during one, which is abandoned at once (its
    temp folder removed by the next start); finished outputs stay and are skipped next time.
    """
    return plan_convert(config, volume).make(watch)


@dataclass
class Output:
    """One task's output: where it goes, what it is made from, and how."""

    task: Task
    target: Path
    files: dict[str, Path]
    settings: dict[str, Any]
    write: Callable[[output.Staging], None]
    # Checks of the inputs too slow to make for an output that is finished already (a checkpoint's hashes).
    check: Callable[[], None] = lambda: None

    def finished(self) -> bool:
        key = output.output_key(output.describe_present_inputs(self.files, self.target), self.settings)
        return output.is_finished(self.target, output.read_manifest(self.target), key)


@dataclass
class ConvertPlan:
    """Every task's output, its inputs resolved and checked: what `make` writes."""

    outputs: list[Output | hub.HubPush]

    def make(self, watch: PreemptionWatch) -> list[Path]:
        """Check the inputs of every output not finished yet, all before the first is written (a corrupt
        checkpoint is exit 2 at the start, not after an hour's merge), then make them in task order."""
        done: list[Path] = []
        try:
            for item in {id(item): item for item in self.outputs}.values():  # one made for two tasks: once
                if not item.finished():
                    with watch.abandoning():
                        item.check()
            for item in self.outputs:
                if item.target in done:  # made for an earlier task already (_one_output_per_folder)
                    done.append(item.target)
                    continue
                if watch.requested:
                    raise WorkAbandoned(watch.signal_name)
                done.append(item.push(watch) if isinstance(item, hub.HubPush) else _produce(item, watch))
        except WorkAbandoned:
            # A stop in the middle of a task ends it at once (PreemptionWatch.abandoning): run on, a merge of
            # a large model met the SIGKILL with the run's lease held, which a new pod then waited out.
            raise Preempted(
                f"stopped by {watch.signal_name or 'signal'}; finished: "
                f"{', '.join(p.name for p in done) or 'nothing'}. Run the same config again to continue"
            ) from None
        return done


def plan_convert(config: ConvertConfig, volume: Volume) -> ConvertPlan:
    """Resolve and check every task's inputs, writing nothing; InputError (exit 2) for the first that is
    missing, refused or does not fit."""
    export_root = volume.run(config.name).export
    adapter_tasks = [t for t in config.task if isinstance(t, MlxTask | MergeTask)]
    sources: AdapterInputs | None = None
    if adapter_tasks:
        need_base = any(isinstance(t, MergeTask) for t in adapter_tasks)
        sources = AdapterInputs.resolve(config, volume, need_base)
        if any(isinstance(t, MlxTask) for t in adapter_tasks):
            problems = mlx.refusals(sources.adapter)
            if problems:  # before any output is written, not after the merge
                raise InputError(
                    f"the adapter {sources.adapter.folder} cannot be converted to an mlx-lm adapter without "
                    "changing what it computes:\n  - " + "\n  - ".join(problems)
                )
        if need_base:
            problems = merge.refusals(sources.adapter, sources.base_dir)
            if problems:
                raise InputError(
                    f"the adapter {sources.adapter.folder} cannot be merged into its base:\n  - "
                    + "\n  - ".join(problems)
                )
    made: list[Output | None] = []  # each task's output; None for a hub task's push, planned below
    for task in config.task:
        if isinstance(task, MlxTask):
            made.append(_mlx(task, sources, export_root))
        elif isinstance(task, MergeTask):
            made.append(_merge(task, sources, export_root))
        elif isinstance(task, HubTask):
            made.append(None)
        else:
            made.append(_export(task, config.name, volume, export_root))
    outputs: list[Output | hub.HubPush] = [
        item if item is not None else _push(task, number, made, volume.run(config.name))
        for number, (task, item) in enumerate(zip(config.task, made, strict=True), start=1)
    ]
    return ConvertPlan(_one_output_per_folder(outputs))


def _push(task: HubTask, number: int, made: list[Output | None], run: RunDir) -> hub.HubPush:
    """The push of task `number`, its source found among the tasks' outputs: one made by an earlier task is
    checked once it is made; one made by a later task would be replaced after the push (exit 2)."""
    makers = [
        (n, item)
        for n, item in enumerate(made, start=1)
        if item is not None and item.target == run.export / task.source
    ]
    earlier = [item.task.kind for n, item in makers if n < number]
    push = hub.plan_push(task, number, run.export, run.hub, run.name, earlier[0] if earlier else None)
    later = [(n, item.task.kind) for n, item in makers if n > number]
    if later:
        raise InputError(
            f"task {number} (hub) pushes {push.source}, which task {later[0][0]} ({later[0][1]}) makes after it; "
            "put the hub task after that one"
        )
    return push


def _one_output_per_folder(outputs: list[Output]) -> list[Output]:
    """Two tasks that name the same folder (`export` of step 4 and of `latest` at 4, both hf-step-4): the
    same conversion is made once for both; different ones are exit 2, since the second replaced the first
    and the user got one of the two outputs asked for, each rerun writing both again."""
    first_by_target: dict[Path, tuple[int, Output]] = {}
    planned = []
    for number, item in enumerate(outputs, start=1):
        first_number, first = first_by_target.setdefault(item.target, (number, item))
        if first is not item and _made_alike(first, item):
            item = first
        elif first is not item:
            raise InputError(
                f"tasks {first_number} ({_described(first)}) and {number} ({_described(item)}) both write "
                f"{item.target}, so the second would replace the first; give one of them its own `output`"
            )
        planned.append(item)
    return planned


def _made_alike(one: Output, other: Output) -> bool:
    """Two exports of the same checkpoint in the same dtype, however the tasks name them (step 4, or `latest`
    at step 4; dtype auto, or the dtype auto means): their inputs and resolved settings are the same."""
    settings = [{k: v for k, v in o.settings.items() if k != "task"} for o in (one, other)]
    exports = isinstance(one.task, ExportTask) and isinstance(other.task, ExportTask)
    return exports and one.files == other.files and settings[0] == settings[1]


def _described(item: Output) -> str:
    details = {k: v for k, v in item.settings.items() if k in ("step", "dtype")}
    return ", ".join([item.task.kind, *(f"{k} {v}" for k, v in details.items())])


def _produce(item: Output, watch: PreemptionWatch) -> Path:
    started = time.monotonic()
    if output.produce(item.target, item.files, item.settings, item.write, watch.abandoning):
        log.info("wrote %s in %.1f s", item.target, time.monotonic() - started)
    else:
        log.info("%s is up to date (same inputs and settings); skipping", item.target)
    return item.target


def _mlx(task: MlxTask, sources: AdapterInputs, export_root: Path) -> Output:
    layers = sources.base_layers()
    settings = {"task": task.model_dump(mode="json"), "base_model": sources.base_name, "base_layers": layers}
    if sources.base_revision:  # the README loads it; set only for a hub base, so other outputs keep their key
        settings["base_revision"] = sources.base_revision
    model_type = mlx.mlx_model_type(sources.adapter, sources.base_model_type())
    if mlx.renames_module_names(model_type):  # made again under mlx-lm's names (GPT-J's were HF's before)
        settings["base_model_type"] = model_type
    chat_format = mlx.trained_template_name(sources.adapter)
    if chat_format:  # made again with its chat format, as above
        settings["chat_format"] = chat_format
    return Output(
        task,
        export_root / task.output,
        sources.adapter.files(),
        settings,
        lambda staging: mlx.write_mlx_adapter(
            sources.adapter, staging, sources.base_name, layers, sources.base_revision, model_type
        ),
    )


def _merge(task: MergeTask, sources: AdapterInputs, export_root: Path) -> Output:
    dtype = task.dtype
    if dtype == "auto":
        dtype = merge.base_dtype(peft_adapter.base_config(sources.base_dir))
    quantization = sources.adapter.quantization
    settings = {
        "task": task.model_dump(mode="json"),
        "dtype": dtype,
        "quantization": quantization if task.qlora_base == "dequantized" else None,
    }
    return Output(
        task,
        export_root / task.output,
        sources.merge_files(),
        settings,
        lambda staging: merge.write_merged(
            sources.adapter,
            sources.base_dir,
            staging,
            dtype,
            quantization,
            task.qlora_base,
            task.max_shard_bytes,
            sources.base_name,
            sources.base_revision,
        ),
    )


def _export(task: ExportTask, name: str, volume: Volume, export_root: Path) -> Output:
    source = export.resolve_checkpoint(task, name, volume)
    dtype = source.dtype(task.dtype)
    settings = {"task": task.model_dump(mode="json"), "step": source.step, "dtype": dtype}
    target = export_root / (task.output or f"hf-step-{source.step}")
    if task.output is None:
        _refuse_another_runs_export(target, source)
    return Output(
        task,
        target,
        source.files(),
        settings,
        lambda staging: export.write_export(source, staging.folder, dtype),
        check=lambda: export.verify_checkpoint(source),
    )


def _refuse_another_runs_export(target: Path, source: export.CheckpointSource) -> None:
    """hf-step-<N> by default: a name the user did not choose, which another run's step N may hold already
    (one convert config collecting several runs' exports); replacing it lost that export without a word,
    and with it that run's weights once its retention had deleted the checkpoint."""
    recorded = (output.read_manifest(target) or {}).get("inputs", {}).get("run/config.yaml", {}).get("path")
    # By the run's name: the volume may have been mounted elsewhere (/workspace, /runpod-volume) then.
    if recorded is not None and Path(recorded).parent.name != source.run.name:
        raise InputError(
            f"{target} holds the export of another run's step {source.step} (made from {recorded}); give this "
            f"task its own `output`, like hf-{source.run.name}-step-{source.step}"
        )
