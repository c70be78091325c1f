"""A run's settings as its checkpoints record them, and what a resuming config changes.

Every checkpoint's state.json holds :func:`record` of its run's config: each setting by its
dotted key (as config.yaml writes it), a value naming a file or folder that exists resolved
to its real path and stamped by its files, so that a resume from another working directory
compares equal. :func:`changes` compares a record with the config about to resume it:
``treadle check`` refuses a change of what the checkpoint was trained from (:data:`FIXED`:
the actor resumes from the checkpoint's weights whatever ``model.path`` says, its data
position counts the rows of the files it was trained on) and names the others.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.config.schema import Config

_DATA = "the checkpoint's data position counts the rows of the data it was trained on"
_ADAPTERS = "the checkpoint's LoRA adapters were made with the recorded setting"

# What a resumed run cannot change, and why: the checkpoint was trained from it.
FIXED: dict[str, str] = {
    "model.path": (
        "the actor resumes from the checkpoint's weights, while the reference model (and "
        "LoRA's base) would be the new one"
    ),
    "model.tokenizer_path": "the checkpoint's model learned the recorded tokenizer's ids",
    "data.source": _DATA,
    "data.train_files": _DATA,
    "data.reasoning_gym.datasets": _DATA,
    "data.reasoning_gym.size": _DATA,
    "data.reasoning_gym.seed": _DATA,
    "actor.lora.rank": _ADAPTERS,
    "actor.lora.alpha": _ADAPTERS,
    "actor.lora.target_modules": _ADAPTERS,
    "critic.model_path": "the critic resumes from the checkpoint's weights",
}
# The same for every run of a directory, or read only when it starts.
_NOT_COMPARED = ("trainer.output_dir", "trainer.resume")


def record(cfg: Config) -> dict[str, Any]:
    """Every setting of ``cfg`` by dotted key, paths resolved and stamped (JSON)."""
    return {key: _where(value) for key, value in _flat(cfg.model_dump(mode="json", by_alias=True))}


@dataclass(frozen=True)
class Change:
    key: str
    before: Any
    after: Any

    @property
    def shown_before(self) -> str:
        return _shown(self.before)

    @property
    def shown_after(self) -> str:
        return _shown(self.after)

    def __str__(self) -> str:
        return f"{self.key} {self.shown_before} -> {self.shown_after}"


def changes(recorded: dict[str, Any], cfg: Config) -> tuple[list[Change], list[Change]]:
    """(changes of :data:`FIXED` settings, other changes) from ``recorded`` to ``cfg``."""
    now = record(cfg)
    fixed: list[Change] = []
    other: list[Change] = []
    lora = bool(recorded.get("actor.lora.rank")) or bool(cfg.actor.lora.rank)
    for key in sorted(recorded.keys() | now.keys()):
        if key in _NOT_COMPARED or (not lora and key.startswith("actor.lora.")):
            continue  # (no adapters before or now: LoRA's other settings are read by nothing)
        before, after = recorded.get(key, _UNSET), now.get(key, _UNSET)
        if not _same(before, after):
            (fixed if key in FIXED else other).append(Change(key, before, after))
    return fixed, other


_UNSET = "(unset)"


def _flat(value: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, item in value.items():
        if isinstance(item, dict) and item:
            out += _flat(item, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", item))
    return out


def _where(value: Any) -> Any:
    """A string naming a file or folder (or ``file.py:function``): ``{"path": real path,
    "stamp": what its files are}``; a list of them each; anything else as it is."""
    if isinstance(value, list):
        return [_where(item) for item in value]
    if not isinstance(value, str) or not value:
        return value
    path, colon, rest = value, "", ""
    if not os.path.exists(path) and ":" in value:
        path, colon, rest = value.rpartition(":")
    if not os.path.exists(path):
        return value
    real = os.path.realpath(path)
    return {"path": f"{real}{colon}{rest}", "stamp": _stamp(real)}


def _stamp(path: str) -> str:
    """A file's size; a folder's files' names and sizes and its config.json (what a model
    folder moved or copied elsewhere keeps, with no weights read)."""
    try:
        if not os.path.isdir(path):
            return str(os.path.getsize(path))
        with os.scandir(path) as entries:
            files = sorted((e.name, e.stat().st_size) for e in entries if e.is_file())
        config = Path(path, "config.json")
        text = config.read_text(errors="replace") if config.is_file() else ""
    except OSError:
        return ""
    return hashlib.sha256(json.dumps([files, text]).encode()).hexdigest()[:16]


def _same(before: Any, after: Any) -> bool:
    """Equal; a path the same real path, or the recorded one gone and this one stamped alike
    (the folder moved)."""
    if isinstance(before, list) and isinstance(after, list):
        return len(before) == len(after) and all(map(_same, before, after))
    if isinstance(before, dict) and isinstance(after, dict) and "path" in before:
        if before["path"] == after.get("path"):
            return True
        gone = not os.path.exists(before["path"].rpartition(":")[0] or before["path"])
        return gone and bool(before["stamp"]) and before["stamp"] == after.get("stamp")
    return bool(before == after)


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_shown(item) for item in value) + "]"
    if isinstance(value, dict) and "path" in value:
        return str(value["path"])
    return value if value == _UNSET else json.dumps(value)
