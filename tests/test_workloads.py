"""The workload registry is the one list of workloads, and the packages import each other without cycles, each only
those above it in docs/design.md's table."""

from __future__ import annotations

import ast
import inspect
import logging
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from trainpod import cli, workloads
from trainpod.config.datagen import DatagenConfig
from trainpod.config.generate import GeneratorDatagenConfig
from trainpod.config.loader import SET_FLAG
from trainpod.config.sft import SftDatagenConfig
from trainpod.errors import ConfigError, ExitCode
from trainpod.workloads import REGISTRY, Kind, Workload

from support import TINY_DATAGEN, run_trainpod

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
PROTOCOL = ("preflight", "run", "disk_estimate")


def test_every_registered_workload_module_provides_the_protocol():
    for workload in REGISTRY.values():
        module = workload.module()
        missing = [name for name in PROTOCOL if not callable(getattr(module, name, None))]
        assert not missing, f"{workload.module_name} lacks {missing}: see trainpod.workloads.WorkloadModule"
        assert len(inspect.signature(module.run).parameters) == 2, f"{workload.name}: run(ctx, config)"


def test_cli_offers_exactly_the_registered_workloads():
    run_parser = next(
        action.choices["run"] for action in cli._parser()._actions if getattr(action, "choices", None)
    )
    workload_argument = next(a for a in run_parser._actions if a.dest == "workload")
    assert list(workload_argument.choices) == list(REGISTRY)


def test_deploy_refuses_a_service_or_unknown_workload_naming_the_field():
    assert workloads.deployable("pretrain").kind is Kind.TRAINING
    for name in ("supervise", "pretrian"):
        with pytest.raises(ConfigError) as caught:
            workloads.deployable(name)
        assert f"workload = {name!r}" in str(caught.value) and "datagen, pretrain" in str(caught.value)


def _string_tuples(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            yield [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def test_no_module_but_the_registry_lists_the_workloads():
    names = set(REGISTRY)
    for path in (SRC / "trainpod").rglob("*.py"):
        if path == SRC / "trainpod/workloads/__init__.py":
            continue
        for strings in _string_tuples(ast.parse(path.read_text())):
            listed = names.intersection(strings)
            assert len(listed) < 2, (
                f"{path} lists workloads {sorted(listed)}: read trainpod.workloads.REGISTRY"
            )


def _package_of(module: str) -> str:
    """trainpod.train.trainer -> trainpod.train; trainpod.cli -> trainpod.cli (a top-level module)."""
    return ".".join(module.split(".")[:2])


def _import_graph() -> dict[str, set[str]]:
    """Edges between the project's packages (and top-level modules), from every import, lazy ones too."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in (SRC / "trainpod").rglob("*.py"):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                unit = _package_of(target)
                exists = (SRC / unit.replace(".", "/")).is_dir() or (
                    SRC / f"{unit.replace('.', '/')}.py"
                ).exists()
                if target.startswith("trainpod.") and exists and unit != _package_of(module):
                    edges[_package_of(module)].add(unit)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    visiting, done = [], set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return [*visiting[visiting.index(node) :], node]
        if node in done:
            return None
        visiting.append(node)
        for target in sorted(edges.get(node, ())):
            found = visit(target)
            if found:
                return found
        visiting.pop()
        done.add(node)
        return None

    return next((c for c in (visit(n) for n in sorted(edges)) if c), None)


def test_the_import_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_import_cycle_between_the_projects_packages():
    edges = _import_graph()
    assert "trainpod.workloads" in edges["trainpod.cli"], "the graph must see cli's lazy imports"
    cycle = _cycle(edges)
    assert cycle is None, (
        f"import cycle {' -> '.join(cycle or [])}: move the shared piece below both (as RunContext lives in "
        "trainpod/context.py) or pass it in"
    )


def _design_layers() -> dict[str, int]:
    """docs/design.md's package table, "lowest first": each package (`errors`, `config/`) and its row."""
    text = (REPO / "docs/design.md").read_text(encoding="utf-8")
    table = text.split("Packages, lowest first", 1)[1].split("\n\n", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    return {f"trainpod.{name.strip(' `/')}": i for i, row in enumerate(rows) for name in row.split(",")}


def test_each_package_imports_only_packages_above_it_in_the_design_docs_table():
    layers = _design_layers()
    assert layers["trainpod.errors"] == 0 and layers["trainpod.remote"] < layers["trainpod.workloads"]
    upward = [
        f"{package} -> {target}"
        for package, targets in _import_graph().items()
        for target in targets
        if package in layers and target in layers and layers[target] > layers[package]
    ]
    assert not upward, f'imports below their place in docs/design.md, "The shape of it": {upward}'


def test_a_datagen_config_names_its_kind_and_an_old_one_loads_with_a_deprecation_warning(caplog):
    datagen = REGISTRY["datagen"].module()
    assert datagen.config_type({"kind": "sft"}) is SftDatagenConfig
    with caplog.at_level(logging.WARNING):
        assert datagen.config_type({"generator": "x:y", "name": "n"}) is GeneratorDatagenConfig
        assert datagen.config_type({"name": "n", "sources": []}) is DatagenConfig
    assert caplog.text.count("deprecated") == 2 and "add `kind: generator`" in caplog.text
    with pytest.raises(ConfigError, match=r"kind = 'shards' is not a datagen kind; set it to one of: tokens"):
        datagen.config_type({"kind": "shards"})
    for kind in (["sft"], {"sft": True}):  # a YAML slip: a list or a mapping, not a name
        with pytest.raises(ConfigError, match=r"is not a datagen kind; set it to one of: tokens"):
            datagen.config_type({"kind": kind})


def test_an_unknown_datagen_kind_exits_2_naming_it(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(TINY_DATAGEN.read_text().replace("kind: tokens", "kind: shards"))
    result = run_trainpod("run", "datagen", "--config", str(config), volume=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == ExitCode.BAD_INPUT, output
    assert "kind = 'shards' is not a datagen kind" in output and "Traceback" not in output


def test_another_workloads_config_is_refused_in_one_line_naming_the_workload_it_is_for(
    tmp_path, monkeypatch, capsys, caplog
):
    """configs/finetune/ holds finetune-vlm configs too: `trainpod run finetune` with one read as a line per
    key the text finetune lacks (data.datasets: unknown key; did you mean 'dataset'? ...), never the verb."""
    from trainpod.workloads.lifecycle import load_workload_config

    from support import CONFIGS

    vlm = CONFIGS / "finetune/qwen3-vl-2b-qlora-ocr.yaml"
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as caught:
        load_workload_config(REGISTRY["finetune"], vlm, [], SET_FLAG)
    assert caught.value.problems == [
        "this is a finetune-vlm config (it validates as one), not a finetune config: run `trainpod run "
        "finetune-vlm` with it (in a pod TRAINPOD_WORKLOAD=finetune-vlm, in a deploy config `workload: "
        "finetune-vlm`), or give finetune its own config"
    ]
    assert "deprecated" not in caplog.text, "trying it as a datagen config warns of nothing"

    volume = tmp_path / "volume"
    volume.mkdir()
    deploy = CONFIGS / "deploy/pretrain-spot.yaml"
    assert (
        cli.main(["run", "pretrain", "--config", str(deploy), "--volume", str(volume)]) == ExitCode.BAD_INPUT
    )
    out = capsys.readouterr()
    assert (
        f"this is a deploy config (it validates as one), not a pretrain config: `trainpod deploy {deploy}`"
        in (out.out + out.err)
    )
    assert not any(volume.iterdir()), "nothing written"
    with pytest.raises(ConfigError, match=r"train.max_stepz: unknown key; did you mean 'max_steps'"):
        load_workload_config(
            REGISTRY["pretrain"], CONFIGS / "pretrain/tiny.yaml", ["train.max_stepz=3"], SET_FLAG
        )


def test_trainpod_run_names_its_set_flag_for_a_missing_field(tmp_path, capsys):
    """`trainpod run` takes --set: its fix for a missing field names the flag, not the pod's TRAINPOD_SET."""
    config = tmp_path / "pretrain.yaml"
    config.write_text("name: x\ndata: {dataset: d}\n")
    volume = tmp_path / "volume"
    volume.mkdir()
    assert (
        cli.main(["run", "pretrain", "--config", str(config), "--volume", str(volume)]) == ExitCode.BAD_INPUT
    )
    out = capsys.readouterr()
    assert "train: required but missing; add it to the YAML or pass --set train=VALUE" in out.out + out.err


def test_trainpod_run_with_a_missing_config_says_where_it_looked_and_names_both_ways_to_give_one(
    tmp_path, capsys
):
    """The pod's TRAINPOD_CONFIG and `trainpod run --config` are looked for in the same places: the message names
    them, and both ways (it named TRAINPOD_CONFIG alone, which --config wins over)."""
    volume = tmp_path / "volume"
    volume.mkdir()
    assert (
        cli.main(["run", "pretrain", "--config", "nope.yaml", "--volume", str(volume)]) == ExitCode.BAD_INPUT
    )
    out = capsys.readouterr()
    text = out.out + out.err
    assert (
        f"config nope.yaml: no such file (looked for {Path.cwd() / 'nope.yaml'}, {volume / 'nope.yaml'}"
        in text
    )
    assert "point TRAINPOD_CONFIG (or --config) at an existing YAML file" in text
    assert not any(volume.iterdir()), "nothing written"


ECHO_MODULE = """
from pathlib import Path

from trainpod.config.loader import Section


class EchoConfig(Section):
    name: str
    text: str

def preflight(ctx, config):
    pass

def run(ctx, config):
    out = ctx.volume.root / "datasets" / config.name
    out.mkdir(parents=True)
    (out / "echo.txt").write_text(config.text)
    return [out]

def disk_estimate(config):
    return None
"""


def test_a_new_workload_is_one_module_and_one_registry_line(tmp_path, monkeypatch):
    (tmp_path / "echo_workload.py").write_text(ECHO_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(
        REGISTRY,
        "echo",
        Workload("echo", Kind.DATA, "writes its text", "echo_workload", "echo_workload:EchoConfig"),
    )
    (tmp_path / "echo.yaml").write_text("name: hello\ntext: hi there\n")
    volume = tmp_path / "volume"
    volume.mkdir()
    code = cli.main(["run", "echo", "--config", str(tmp_path / "echo.yaml"), "--volume", str(volume)])
    assert code == ExitCode.DONE
    assert (volume / "datasets/hello/echo.txt").read_text() == "hi there"
    sys.modules.pop("echo_workload", None)


@pytest.mark.parametrize(
    ("workload", "config"),
    [
        ("pretrain", "configs/pretrain/tiny.yaml"),
        ("finetune", "configs/finetune/tiny.yaml"),
        ("finetune-vlm", "configs/finetune/tiny-vlm.yaml"),
    ],
)
def test_a_trainers_bad_config_is_refused_before_torch_is_imported(workload, config, tmp_path):
    """The config class came from the workload's module, which imports torch and transformers: `trainpod run`
    refused a misspelt key after ten seconds of imports on two cores. The registry line names the class now."""
    volume = tmp_path / "volume"
    volume.mkdir()
    probe = (
        "import sys\n"
        "from trainpod import cli\n"
        f"code = cli.main(['run', {workload!r}, '--config', {str(REPO / config)!r}, '--volume', {str(volume)!r},"
        " '--set', 'train.lerning_rate=1'])\n"
        "print('exit', code, 'imported', sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().endswith("exit 2 imported []"), result.stdout + result.stderr
    assert "train.lerning_rate" in result.stdout + result.stderr  # the refusal names the field
    assert not any(volume.iterdir())
