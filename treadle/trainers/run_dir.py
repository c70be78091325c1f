"""The run directory: its lock, its resolved config, and where a run resumes from.

``<output_dir>/.lock`` is held by the one run working on the directory; ``config.yaml`` is
the config as resolved; the newest complete checkpoint (:mod:`treadle.checkpoint`) is where
a run resumes, the actor from its ``model/`` (or, with LoRA, from the base model and the
checkpoint's adapters).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from pathlib import Path

from treadle import checkpoint as ckpt
from treadle.config import Config, dump_config
from treadle.errors import ConfigError

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
