"""Load a YAML config into a pydantic model, apply overrides, and report every problem at once."""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import shlex
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict

from trainpod.config.fields import field_rows, sections_of
from trainpod.errors import ConfigError


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are checked on assignment."""

    # allow_inf_nan=False: `.inf` passed every ge/gt bound (an infinite lease TTL held a dead pod's run forever)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)


ConfigT = TypeVar("ConfigT", bound=Section)


def without_settings_added_later(settings: dict, added_later: dict[tuple[str, ...], object]) -> dict:
    """`settings` (a model_dump) less each setting added later that holds its value of before.

    What identifies a made dataset (its settings hash, its key) must not change when a kit upgrade only
    adds a setting whose default gives the same output: a half-made dataset's resume, or a finished one's
    reuse, would be refused. `added_later` maps the setting's path ("*" for every item of a list) to the
    value that gives the output of before it existed; set to anything else, it counts.
    """
    for path, before in added_later.items():
        _drop_where(settings, path, before)
    return settings


def _drop_where(tree: object, path: tuple[str, ...], value: object) -> None:
    head, rest = path[0], path[1:]
    if head == "*" and isinstance(tree, list):
        for item in tree:
            _drop_where(item, rest, value)
    elif isinstance(tree, dict) and head in tree:
        if rest:
            _drop_where(tree[head], rest, value)
        elif tree[head] == value:
            del tree[head]


def parse_overrides(text: str | None) -> list[str]:
    """Split TRAINPOD_SET ("a.b=1 c=x" or one per line; shell quoting allowed) into assignments."""
    if not text or not text.strip():
        return []
    try:
        return shlex.split(text, comments=False, posix=True)
    except ValueError as exc:  # an unbalanced quote, a trailing backslash
        raise ConfigError(
            [
                f"TRAINPOD_SET={text!r}: {str(exc).lower()}; close every quote, or write it "
                'without quotes: TRAINPOD_SET="train.max_steps=1000 train.lr=3e-4"'
            ]
        ) from None


def _apply_override(tree: dict[str, Any], assignment: str, problems: list[str]) -> None:
    key, sep, raw_value = assignment.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        problems.append(
            f"override {assignment!r} is not of the form key.path=value; "
            "write it like train.max_steps=1000 (TRAINPOD_SET separates several with spaces or newlines)"
        )
        return
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError:
        value = raw_value  # not YAML: keep it as the literal string
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            problems.append(
                f"override {key}: '{part}' holds a value, not a section, so it has no keys below it"
            )
            return
        node = child
    node[parts[-1]] = value


def _section_at(model_cls: type[BaseModel], loc: tuple[Any, ...]) -> tuple[Any, Any]:
    """The section class at `loc` and the field that holds it (None at the top), walking through what
    pydantic puts in an error's loc besides field names: a list item's index (`sources.0.path`) and a
    tagged union's tag (`task.0.merge.dtype`). (None, None) when `loc` leads nowhere known."""
    cls: Any = model_cls
    field = None
    for part in loc:
        if field is not None and (isinstance(part, int) or typing.get_origin(field.annotation) is dict):
            continue  # an item of the list (or a key of the mapping) the field holds: still the field's
        sections = {m.__name__: m for m, _ in sections_of(getattr(field, "annotation", None))}
        tagged = {_tag_of(m): m for m in sections.values()}
        if field is not None and len(sections) > 1 and part in (tagged | sections):
            cls = (tagged | sections)[part]  # one of several sections, named by its tag or class
            continue
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return None, None
        found = [section for section, _ in sections_of(field.annotation)]
        cls = found[0] if len(found) == 1 else None
    return cls, field


def _tag_of(section: type[BaseModel]) -> str | None:
    """The one value a section's `Literal` tag field allows (convert's `kind: merge`), as pydantic's loc names it."""
    for info in section.model_fields.values():
        allowed = getattr(info.annotation, "__args__", ())
        if getattr(info.annotation, "__origin__", None) is Literal and len(allowed) == 1:
            return str(allowed[0])
    return None


def _known_fields(model_cls: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names accepted at `loc` (the parent of an unknown key), for a 'did you mean'."""
    cls, _ = _section_at(model_cls, loc)
    return sorted(getattr(cls, "model_fields", {}))


def _deeper_homes(model_cls: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Where an unknown key is a field further down the section it was given in, as dotted paths from the top:
    a finetune's `sft` is `data.sft`. The SFT code names its fields as a datagen config's `sft:` section has them
    (`raise sft.cutoff_len`), which a finetune's user then passed as --set sft.cutoff_len=... to no avail."""
    cls, _ = _section_at(model_cls, loc[:-1])
    if cls is None:
        return []
    above = "".join(f"{part}." for part in loc[:-1])
    paths = [row.path.replace("[]", "") for row in field_rows(cls)]
    return [above + path for path in paths if "." in path and path.rsplit(".", 1)[-1] == str(loc[-1])][:3]


def _field_description(model_cls: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    _, field = _section_at(model_cls, loc)
    return field.description if field is not None else None


@dataclass(frozen=True)
class OverrideRoute:
    """How the command at hand lets its user override a config field, which a config error names as the fix.

    `trainpod run` and `trainpod estimate` take --set; a pod reads TRAINPOD_SET; `trainpod deploy` takes
    neither (argparse: unrecognized arguments) and the pod it rents applies the deploy YAML's env.set, its
    TRAINPOD_SET. A loader given no route names the YAML alone, a fix that holds wherever the config is read.
    """

    each: str  # written before each assignment: "--set " for a flag, "" for a list of them
    sentence: str  # the fix, {} standing for the assignments

    def fix(self, *assignments: str) -> str:
        return self.sentence.format(" ".join(self.each + assignment for assignment in assignments))


SET_FLAG = OverrideRoute("--set ", "pass {}")
POD_SET_VARIABLE = OverrideRoute("", "add {} to TRAINPOD_SET")
DEPLOY_ENV_SET = OverrideRoute("", "add {} to the deploy YAML's env.set (the pod's TRAINPOD_SET)")


def _by_field(model_cls: type[BaseModel], errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`errors` with those of one field of several types (`int | Literal['latest']`) merged into one at the field.

    pydantic reports a value that fits none of a union's types once per type, each at the field's path plus
    the type's name: `task.0.export.step.int` and `task.0.export.step.literal['latest']`, two problems for one
    value, at paths no --set can name, without the field's description as their fix."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    kept: list[dict[str, Any]] = []
    for error in errors:
        loc = _union_field_loc(model_cls, tuple(error["loc"]))
        if loc is None:
            kept.append(error)
            continue
        if loc not in merged:
            merged[loc] = {**error, "loc": loc, "depth": len(error["loc"])}
            kept.append(merged[loc])
            continue
        first = merged[loc]
        first["msg"] += ", or " + error["msg"].removeprefix("Input should be ")
        if len(error["loc"]) < first["depth"]:  # an error about the whole value, not one item of it
            first["input"], first["depth"] = error["input"], len(error["loc"])
    return kept


def _union_field_loc(model_cls: type[BaseModel], loc: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The path of the field of several (non-section) types that `loc` lies inside, below one of its types' names."""
    for end in range(len(loc) - 1, 0, -1):
        cls, field = _section_at(model_cls, loc[:end])
        if field is None or cls is not None:
            continue
        types_ = [arg for arg in typing.get_args(field.annotation) if arg is not type(None)]
        if typing.get_origin(field.annotation) in (typing.Union, types.UnionType) and len(types_) > 1:
            return loc[:end]
        return None
    return None


def _describe(model_cls: type[BaseModel], error: dict[str, Any], route: OverrideRoute | None) -> str:
    loc = tuple(error["loc"])
    kind = error["type"]
    if kind == "union_tag_invalid":
        # A list item of several sections (convert's `task`) whose tag names none: the tag is the wrong value.
        tag_field = str(error["ctx"]["discriminator"]).strip("'")
        expected = str(error["ctx"]["expected_tags"]).replace("'", "")
        dotted = ".".join(str(part) for part in (*loc, tag_field))
        value = error["input"].get(tag_field) if isinstance(error["input"], dict) else error["input"]
        return f"{dotted} = {value!r}: should be one of: {expected}; fix: set {tag_field} to one of them"
    dotted = ".".join(str(part) for part in loc) or "(top level)"
    if kind == "extra_forbidden":
        known = _known_fields(model_cls, loc[:-1])
        guess = difflib.get_close_matches(str(loc[-1]), known, n=1) or _deeper_homes(model_cls, loc)
        hint = "did you mean " + " or ".join(f"'{g}'" for g in guess) + "? " if guess else ""
        return f"{dotted}: unknown key; {hint}remove it or use one of: {', '.join(known)}"
    if kind == "missing":
        description = _field_description(model_cls, loc)
        about = f" ({description})" if description else ""
        if any(isinstance(part, int) for part in loc):  # --set reaches no list item (a.0.b is not a path)
            return f"{dotted}: required but missing{about}; add it to that entry of the list in the YAML"
        if route is None or not getattr(model_cls, "takes_overrides", True):  # deploy, supervise: no --set
            return f"{dotted}: required but missing{about}; add it to the YAML"
        return f"{dotted}: required but missing{about}; add it to the YAML or {route.fix(f'{dotted}=VALUE')}"
    if kind == "value_error" and isinstance(error.get("input"), dict):
        # A cross-field check on a whole section: its message already names the fields and the fix.
        return str(error["msg"]).removeprefix("Value error, ")
    value = error.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    description = _field_description(model_cls, loc)
    fix = f"fix: {_sentence_inside(description)}" if description else "fix the value"
    if kind == "string_type" and isinstance(value, (bool, int, float)):
        # `env: {MY_SETTING: 1}`, `command: [train, --steps, 100]`, `git_ref: 1.0`: text YAML read as another type.
        written = str(value).lower() if isinstance(value, bool) else str(value)
        return (
            f"{dotted} = {shown}: YAML reads {written} without quotes as a "
            f"{'boolean' if isinstance(value, bool) else 'number'}, and this takes text; write it in quotes, "
            f'"{written}"; {fix}'
        )
    return f"{dotted} = {shown}: {error['msg']}; {fix}"


def _sentence_inside(description: str) -> str:
    """A description to follow "fix: ": its first letter lower case, unless its first word is a name with more
    capitals (GPUs, LoRA, TRAINPOD_ON_FINISH: "tRAINPOD_ON_FINISH" would name a variable that does not exist)."""
    first_word = description.split(maxsplit=1)[0]
    if any(c.isupper() or c == "_" for c in first_word[1:]):
        return description
    return description[0].lower() + description[1:]


def validate_tree(
    model_cls: type[ConfigT], tree: Any, source: str | None = None, route: OverrideRoute | None = None
) -> ConfigT:
    """`tree` as a `model_cls`; ConfigError listing every problem, each fix by `route` where one can override."""
    if not isinstance(tree, dict):
        raise ConfigError(
            [f"the config must be a mapping of keys to values, got {type(tree).__name__}"], source
        )
    booleans = _booleans_for_numbers(model_cls, tree)
    if booleans:
        # Each replaced by a value no type takes: their fields fail, not as 1 or 0 in cross-field checks (a section
        # with a failed field runs none), and their own errors are left out for the problems above.
        tree = copy.deepcopy(tree)
        for loc in booleans:
            _replace(tree, loc, _NOT_A_VALUE)
    try:
        config = model_cls.model_validate(tree)
    except pydantic.ValidationError as exc:
        errors = [e for e in _by_field(model_cls, exc.errors()) if tuple(e["loc"]) not in booleans]
        problems = [*booleans.values(), *(_describe(model_cls, e, route) for e in errors)]
        raise ConfigError(problems, source) from None
    return config


_NOT_A_VALUE = object()


def _replace(tree: Any, loc: tuple[Any, ...], value: object) -> None:
    """Put `value` at `loc` of `tree`; a part of `loc` that is not a key or index there (a tagged item's tag in
    pydantic's loc, the index of convert's `task: {kind: mlx}`, a list of one) is passed over."""
    node = tree
    for part in loc[:-1]:
        if (isinstance(node, list) and isinstance(part, int)) or (isinstance(node, dict) and part in node):
            node = node[part]
    node[loc[-1]] = value


def _booleans_for_numbers(
    model_cls: type[BaseModel], tree: Any, loc: tuple[Any, ...] = ()
) -> dict[tuple[Any, ...], str]:
    """A problem for each boolean given to a field that takes a number, which pydantic reads as 1 or 0: YAML reads
    true, yes and on (false, no, off) as booleans, and `train.lr: true` trained at lr 1.0, `train.max_steps: yes`
    for one step, silently. A check of the tree before pydantic's, as a validator on every field cannot be: pydantic
    refuses one on a tag field (convert's `kind`)."""
    if not isinstance(tree, dict):
        return {}
    problems = {}
    for key, value in tree.items():
        field = model_cls.model_fields.get(key)
        if field is None:
            continue
        dotted = ".".join(str(part) for part in (*loc, key))
        if isinstance(value, bool) and _takes_a_number_not_a_boolean(field.annotation):
            description = f"; fix: {_sentence_inside(field.description)}" if field.description else ""
            problems[(*loc, key)] = _boolean_for_a_number(dotted, value) + description
            continue
        if isinstance(value, dict) and _maps_to_numbers(field.annotation):  # datagen's `kinds: {easy: yes}`
            for name, share in value.items():
                if isinstance(share, bool):
                    problems[(*loc, key, name)] = _boolean_for_a_number(f"{dotted}.{name}", share)
            continue
        sections = {_tag_of(section): section for section, _ in sections_of(field.annotation)}
        listed = typing.get_origin(field.annotation) is list  # convert's `task: mlx` is a list of one
        for index, item in enumerate(value if isinstance(value, list) else [value]):
            where = (*loc, key, index) if listed else (*loc, key)
            if len(sections) == 1:
                problems |= _booleans_for_numbers(next(iter(sections.values())), item, where)
            elif isinstance(item, dict) and isinstance(tag := item.get("kind"), str) and tag in sections:
                problems |= _booleans_for_numbers(
                    sections[tag], item, (*where, tag)
                )  # convert's tasks, by kind
    return problems


def _boolean_for_a_number(dotted: str, value: bool) -> str:
    return (
        f"{dotted} = {value!r}: YAML reads {str(value).lower()} (and yes/no, on/off) without quotes as a boolean, "
        "and this takes a number; write the number"
    )


def _maps_to_numbers(annotation: Any) -> bool:
    """A mapping field whose values are numbers (`dict[str, float] | None`)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for allowed in typing.get_args(annotation) if union else (annotation,):
        if typing.get_origin(allowed) is dict and _takes_a_number_not_a_boolean(typing.get_args(allowed)[1]):
            return True
    return False


def _takes_a_number_not_a_boolean(annotation: Any) -> bool:
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    allowed = set(typing.get_args(annotation)) if union else {annotation}
    return bool(allowed & {int, float}) and bool not in allowed


def load_tree(path: Path | str | None, overrides: list[str] = ()) -> tuple[dict[str, Any], str]:
    """Read `path` (YAML) and apply `overrides` in order: the raw tree, before validation, and its source.

    Raises ConfigError (exit 2) for a missing file, YAML syntax and malformed overrides.
    """
    problems: list[str] = []
    source = str(path) if path is not None else "overrides"
    tree: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "does not exist"
            raise ConfigError(
                [
                    # Where the path came from (deploy's argument, --config, TRAINPOD_CONFIG) is the caller's to say:
                    # TRAINPOD_CONFIG named here told `trainpod deploy X.yaml` of a variable it never reads.
                    f"config file {path} {what}; give the path of an existing YAML file"
                ],
                source,
            )
        try:
            tree = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError([f"malformed YAML{where}: {problem}; fix the syntax there"], source) from None
        except UnicodeDecodeError:
            raise ConfigError(["the file is not UTF-8 text; save it as UTF-8 YAML"], source) from None
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigError(
                [f"the top level must be a mapping of keys to values, got {type(tree).__name__}"], source
            )
    for assignment in overrides:
        _apply_override(tree, assignment, problems)
    if problems:
        raise ConfigError(problems, source)
    return tree, source


def load_config(
    model_cls: type[ConfigT],
    path: Path | str | None,
    overrides: list[str] = (),
    route: OverrideRoute | None = None,
) -> ConfigT:
    """Read `path` (YAML), apply `overrides` in order, validate, and return the typed config.

    Raises ConfigError (exit 2) listing every problem: YAML syntax, malformed overrides, unknown
    keys, wrong types, failed checks; a missing field's fix names `route`, the caller's way to override one.
    """
    tree, source = load_tree(path, overrides)
    return validate_tree(model_cls, tree, source, route)


def dump_config(config: BaseModel) -> str:
    """The resolved config as YAML, in field order, suitable to load again."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def config_hash(config: BaseModel) -> str:
    canonical = json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
