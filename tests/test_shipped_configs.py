"""Every YAML under configs/ loads and validates; presets have the sizes their names promise."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainpod.config import load_config
from trainpod.config.datagen import DatagenConfig
from trainpod.config.pretrain import PretrainConfig
from trainpod.train.model import llama_config, padded_vocab, parameter_count

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TYPES = {"datagen": DatagenConfig, "pretrain": PretrainConfig}
PRESET_SIZES = {"125m": 125e6, "1b": 1e9, "2b": 2e9, "4b": 4e9}


def shipped() -> list[Path]:
    return sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent.name in TYPES)


def test_every_workload_folder_ships_configs():
    assert {p.parent.name for p in shipped()} == set(TYPES)


@pytest.mark.parametrize("path", shipped(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_config_loads_and_validates(path):
    config = load_config(TYPES[path.parent.name], path)
    assert config.name


@pytest.mark.parametrize(("preset", "nominal"), PRESET_SIZES.items())
def test_pretrain_preset_parameter_count_is_within_10_percent_of_its_name(preset, nominal):
    config = load_config(PretrainConfig, CONFIGS / "pretrain" / f"{preset}.yaml")
    vocab = config.model.vocab_size or padded_vocab(32768)
    count = parameter_count(llama_config(config.model, vocab, config.train.seq_len))  # on the meta device
    assert abs(count - nominal) / nominal <= 0.10, f"{preset}: {count / 1e6:.1f}M parameters"


def test_every_pretrain_config_names_a_dataset_a_shipped_datagen_config_makes():
    made = {load_config(DatagenConfig, p).name for p in shipped() if p.parent.name == "datagen"}
    for path in (p for p in shipped() if p.parent.name == "pretrain"):
        dataset = load_config(PretrainConfig, path).data.dataset
        assert dataset in made, (
            f"{path.name}: data.dataset={dataset!r}; shipped datagen configs make {sorted(made)}"
        )
