"""Every YAML under configs/ loads and validates; presets have the sizes their names promise."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainpod.config import load_config
from trainpod.config.convert import ConvertConfig
from trainpod.config.datagen import DatagenConfig
from trainpod.config.deploy import DeployConfig
from trainpod.config.finetune import FinetuneConfig
from trainpod.config.loader import load_tree
from trainpod.config.pretrain import PretrainConfig
from trainpod.config.sft import SftDatagenConfig
from trainpod.train.model import llama_config, parameter_count
from trainpod.train.shape import padded_vocab
from trainpod.workloads import REGISTRY

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TYPES = {
    "datagen": DatagenConfig,
    "pretrain": PretrainConfig,
    "finetune": FinetuneConfig,
    "convert": ConvertConfig,
    "deploy": DeployConfig,
}
PRESET_SIZES = {"125m": 125e6, "1b": 1e9, "2b": 2e9, "4b": 4e9}


def shipped() -> list[Path]:
    return sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent.name in TYPES)


def test_every_workload_folder_ships_configs():
    assert {p.parent.name for p in shipped()} == set(TYPES)


@pytest.mark.parametrize("path", shipped(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_config_loads_and_validates(path):
    config = load_config(config_type(path), path)
    assert getattr(config, "name", None) or config.run


def config_type(path: Path) -> type:
    """The config class `trainpod run` picks: the registry's module for the folder's workload
    (configs/finetune/*-vl*.yaml are vision-language finetunes: `trainpod run finetune-vlm`)."""
    workload = REGISTRY.get(path.parent.name)
    if path.parent.name == "finetune" and "-vl" in path.stem:
        workload = REGISTRY["finetune-vlm"]
    return workload.config_type(load_tree(path)[0]) if workload else TYPES[path.parent.name]


def test_every_shipped_datagen_config_names_its_kind(caplog):
    for path in (p for p in shipped() if p.parent.name == "datagen"):
        assert "kind" in load_tree(path)[0], f"{path.name}: add `kind: tokens|sft|generator` at the top"
        config_type(path)
    assert "deprecated" not in caplog.text


def test_the_datagen_kinds_are_told_apart_by_their_kind_key():
    kinds = {p.name: config_type(p).__name__ for p in shipped() if p.parent.name == "datagen"}
    assert kinds["tiny.yaml"] == "DatagenConfig"
    assert kinds["sft-tiny.yaml"] == "SftDatagenConfig"
    assert kinds["generator-tiny.yaml"] == "GeneratorDatagenConfig"


def test_every_finetune_profile_names_a_dataset_a_shipped_sft_datagen_config_makes():
    made = {load_config(SftDatagenConfig, p).name for p in shipped() if config_type(p) is SftDatagenConfig}
    for path in (p for p in shipped() if config_type(p) is FinetuneConfig):
        config = load_config(FinetuneConfig, path)
        if config.data.dataset is not None:
            assert config.data.dataset in made, (
                f"{path.name}: data.dataset={config.data.dataset!r}; made: {made}"
            )


@pytest.mark.parametrize(("preset", "nominal"), PRESET_SIZES.items())
def test_pretrain_preset_parameter_count_is_within_10_percent_of_its_name(preset, nominal):
    config = load_config(PretrainConfig, CONFIGS / "pretrain" / f"{preset}.yaml")
    vocab = config.model.vocab_size or padded_vocab(32768)
    count = parameter_count(llama_config(config.model, vocab, config.train.seq_len))  # on the meta device
    assert abs(count - nominal) / nominal <= 0.10, f"{preset}: {count / 1e6:.1f}M parameters"


def test_every_pretrain_config_names_a_dataset_a_shipped_datagen_config_makes():
    made = {load_config(DatagenConfig, p).name for p in shipped() if config_type(p) is DatagenConfig}
    for path in (p for p in shipped() if p.parent.name == "pretrain"):
        dataset = load_config(PretrainConfig, path).data.dataset
        assert dataset in made, (
            f"{path.name}: data.dataset={dataset!r}; shipped datagen configs make {sorted(made)}"
        )


def test_the_vlm_configs_load_as_vision_finetunes_with_the_ocr_settings():
    ocr = load_config(
        config_type(CONFIGS / "finetune/qwen3-vl-2b-qlora-ocr.yaml"),
        CONFIGS / "finetune/qwen3-vl-2b-qlora-ocr.yaml",
    )
    assert type(ocr).__name__ == "VlmFinetuneConfig"
    assert (ocr.lora.r, ocr.lora.alpha, ocr.train.lr) == (16, 16, 2e-4)
    assert (ocr.train.micro_batch_size, ocr.train.grad_accum_steps, ocr.train.max_steps) == (2, 4, 500)
    assert ocr.ranked_metric == "eval_cer" and ocr.generation_eval.every_evals >= 1
    assert (ocr.checkpoint.keep_best, ocr.checkpoint.keep_last) == (5, 5)
    tiny = load_config(config_type(CONFIGS / "finetune/tiny-vlm.yaml"), CONFIGS / "finetune/tiny-vlm.yaml")
    assert tiny.method == "qlora" and tiny.train.cpu_threads


EXAMPLES = CONFIGS.parent / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*/*.yaml")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_example_config_validates_and_runs_a_program_that_exists(path):
    """README: `trainpod run command --config examples/<example>/command.yaml` from the repository's root."""
    from trainpod.config.command import CommandConfig

    config = load_config(CommandConfig, path)
    program = next(word for word in config.command if "/" in word)  # `python examples/x/train.py` or `./x.sh`
    assert (CONFIGS.parent / program).is_file(), (
        f"{path.name}: command names {program}, which is not in the repo"
    )
