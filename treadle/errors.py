"""Exceptions treadle raises for problems the user can fix.

Every message names where the problem is (a config key, a file and row, a reward function and
sample) and, when it can, how to fix it. Bugs inside treadle stay ordinary Python exceptions.
"""

from __future__ import annotations


class TreadleError(Exception):
    """Base class of the errors a user can act on."""


class ConfigError(TreadleError):
    """A config value is invalid or points at something that is not there (a path, a name)."""


class DataError(TreadleError):
    """A dataset file is missing, unreadable, or has a bad row."""


class RewardError(TreadleError):
    """A reward function raised or returned something that is not a finite number."""


class WorkerDied(TreadleError):
    """A worker process of the run died (killed, out of memory, crashed): the run cannot go on."""


class Stopped(TreadleError):
    """A run stopped by a signal (Ctrl-C, SIGTERM); the message says where and how to resume."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Terminated(KeyboardInterrupt):
    """Raised by the command line's SIGTERM handler, so a SIGTERM unwinds like Ctrl-C."""
