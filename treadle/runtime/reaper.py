"""Nothing of a run left behind, however its driver ends: ``python -m treadle.runtime.reaper``.

Ray starts its GCS, raylet, dashboard and monitors as children of the driver that calls
``ray.init``, and they die with it (``PR_SET_PDEATHSIG``); but the raylet's own children, the
dashboard and runtime-env agents and the workers, outlive a driver killed with SIGKILL (measured
on Ray 2.60: the agents were still there minutes later). A reward pool's or a sandbox's
processes are the driver's children too.

:func:`watch` starts this module in a session of its own, holding the read end of a pipe whose
write end only the driver holds. While the driver lives, the reaper notes its descendants every
``interval`` seconds (pid and start time, so a reused pid is never mistaken for one of them);
when the pipe reaches end of file (the driver exited, whatever the way: a return, an error, a
signal, SIGKILL) it sends SIGTERM to every noted process still alive and to its descendants,
SIGKILL to what is left after ``grace`` seconds, and exits. Everything is gone within
``interval + grace`` seconds (3 s by default) of the driver's end.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

_Proc = tuple[int, int]  # (pid, start time in clock ticks since boot)

_watching: subprocess.Popen[bytes] | None = None


def watch(interval: float = 1.0, grace: float = 2.0) -> None:
    """Start the reaper for this process (once; later calls do nothing). Linux only."""
    global _watching
    if _watching is not None and _watching.poll() is None:
        return
    if not Path("/proc/self/stat").exists():
        return
    # The write end stays in this process only: Popen closes it in every child it starts.
    _watching = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "treadle.runtime.reaper",
            str(os.getpid()),
            str(interval),
            str(grace),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the driver's process group: Ctrl-C does not reach it
    )


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of ``pid``, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
    return int(fields[1]), int(fields[19])


def _table() -> dict[int, tuple[int, int]]:
    """Every process: pid -> (parent pid, start time)."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                out[int(entry.name)] = stat
    return out


def descendants(roots: set[int], table: dict[int, tuple[int, int]]) -> set[_Proc]:
    """The processes below ``roots`` in ``table`` (not the roots themselves)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[_Proc] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in roots and (child, table[child][1]) not in found:
                found.add((child, table[child][1]))
                todo.append(child)
    return found


def _alive(procs: set[_Proc], table: dict[int, tuple[int, int]]) -> set[_Proc]:
    return {(pid, start) for pid, start in procs if table.get(pid, (0, -1))[1] == start}


def reap(noted: set[_Proc], grace: float) -> None:
    """SIGTERM to ``noted`` and their descendants, then SIGKILL to what is left."""
    me = os.getpid()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        table = _table()
        targets = _alive(noted, table)
        targets |= descendants({pid for pid, _ in targets}, table)
        targets = {(pid, start) for pid, start in targets if pid != me}
        noted |= targets
        for pid, _ in targets:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 1.0)
        while targets and time.monotonic() < deadline:
            time.sleep(0.1)
            targets = _alive(targets, _table())
        if not targets:
            return


def main(pid: int, interval: float, grace: float, pipe: IO[bytes]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    noted: set[_Proc] = set()
    me = os.getpid()
    while True:
        ready, _, _ = select.select([pipe], [], [], interval)
        if ready and not pipe.read1(4096):  # type: ignore[attr-defined]
            break  # end of file: the driver is gone
        noted |= {p for p in descendants({pid}, _table()) if p[0] != me}
    reap(noted, grace)


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.stdin.buffer)
