"""Checkpoint directories: written under a temporary name, sealed by a manifest, renamed.

``<output_dir>/checkpoints/step_<N>/`` holds ``model/`` (an HF safetensors folder; with
LoRA ``adapter/`` instead, the adapters as a peft folder), ``optimizer.safetensors`` (not
with ``trainer.save_optimizer=false``) + ``optimizer.json``, ``rng_rank<r>.safetensors``,
the other roles' folders, ``state.json`` (step, data position, driver state) and, written
last and atomically, ``manifest.json``: every other file with its size and sha256. Then the
directory is renamed from ``step_<N>.tmp``.

A checkpoint is complete when its manifest is there and every file matches it. Resuming
verifies the newest: a file missing, truncated or with other bytes (a flipped bit included)
makes it fall back to the one before, with a warning naming the file; when no complete
checkpoint is left the run stops with one error naming what is damaged.

:func:`save` writes one (the actor's group at the top, each other role in ``<name>/``);
:func:`export_model` copies one to ``<output_dir>/final_model``, files of its own that
rotation cannot touch (with LoRA: the merged model, its adapter in ``adapter/``).

A write that fails (disk full, no permission, an I/O error: an OSError here or in a worker)
is a :class:`CheckpointWriteError`, one line naming the path and the cause; the partial
``step_<N>.tmp`` is removed and nothing older is pruned, so the previous sealed checkpoint is
where the same command resumes.

Retention (:class:`Retention`): once a checkpoint is sealed, the older ones beyond the newest
``keep_last`` are removed, except the best: the one whose state.json records the best value
of the ``best`` metric (``state["eval"]``, the step's evaluation metrics). The ranking is read
from the directories on disk, so the best of an earlier process of the run is kept after a
resume; a checkpoint without the metric (an older treadle's) is not ranked.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from treadle.runtime.errors import TreadleError
from treadle.runtime.faults import failpoint

_STEP = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
log = logging.getLogger("treadle")


class CheckpointError(TreadleError):
    """No complete checkpoint to resume from although there are checkpoints; names the damage."""


class CheckpointWriteError(TreadleError):
    """A checkpoint (or final_model) could not be written; names the path and the cause."""


def os_error(error: BaseException) -> OSError | None:
    """The OSError behind ``error``: itself, or a Ray worker's that a RayTaskError wraps."""
    for e in (getattr(error, "cause", None), error):
        if isinstance(e, OSError):
            return e
    return None


def write_error(step: int, error: OSError, path: Path) -> CheckpointWriteError:
    """``checkpoint step N: cannot write <path>: <cause> (<errno name>)``; the path is the
    file the OSError names, else ``path``."""
    where = error.filename if error.filename is not None else path
    if isinstance(error, shutil.Error) and error.args and isinstance(error.args[0], list):
        _, where, cause = error.args[0][0]  # copytree's first (source, destination, why)
        return CheckpointWriteError(f"checkpoint step {step}: cannot write {where}: {cause}")
    if error.errno is None:
        cause = str(error) or type(error).__name__
    else:
        name = errno.errorcode.get(error.errno, f"errno {error.errno}")
        cause = f"{error.strerror or os.strerror(error.errno)} ({name})"
    return CheckpointWriteError(f"checkpoint step {step}: cannot write {where}: {cause}")


class Saves(Protocol):
    """What writes its state into a checkpoint directory (a worker group)."""

    def save_checkpoint(self, path: str) -> Any: ...


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)))


def checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of the run's renamed checkpoints, oldest first (not verified:
    :func:`damage` says whether one is complete)."""
    return _steps(checkpoint_root(output_dir))


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and p.relative_to(directory) != Path(MANIFEST)
    )


def damage(path: Path) -> str | None:
    """What is wrong with checkpoint ``path`` (naming the file), or None if it is complete."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing (the checkpoint was not finished)"
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{manifest} is unreadable ({e})"
    for name, entry in entries.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != entry["size"]:
            return f"{f} has {size} bytes, the manifest says {entry['size']}"
        if _sha256(f) != entry["sha256"]:
            return f"{f} is corrupted (its sha256 differs from the manifest's)"
    return None


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory; None when there is none at all.

    A damaged checkpoint is skipped with a warning naming the damage; if every checkpoint is
    damaged, :class:`CheckpointError` names the newest one's."""
    found = _steps(checkpoint_root(output_dir))
    problems: list[str] = []
    for _, path in reversed(found):
        problem = damage(path)
        if problem is None:
            if problems:
                log.warning("resuming from %s: newer checkpoints are damaged", path)
            return path
        log.warning("checkpoint %s is damaged, not resumed from: %s", path.name, problem)
        problems.append(problem)
    if problems:
        raise CheckpointError(
            f"no complete checkpoint to resume from: {problems[0]}; delete the damaged "
            "checkpoints (or the run directory) or set trainer.resume=false to start over"
        )
    return None


def begin(output_dir: str | Path, step: int) -> Path:
    """A fresh temporary directory for the checkpoint of ``step``."""
    tmp = checkpoint_root(output_dir) / f"step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


@dataclass(frozen=True)
class Retention:
    """Which sealed checkpoints stay: the newest ``keep_last`` and, with ``best`` (an eval
    metric's name), the one with its best value (``mode``: higher or lower is better; on a
    tie the earlier one)."""

    keep_last: int = 2
    best: str | None = None
    mode: Literal["max", "min"] = "max"


def evaluated(path: Path, metric: str) -> float | None:
    """The value of ``metric`` the checkpoint's state.json records (None: not evaluated)."""
    try:
        value = read_state(path).get("eval", {}).get(metric)
    except (OSError, ValueError, AttributeError):  # a damaged state.json ranks nothing
        return None
    return float(value) if isinstance(value, int | float) else None


def best_checkpoint(output_dir: str | Path, metric: str, mode: str = "max") -> Path | None:
    """The sealed checkpoint with the best recorded ``metric`` (the earliest on a tie), or
    None when no checkpoint records it."""
    best: tuple[float, Path] | None = None
    for _, path in _steps(checkpoint_root(output_dir)):
        value = evaluated(path, metric)
        if value is None:
            continue
        signed = value if mode == "max" else -value
        if best is None or signed > best[0]:
            best = (signed, path)
    return best[1] if best is not None else None


def prune(output_dir: str | Path, retention: Retention) -> list[Path]:
    """Remove the sealed checkpoints beyond ``retention`` (never the newest, never the
    best); the removed ones. One that cannot be removed is a warning: the newest is sealed."""
    found = [path for _, path in _steps(checkpoint_root(output_dir))]
    kept = set(found[-retention.keep_last :])
    best = retention.best and best_checkpoint(output_dir, retention.best, retention.mode)
    if best:
        kept.add(best)
    removed = [path for path in found if path not in kept]
    for path in removed:
        try:
            shutil.rmtree(path)
        except OSError as e:
            log.warning("could not remove the old checkpoint %s: %s", path, e)
    return removed


def commit(tmp: Path, state: dict[str, Any], retention: Retention) -> Path:
    """:func:`seal` ``tmp``, then prune older checkpoints as ``retention`` says."""
    final = seal(tmp, state)
    prune(final.parent.parent, retention)
    return final


def seal(tmp: Path, state: dict[str, Any]) -> Path:
    """Write state.json and the manifest, and rename ``tmp`` to its final name."""
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    files = {
        str(f.relative_to(tmp)): {"size": f.stat().st_size, "sha256": _sha256(f)}
        for f in _files(tmp)
    }
    partial = tmp / (MANIFEST + ".tmp")
    with partial.open("w") as out:
        json.dump({"files": files}, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, tmp / MANIFEST)
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def holds_adapters(path: Path) -> bool:
    """Whether checkpoint ``path`` is a LoRA run's: ``adapter/`` (a peft folder) instead of
    ``model/``; the base model is ``model.path``."""
    return (path / "adapter").is_dir() and not (path / "model").is_dir()


def read_state(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((path / "state.json").read_text())
    return state


def newest_state(output_dir: str | Path) -> tuple[dict[str, Any], Path] | None:
    """The state.json of ``output_dir``'s newest checkpoint that names its command ("sft",
    "train", ...), with the checkpoint; None if none does (no checkpoint, or checkpoints of an
    earlier version). Not verified: only state.json is read."""
    for _, path in reversed(checkpoints(output_dir)):
        try:
            state = read_state(path)
        except (OSError, ValueError):  # a damaged state.json says nothing
            continue
        if isinstance(state, dict) and isinstance(state.get("command"), str):
            return state, path
    return None


def save(
    output_dir: str | Path,
    step: int,
    actors: Saves,
    roles: Mapping[str, Saves],
    state: dict[str, Any],
    retention: Retention,
) -> Path:
    """Checkpoint ``step`` atomically, then prune as ``retention`` says.

    ``actors`` write the top of the directory, each of ``roles`` its own ``<name>/``;
    ``state`` (the data position, the step's eval metrics and whatever else the driver keeps)
    goes to state.json. A failed write is a :class:`CheckpointWriteError` (see the module's
    docstring): the partial directory is removed, no older checkpoint is.
    """
    tmp = checkpoint_root(output_dir) / f"step_{step}.tmp"
    try:
        begin(output_dir, step)
        actors.save_checkpoint(str(tmp))
        for name, role in roles.items():
            role.save_checkpoint(str(tmp / name))
        failpoint("checkpoint", step)
        final = seal(tmp, {"step": step, **state})
    except Exception as e:
        cause = os_error(e)
        if cause is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(step, cause, tmp) from e
    prune(output_dir, retention)
    return final


def export_model(checkpoint_dir: Path, dest: Path) -> Path:
    """Copy the checkpoint's model folder to ``dest`` (the run's final model): files of its
    own, which checkpoint rotation cannot touch."""
    from treadle.models.loading import ADAPTER_DIR, export_merged  # transformers: only to export

    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        if holds_adapters(checkpoint_dir):  # LoRA: merged, with the adapter in adapter/
            export_merged(checkpoint_dir / ADAPTER_DIR, tmp)
        else:
            shutil.copytree(checkpoint_dir / "model", tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dest.exists():  # only now: a failed export leaves the previous final_model
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest
