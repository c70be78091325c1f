"""Reading a run's config: YAML (a key given twice is an error), ``a.b=value`` overrides,
unknown keys with the closest valid one, one line per problem; and writing the resolved config."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from treadle.config.schema import Config
from treadle.runtime.errors import ConfigError

# ----------------------------------------------------------------------------- loading


def load_config(
    path: str | Path | Mapping[str, Any] | None, overrides: Sequence[str] = ()
) -> Config:
    """Read a YAML file (or take a mapping of sections, as the YAML would hold them), apply
    ``a.b=value`` overrides and validate everything.

    Raises one ConfigError whose message has a line per problem: a YAML syntax error or a
    duplicate key (file, line, column) stops at once; bad overrides, unknown keys and invalid
    values are all listed.
    """
    if isinstance(path, Mapping):
        raw: dict[str, Any] = copy.deepcopy(dict(path))
    else:
        raw = {} if path is None else _read_yaml(Path(path))
    problems: list[str] = []
    for item in overrides:
        try:
            _apply_override(raw, item)
        except ConfigError as e:
            problems.append(str(e))
    problems += _check_keys(raw, Config, prefix="")
    if problems:
        raise ConfigError("\n".join(problems))
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_describe_validation_error(e)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader whose mappings refuse a key given twice (PyYAML keeps the last silently)."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.Node) -> dict[Any, Any]:
    assert isinstance(node, yaml.MappingNode)  # registered for the mapping tag only
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: later keys override it
            continue
        key = loader.construct_object(key_node)  # type: ignore[no-untyped-call]
        line = key_node.start_mark.line + 1
        if isinstance(key, str) and key in seen:
            raise ConfigError(
                f"line {line}: key '{key}' is given twice (first on line {seen[key]}); "
                "YAML would keep only the last: remove one"
            )
        if isinstance(key, str):
            seen[key] = line
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _unique_mapping,
)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = " ".join(str(x) for x in (e.context, e.problem) if x)
        if "'\\t'" in what:  # PyYAML's "found character '\t' that cannot start any token"
            what += " (YAML indents with spaces, never tabs: replace the tab with spaces)"
        raise ConfigError(f"{path}:{where}: YAML syntax error: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML error: {e}") from None
    except RecursionError:
        raise ConfigError(
            f"{path}: the YAML is nested too deeply to read: a run's config is sections of "
            "keys, a few levels deep"
        ) from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return loaded or {}


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not key.strip() or not all(p.strip() for p in parts):
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    try:  # YAML parsing gives numbers, booleans, null and lists their types ("[a.jsonl]").
        parsed = _parse_value(value)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(
            f"override {item!r}: the value is not valid YAML ({problem}); quote it"
        ) from None
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = parsed


# Stands for '#' while an override's value is parsed (a character no one types).
_HASH = "\ue000"


def _parse_value(value: str) -> Any:
    """An override's value as YAML reads it, but a '#' is kept: YAML would read ` #` as the
    start of a comment and drop the rest ('data.system_prompt=You are #1' gave 'You are'),
    and on a command line a '#' that reaches treadle was quoted for the shell on purpose;
    and a mapping is one written ``{a: 1}``."""
    if not value.strip():
        return ""
    hashes = "#" in value and _HASH not in value
    parsed = yaml.safe_load(value.replace("#", _HASH) if hashes else value)
    if isinstance(parsed, dict) and not value.lstrip().startswith("{"):
        # YAML's block form: 'f.py:' (a reward function's name left out) read as {'f.py':
        # None}; a command line writes a mapping as {a: 1}, so this is the string it says
        return value.strip()
    return _put_back(parsed) if hashes else parsed


def _put_back(parsed: Any) -> Any:
    if isinstance(parsed, str):
        return parsed.replace(_HASH, "#")
    if isinstance(parsed, list):
        return [_put_back(v) for v in parsed]
    if isinstance(parsed, dict):
        return {_put_back(k): _put_back(v) for k, v in parsed.items()}
    return parsed


# keys of earlier versions: the error names the new key
RENAMED = {"trainer.keep_checkpoints": "trainer.keep_last"}


def _check_keys(raw: dict[str, Any], model: type[BaseModel], prefix: str) -> list[str]:
    """Every unknown key (with the closest valid one) and every section that is no mapping."""
    fields = {f.alias or name: f for name, f in model.model_fields.items()}
    problems = []
    for key, value in raw.items():
        if key not in fields:
            valid = list(fields)
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            if f"{prefix}{key}" in RENAMED:
                hint = f"; it is now '{RENAMED[f'{prefix}{key}']}'"
            where = f"section '{prefix[:-1]}'" if prefix else "the config"
            problems.append(
                f"unknown key '{prefix}{key}' in {where}{hint} (valid: {', '.join(valid)})"
            )
            continue
        sub = fields[key].annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            if not isinstance(value, dict):
                problems.append(f"'{prefix}{key}' is a section: give it a mapping of keys")
                continue
            problems += _check_keys(value, sub, prefix=f"{prefix}{key}.")
    return problems


def _describe_validation_error(e: ValidationError) -> str:
    """One line per invalid value: the key, what is wrong, the value given."""
    lines = []
    for err in e.errors():
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])[1:]
        if err["type"] == "value_error" and (not key or isinstance(err.get("input"), dict)):
            # a cross-field rule (of the config or a section): its message names the keys
            lines += str(err["msg"]).removeprefix("Value error, ").splitlines()
            continue
        msg = str(err["msg"]).removeprefix("Value error, ")
        given = repr(err.get("input"))
        given = given if len(given) <= 60 else given[:57] + "..."
        lines.append(f"{key}: {msg[:1].lower()}{msg[1:]} (got {given})")
    return "\n".join(lines)


def dump_config(config: Config, path: str | Path) -> None:
    """Write the fully resolved config as YAML (every field, defaults included)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = config.model_dump(mode="json", by_alias=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
