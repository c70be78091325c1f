"""Metrics out of a run: one JSON line per step, a console progress bar, phase timers.

Every step appends ``{"step": N, ...}`` to ``<output_dir>/metrics.jsonl`` (flushed at once,
so a crash loses nothing written). A run that resumes after step N first drops the lines of
steps after N (written before the crash, and about to be run again), so the file holds each
step once. The console shows a progress bar with the current reward.
Phase timers write ``timing/<phase>`` in seconds.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def timed(metrics: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall time of the block to ``metrics['timing/<name>']``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[f"timing/{name}"] = metrics.get(f"timing/{name}", 0.0) + (
            time.perf_counter() - start
        )


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class Tracker:
    """JSONL metrics file + rich progress bar. Use as a context manager."""

    def __init__(
        self,
        output_dir: str | Path,
        total_steps: int,
        start_step: int = 0,
        show_progress: bool = True,
        headline: str = "reward/mean",
    ) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.headline = headline
        _keep_steps_up_to(self.path, start_step)
        self._file = self.path.open("a")
        self._progress = Progress(
            TextColumn("[bold]treadle"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            disable=not show_progress,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=start_step, status=""
        )

    def __enter__(self) -> Tracker:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()
        self._file.close()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        value = metrics.get(self.headline)
        status = f"{self.headline} {value:.3f}" if isinstance(value, int | float) else ""
        self._progress.update(self._task, completed=step, status=status)

    def print(self, message: str) -> None:
        self._progress.console.print(message)


def _keep_steps_up_to(path: Path, last: int) -> None:
    """Rewrite ``path`` (atomically) without the records of steps after ``last``."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and _step(line) <= last]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def _step(line: str) -> float:
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):  # a line cut by a crash: drop it
        return math.inf


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
