"""The references in ``docs/``, generated from the code so that they cannot drift from it.

- ``docs/config.md`` from the config classes: every key of every section (sub-sections too) is
  one table row: its name, its type with the bounds pydantic checks, its default and its
  description, all read from ``Config.model_fields``.
- ``docs/algorithms.md`` from the algorithm registries: every registered name is one row with
  its paper and formula (the first paragraph of the function's docstring), the config key that
  selects it and what it needs (its registration facts).

``python -m treadle.cli.docs`` writes both; ``python -m treadle.cli.docs --check`` exits 1 when a
file differs from what the code says (``tests/config/test_config_docs.py`` and
``tests/algorithms/test_reference.py`` run the same comparison). Change a field or register a
function, run the command, commit both.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from treadle.config import Config, Section

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
DOC = DOCS_DIR / "config.md"
COMMAND = "python -m treadle.cli.docs"

HEADER = f"""# Config reference

<!-- Generated from treadle/config/ by `{COMMAND}`: do not edit by hand. -->

A run is one YAML file of the sections below (every key optional: a default is used for
what is not given) plus `section.key=value` overrides on the command line
(`treadle train run.yaml trainer.total_steps=20 data.train_files=[a.jsonl,b.jsonl]`) or
`overrides=[...]` in Python (`treadle.train`). Unknown keys are errors naming the closest
valid key; cross-field rules are checked before anything starts; the resolved config is
written to `<trainer.output_dir>/config.yaml`. `null` is YAML's None.
"""


def render() -> str:
    """The whole reference, as ``docs/config.md`` should hold it."""
    parts = [HEADER]
    for name, field in Config.model_fields.items():
        parts += _section(field.alias or name, _model(field.annotation))
    return "\n".join(parts)


def _model(annotation: Any) -> type[BaseModel]:
    assert isinstance(annotation, type) and issubclass(annotation, BaseModel), annotation
    return annotation


def _section(path: str, model: type[BaseModel]) -> Iterator[str]:
    yield f"## `{path}`\n" if "." not in path else f"### `{path}`\n"
    doc = model.__doc__ if model.__doc__ not in (Section.__doc__, BaseModel.__doc__) else None
    if doc:
        yield inspect.cleandoc(doc) + "\n"
    nested: list[tuple[str, type[BaseModel]]] = []
    groups = _groups(model)
    for owner, names in groups:
        if len(groups) > 1 and owner is not model:  # a settings class the section is made of
            yield f"`{owner.__name__}`: {_cell(inspect.cleandoc(owner.__doc__ or ''))}\n"
        yield "\n".join(_rows(path, model, names, nested)) + "\n"
    for sub_path, sub_model in nested:
        yield from _section(sub_path, sub_model)


def _groups(model: type[BaseModel]) -> list[tuple[type, list[str]]]:
    """The section's keys in order, in runs of the class that declares them (a section built
    of settings classes, as ``algorithm`` is, gets a table for each)."""
    groups: list[tuple[type, list[str]]] = []
    for name in model.model_fields:
        owner = next(c for c in model.__mro__ if name in getattr(c, "__annotations__", {}))
        if groups and groups[-1][0] is owner:
            groups[-1][1].append(name)
        else:
            groups.append((owner, [name]))
    return groups


def _rows(
    path: str, model: type[BaseModel], names: list[str], nested: list[tuple[str, type[BaseModel]]]
) -> list[str]:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name in names:
        field = model.model_fields[name]
        key = field.alias or name
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            nested.append((f"{path}.{key}", sub))
            rows.append(f"| `{key}` | section | | see `{path}.{key}` below |")
            continue
        rows.append(
            f"| `{key}` | {_cell(_type(field))} | {_cell(_default(field))} | "
            f"{_cell(field.description or '')} |"
        )
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type(field: FieldInfo) -> str:
    """The field's type as a reader writes it, with its bounds: ``int > 0``."""
    return _annotation(field.annotation) + _bounds(field.metadata)


def _bounds(metadata: list[Any]) -> str:
    marks = []
    for m in metadata:
        if isinstance(m, FieldInfo):  # Annotated[float, Field(ge=0)]: its own constraints
            marks += [_bounds(m.metadata)[2:-1]] if m.metadata else []
        elif isinstance(m, Gt):
            marks.append(f"> {m.gt}")
        elif isinstance(m, Ge):
            marks.append(f">= {m.ge}")
        elif isinstance(m, Lt):
            marks.append(f"< {m.lt}")
        elif isinstance(m, Le):
            marks.append(f"<= {m.le}")
        elif isinstance(m, MinLen) and m.min_length == 1:
            marks.append("non-empty")
    return f" ({', '.join(marks)})" if marks else ""


def _annotation(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _annotation(args[0]) + _bounds(list(args[1:]))
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        kinds = [_annotation(a) for a in args if a is not type(None)]
        return " | ".join(kinds) + (" | null" if type(None) in args else "")
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_annotation(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value}`" if isinstance(value, str) and value else f"`{json.dumps(value)}`"


def main(argv: list[str] | None = None) -> int:
    from treadle.algorithms.reference import render as render_algorithms

    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a file is not current")
    p.add_argument(
        "--dir",
        type=Path,
        default=DOCS_DIR,
        help="where config.md and algorithms.md are (default: the repository's docs/)",
    )
    args = p.parse_args(argv)
    stale = 0
    for name, text in (("config.md", render()), ("algorithms.md", render_algorithms())):
        path = args.dir / name
        if args.check:
            current = path.read_text() if path.is_file() else ""
            if current != text:
                print(f"{path} is out of date: run `{COMMAND}`", file=sys.stderr)
                stale = 1
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
