"""Benchmarks run under treadle's environment (`.venv`), which is set up when missing.

`python bench/<script>.py` from a fresh clone: if this python lacks treadle's stack, run
`make install` (a no-op when `.venv` is up to date; a few minutes the first time) and re-run
the script under `.venv/bin/python`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("treadle", "torch", "vllm", "psutil")


def ensure_project_python() -> None:
    if all(importlib.util.find_spec(m) for m in NEEDED):
        return
    python = ROOT / ".venv" / "bin" / "python"
    if Path(sys.executable) == python:
        missing = [m for m in NEEDED if not importlib.util.find_spec(m)]
        sys.exit(f"{python} lacks {', '.join(missing)}: run `make install`")
    print("treadle's environment: make install (a no-op when .venv is up to date)", flush=True)
    subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), "install"], check=True)
    os.execv(python, [str(python), *sys.argv])


def model_folder(name: str, workdir: Path) -> Path:
    """The model a benchmark runs: "tiny" (`treadle prepare`'s, made in ``workdir``) or
    SmolLM2-135M-Instruct (`treadle model fetch`, cached)."""
    if name == "tiny":
        from treadle.tasks.arithmetic import prepare

        return Path(prepare(workdir / "tiny")["model"])
    from treadle.models.hub import fetch_model

    return Path(fetch_model("smollm2-135m-instruct"))
