"""Reading data files: JSONL (``.jsonl``, ``.json``), Parquet (``.parquet``) or folders written
by ``datasets.Dataset.save_to_disk``, through ``datasets``. Every row becomes a ``Record`` with
its message prefix (``data.train_files: train.jsonl row 7``) and a stable id ``<file>:<row>``.

A file that does not parse (not UTF-8, bad JSON, a row that is not an object, a key given
twice, an integer beyond 64 bits) fails naming the file and the 1-based row (blank lines are not
rows).

A row holds the values the file holds. `datasets` infers one Arrow type per JSON column, which
can change them: ints in a column with a float become floats (``79`` -> ``79.0``), an integer
beyond int64 a float, an ISO date string a timestamp, and a column that mixes strings with
numbers or lists is stored as JSON text and decoded again, so the string ``"007"`` comes back as
the number ``7``. Such columns (any type but string, int64, bool, null and lists or structs of
them) are taken from the file itself, parsed with `json`; the others keep `datasets`' values.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.runtime.errors import DataError

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SPACE = re.compile(r"[ \t\n\r]*")  # what JSON counts as whitespace


@dataclass
class Record:
    where: str  # "data.train_files: train.jsonl row 7", for messages
    uid: str
    row: dict[str, Any]
    file: str = ""


def read_records(files: Sequence[str | Path], config_key: str) -> list[Record]:
    """All rows of all files, each with its message prefix and stable id."""
    if isinstance(files, (str, Path)):
        files = [files]
    names = [Path(f).name for f in files]
    unique_names = len(set(names)) == len(names)
    records = []
    for file, name in zip(files, names, strict=True):
        label = name if unique_names else str(file)
        rows = _read_file(Path(file), config_key)
        records += [
            Record(f"{config_key}: {file} row {i}", f"{label}:{i}", row, str(file))
            for i, row in enumerate(rows, start=1)
        ]
    if not records:
        raise DataError(f"{config_key}: no rows in {', '.join(map(str, files)) or 'no files'}")
    return records


def _loops(path: Path) -> bool:
    try:
        path.resolve(strict=True)
    except RuntimeError:  # Python 3.11's "Symlink loop from ..."
        return True
    except OSError as e:  # (3.13: ELOOP)
        return e.errno == errno.ELOOP
    return False


def _read_file(path: Path, config_key: str) -> list[dict[str, Any]]:
    if path.is_dir():
        return _read_saved(path, config_key)
    if not path.is_file():
        if path.is_symlink():  # (a link whose target is gone, or that leads back to itself)
            raise DataError(
                f"{config_key}: '{path}' is a symlink to '{os.readlink(path)}', which "
                f"{'leads round in a loop' if _loops(path) else 'does not exist'}: fix the link"
            )
        raise DataError(f"{config_key}: file '{path}' does not exist")
    builder = _FORMATS.get(path.suffix.lower())
    if builder is None:
        raise DataError(
            f"{config_key}: '{path}' is not JSONL (.jsonl, .json), Parquet (.parquet) or a "
            "folder written by Dataset.save_to_disk"
        )
    if path.stat().st_size == 0:
        return []
    # imported here: ~0.6 s (pandas, fsspec) that a process reading no such file skips
    from datasets import load_dataset

    datasets_log = logging.getLogger("datasets")
    level = datasets_log.level
    datasets_log.setLevel(logging.CRITICAL)  # it logs a parse error before raising it
    try:
        ds = load_dataset(builder, data_files=str(path), split="train")
        rows = _rows(ds)
        changed = [f.name for f in ds.data.schema if not _kept_as_written(f.type)]
        if builder == "json" and changed:
            _take_from_file(rows, path, changed)
    except Exception as e:  # datasets wraps parse errors in several exception types
        bad_row = _find_bad_row(path) if builder == "json" else None
        cause = bad_row or _first_line(e)
        raise DataError(f"{config_key}: cannot read '{path}': {cause}") from None
    finally:
        datasets_log.setLevel(level)
    return rows


def _first_line(error: BaseException) -> str:
    """The error's first line; past `datasets`' 'An error occurred while generating the
    dataset', which says nothing, to the error it wraps."""
    while str(error).startswith("An error occurred while generating") and error.__cause__:
        error = error.__cause__
    return (str(error).splitlines() or [type(error).__name__])[0]


def _kept_as_written(arrow_type: Any) -> bool:
    """Whether `datasets` gives a JSON column's values exactly as the file wrote them."""
    import pyarrow as pa

    types = pa.types
    if types.is_list(arrow_type) or types.is_large_list(arrow_type):
        return _kept_as_written(arrow_type.value_type)
    if types.is_struct(arrow_type):
        return all(_kept_as_written(field.type) for field in arrow_type)
    kept = (types.is_string, types.is_int64, types.is_boolean, types.is_null)
    return any(is_type(arrow_type) for is_type in kept)


def _take_from_file(rows: list[dict[str, Any]], path: Path, columns: list[str]) -> None:
    """Replace the values of `columns` by the file's own (see the module docstring)."""
    text = path.read_bytes().decode("utf-8-sig")
    if text.lstrip().startswith("["):
        parsed = json.loads(text)
    else:  # one JSON value after another: rows one a line, or spread over several
        decoder, parsed, end = json.JSONDecoder(), [], _after_space(text, 0)
        while end < len(text):
            value, end = decoder.raw_decode(text, end)
            parsed.append(value)
            end = _after_space(text, end)
    if len(parsed) != len(rows) or not all(isinstance(row, dict) for row in parsed):
        return  # a shape `datasets` reads its own way (an array of strings): keep its values
    for row, in_file in zip(rows, parsed, strict=True):
        for column in columns:
            row[column] = in_file.get(column)


def _after_space(text: str, start: int) -> int:
    space = _SPACE.match(text, start)
    return space.end() if space else start


def _read_saved(path: Path, config_key: str) -> list[dict[str, Any]]:
    """The rows of a folder written by ``Dataset.save_to_disk`` (one split of a DatasetDict's
    folder: ``folder/train``)."""
    from datasets import Dataset, load_from_disk

    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise DataError(
            f"{config_key}: '{path}' holds a DatasetDict: name one split's folder "
            f"({', '.join(f'{path}/{name}' for name in splits) or 'none found'})"
        )
    if not (path / "state.json").is_file():
        raise DataError(
            f"{config_key}: '{path}' is a folder, but not one written by Dataset.save_to_disk "
            "(no state.json in it)"
        )
    try:
        ds = load_from_disk(str(path))
    except Exception as e:  # a damaged folder: arrow and json errors of several kinds
        raise DataError(f"{config_key}: cannot read '{path}': {e}") from None
    assert isinstance(ds, Dataset)
    return _rows(ds)


def _rows(ds: Any) -> list[dict[str, Any]]:
    """A dataset's rows as dicts, by Arrow's own conversion: 5,000 rows in ~0.01 s, against
    ~0.4 s row by row through `datasets`' formatter. Values come as stored, never decoded: a
    `datasets` Image column gives ``{"bytes", "path"}`` (which `images.read_images` opens;
    the formatter made it a PIL picture, which it refused)."""
    return ds.to_list()


def _find_bad_row(path: Path) -> str | None:
    """Which row of a JSON Lines file (or JSON array) does not parse, and why; None if all do.

    `datasets` says 'JSON parse error ... in row 0' (its row count, 0-based within a block)
    or only 'utf-8 codec can't decode'; this names the 1-based row as the file numbers it.
    """
    data = path.read_bytes()
    if data.lstrip().startswith(b"["):  # a .json file holding one array of rows
        return _bad_array_row(data)
    lines = [line for line in data.split(b"\n") if line.strip()]
    for row, line in enumerate(lines, start=1):
        value, error = _json(line)
        if isinstance(error, UnicodeDecodeError):
            return f"row {row}: not UTF-8 (byte {error.start} of the row)"
        if isinstance(error, _KeyTwice):
            return f"row {row}: key '{error.key}' is given twice: keep one"
        if error is not None:
            return f"row {row}: not valid JSON (column {error.colno}: {error.msg})"
        if problem := _not_an_object(row, value) or _big_int(row, value):
            return problem
    return None


def _bad_array_row(data: bytes) -> str | None:
    rows, error = _json(data)
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 (byte {error.start} of the file)"
    if isinstance(error, _KeyTwice):  # the parser does not say in which row
        return f"a row gives key '{error.key}' twice: keep one"
    if error is not None:
        return f"not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
    values = rows if isinstance(rows, list) else []
    problems = (
        _not_an_object(row, value) or _big_int(row, value)
        for row, value in enumerate(values, start=1)
    )
    return next((p for p in problems if p), None)


class _KeyTwice(ValueError):
    """A JSON object that gives a key twice: Arrow refuses it ('specified twice'), `json` would
    keep the last value."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _KeyTwice(key)
        seen.add(key)
    return dict(pairs)


def _json(data: bytes) -> tuple[Any, UnicodeDecodeError | json.JSONDecodeError | _KeyTwice | None]:
    """``(value, None)``, or ``(None, why)`` when the bytes are not UTF-8 JSON."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_object), None
    except (UnicodeDecodeError, json.JSONDecodeError, _KeyTwice) as e:
        return None, e


def _big_int(row: int, value: dict[str, Any]) -> str | None:
    """A field holding an integer Arrow cannot store (beyond 64 bits, at any depth)."""
    field = next((key for key, v in value.items() if _has_big_int(v)), None)
    if field is None:
        return None
    return f"row {row}: field '{field}' holds an integer beyond 64 bits: quote it as a string"


def _has_big_int(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_big_int(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_big_int(v) for v in value)
    return isinstance(value, int) and not -(2**63) <= value < 2**64


def _not_an_object(row: int, value: Any) -> str | None:
    if isinstance(value, dict):
        return None
    return f"row {row}: not a JSON object (a {_json_type(value)})"


def _json_type(value: Any) -> str:
    names = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return names.get(type(value), "null" if value is None else type(value).__name__)


def require(record: Record, key: str, what: str) -> Any:
    value = record.row.get(key)
    blank = isinstance(value, str) and not value.strip()
    if value is None or blank or (isinstance(value, list) and not value):
        raise DataError(f"{record.where}: {what} field '{key}' is missing or empty")
    return value


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def answer_text(record: Record, key: str, value: Any) -> str:
    """The ground truth handed to the reward function: a string, number or list (as JSON);
    a JSON object is refused (a nested row, not an answer)."""
    if isinstance(value, dict):
        raise DataError(
            f"{record.where}: answer field '{key}' is a JSON object; the answer is the ground "
            "truth given to the reward function as text: give it as a string (or set "
            "data.answer_key to the column that holds the answer)"
        )
    return as_text(value)


ROLES = ("system", "user", "assistant", "tool")  # what chat templates render as turns


def check_messages(record: Record, key: str, value: Any) -> list[dict[str, str]]:
    """``value`` as chat messages: each a known role with some content (a template renders
    any role it is given, ``<|im_start|>robot``, and an empty turn as a turn)."""
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        raise DataError(
            f"{record.where}: field '{key}' must be a string or a list of "
            "{'role': str, 'content': str} messages"
        )
    for i, m in enumerate(value, start=1):
        if m["role"] not in ROLES:
            raise DataError(
                f"{record.where}: field '{key}' message {i} has role {m['role']!r} (roles: "
                f"{', '.join(ROLES)})"
            )
        if not m["content"].strip():
            raise DataError(f"{record.where}: field '{key}' message {i} has empty content")
    return [{"role": m["role"], "content": m["content"]} for m in value]
