"""Every field of a config, from its pydantic models: dotted path, type (with a number's range), default, description.

    trainpod config fields finetune     # or pretrain, datagen, datagen-sft, convert, deploy, ...

Nested sections are walked (`train.lr`); a list of sections shows its items as `path[].field`, and one
of several sections its own fields under its tag (`task[kind=merge].dtype`).
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class FieldRow:
    path: str
    type: str
    default: str
    description: str


def field_rows(model: type[BaseModel], prefix: str = "") -> list[FieldRow]:
    """One row per field, depth first in declaration order; a section's own row comes before its fields."""
    rows = []
    for name, info in model.model_fields.items():
        path = prefix + name
        rows.append(FieldRow(path, _type_with_bounds(info), _default(info), info.description or ""))
        for nested, suffix in sections_of(info.annotation):
            rows += field_rows(nested, f"{path}{suffix}.")
    return rows


def sections_of(annotation: Any) -> list[tuple[type[BaseModel], str]]:
    """Config sections inside a field's type: itself, Optional[...], Annotated[...] or list[...] of one.
    One of several sections (convert's `task`: mlx, merge or export) is told apart by its tag, as in
    `task[kind=merge].dtype`: their fields share names but not defaults."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, "")]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return sections_of(args[0])
    if origin is list and args:
        return [(model, f"[{suffix.strip('[]')}]") for model, suffix in sections_of(args[0])]
    if origin in (typing.Union, types.UnionType):
        found = [model for arg in args for model, _ in sections_of(arg)]
        return [(model, _tag(model) if len(found) > 1 else "") for model in found]
    return []


def _tag(model: type[BaseModel]) -> str:
    """`[kind=merge]`: the field whose one allowed value names this section among the union's."""
    for name, info in model.model_fields.items():
        if (
            typing.get_origin(info.annotation) is typing.Literal
            and len(typing.get_args(info.annotation)) == 1
        ):
            return f"[{name}={typing.get_args(info.annotation)[0]}]"
    return f"[{model.__name__}]"


def type_name(annotation: Any) -> str:
    """`int`, `str | None`, `list[str]`, `one of: nf4, fp4`: types as a config writer reads them."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return "one of: " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of: " + ", ".join(str(m.value) for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def bounds(info: Any) -> str:
    """A number field's range as the loader checks it: `>= 1`, `>= 0, < 1` (empty when it has none)."""
    found = [
        f"{sign} {getattr(item, name)}"
        for item in info.metadata
        for name, sign in BOUNDS
        if getattr(item, name, None) is not None
    ]
    return ", ".join(found)


def _type_with_bounds(info: Any) -> str:
    """`int >= 1`, and `int >= 1 | None` where None is allowed too (the bounds are the number's)."""
    name, limits = type_name(info.annotation), bounds(info)
    if not limits:
        return name
    if name.endswith(" | None"):
        return f"{name.removesuffix(' | None')} {limits} | None"
    return f"{name} {limits}"


def _default(info: Any) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "(required)"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(section)"
    return repr(value)


def format_rows(rows: list[FieldRow]) -> str:
    """Aligned columns: path, type, default; the description on the next line, indented."""
    width_path = max(len(r.path) for r in rows)
    width_type = min(max(len(r.type) for r in rows), 40)
    lines = []
    for row in rows:
        lines.append(f"{row.path:<{width_path}}  {row.type:<{width_type}}  default {row.default}")
        if row.description:
            lines.append(f"    {row.description}")
    return "\n".join(lines)
