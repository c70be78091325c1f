"""A time limit on importing user code (plug-ins, reward functions, agent loops, tools)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator

from treadle.runtime.errors import ConfigError

IMPORT_TIMEOUT_S = 60.0  # importing a reward function or an agent loop may take this long


class _ImportTimeout(BaseException):
    """Raised by SIGALRM in code that blocks; a BaseException so user code's `except
    Exception` (and treadle's own import wrappers) let it through."""


@contextlib.contextmanager
def time_limit(seconds: float, key: str) -> Iterator[None]:
    """Interrupt the block after ``seconds`` with ConfigError naming ``key`` (main thread only:
    elsewhere, or where there is no SIGALRM, the block runs without a limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise _ImportTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    start = time.monotonic()
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _ImportTimeout:
        raise ConfigError(
            f"{key}: importing it took longer than {seconds:g} s: does it block or loop at "
            "import time?"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:  # someone else's timer (a test timeout): give back what is left of it
            left = max(outer - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, interval)
