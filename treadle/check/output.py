"""The run directory, ``trainer.output_dir``: where a run writes, and what it resumes from.

It is a directory, or can be created (its nearest existing parent is a writable directory on
a file system mounted read-write, and creating it, as the run will, works: it is removed at
once); it is no model folder's, nor holds or is held by one; no live
run holds its lock (:func:`lock_holder`, tried with ``flock`` as the run takes it). A run
resumes from its newest checkpoint: one written by another command, or with a setting that
cannot change (``treadle.config.recorded.FIXED``), is refused; the others changed since are
named in the summary.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from treadle.config import Config
from treadle.config.rules import Kind
from treadle.runtime.errors import ConfigError


def check_output_dir(cfg: Config, kind: Kind, summary: list[str]) -> None:
    key = "trainer.output_dir"
    out = Path(cfg.trainer.output_dir).expanduser()
    try:
        out.exists()
    except OSError as e:  # a name too long, a loop of symlinks
        raise _cannot_create(out, e) from None
    if out.is_symlink() and not out.exists():
        raise ConfigError(
            f"{key}: '{out}' is a symlink to '{os.readlink(out)}', which does not exist: "
            "create its target, or set trainer.output_dir to another directory"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}: '{out}' is a file, not a directory")
    _check_apart_from_models(cfg, out)
    if out.is_dir():
        _check_existing_dir(out, key)
        resumes = _check_resumed_run(cfg, out, kind) if cfg.trainer.resume else ""
        summary.append(f"{key}: {out} (exists{resumes})")
        return
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{key}: cannot create '{out}': '{parent}' is a file")
    if _read_only(parent):
        raise ConfigError(f"{key}: cannot create '{out}': '{parent}' is on a read-only file system")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot create '{out}': '{parent}' is not writable")
    _try_creating(out, parent)
    summary.append(f"{key}: {out} (new)")


def _try_creating(out: Path, parent: Path) -> None:
    """Create ``out`` as the run will (``mkdir(parents=True)``) and remove what was created:
    some directories refuse what their permissions allow (``/proc``, ``/sys``). One another
    process made meanwhile (a run, a check beside this one) can be created, and is not this
    check's to remove."""
    made = [out, *[p for p in out.parents if parent in p.parents]]  # deepest first
    error: OSError | None = None
    try:
        out.mkdir(parents=True)
    except FileExistsError:
        return
    except OSError as e:
        error = e
    for directory in made:
        with contextlib.suppress(OSError):  # (not made, or written to meanwhile: kept)
            directory.rmdir()
    if error is not None:
        raise _cannot_create(out, error)


def _cannot_create(out: Path, error: OSError) -> ConfigError:
    return ConfigError(
        f"trainer.output_dir: cannot create '{out}' ({error.strerror}): set "
        "trainer.output_dir to a directory that can be created"
    )


def _check_apart_from_models(cfg: Config, out: Path) -> None:
    """The run directory is no model folder's, nor holds or is held by one: a run writes its
    checkpoints, logs and final_model/ there (into the model folder, or over the model it
    starts from; and the next run resumes from them)."""
    folders = {
        "model.path": cfg.model.path,
        "model.tokenizer_path": cfg.model.tokenizer_path,
        "critic.model_path": cfg.critic.model_path,
        "reward.model_path": cfg.reward.model_path,
        "prime.model_path": cfg.prime.model_path,
        "teacher.model_path": cfg.teacher.model_path,
    }
    run = out.resolve()
    for key, path in folders.items():
        folder = Path(path).expanduser().resolve() if path else None
        if folder is None or not folder.is_dir():
            continue
        if run == folder:
            where = f"is {key}'s folder '{folder}'"
        elif folder in run.parents:
            where = f"'{run}' is inside {key}'s folder '{folder}'"
        elif run in folder.parents:
            where = f"'{run}' holds {key}'s folder '{folder}'"
        else:
            continue
        raise ConfigError(
            f"trainer.output_dir {where}: the run writes its checkpoints, logs and final_model/ "
            "there, into the model folder or over the model it starts from: set "
            "trainer.output_dir to a directory of its own"
        )


def _check_resumed_run(cfg: Config, out: Path, kind: Kind) -> str:
    """A run resumes from its directory's newest checkpoint: one another command wrote (an SFT
    run's, resumed by `treadle train`), or of another model or data, would be taken as this
    run's. What the summary says of it: the checkpoint and the settings changed since."""
    from treadle.config.recorded import FIXED, changes
    from treadle.models import checkpoint as ckpt

    found = ckpt.newest_state(out)
    if found is None:
        return ""
    state, newest = found
    if state["command"] != kind:
        raise ConfigError(
            f"trainer.output_dir: '{out}' holds a `treadle {state['command']}` run (checkpoints "
            f"up to {newest.name}), which `treadle {kind}` would resume as its own: set "
            "trainer.output_dir to another directory"
        )
    recorded = state.get("settings")
    if not isinstance(recorded, dict):  # written before checkpoints recorded their settings
        return f"; resumes from {newest.name}"
    fixed, other = changes(recorded, cfg)
    if fixed:
        raise ConfigError(
            "\n".join(
                f"{c.key}: the run in '{out}' ({newest.name}) was trained with "
                f"{c.key}={c.shown_before}, this config has {c.shown_after}: {FIXED[c.key]}; "
                f"set {c.key} back, or set trainer.output_dir to another directory"
                for c in fixed
            )
        )
    if not other:
        return f"; resumes from {newest.name}"
    shown = ", ".join(map(str, other[:8])) + (
        f" and {len(other) - 8} more" if len(other) > 8 else ""
    )
    plural = "s" if len(other) > 1 else ""
    return f"; resumes from {newest.name} with {len(other)} setting{plural} changed: {shown}"


def _check_existing_dir(out: Path, key: str) -> None:
    if _read_only(out):
        raise ConfigError(f"{key}: '{out}' is on a read-only file system")
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: '{out}' is not writable")
    holder = lock_holder(out / ".lock")
    if holder is not None:
        raise ConfigError(
            f"{key}: '{out}' is in use by another run ({holder}): wait for it to end or "
            "stop it, or set trainer.output_dir to another directory"
        )


def _read_only(path: Path) -> bool:
    """Whether ``path`` is on a file system mounted read-only (root may write elsewhere)."""
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def lock_holder(path: Path) -> str | None:
    """Who holds the run lock ``path`` (``pid N on host``, or "pid unknown"); None if nobody.

    Tries the lock (``flock``, as ``trainers.run_dir.RunLock`` takes it) and lets it go at once.
    """
    try:
        file = path.open("r")
    except FileNotFoundError:
        return None
    with file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return file.read().strip() or "pid unknown"
        fcntl.flock(file.fileno(), fcntl.LOCK_UN)
    return None
