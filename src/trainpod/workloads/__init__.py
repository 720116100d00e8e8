"""The one list of workloads. `trainpod run`, `trainpod boot`, the lifecycle and deploy all read it.

    trainpod run pretrain --config configs/pretrain/tiny.yaml
    TRAINPOD_WORKLOAD=finetune TRAINPOD_CONFIG=... trainpod boot

Adding a workload is one module in this package plus one line in REGISTRY (docs/design.md,
"Workloads"). The module provides the three functions of `WorkloadModule`; the line names its config
class; its `Kind` says which lifecycle wraps it (workloads/lifecycle.py): the run folder, the lease,
DONE, ranks per GPU. Modules are imported only when their workload runs, so `trainpod --help` does not
import torch, and a config is validated (`trainpod run`'s refusal of a bad one, the check of the workload
config `deploy` makes, `config fields`) without the seconds torch and transformers take to import.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass
from typing import Any, Protocol

from trainpod.errors import ConfigError


class Kind(enum.Enum):
    """What the lifecycle does around a workload's `run` (docs/design.md, "Workloads")."""

    TRAINING = "training"  # one rank per GPU; run folder, lease, checkpoints, status, DONE
    COMMAND = "command"  # the user's program under the training lifecycle, as one process
    DATA = "data"  # writes datasets/ and tokenizers/, resuming from its own progress; no run folder
    CONVERSION = "conversion"  # writes runs/<run>/export/ under the run's lease; never DONE
    SERVICE = "service"  # watches other runs (supervise); its config is a deploy config

    @property
    def owns_run_folder(self) -> bool:
        """Whether the workload's run gets runs/<run>/ with a lease, config.yaml, status.json and DONE."""
        return self in (Kind.TRAINING, Kind.COMMAND)

    @property
    def rank_per_gpu(self) -> bool:
        """Whether boot starts one process per GPU (and torchrun across the nodes of a cluster)."""
        return self is Kind.TRAINING


class WorkloadModule(Protocol):
    """What a workload module defines (trainpod/workloads/<name>.py)."""

    def preflight(self, ctx: Any, config: Any) -> None:
        """Check the inputs and raise a TrainpodError (exit 2) before anything is written."""

    def run(self, ctx: Any, config: Any) -> Any:
        """Do the work. TRAINING/COMMAND: the DONE summary (a dict); DATA/CONVERSION: the output folders;
        SERVICE: its exit code. Stops raise TrainpodError subclasses (Preempted, BudgetExhausted, ...)."""

    def disk_estimate(self, config: Any) -> int | None:
        """Bytes the workload will need on the volume (boot refuses to start when they are not free)."""

    # Optional: `check_gpu_memory(config, volume, gpus)`, which boot calls before starting the ranks, to
    # refuse (exit 2) a config whose estimated peak GPU memory cannot fit (pretrain has one).
    # Optional for a CONVERSION: `check_ahead(config, environ)`, which boot calls for a deploy's `then` before the
    # run it converts has started, to refuse (exit 2) what needs no input of the run: a hub task's HF_TOKEN.


@dataclass(frozen=True)
class Workload:
    name: str
    kind: Kind
    summary: str
    module_name: str
    # "module:attribute", a module that imports neither torch nor transformers: the pydantic config class, or a
    # function of the YAML tree (before validation) that returns it (datagen picks by `kind:`).
    config: str

    def module(self) -> WorkloadModule:
        return importlib.import_module(self.module_name)  # type: ignore[return-value]

    def config_type(self, tree: dict[str, Any]) -> type:
        """The pydantic config class for this YAML tree (before validation)."""
        module_name, _, attribute = self.config.partition(":")
        found = getattr(importlib.import_module(module_name), attribute)
        return found if isinstance(found, type) else found(tree)


_WORKLOADS = (
    Workload("datagen", Kind.DATA, "tokenizer + token shards, SFT data, or your generator's records", __name__ + ".datagen", __name__ + ".datagen:config_type"),
    Workload("pretrain", Kind.TRAINING, "a Llama decoder from scratch on token shards", __name__ + ".pretrain", "trainpod.config.pretrain:PretrainConfig"),
    Workload("finetune", Kind.TRAINING, "QLoRA, LoRA or full finetuning of an existing model", __name__ + ".finetune", "trainpod.config.finetune:FinetuneConfig"),
    Workload("finetune-vlm", Kind.TRAINING, "QLoRA, LoRA or full finetuning of a vision-language model (Qwen-VL) on images + text", __name__ + ".finetune_vlm", "trainpod.config.finetune_vlm:VlmFinetuneConfig"),
    Workload("command", Kind.COMMAND, "your own program (any language) under the run lifecycle", __name__ + ".command", "trainpod.config.command:CommandConfig"),
    Workload("convert", Kind.CONVERSION, "adapters to MLX, merged into their base; checkpoints to HF; exports pushed to the Hub", __name__ + ".convert", "trainpod.config.convert:ConvertConfig"),
    Workload("supervise", Kind.SERVICE, "bring a run's interrupted spot pods back until it is done", __name__ + ".supervise", "trainpod.config.deploy:DeployConfig"),
)  # fmt: skip
REGISTRY: dict[str, Workload] = {workload.name: workload for workload in _WORKLOADS}


def conversions() -> list[str]:
    """The workloads a deploy's `then` may run after DONE (boot, deploy's checks): the CONVERSION kind's."""
    return [name for name, workload in REGISTRY.items() if workload.kind is Kind.CONVERSION]


def get(name: str | None) -> Workload:
    """The workload called `name`; a ConfigError (exit 2) listing the known ones otherwise."""
    workload = REGISTRY.get(name or "")
    if workload is None:
        shown = repr(name) if name else "unset"
        raise ConfigError([f"workload {shown} is not one of: {', '.join(REGISTRY)}"])
    return workload


def names(*kinds: Kind) -> list[str]:
    """The workloads' names, of the given kinds only when any are given."""
    return [name for name, workload in REGISTRY.items() if not kinds or workload.kind in kinds]


def deployable(name: str) -> Workload:
    """The workload a deploy config names: anything but a service, which watches pods instead of being one."""
    workload = REGISTRY.get(name)
    if workload is None or workload.kind is Kind.SERVICE:
        choices = ", ".join(names(*(k for k in Kind if k is not Kind.SERVICE)))
        raise ConfigError([f"workload = {name!r}: not a workload a pod can run; set it to one of: {choices}"])
    return workload
