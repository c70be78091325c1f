"""The command line's console: treadle's own lines, and the libraries' elsewhere.

Every command starts quiet (:func:`quiet`): the messages of vLLM, Ray, transformers, datasets,
torch and the trackers, and Python's warnings, are kept off the console
(:func:`treadle.tracking.tracker.quiet_console`, the mechanism a run's ``logs/`` uses). A run
writes them to its ``<output_dir>/logs/driver.log`` (with what was kept before it knew its
directory, during the check); ``treadle eval`` and ``treadle serve``, which have no run
directory unless evaluating a run's checkpoints, to ``<logs>/<command>-<time>-<pid>/driver.log``
(``$TREADLE_LOGS``, else ``logs/`` in treadle's cache, ``treadle.models.hub.cache_root``), which
their first line names (:func:`own_log`). ``--verbose`` (every command has it; for a config it
also sets ``trainer.verbose``) and ``trainer.verbose=true`` show them instead (:func:`settle`).

An error that is no problem of the user's config or data (a library's, or treadle's own bug)
ends the command with one line and the place of its traceback, beside the libraries' messages
(:func:`failed`); with ``--verbose``, Python's traceback.

A long phase (a model's fetch and conversion, an engine's start, an evaluation) shows a
spinner with its seconds on a terminal (:func:`progress`); piped, nothing but the lines the
phase prints itself, so that a log file reads as plain lines.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from treadle.models.hub import cache_root
from treadle.tracking.tracker import log_file, loud, quiet_console


def quiet(args: argparse.Namespace) -> Callable[[], None]:
    """The command's console quiet from its start (unless ``--verbose``), its own log folder
    the fallback (:func:`command_logs`); returns the function that puts the logging back."""
    if getattr(args, "verbose", False):
        return lambda: None
    return quiet_console(fallback=command_logs(getattr(args, "command", "treadle")))


def settle(cfg: Any) -> None:
    """The loaded config says ``trainer.verbose=true``: the libraries' messages are shown."""
    if cfg.trainer.verbose:
        loud()


def command_logs(command: str) -> Path:
    """The log folder of a ``command`` that has no run directory (made when first written),
    in ``$TREADLE_LOGS``, else ``<cache>/logs``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(os.environ.get("TREADLE_LOGS") or cache_root() / "logs").expanduser()
    return root / f"{command}-{stamp}-{os.getpid()}"


def own_log(cfg: Any) -> str:
    """The end of a command's first line, which names where its library messages go: a run's
    ``logs/``, or for ``eval`` and ``serve`` without a run directory, a log file of its own
    from now on; unless verbose."""
    if cfg.trainer.verbose:
        return "library messages shown (trainer.verbose)"
    return f"library messages: {log_file()}"


def failed(error: BaseException, command: str) -> int:
    """An error that is not the user's to fix: one line, and where its traceback is (the
    command's log file, beside the libraries' messages); exit code 1."""
    log = log_file()
    lines = str(error).strip().splitlines()
    shown = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    print(f"treadle: error: {shown}", file=sys.stderr)
    if log is None:  # (nothing routed: the traceback is the console's)
        traceback.print_exception(error, file=sys.stderr)
        return 1
    with log.open("a", encoding="utf-8") as f:
        f.write(f"treadle {command} failed:\n")
        traceback.print_exception(error, file=f)
    print(f"treadle: error: its traceback and the libraries' messages: {log}", file=sys.stderr)
    return 1


@contextlib.contextmanager
def progress(text: str, stream: Any = None) -> Iterator[Callable[[str], None]]:
    """On a terminal (``stream``, default stdout), a spinner with ``text`` and the seconds so
    far while the block runs, gone when it ends; elsewhere nothing. It writes to its own copy
    of the terminal's descriptor: an engine's start sends this process's own output to its
    log file meanwhile (``treadle.tracking.tracker.quiet_start``). Yields the function that
    prints a line (above the spinner)."""
    stream = stream or sys.stdout
    if not stream.isatty():
        yield lambda line: print(line, file=stream, flush=True)
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    stream.flush()
    with os.fdopen(os.dup(stream.fileno()), "w") as own:
        console = Console(file=own, force_terminal=True)
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}", markup=False),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        ) as bar:
            bar.add_task(text, total=None)
            yield lambda line: bar.console.print(line, markup=False, highlight=False)
