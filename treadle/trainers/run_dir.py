"""The run directory: its lock, its resolved config, its checkpoints saved and exported, and
where a run resumes from.

``<output_dir>/.lock`` is held by the one run working on the directory; ``config.yaml`` is
the config as resolved; the newest complete checkpoint (:mod:`treadle.models.checkpoint`) is where
a run resumes, the actor from its ``model/`` (or, with LoRA, from the base model and the
checkpoint's adapters).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from treadle.config import Config, dump_config
from treadle.models import checkpoint as ckpt
from treadle.runtime.errors import ConfigError

log = logging.getLogger("treadle")


class RunLock:
    """``<output_dir>/.lock``: held (``flock``) by the run working on the directory, with its
    pid inside. A second run stops at once naming the holder; the lock of a run that died
    goes with its process and is taken over with a warning."""

    def __init__(self, out: Path) -> None:
        self.path = out / ".lock"
        self.file = self.path.open("a+")
        self.file.seek(0)
        holder = self.file.read().strip()
        try:
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise ConfigError(
                f"{out} is in use by another run ({holder or 'pid unknown'}): wait for it to "
                "end or stop it, or set trainer.output_dir to another directory"
            ) from None
        if holder:
            log.warning(
                "%s: took over the lock of a run that ended without releasing it (%s)", out, holder
            )
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}")
        self.file.flush()

    def release(self) -> None:
        if not self.file.closed:
            self.file.seek(0)
            self.file.truncate()
            self.file.close()  # closing releases the flock


def prepare_run_dir(cfg: Config) -> tuple[Path, RunLock]:
    """The run directory, locked, with the resolved config written into it."""
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out)
    dump_config(cfg, out / "config.yaml")
    return out, lock


def resume_point(cfg: Config) -> tuple[Path | None, str]:
    """(newest complete checkpoint or None, the folder the actor starts from)."""
    latest = ckpt.latest_checkpoint(cfg.trainer.output_dir) if cfg.trainer.resume else None
    if latest is not None:  # LoRA: the base model, its adapters are loaded on resume
        return latest, cfg.model.path if ckpt.holds_adapters(latest) else str(latest / "model")
    if not cfg.model.path:
        raise ConfigError("model.path is empty: give a local Hugging Face model folder")
    return None, cfg.model.path


def save_checkpoint(
    cfg: Config,
    step: int,
    actors: ckpt.Saves,
    roles: Mapping[str, ckpt.Saves],
    state: dict[str, Any],
    metrics: Mapping[str, float],
    last: bool,
) -> str:
    """Checkpoint ``step`` with the driver's ``state`` and the step's eval metrics in
    state.json (``trainer.keep_best`` ranks checkpoints by them), prune (``trainer.keep_last``),
    and at the last step export ``final_model``: this step's model, or the best checkpoint's
    (``trainer.final_model``). Returns what final_model is when it is not this step's ("")."""
    t = cfg.trainer
    evals = {k: v for k, v in metrics.items() if k.startswith("eval/")}
    retention = ckpt.Retention(t.keep_last, t.keep_best, t.best_mode())
    done = ckpt.save(t.output_dir, step, actors, roles, {**state, "eval": evals}, retention)
    if t.keep_best is not None and t.keep_best not in evals:
        logged = ", ".join(sorted(evals)) or "none: no evaluation ran at this step"
        raise ConfigError(
            f"trainer.keep_best={t.keep_best}: step {step} logged no such metric (its eval "
            f"metrics: {logged}); set trainer.keep_best to one of them. The checkpoint of "
            f"step {step} is saved: the same command resumes from it"
        )
    if not last:
        return ""
    source, note = done, ""
    if t.final_model == "best" and t.keep_best is not None:
        source = ckpt.best_checkpoint(t.output_dir, t.keep_best, t.best_mode()) or done
        value = ckpt.evaluated(source, t.keep_best)
        note = f" (the best checkpoint, {source.name}: {t.keep_best}={value})"
    dest = Path(t.output_dir) / "final_model"
    try:
        ckpt.export_model(source, dest)
    except OSError as e:  # the step's checkpoint is sealed; the previous final_model stays
        raise ckpt.write_error(step, e, dest) from e
    return note


def resume_hint(cfg: Config) -> str:
    """What running the same command again does, for a message about a stopped run."""
    latest = ckpt.latest_checkpoint(cfg.trainer.output_dir) if cfg.trainer.resume else None
    if latest is not None:
        return f"the last checkpoint is {latest}: the same command resumes from it"
    return "there is no checkpoint yet: the same command starts over"
