"""Fault injection for the fault and signal suites (tests/trainers/test_faults.py and
test_signals.py).

``TREADLE_FAILPOINT=<point>@<step>`` kills the driver with SIGKILL when the run reaches that
point of that step, exactly as a ``kill -9`` from outside would, at a moment a test can name.
``TREADLE_FAILPOINT=<point>@<step>:<SIGNAL>[+<seconds>]`` instead sends SIGINT to the
driver's process group, as a terminal's Ctrl-C does, or SIGTERM to the driver, as ``kill PID``
does, at that point or ``seconds`` after it (sent from a thread: it lands in whatever the run
does by then, a Ray call, an asyncio task, a reward worker's pipe). SIGTERM to the whole group
would reach Ray's GCS and raylet too, which block SIGINT only. ``write@<step>:ENOSPC`` makes the
actor's rank 0 fail its model write of that step's checkpoint as a full disk does (in its own
process under Ray, while the other ranks go on into the checkpoint's collectives). The points:

- ``launch@0``: the config is checked, Ray is starting in the background, the command imports
  its trainer and reads its data;
- ``ray@0``: Ray has started in the background, the driver has not asked for it yet;
- ``startup@0``: the run directory is locked and the workers are up, no step has run;
- ``begin@N``: step N starts;
- ``step@N``: step N has run and its metrics are written, its checkpoint is not;
- ``checkpoint@N``: step N's checkpoint files are written, its manifest (the seal) is not;
- ``sealed@N``: step N's checkpoint is complete (renamed to ``step_N``);
- ``eval@0``: a held-out evaluation starts;
- ``write@N``: the actor's rank 0 is about to write step N's model files.

Unset (always, outside tests) it does nothing.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from pathlib import Path


def failpoint(point: str, step: int = 0, path: Path | None = None) -> None:
    """What ``TREADLE_FAILPOINT`` says to do at ``point`` of ``step`` (``path``: the file a
    write point is about to write)."""
    spec = os.environ.get("TREADLE_FAILPOINT", "")
    where, _, action = spec.partition(":")
    if where != f"{point}@{step}":
        return
    if action == "ENOSPC":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
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
