"""Config loading: YAML + overrides, every problem reported at once with field, value and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainpod.config import load_config, parse_overrides
from trainpod.config.loader import DEPLOY_ENV_SET, POD_SET_VARIABLE, SET_FLAG
from trainpod.config.pretrain import PretrainConfig
from trainpod.errors import ConfigError, ExitCode

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs/pretrain/tiny.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_tiny_config_loads_with_defaults_filled_in():
    config = load_config(PretrainConfig, TINY)
    assert config.name == "tiny-pretrain"
    assert config.model.num_layers == 2
    assert config.checkpoint.keep_last == 2
    assert config.train.tokens_per_step_per_rank == 64 * 8 * 2


def test_overrides_win_over_yaml_and_parse_yaml_scalars():
    config = load_config(PretrainConfig, TINY, ["train.max_steps=7", "train.compile=true", "train.lr=1e-4"])
    assert (config.train.max_steps, config.train.compile, config.train.lr) == (7, True, 1e-4)


def test_trainpod_set_splits_on_spaces_and_newlines_with_quoting():
    assert parse_overrides("a.b=1 c='x y'\nd=2") == ["a.b=1", "c=x y", "d=2"]
    assert parse_overrides("  ") == []


def test_trainpod_set_with_an_unbalanced_quote_is_a_config_error_naming_it():
    with pytest.raises(ConfigError) as caught:
        parse_overrides("train.lr='1e-4 train.max_steps=5")
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert "TRAINPOD_SET=" in str(caught.value) and "no closing quotation" in str(caught.value)


def test_every_problem_is_reported_at_once_with_field_value_and_fix(tmp_path):
    path = write(
        tmp_path, "name: x\ndata: {dataset: d}\ntrain: {max_steps: ten, lrr: 0.1}\nmodel: {num_heads: -1}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(PretrainConfig, path)
    message = str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert len(caught.value.problems) == 3, message
    assert "train.max_steps = 'ten'" in message and "optimizer steps to train for" in message
    assert "train.lrr: unknown key; did you mean 'lr'?" in message
    assert "model.num_heads = -1" in message and "greater than or equal to 1" in message
    assert str(path) in message


def test_malformed_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "name: x\ntrain:\n  max_steps: [1, 2\n")
    with pytest.raises(ConfigError, match=r"malformed YAML at line \d+"):
        load_config(PretrainConfig, path)


@pytest.mark.parametrize(
    ("route", "fix"),
    [
        (None, "add it to the YAML"),
        (SET_FLAG, "add it to the YAML or pass --set train=VALUE"),
        (POD_SET_VARIABLE, "add it to the YAML or add train=VALUE to TRAINPOD_SET"),
        (
            DEPLOY_ENV_SET,
            "add it to the YAML or add train=VALUE to the deploy YAML's env.set (the pod's TRAINPOD_SET)",
        ),
    ],
    ids=["no-route", "run-flag", "pod-variable", "deploy-env-set"],
)
def test_missing_required_field_says_how_to_add_it_by_the_callers_route(tmp_path, route, fix):
    """The loader named `trainpod run`'s --set wherever it was called: a pod (boot) has TRAINPOD_SET, a deploy its
    YAML's env.set; without a route, a flag no command of the caller takes must not be named."""
    path = write(tmp_path, "name: x\ndata: {dataset: d}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(PretrainConfig, path, route=route)
    assert caught.value.problems == [f"train: required but missing; {fix}"]


def test_cross_field_check_names_both_fields(tmp_path):
    path = write(tmp_path, "name: x\ndata: {dataset: d}\ntrain: {max_steps: 5, warmup_steps: 10}\n")
    with pytest.raises(ConfigError, match=r"train.warmup_steps=10 exceeds train.max_steps=5"):
        load_config(PretrainConfig, path)


def test_an_odd_head_size_is_refused_before_a_gpu_is_paid_for():
    # hidden 24 / 8 heads = 3 dimensions per head: rotary embeddings rotate pairs, so the first forward
    # failed (exit 1, a failed start, retried until FAILED) instead of the config (exit 2).
    with pytest.raises(
        ConfigError, match=r"model.hidden_size=24 / model.num_heads=8 gives heads of 3"
    ) as caught:
        load_config(
            PretrainConfig, TINY, ["model.hidden_size=24", "model.num_heads=8", "model.num_kv_heads=8"]
        )
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    load_config(PretrainConfig, TINY, ["model.hidden_size=48", "model.num_heads=8", "model.num_kv_heads=8"])


def test_malformed_override_is_a_config_error():
    with pytest.raises(ConfigError, match="not of the form key.path=value"):
        load_config(PretrainConfig, TINY, ["train.max_steps"])


def test_override_into_a_scalar_is_refused():
    with pytest.raises(ConfigError, match="'max_steps' holds a value, not a section"):
        load_config(PretrainConfig, TINY, ["train.max_steps.x=1"])


def test_missing_config_file_names_no_variable_its_caller_may_not_read(tmp_path):
    """ "set TRAINPOD_CONFIG" was the fix for every command: `trainpod deploy X.yaml` reads no such variable, and
    `trainpod run --config` wins over it. Where the path came from is the caller's to name (resolve_config_path)."""
    with pytest.raises(ConfigError) as caught:
        load_config(PretrainConfig, tmp_path / "nope.yaml")
    assert caught.value.problems == [
        f"config file {tmp_path / 'nope.yaml'} does not exist; give the path of an existing YAML file"
    ]


def test_a_folder_given_as_the_config_is_not_said_to_be_missing(tmp_path):
    # `--config configs/` (a tab completion short of the file) read "config file .../configs does not exist".
    with pytest.raises(
        ConfigError,
        match=rf"config file {tmp_path} is a folder, not a file; give the path of an existing YAML",
    ):
        load_config(PretrainConfig, tmp_path)


def test_a_secret_in_the_command_configs_env_is_refused_before_it_is_copied_to_the_volume(tmp_path):
    from trainpod.config.command import CommandConfig

    path = write(
        tmp_path,
        "name: x\ncommand: [python, train.py]\n"
        "env: {WANDB_API_KEY: 0123456789abcdef, MY_SERVICE_TOKEN: abcdef123456, WANDB_MODE: offline}\n",
    )
    with pytest.raises(ConfigError) as caught:
        load_config(CommandConfig, path)
    message = str(caught.value)
    assert "env.WANDB_API_KEY: a secret does not belong in this file" in message
    assert "env.MY_SERVICE_TOKEN: a secret" in message and "WANDB_MODE" not in message
    assert "0123456789abcdef" not in message


@pytest.mark.parametrize("value", [".inf", ".nan"])
def test_an_infinite_or_nan_number_is_refused_naming_the_field(value):
    with pytest.raises(ConfigError) as caught:
        load_config(PretrainConfig, TINY, [f"checkpoint.lease_ttl_seconds={value}"])
    assert "checkpoint.lease_ttl_seconds" in str(caught.value) and "finite number" in str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT


def test_a_typo_inside_a_list_entry_names_the_keys_that_entry_takes(tmp_path):
    # The entries of a list (datagen's sources, a finetune's datasets, convert's tasks) are where a user
    # writes most keys by hand; a typo there read "remove it or use one of: " with nothing after it.
    from trainpod.config.convert import ConvertConfig
    from trainpod.config.datagen import DatagenConfig

    datagen = write(
        tmp_path, "kind: tokens\nname: d\ntokenizer: {name: t}\nsources: [{path: x, text_feild: t}]\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(DatagenConfig, datagen)
    assert "sources.0.text_feild: unknown key; did you mean 'text_field'?" in str(caught.value)
    assert "use one of: format, hf, hf_config" in str(caught.value)

    convert = write(tmp_path, "name: c\nadapter: run:x\nbase_model: b\ntask: [{kind: merge, dtypo: auto}]\n")
    with pytest.raises(ConfigError, match=r"task.0.merge.dtypo: unknown key; did you mean 'dtype'\?"):
        load_config(ConvertConfig, convert)


def test_a_wrong_value_inside_a_list_entry_gives_its_fields_description_as_the_fix(tmp_path):
    from trainpod.config.convert import ConvertConfig

    path = write(tmp_path, "name: c\nadapter: run:x\nbase_model: b\ntask: [{kind: merge, dtype: fp8}]\n")
    with pytest.raises(
        ConfigError, match=r"task.0.merge.dtype = 'fp8': .*; fix: weights dtype of the merged"
    ):
        load_config(ConvertConfig, path)


def test_a_missing_key_inside_a_list_entry_is_not_told_to_use_a_set_that_cannot_reach_it(tmp_path):
    from trainpod.config.finetune import FinetuneConfig

    path = write(tmp_path, "name: f\nbase_model: {path: m}\ndata: {sft: {datasets: [{format: alpaca}]}}\n"
                 "train: {max_steps: 5}\n")  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        load_config(FinetuneConfig, path)
    message = str(caught.value)
    assert "data.sft.datasets.0.path: required but missing" in message and "--set" not in message
    assert "add it to that entry of the list in the YAML" in message


def test_the_fix_keeps_a_description_that_starts_with_a_name_in_capitals_as_written(tmp_path):
    # "fix: tRAINPOD_MAX_FAILED_STARTS: ..." named a variable that does not exist; "gPUs", "sECURE" read as typos.
    from trainpod.config.deploy import DeployConfig

    path = write(
        tmp_path,
        "run: r\nworkload: pretrain\nconfig: c.yaml\nimage: {name: ghcr.io/me/trainpod:0.1.0}\n"
        "pod: {gpu_types: [x], gpu_count: 0, cloud: PRIVATE}\nvolume: {name: v, data_center: EU-RO-1}\n"
        "env: {max_failed_starts: 0}\n",
    )
    with pytest.raises(ConfigError) as caught:
        load_config(DeployConfig, path)
    message = str(caught.value)
    assert "fix: GPUs per pod" in message and "fix: SECURE or COMMUNITY cloud" in message, message
    assert "fix: TRAINPOD_MAX_FAILED_STARTS: failed starts in a row" in message, message
    mlp = pytest.raises(ConfigError, load_config, PretrainConfig, TINY, ["model.intermediate_size=0"])
    assert "fix: MLP width" in str(mlp.value)
    assert "fix: optimizer steps to train for" in str(
        pytest.raises(ConfigError, load_config, PretrainConfig, TINY, ["train.max_steps=0"]).value
    ), "a plain description still reads on from 'fix: '"


def test_text_that_yaml_reads_as_a_number_or_boolean_is_told_to_be_quoted(tmp_path):
    # README's command config: `env: {MY_SETTING: "1"}`; unquoted it read "Input should be a valid string; fix
    # the value", naming neither why 1 is not text nor what the field is.
    from trainpod.config.command import CommandConfig

    path = write(
        tmp_path, "name: r\ncommand: [python, train.py, --steps, 100]\nenv: {MY_SETTING: 1, DEBUG: true}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(CommandConfig, path)
    message = str(caught.value)
    assert (
        'command.3 = 100: YAML reads 100 without quotes as a number, and this takes text; write it in quotes, "100"'
        in message
    )
    assert "env.MY_SETTING = 1: YAML reads 1 without quotes as a number" in message
    assert (
        'env.DEBUG = True: YAML reads true without quotes as a boolean, and this takes text; write it in quotes, "true"'
        in message
    )
    assert "fix: more environment variables for the program" in message and "fix the value" not in message


FINETUNE_WITHOUT_LR = """
name: ft
base_model: {path: models/base}
method: METHOD
data: {sft: {datasets: [{path: data/sft.jsonl}]}}
train: {max_steps: 10}
"""
FINETUNE_DATA = "data: {sft: {datasets: [{path: data/sft.jsonl}]}}"


@pytest.mark.parametrize(("method", "lr"), [("qlora", 2e-4), ("lora", 2e-4), ("full", 2e-5)])
def test_a_finetune_without_a_learning_rate_takes_the_one_axolotl_and_llamafactory_give_its_method(
    tmp_path, method, lr
):
    """2e-4 is an adapter's learning rate; a full finetune (every weight) at 2e-4 forgets much of what the base
    knew, and axolotl's and LLaMA-Factory's full finetuning examples train at 1e-5 to 2e-5."""
    from trainpod.config.finetune import FinetuneConfig
    from trainpod.config.finetune_vlm import VlmFinetuneConfig

    path = write(tmp_path, FINETUNE_WITHOUT_LR.replace("METHOD", method))
    assert load_config(FinetuneConfig, path).train.lr == lr
    assert load_config(FinetuneConfig, path, ["train.lr=3e-4"]).train.lr == 3e-4
    images = "data: {datasets: [{path: data/ocr.jsonl}]}"
    vlm = write(tmp_path, FINETUNE_WITHOUT_LR.replace("METHOD", method).replace(FINETUNE_DATA, images))
    assert load_config(VlmFinetuneConfig, vlm).train.lr == lr


def test_an_unknown_key_that_is_a_field_further_down_is_pointed_at_its_place():
    """A finetune's user told by the SFT code to raise `sft.cutoff_len` passed --set sft.cutoff_len=256, and got
    "sft: unknown key" with the top-level names alone; its field is data.sft.cutoff_len."""
    from trainpod.config.finetune import FinetuneConfig

    tiny = Path(__file__).resolve().parents[1] / "configs/finetune/tiny.yaml"
    for key, place in (("sft.cutoff_len", "data.sft"), ("cutoff_len", "data.sft.cutoff_len")):
        with pytest.raises(ConfigError) as caught:
            load_config(FinetuneConfig, tiny, [f"{key}=256"], route=SET_FLAG)
        assert f"{key.split('.')[0]}: unknown key; did you mean '{place}'?" in str(caught.value)
    with pytest.raises(ConfigError, match=r"train\.lrr: unknown key; did you mean 'lr'\?"):
        load_config(FinetuneConfig, tiny, ["train.lrr=1"])
