"""What README.md and docs/design.md tell a user to type is what the code takes: every `trainpod ...` command
line in their code blocks (and in examples/) parses with the CLI's own parser, and every config field they
name (`train.micro_batch_size`, `supervise.max_replacements`) is a field of some config, and every section of
docs/design.md the code cites (`docs/design.md, "Exit codes"`) is one of its headings. The environment's
side of the same contract is tests/test_env_contract.py."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from trainpod import cli, demo
from trainpod.config.fields import field_rows

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "docs/design.md"]
CODE_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)  # (language, text): fences never nest
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
FILE_SUFFIXES = {
    "json",
    "jsonl",
    "yaml",
    "yml",
    "py",
    "png",
    "md",
    "pt",
    "safetensors",
    "txt",
    "gz",
    "sh",
    "log",
}


def command_lines() -> list[tuple[str, str]]:
    """(file, command) for each `trainpod ...` line of the docs' shell blocks, and of the scripts, configs and
    their comments under examples/ and configs/ (`#   trainpod supervise pretrain-125m --config ...`)."""
    sources = [
        (doc, block)
        for doc in DOCS
        for language, block in CODE_BLOCK.findall(doc.read_text(encoding="utf-8"))
        if language in ("sh", "bash", "shell")
    ]
    for folder in ("examples", "configs"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix in (".sh", ".py", ".yaml"):
                sources.append((path, path.read_text(encoding="utf-8")))
    found = []
    for path, text in sources:
        for line in text.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("#").strip()
            for command in [*re.findall(r"\$\((trainpod [^)]*)\)", line), line.split(" #", 1)[0].strip()]:
                words = command.split()
                while words and ASSIGNMENT.match(words[0]):  # VAR=value before the command
                    words.pop(0)
                if words[:1] == ["trainpod"] and len(words) > 1:
                    found.append((str(path.relative_to(REPO)), " ".join(words)))
    return list(dict.fromkeys(found))


def test_the_docs_hold_trainpod_command_lines():
    assert len(command_lines()) >= 25, "the scan found too few command lines: its patterns are broken"


@pytest.mark.parametrize(("source", "command"), command_lines(), ids=lambda v: v)
def test_every_trainpod_command_line_in_the_docs_parses(source, command):
    # `[--terminate]` and `[STEP]` are optional parts, shown as such; `"$VAR"` is a value like any other.
    argv = [word for word in shlex.split(command)[1:] if not (word.startswith("[") and word.endswith("]"))]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            cli._parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{source}: `{command}` is refused by the CLI: {errors.getvalue()}")


def config_fields() -> set[str]:
    """Every dotted field path of every config `trainpod config fields` knows, list and tag marks dropped."""
    return {
        re.sub(r"\[[^]]*\]", "", row.path)
        for config_type in cli._config_types().values()
        for row in field_rows(config_type)
    }


def named_fields() -> list[tuple[str, str]]:
    """(file, name) for each `section.field` the docs name in backticks (`train.seq_len`, `pod.spot: true`)
    whose first part is a config's top-level field; file names (`config.yaml`) are not fields."""
    sections = {path.split(".")[0] for path in config_fields()}
    found = []
    for doc in DOCS:
        for name in re.findall(
            r"`([a-z_]+(?:\.[a-z_0-9]+)+)(?:[:=][^`]*)?`", doc.read_text(encoding="utf-8")
        ):
            if name.split(".")[0] in sections and name.rsplit(".", 1)[-1] not in FILE_SUFFIXES:
                found.append((str(doc.relative_to(REPO)), name))
    return sorted(set(found))


def test_the_docs_name_config_fields():
    assert len(named_fields()) >= 30, "the scan found too few field names: its pattern is broken"


@pytest.mark.parametrize(("source", "name"), named_fields(), ids=lambda v: v)
def test_every_config_field_the_docs_name_exists(source, name):
    assert name in config_fields(), (
        f"{source} names `{name}`, which no config has; fix the name (`trainpod config fields WORKLOAD` lists them)"
    )


@pytest.mark.parametrize("verb", sorted(cli.VERBS))
def test_each_verbs_summary_in_trainpod_help_is_a_whole_sentence(verb):
    """`trainpod --help` showed deploy's as "... and pod `<run>-<workload>`", cut at its docstring's line break."""
    summary = cli._summary(cli.VERBS[verb][0])
    assert summary.endswith((".", ")")) and "  " not in summary, f"{verb}: {summary!r}"


def test_stop_says_in_its_help_that_supervisors_leave_the_run_down(capsys):
    """README: the stop is recorded as runs/<run>/STOPPED, which supervisors honour until `trainpod deploy`."""
    with pytest.raises(SystemExit):
        cli.main(["stop", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "STOPPED" in help_text and "trainpod deploy" in help_text, help_text


def demo_volume_chat_lines() -> list[tuple[str, str]]:
    """(file, command) for each `trainpod generate` or `trainpod chat` line the docs point at the demo's volume."""
    return [
        (source, command)
        for source, command in command_lines()
        if command.split()[1] in ("generate", "chat") and "demo-volume" in command.split()
    ]


@pytest.mark.parametrize(("source", "command"), demo_volume_chat_lines(), ids=lambda v: v)
def test_the_docs_generate_and_chat_on_the_demo_volume_ask_for_an_answer_its_model_has_room_for(
    source, command
):
    """The README's `trainpod generate tiny-finetune ... --volume demo-volume` was exit 2 on the demo's volume: the
    tiny model reads 128 positions, the alpaca prompt takes 107, and the default --max-new-tokens is 200."""
    args = cli._parser().parse_args(shlex.split(command)[1:])
    assert args.max_new_tokens <= demo.MAX_NEW_TOKENS, (
        f"{source}: `{command}` asks for {args.max_new_tokens} new tokens; the demo's model has room for "
        f"{demo.MAX_NEW_TOKENS} after its prompt: pass --max-new-tokens {demo.MAX_NEW_TOKENS}"
    )


def test_the_docs_show_generate_and_chat_on_the_demo_volume():
    assert len(demo_volume_chat_lines()) >= 2, (
        "the README's generate and chat lines on demo-volume were not found"
    )


def test_estimates_help_names_every_training_workload_it_takes(capsys):
    """README: `estimate` takes "a pretrain, finetune, finetune-vlm or deploy config"; its help named pretrain and
    finetune alone."""
    from trainpod import workloads

    with pytest.raises(SystemExit):
        cli.main(["estimate", "--help"])
    help_text = capsys.readouterr().out
    usage, _, arguments = help_text.partition("positional arguments:")
    for name in workloads.names(workloads.Kind.TRAINING):
        assert re.search(rf"\b{name}\b(?!-)", " ".join(usage.split())), f"the summary leaves out {name}"
        assert re.search(rf"\b{name}\b(?!-)", arguments), f"CONFIG's help leaves out {name}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_exit_code_the_kit_gives_is_a_row_of_the_docs_exit_codes_table(doc):
    """README's table had no 130 (Ctrl-C ending push, pull, deploy or supervise), which errors.ExitCode gives."""
    from trainpod.errors import ExitCode

    section = doc.read_text(encoding="utf-8").split("Exit codes\n", 1)[1]
    rows = {line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")}
    missing = [f"{code.name}={int(code)}" for code in ExitCode if str(int(code)) not in rows]
    assert not missing, f"{doc.name}'s exit codes table has no row for {', '.join(missing)}"


# `docs/design.md, "Exit codes"` as the code cites it, its title wrapped over lines of a docstring or a comment too
CITATION = re.compile(r"design\.md,\s+(?:\"([^\"]+)\"|'([^']+)')")


def design_citations() -> list[tuple[str, str]]:
    """(file, section) for each citation of docs/design.md by section in the code, the tests and README."""
    paths = [REPO / "README.md", *(REPO / "src").rglob("*.py"), *(REPO / "tests").rglob("*.py")]
    return [
        (str(path.relative_to(REPO)), section)
        for path in paths
        if path != Path(__file__).resolve()
        for quoted in CITATION.findall(path.read_text(encoding="utf-8"))
        for section in [re.sub(r"\s*\n\s*#?\s*", " ", "".join(quoted))]
    ]


def test_the_code_cites_the_design_doc_by_section():
    assert len(design_citations()) >= 20, "the scan found too few citations: its pattern is broken"


@pytest.mark.parametrize(("source", "section"), design_citations(), ids=lambda v: v)
def test_every_section_the_code_cites_is_a_heading_of_the_design_doc(source, section):
    """hub.py cited "Environment" and three places "Work of rank 0 alone" (a paragraph of "Checkpoints")."""
    headings = re.findall(r"^#{2,3} (.+)$", (REPO / "docs/design.md").read_text(encoding="utf-8"), re.M)
    assert section in headings, (
        f'{source} cites docs/design.md, "{section}": no such section; one of {headings}'
    )
