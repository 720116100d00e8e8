"""Every field of every workload's config refuses a value of the wrong type at load, with exit 2 and a message
that names the field's dotted path, the value and a fix; and the numeric fields refuse the values of the right
type that make no sense (a learning rate of 0, a batch of 0, a ratio above 1) in the same way.

    PYTHONPATH=src:tests python -m pytest -q tests/test_config_every_field.py

Config loading only: no model, no data, no training (seconds). The fields come from `trainpod config fields`'s
own source (cli._config_types, fields.field_rows), so a field added later is checked without a new row here.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from trainpod.cli import _config_types
from trainpod.config.fields import field_rows
from trainpod.config.loader import SET_FLAG, load_config, load_tree, validate_tree
from trainpod.errors import ConfigError, ExitCode

REPO = Path(__file__).resolve().parents[1]
# A config of each type that loads as it is; each test changes one field of it.
BASE_CONFIGS = {
    "datagen": "configs/datagen/tiny.yaml",
    "datagen-sft": "configs/datagen/sft-tiny.yaml",
    "datagen-generator": "configs/datagen/generator-tiny.yaml",
    "pretrain": "configs/pretrain/tiny.yaml",
    "finetune": "configs/finetune/tiny.yaml",
    "finetune-vlm": "configs/finetune/tiny-vlm.yaml",
    "command": "examples/nanogpt/command.yaml",
    "convert": "configs/convert/tiny.yaml",
    "supervise": "configs/deploy/finetune-spot.yaml",  # has a `then`, whose config is required within it
    "deploy": "configs/deploy/finetune-spot.yaml",
}
WRONG_TYPE = {"wrong": "type"}  # a mapping where a number, text, choice or list belongs
WRONG_TYPE_FOR_A_MAPPING = ["wrong", "type"]  # a list where a mapping belongs (env, params, kinds)
ITEM = re.compile(r"^(?P<name>\w+)(?:\[(?P<tag>[^\]]*)\])?$")
# What a section added by its tag needs besides the tag to be valid (a hub task names what it pushes, and where).
REQUIRED_OF_ADDED = {"hub": {"source": "merged", "repo_id": "someone/tiny-ft"}}


def leaf_fields() -> list[tuple[str, str, str]]:
    """(workload, dotted path, type) of every field that holds a value rather than a section."""
    found = []
    for workload, config_type in _config_types().items():
        rows = field_rows(config_type)
        paths = [row.path for row in rows]
        for row in rows:
            if not any(p.startswith((row.path + ".", row.path + "[")) for p in paths):
                found.append((workload, row.path, row.type))
    return found


def test_every_workload_has_a_base_config():
    assert set(_config_types()) == set(BASE_CONFIGS), "add a loadable config of the new type to BASE_CONFIGS"


def test_every_base_config_loads_as_it_is():
    for workload, config_type in _config_types().items():
        load_config(config_type, REPO / BASE_CONFIGS[workload])


def set_in_tree(tree: dict, path: str, value: object) -> str:
    """Put `value` at `path` (`sources[].path`: the first item; `task[kind=export].dtype`: the item of that kind,
    added when the config has none) and return the dotted path pydantic's error gives (`sources.0.path`)."""
    node, dotted = tree, []
    parts = path.split(".")
    for depth, part in enumerate(parts):
        match = ITEM.match(part)
        name, tag = match["name"], match["tag"]
        last = depth == len(parts) - 1
        if tag is None:
            dotted.append(name)
            if last:
                node[name] = value
            else:
                if node.get(name) is None:
                    node[name] = {}
                node = node[name]
            continue
        items = node.setdefault(name, [])
        if tag:  # one of several sections, told apart by a tag: kind=export
            key, _, kind = tag.partition("=")
            index = next((i for i, item in enumerate(items) if item.get(key) == kind), None)
            if index is None:
                items.append({key: kind} | REQUIRED_OF_ADDED.get(kind, {}))
                index = len(items) - 1
            tag_itself = depth == len(parts) - 2 and parts[-1] == key
            dotted += [name, str(index)] if tag_itself else [name, str(index), kind]
        else:
            if not items:
                items.append({})
            index = 0
            dotted += [name, "0"]
        node = items[index]
        if last:
            raise AssertionError(f"{path}: a list of sections is not a leaf")
    return ".".join(dotted)


def problems_of(workload: str, path: str, value: object, written: str) -> tuple[str, list[str]]:
    """Load `workload`'s base config with `value` (`written` in YAML) at `path`: the dotted path pydantic gives
    the field, and the problems of the ConfigError (exit 2) the loader must raise."""
    config_type = _config_types()[workload]
    base = REPO / BASE_CONFIGS[workload]
    with pytest.raises(ConfigError) as caught:
        if "[" in path:  # a list item: no override reaches it, the YAML does
            tree, source = load_tree(base)
            tree = copy.deepcopy(tree)
            dotted = set_in_tree(tree, path, value)
            validate_tree(config_type, tree, source, SET_FLAG)
        else:
            dotted = path
            load_config(config_type, base, [f"{path}={written}"], SET_FLAG)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert len(caught.value.problems) == 1, f"one wrong field, one problem; got:\n{caught.value}"
    return dotted, caught.value.problems


@pytest.mark.parametrize(("workload", "path", "type_name"), leaf_fields(), ids=lambda v: v)
def test_a_value_of_the_wrong_type_is_refused_naming_field_value_and_fix(workload, path, type_name):
    mapping = type_name.startswith("dict") or " dict[" in type_name
    wrong, written = (WRONG_TYPE_FOR_A_MAPPING, "[wrong, type]") if mapping else (WRONG_TYPE, "{wrong: type}")
    dotted, problems = problems_of(workload, path, wrong, written)
    assert problems[0].startswith(f"{dotted} = {wrong!r}: "), (
        f"the problem must start with the field's dotted path and the value given; got:\n{problems[0]}"
    )
    assert "; fix" in problems[0] or "; write it in quotes" in problems[0], f"no fix in:\n{problems[0]}"


def takes_a_number(type_name: str) -> bool:
    return bool(re.match(r"(int|float)\b", type_name)) and "bool" not in type_name


@pytest.mark.parametrize(
    ("workload", "path"), [(w, p) for w, p, t in leaf_fields() if takes_a_number(t)], ids=lambda v: v
)
def test_a_boolean_for_a_number_is_refused_not_read_as_1(workload, path):
    """pydantic reads true as 1 and false as 0, and YAML reads yes and on as true: `train.lr: true` trained at
    lr 1.0, `train.max_steps: yes` for one step."""
    dotted, problems = problems_of(workload, path, True, "yes")
    assert problems[0].startswith(
        f"{dotted} = True: YAML reads true (and yes/no, on/off) without quotes as a "
    ), problems[0]
    assert "write the number" in problems[0]


def test_a_boolean_among_a_mappings_numbers_is_refused_not_read_as_1():
    """datagen's `kinds: {easy: yes, hard: 0}` was read as {easy: 1.0, hard: 0.0}: a share the user never wrote."""
    dotted, problems = problems_of(
        "datagen-generator", "kinds", {"easy": True, "hard": 0.0}, "{easy: yes, hard: 0}"
    )
    assert problems == [
        "kinds.easy = True: YAML reads true (and yes/no, on/off) without quotes as a boolean, and this takes a "
        "number; write the number"
    ]


# Values of the right type that make no sense, each refused at load. Those the loader let through before this
# test (it fails on the code before them): train.seed below 0 or from 2**32 (numpy's data order raised
# ValueError, in a finetune at its first batch, after the base model had loaded; in a pretrain at its second
# pass over the shards), data.min_pixels above data.max_pixels (an image under min_pixels came out above
# max_pixels, silently), generation_eval.every_evals with train.eval_every=0 (it runs at evals: never, silently).
# The others pin the bounds every numeric field had already.
NONSENSE = [
    ("pretrain", ["train.seed=-1"], "train.seed = -1: Input should be greater than or equal to 0"),
    ("pretrain", ["train.seed=4294967296"], "train.seed = 4294967296: Input should be less than or equal to"),
    ("finetune", ["train.seed=-1"], "train.seed = -1: Input should be greater than or equal to 0"),
    ("finetune-vlm", ["train.seed=-7"], "train.seed = -7: Input should be greater than or equal to 0"),
    (
        "finetune-vlm",
        ["data.min_pixels=20000", "data.max_pixels=5000"],
        "data.min_pixels=20000 is above data.max_pixels=5000",
    ),
    ("pretrain", ["train.lr=0"], "train.lr = 0: Input should be greater than 0"),
    ("pretrain", ["train.max_steps=0"], "train.max_steps = 0: Input should be greater than or equal to 1"),
    ("pretrain", ["train.micro_batch_size=0"], "train.micro_batch_size = 0: Input should be greater"),
    ("pretrain", ["train.grad_accum_steps=0"], "train.grad_accum_steps = 0: Input should be greater"),
    ("pretrain", ["train.min_lr_ratio=1.5"], "train.min_lr_ratio = 1.5: Input should be less than or equal"),
    ("pretrain", ["train.max_steps=50", "train.warmup_steps=51"], "train.warmup_steps=51 exceeds"),
    (
        "pretrain",
        ["train.eval_every=-1"],
        "train.eval_every = -1: Input should be greater than or equal to 0",
    ),
    ("pretrain", ["model.dropout=1"], "model.dropout = 1: Input should be less than 1"),
    ("pretrain", ["model.num_heads=3"], "model.hidden_size=64 is not divisible by model.num_heads=3"),
    ("pretrain", ["train.lr=.nan"], "train.lr = nan: Input should be a finite number"),
    ("finetune", ["train.lr=0"], "train.lr = 0: Input should be greater than 0"),
    ("finetune", ["train.max_steps=0"], "train.max_steps = 0: Input should be greater than or equal to 1"),
    (
        "finetune",
        ["train.max_steps=null", "train.epochs=0"],
        "train.epochs = 0: Input should be greater than 0",
    ),
    ("finetune", ["lora.r=0"], "lora.r = 0: Input should be greater than or equal to 1"),
    ("finetune", ["lora.alpha=0"], "lora.alpha = 0: Input should be greater than 0"),
    ("finetune", ["train.warmup_ratio=1"], "train.warmup_ratio = 1: Input should be less than 1"),
    ("finetune", ["data.sft.val_ratio=1"], "data.sft.val_ratio = 1: Input should be less than 1"),
    (
        "finetune",
        ["train.eval_every=0", "train.early_stopping_patience=2"],
        "train.early_stopping_patience=2 never acts",
    ),
    (
        "finetune",
        ["generation_eval.every_evals=1", "train.eval_every=0"],
        "generation_eval.every_evals=1 never runs with train.eval_every=0",
    ),
    (
        "finetune",
        ["checkpoint.keep_last=1"],
        "checkpoint.keep_last = 1: Input should be greater than or equal",
    ),
    (
        "finetune",
        ["generation_eval.max_samples=0"],
        "generation_eval.max_samples = 0: Input should be greater",
    ),
    ("datagen", ["val_ratio=1.5"], "val_ratio = 1.5: Input should be less than 1"),
    ("datagen", ["shard_tokens=0"], "shard_tokens = 0: Input should be greater than or equal to 1"),
    ("datagen-sft", ["sft.cutoff_len=0"], "sft.cutoff_len = 0: Input should be greater than or equal to 8"),
    (
        "datagen-generator",
        ["splits.train=1.2"],
        "splits.train = 1.2: Input should be less than or equal to 1",
    ),
    (
        "datagen-generator",
        ["chunk_records=0"],
        "chunk_records = 0: Input should be greater than or equal to 1",
    ),
    ("command", ["status_every_seconds=0"], "status_every_seconds = 0: Input should be greater than 0"),
    ("deploy", ["pod.gpu_count=0"], "pod.gpu_count = 0: Input should be greater than or equal to 1"),
    ("deploy", ["supervise.poll_s=0"], "supervise.poll_s = 0: Input should be greater than 0"),
    (
        "deploy",
        ["supervise.backoff_s=600", "supervise.max_backoff_s=60"],
        "supervise.max_backoff_s=60 is below supervise.backoff_s=600",
    ),
    (
        "deploy",
        ["budget.budget_usd=-1"],
        "budget.budget_usd = -1: Input should be greater than or equal to 0",
    ),
]


@pytest.mark.parametrize(("workload", "overrides", "problem"), NONSENSE, ids=lambda v: str(v))
def test_a_value_that_makes_no_sense_is_refused_at_load_naming_field_value_and_fix(
    workload, overrides, problem
):
    with pytest.raises(ConfigError) as caught:
        load_config(_config_types()[workload], REPO / BASE_CONFIGS[workload], overrides, SET_FLAG)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert len(caught.value.problems) == 1, str(caught.value)
    assert caught.value.problems[0].startswith(problem), caught.value.problems[0]
    assert re.search(r"; (fix|lower|raise|set|pick|give)", caught.value.problems[0]), caught.value.problems[0]


# Odd but legitimate: each loads. A first eval after the last step (eval_every > max_steps) just never runs, as
# in axolotl and LLaMA-Factory; warmup over the whole run holds the peak at the end; one image size (min equal
# to max pixels) is a fixed size; seed 0 is a seed; beta1 0 is Adam without momentum (refused before, though torch's
# and bitsandbytes' AdamW take it).
LEGITIMATE = [
    ("pretrain", ["train.max_steps=50", "train.eval_every=500"]),
    ("pretrain", ["train.max_steps=50", "train.warmup_steps=50"]),
    ("pretrain", ["train.seed=0", "train.min_lr_ratio=1", "train.beta1=0"]),
    ("finetune", ["train.beta1=0"]),
    ("finetune", ["train.seed=4294967295", "train.eval_every=1000", "train.early_stopping_patience=0"]),
    ("finetune-vlm", ["data.min_pixels=3136", "data.max_pixels=3136"]),
]


@pytest.mark.parametrize(("workload", "overrides"), LEGITIMATE, ids=lambda v: str(v))
def test_a_value_that_is_odd_but_legitimate_loads(workload, overrides):
    load_config(_config_types()[workload], REPO / BASE_CONFIGS[workload], overrides, SET_FLAG)


def test_config_fields_shows_each_numbers_range(capsys):
    from trainpod import cli

    assert cli.main(["config", "fields", "pretrain"]) == 0
    types = {line.split()[0]: line.split("  default ")[0].split(None, 1)[1].strip() for line in
             capsys.readouterr().out.splitlines() if line and not line[0].isspace()}  # fmt: skip
    assert types["train.lr"] == "float > 0"
    assert types["train.min_lr_ratio"] == "float >= 0, <= 1"
    assert types["train.seed"] == "int >= 0, <= 4294967295"
    assert types["model.vocab_size"] == "int >= 2 | None", "a bound is the number's, written before | None"
    assert types["train.compile"] == "bool"
