"""Checkpoint directories: written under a temporary name, renamed when complete.

``<output_dir>/checkpoints/step_<N>/`` holds ``model/`` (an HF safetensors folder),
``optimizer.safetensors`` + ``optimizer.json``, ``rng_rank<r>.safetensors`` and
``state.json`` (step, data position, driver state). ``state.json`` is written last, then the
directory is renamed from ``step_<N>.tmp``: a directory named ``step_<N>`` is complete by
construction, so resuming takes the newest one and ignores anything half written.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    done = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP.match(p.name)) and (p / "state.json").is_file()
    ]
    return max(done)[1] if done else None


def begin(output_dir: str | Path, step: int) -> Path:
    """A fresh temporary directory for the checkpoint of ``step``."""
    tmp = checkpoint_root(output_dir) / f"step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, state: dict[str, Any], keep: int) -> Path:
    """Write state.json, rename to its final name, and prune older checkpoints."""
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    root = final.parent
    done = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)))
    for _, old in done[:-keep]:
        shutil.rmtree(old)
    return final


def read_state(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "state.json").read_text()))
