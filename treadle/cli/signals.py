"""Ctrl-C and SIGTERM in the command line's process: a stop unwinds the command, and its
clean-up has :data:`STOP_GRACE_S` before the process ends regardless.

The handler notes the signal (it cannot be lost, see :mod:`treadle.runtime.errors`) and raises
in the main thread: SIGTERM as ``Terminated``, SIGINT as ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Any

from treadle.runtime.errors import (
    Terminated,
    note_signal,
    signalled,
    stop_cause,
    stop_line,
)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


# After a stop signal, the command's clean-up (workers shut down, files closed) gets this long.
STOP_GRACE_S = 60.0


# After a stop signal whose handler has not run (see _Overrun), the main thread is sent it again.
WAKE_AFTER_S = (1.0, 5.0)


class _Overrun:
    """The command line's own process ends within :data:`STOP_GRACE_S` of a stop signal, or
    at once on a second one, whatever its clean-up waits for (a wait that never ended once
    kept a stopped run alive): it says where it stood and exits with the stop's code, and the
    reaper (:mod:`treadle.runtime.reaper`) takes Ray's processes with it. Nothing already written is
    lost: checkpoints are sealed or not there, the metrics of each step logged as it ended.

    A thread started with the command counts the signals; the handler only raises, once.
    Python runs a handler in the main thread at its next bytecode, and a signal that lands on
    another thread, or just before the main thread goes to sleep in a wait with no timeout,
    leaves it asleep with the handler not run (a second Ctrl-C was lost so, in CI). Python's
    C-level handler writes each signal's number to the wakeup fd (``signal.set_wakeup_fd``)
    in whichever thread took it: the stop thread reads them there, sends the main thread the
    signal once more (``pthread_kill``, which wakes it) if its handler has not run
    :data:`WAKE_AFTER_S` after, and ends the process on a second one.

    A stop raised where Python ignores exceptions (a ``__del__``, a weakref callback: asyncio's
    transports were collected just as one Ctrl-C landed, in CI) reaches
    ``sys.unraisablehook`` instead of unwinding the command: it counts as not raised, so the
    stop thread sends it again."""

    def __init__(self) -> None:
        self.raised = threading.Event()  # the main thread's handler ran (and raised)
        self.code: int | None = None  # the command's exit code, once its outcome is settled
        self.thread: threading.Thread | None = None
        self.main = 0  # the main thread's id (where the handler and the clean-up run)

    def arm(self) -> None:
        """Watch from now on (this process's own command line only: not main(argv) in tests)."""
        if self.thread is None:
            self.main = threading.get_ident()
            read, write = os.pipe()
            os.set_blocking(write, False)  # the C-level handler must never wait on it
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            os.register_at_fork(after_in_child=_forget_wakeup_fd)
            sys.unraisablehook = self._unraisable(sys.unraisablehook)
            self.thread = threading.Thread(
                target=self._watch, args=(read,), name="treadle stop", daemon=True
            )
            self.thread.start()

    def raises(self) -> bool:
        """Whether the handler raises for this signal: the first only, once armed (the stop
        thread ends the process on a second); each of them before (``main(argv)`` in tests)."""
        first = not self.raised.is_set()
        self.raised.set()
        return first or self.thread is None

    def _unraisable(self, before: Any) -> Any:
        def hook(unraisable: Any) -> None:
            if isinstance(unraisable.exc_value, KeyboardInterrupt) and self.raised.is_set():
                self.raised.clear()  # swallowed: the stop thread sends it again
            else:
                before(unraisable)

        return hook

    def _watch(self, fd: int) -> None:
        first, second = self._count(fd)
        if not signalled():  # the handler never ran: the stop line still names the signal
            note_signal(first)
        how, code = stop_cause()
        if self.code is None:  # the line a stop ends with is not out yet
            lines = []
            if not second:
                frame = sys._current_frames().get(self.main)
                stack = traceback.format_stack(frame)[-6:] if frame is not None else []
                lines.append(f"treadle: the clean-up did not end in {STOP_GRACE_S:g} s; it was at")
                lines += [line.rstrip() for line in stack]
            lines.append(f"treadle: {stop_line(how)}")
            os.write(2, ("\n".join(lines) + "\n").encode())  # not sys.stderr: it may be locked
        os._exit(code if self.code is None else self.code)

    def _count(self, fd: int) -> tuple[int, bool]:
        """The first stop signal's number and whether a second one came (at once), or not
        within the grace."""
        first, since, wakes, woken = 0, 0.0, list(WAKE_AFTER_S), 0
        while True:
            now = time.monotonic()
            if first and now - since >= STOP_GRACE_S:
                return first, False
            if first and wakes and now - since >= wakes[0]:
                wakes.pop(0)
                if not self.raised.is_set():  # the main thread sleeps through it: wake it
                    woken += 1
                    signal.pthread_kill(self.main, first)
            due = [since + s for s in (STOP_GRACE_S, *wakes[:1])] if first else []
            if not select.select([fd], [], [], max(0.0, min(due) - now) if due else None)[0]:
                continue
            for signum in os.read(fd, 64):
                if signum not in STOP_SIGNALS:
                    continue
                if woken:  # the one sent to wake the main thread
                    woken -= 1
                elif first:
                    return first, True
                else:
                    first, since = signum, time.monotonic()


def _forget_wakeup_fd() -> None:
    """A process forked from the command's (no exec) has no stop thread to read the fd."""
    with contextlib.suppress(ValueError):  # forked from another thread than the main one
        signal.set_wakeup_fd(-1)


overrun = _Overrun()


def set_stop_handlers(handler: Any) -> list[Any]:
    """Set ``handler`` (or each of a list) for SIGINT and SIGTERM; the ones they had (None: one
    set from C, which Python cannot put back: left as it is)."""
    handlers = handler if isinstance(handler, list) else [handler, handler]
    return [
        signal.signal(s, h) if h is not None else signal.getsignal(s)
        for s, h in zip(STOP_SIGNALS, handlers, strict=True)
    ]


def on_stop_signal(signum: int, frame: object) -> None:
    """Ctrl-C and SIGTERM: noted (it cannot be lost, see treadle.runtime.errors) and raised, so the
    command unwinds from wherever it is; SIGTERM as Terminated, a KeyboardInterrupt."""
    note_signal(signum)
    if not overrun.raises():  # a second one: the process exits at once (its stop thread)
        return
    # A coroutine made but not yet awaited where this lands is never awaited: Python would
    # warn of it as the stop's traceback lets go of it, after the stop line.
    warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
