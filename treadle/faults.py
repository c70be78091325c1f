"""Fault injection for the fault and signal suites (tests/trainers/test_faults.py and
test_signals.py).

``TREADLE_FAILPOINT=<point>@<step>`` kills the driver with SIGKILL when the run reaches that
point of that step, exactly as a ``kill -9`` from outside would, at a moment a test can name.
``TREADLE_FAILPOINT=<point>@<step>:<SIGNAL>[+<seconds>]`` instead sends SIGINT to the
driver's process group, as a terminal's Ctrl-C does, or SIGTERM to the driver, as ``kill PID``
does, at that point or ``seconds`` after it (sent from a thread: it lands in whatever the run
does by then, a Ray call, an asyncio task, a reward worker's pipe). SIGTERM to the whole group
would reach Ray's GCS and raylet too, which block SIGINT only. The points:

- ``launch@0``: the config is checked, Ray is starting in the background, the command imports
  its trainer and reads its data;
- ``ray@0``: Ray has started in the background, the driver has not asked for it yet;
- ``startup@0``: the run directory is locked and the workers are up, no step has run;
- ``begin@N``: step N starts;
- ``step@N``: step N has run and its metrics are written, its checkpoint is not;
- ``checkpoint@N``: step N's checkpoint files are written, its manifest (the seal) is not;
- ``sealed@N``: step N's checkpoint is complete (renamed to ``step_N``);
- ``eval@0``: a held-out evaluation starts.

Unset (always, outside tests) it does nothing.
"""

from __future__ import annotations

import os
import signal
import threading


def failpoint(point: str, step: int = 0) -> None:
    spec = os.environ.get("TREADLE_FAILPOINT", "")
    where, _, action = spec.partition(":")
    if where != f"{point}@{step}":
        return
    if not action:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    name, _, delay = action.partition("+")
    signum = signal.Signals[name]

    def send() -> None:
        if signum == signal.SIGINT:
            os.killpg(os.getpgrp(), signum)
        else:
            os.kill(os.getpid(), signum)

    if delay:
        timer = threading.Timer(float(delay), send)
        timer.daemon = True
        timer.start()
    else:
        send()
