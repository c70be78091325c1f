"""Where the time from the command to the first step goes.

:func:`mark` notes that a part of start-up has just finished. Under the command line
(:func:`from_process_start`) the first run of the process counts from the process's own
start (the kernel's start time: the interpreter and the imports count); otherwise (the
Python API, tests, a second run in one process) a run counts from its :func:`begin`. The first
step of a run logs ``timing/startup`` (from the start to the first step) and
``startup/<part>`` (each part's own seconds, in the order they finished; ``other`` is what no
part claims; ``<part>/<detail>``: a part's own breakdown, e.g. the workers' model loads and
engine start), and ``bench/startup.py`` prints them as a table.
"""

from __future__ import annotations

import os
import time

_T0 = time.monotonic()
_origin = 0.0  # process age at which the current run began
_runs = 0
_cli = False
_reported = False
_marks: list[tuple[str, float]] = []
_details: dict[str, float] = {}


def process_age() -> float:
    """Seconds since this process started."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # no /proc: from this module's import on
        return time.monotonic() - _T0


def from_process_start() -> None:
    """The command line: its first run counts from the process's start."""
    global _cli
    _cli = True


def begin() -> None:
    """A run begins (its trainer is built): under the command line, the first run keeps the
    marks made since the process started; any other starts afresh."""
    global _origin, _runs, _reported
    if _runs or not _cli:
        _origin = process_age()
        _marks.clear()
        _details.clear()
    _runs += 1
    _reported = False


def mark(part: str) -> None:
    """``part`` of start-up ends now (a part marked twice keeps its first end)."""
    if all(name != part for name, _ in _marks):
        _marks.append((part, process_age() - _origin))


def startup_metrics() -> dict[str, float]:
    """``timing/startup`` and each marked part's seconds; empty after the first call of a
    run, so only its first step reports them."""
    global _reported
    if _reported:
        return {}
    _reported = True
    now = process_age() - _origin
    out, before = {"timing/startup": now}, 0.0
    for name, at in _marks:
        out[f"startup/{name}"] = max(at - before, 0.0)
        before = max(before, at)
    out["startup/other"] = max(now - before, 0.0)
    out.update({f"startup/{name}": seconds for name, seconds in _details.items()})
    return out


class PartTimer:
    """Seconds of consecutive parts of one piece of start-up (a worker's construction)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = now - self._last
        self._last = now


def detail(prefix: str, parts: dict[str, float]) -> None:
    """Report ``startup/<prefix>/<part>`` too (parts of a marked part: not added again)."""
    _details.update({f"{prefix}/{name}": seconds for name, seconds in parts.items()})
