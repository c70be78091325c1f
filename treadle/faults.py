"""Fault injection for the fault suite (tests/test_faults.py).

``TREADLE_FAILPOINT=<point>@<step>`` kills the driver with SIGKILL when the run reaches that
point of that step, exactly as a ``kill -9`` from outside would, at a moment a test can name:

- ``startup@0``: the run directory is locked and the workers are up, no step has run;
- ``step@N``: step N has run and its metrics are written, its checkpoint is not;
- ``checkpoint@N``: step N's checkpoint files are written, its manifest (the seal) is not.

Unset (always, outside tests) it does nothing.
"""

from __future__ import annotations

import os
import signal


def failpoint(point: str, step: int = 0) -> None:
    if os.environ.get("TREADLE_FAILPOINT") == f"{point}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
