"""Exceptions treadle raises for problems the user can fix.

Every message names where the problem is (a config key, a file and row, a reward function and
sample) and, when it can, how to fix it. Bugs inside treadle stay ordinary Python exceptions.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator


class TreadleError(Exception):
    """Base class of the errors a user can act on."""


class ConfigError(TreadleError):
    """A config value is invalid or points at something that is not there (a path, a name)."""


class DataError(TreadleError):
    """A dataset file is missing, unreadable, or has a bad row."""


class RewardError(TreadleError):
    """A reward function raised or returned something that is not a finite number."""

    sample: int | None = None  # which of the scored samples failed, where one did


class WorkerDied(TreadleError):
    """A worker process of the run died (killed, out of memory, crashed): the run cannot go on."""


class Stopped(TreadleError):
    """A run stopped by a signal (Ctrl-C, SIGTERM); the message says where and how to resume."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Terminated(KeyboardInterrupt):
    """Raised by the command line's SIGTERM handler, so a SIGTERM unwinds like Ctrl-C."""


# The stop signals the command line's handlers took, first first. The handler raises too, but
# the exception may not survive where it lands: Ray's ``ray.get`` turns it into a bare
# KeyboardInterrupt, an asyncio task keeps it, a finalizer drops it. This note cannot be lost.
_received: list[int] = []


def note_signal(signum: int) -> None:
    """Record that ``signum`` (SIGINT or SIGTERM) arrived: the run must stop."""
    _received.append(signum)


def clear_signals() -> None:
    _received.clear()


def signalled() -> bool:
    return bool(_received)


def stop_cause(error: BaseException | None = None) -> tuple[str, int]:
    """("Ctrl-C", 130) or ("SIGTERM", 143): the first stop signal noted, else ``error``'s kind."""
    term = _received[0] == signal.SIGTERM if _received else isinstance(error, Terminated)
    return ("SIGTERM", 143) if term else ("Ctrl-C", 130)


# Where a run stands, for the line that says it stopped ("during step 3; the last checkpoint is
# ...: the same command resumes from it"): set by the loop that runs (Trainer.fit).
_whereabouts: list[Callable[[], str]] = []


@contextlib.contextmanager
def whereabouts(where: Callable[[], str]) -> Iterator[None]:
    """While in this block, :func:`stop_line` adds ``where()`` to what it says."""
    _whereabouts.append(where)
    try:
        yield
    finally:
        _whereabouts.remove(where)


def stop_line(how: str) -> str:
    """ "stopped by <how>", and where the run stands when a loop is running."""
    where = _whereabouts[-1]() if _whereabouts else ""
    return f"stopped by {how} {where}" if where else f"stopped by {how}"


def raise_if_signalled() -> None:
    """Raise the KeyboardInterrupt of a stop signal that arrived but whose exception was lost
    on the way (see ``_received``)."""
    if _received:
        raise Terminated() if _received[0] == signal.SIGTERM else KeyboardInterrupt()
