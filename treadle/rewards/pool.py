"""``RewardPool``: a reward function called in worker processes of its own, each call under a
time limit, so that a reward that hangs, crashes its process or exits cannot stall or end the
run (see :mod:`treadle.rewards`)."""

from __future__ import annotations

import contextlib
import numbers
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from treadle.rewards.functions import PYTHON, REGISTERED, pickled, resolve
from treadle.rewards.results import Outcome, Sample, as_result, outcome
from treadle.runtime.errors import RewardError

STARTUP_TIMEOUT_S = 120.0  # a worker that has not loaded the function by then is an error


_CHILD = (
    "import sys; from treadle.rewards.pool import _serve_fd; "
    "_serve_fd(int(sys.argv[1]), sys.argv[2])"
)


class _Worker:
    """One process of a RewardPool and the sample it is scoring.

    A fresh interpreter (not multiprocessing's spawn, which re-runs the parent's ``__main__``:
    a user's script, or nothing at all under ``python -c``), joined by a socket pair."""

    def __init__(self, spec: str, payload: bytes | None = None) -> None:
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])
        # a pickled function may name modules of the trainer's sys.path (a user's package)
        extra = sys.path if payload is not None else []
        path = os.pathsep.join(
            dict.fromkeys(filter(None, [package_root, os.environ.get("PYTHONPATH"), *extra]))
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(theirs.fileno()), spec],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path},
            # a group of its own: Ctrl-C (to the terminal's group) never reaches it, not even
            # before it ignores SIGINT (while it imports, it would die with a traceback)
            process_group=0,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        if payload is not None:  # a registered Python function: the child waits for it
            self.conn.send_bytes(payload)
        self.ready = False
        self.started = time.monotonic()
        self.job: tuple[int, float] | None = None  # (sample index, deadline)

    def stop(self, kill: bool) -> str:
        """End the process (at once with SIGKILL if `kill`); what ended it, in words."""
        if kill:
            self.process.kill()
        else:
            with contextlib.suppress(OSError):
                self.conn.send(None)
        try:
            self.process.wait(None if kill else 1.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.conn.close()
        code = self.process.returncode
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"


class RewardPool:
    """``num_workers`` processes that call the reward function ``spec`` names, each call
    under ``timeout_s``.

    A process scores one sample at a time; one that times out is killed, one that ends (a
    crash, ``os._exit``, the OOM killer) is found dead, and either way a new process takes its
    place. A sample whose process ended is scored once more, in a new process (``restarts``
    counts those processes); a timeout, or a second end, is the sample's outcome. After the
    first failure no further samples are handed out but those retries; those in progress
    finish. The processes ignore Ctrl-C (the trainer handles it
    and closes the pool) and exit when the trainer's end of their pipe closes, so a trainer
    killed with SIGKILL leaves none behind. ``map`` is safe to call from several threads (one
    batch at a time).
    """

    def __init__(self, spec: str, num_workers: int, timeout_s: float) -> None:
        self.spec, self.size, self.timeout_s = spec, num_workers, timeout_s
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.restarts = 0  # processes that ended while scoring, each started again
        self._retried: set[int] = set()  # this batch's samples already scored again
        registered = REGISTERED.get(spec) if spec.startswith(PYTHON) else None
        self._payload = None if registered is None else pickled(registered, spec)

    def _new_worker(self) -> _Worker:
        return _Worker(self.spec, self._payload)

    def map(self, samples: list[Sample]) -> list[Outcome]:
        """The outcome of each sample, in order: all of them, or those up to a failure."""
        with self._lock:
            while len(self._workers) < self.size:
                self._workers.append(self._new_worker())
            try:
                return self._run(samples)
            except BaseException:  # samples may be in flight: start afresh next time
                self._stop_all()
                raise

    def _run(self, samples: list[Sample]) -> list[Outcome]:
        pending = deque(range(len(samples)))
        outcomes: dict[int, Outcome] = {}
        self._retried = set()
        failed = False

        def due() -> bool:  # after a failure, only the retries (at the front) are handed out
            return bool(pending) and (not failed or pending[0] in self._retried)

        while due() or any(w.job for w in self._workers):
            for w in self._workers:
                if w.ready and w.job is None and due():
                    i = pending.popleft()
                    try:
                        w.conn.send((i, samples[i]))
                    except OSError:  # its process ended while idle (killed between batches)
                        pending.appendleft(i)
                        self._restart(w)
                        continue
                    w.job = (i, time.monotonic() + self.timeout_s)
            for conn in wait([w.conn for w in self._workers], self._until_next_deadline()):
                failed |= self._receive(self._find(conn), outcomes, pending)
            failed |= self._reap_overdue(outcomes)
        return [outcomes[i] for i in sorted(outcomes)]

    def _find(self, conn: object) -> _Worker:
        return next(w for w in self._workers if w.conn is conn)

    def _until_next_deadline(self) -> float:
        now = time.monotonic()
        deadlines = [w.job[1] for w in self._workers if w.job]
        deadlines += [w.started + STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
        return max(0.0, min(deadlines, default=now + 1.0) - now)

    def _receive(self, w: _Worker, outcomes: dict[int, Outcome], pending: deque[int]) -> bool:
        """Take `w`'s message; whether a sample failed (a sample whose process ended goes back
        to the front of `pending` the first time)."""
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            how = w.stop(kill=False)
            if w.job is None:  # idle: a new one takes its place (a restart too)
                self._replace(w)
                self.restarts += w.ready
                if not w.ready:
                    raise RewardError(
                        f"reward function '{self.spec}': its worker process ended ({how}) while "
                        "loading the function"
                    ) from None
                return False
            index = w.job[0]
            self._replace(w)
            self.restarts += 1
            if index not in self._retried:  # once more, in the new process
                self._retried.add(index)
                pending.appendleft(index)
                return False
            outcomes[index] = (None, f"its worker process ended ({how}) while scoring it")
            return True
        kind, payload = message
        if kind == "ready":
            w.ready = True
            return False
        if kind == "load":  # the function did not load in the worker (it did here)
            self._replace(w)
            raise RewardError(f"reward function '{self.spec}' did not load in a worker: {payload}")
        assert w.job is not None and kind == w.job[0], (message, w.job)
        value, error = payload
        outcomes[kind] = (value, error)
        w.job = None
        return error is not None or isinstance(as_result(value), str)

    def _reap_overdue(self, outcomes: dict[int, Outcome]) -> bool:
        now, failed = time.monotonic(), False
        for w in list(self._workers):
            if w.job and now >= w.job[1]:
                w.stop(kill=True)
                outcomes[w.job[0]] = (
                    None,
                    f"took longer than reward.timeout_s={self.timeout_s:g} s (its worker "
                    "process was killed and a new one started)",
                )
                self._replace(w)
                failed = True
            elif not w.ready and now >= w.started + STARTUP_TIMEOUT_S:
                w.stop(kill=True)
                self._replace(w)
                raise RewardError(
                    f"reward function '{self.spec}' did not load in a worker process within "
                    f"{STARTUP_TIMEOUT_S:g} s"
                )
        return failed

    def _restart(self, w: _Worker) -> None:
        """``w``'s process ended outside a job: a new one in its place, counted."""
        w.stop(kill=False)
        self._replace(w)
        self.restarts += 1

    def _replace(self, w: _Worker) -> None:
        self._workers[self._workers.index(w)] = self._new_worker()

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        with self._lock:
            self._stop_all()

    def _stop_all(self) -> None:
        for w in self._workers:
            w.stop(kill=w.job is not None)
        self._workers = []


def _serve_fd(fd: int, spec: str) -> None:
    _serve(spec, Connection(fd))


def _serve(spec: str, conn: Connection) -> None:
    """A RewardPool process: load the function, then score one sample per message until the
    trainer sends None or its end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    try:
        if spec.startswith(PYTHON):
            import cloudpickle

            fn = cloudpickle.loads(conn.recv_bytes())
        else:
            fn = resolve(spec)
    except BaseException as e:
        conn.send(("load", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        index, sample = message
        value, error = outcome(fn, sample, {})
        if error is not None:
            sent: tuple[Any, str | None] = (None, f"raised {type(error).__name__}: {error}")
        elif isinstance(value, numbers.Real):
            sent = (float(value), None)
        elif isinstance(value, Mapping):  # components: as floats, or what is wrong, in words
            result = as_result(value)
            sent = (None, result) if isinstance(result, str) else (result[1], None)
        else:  # sent as text: it may not pickle, and it is an error either way
            sent = (None, f"returned {value!r}, not a finite number (float32)")
        conn.send((index, sent))
