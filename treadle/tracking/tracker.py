"""Metrics out of a run: the loggers of ``trainer.loggers``, phase timers, and where the
messages of Ray, vLLM and torch go.

Every step's metrics go to each logger (:mod:`treadle.tracking.sinks`): ``metrics.jsonl`` (one
JSON line per step, flushed at once, each step once after a resume), the console, and the
trackers (TensorBoard, wandb, MLflow, SwanLab). Phase timers write ``timing/<phase>`` in
seconds and, in a process that computes on a CUDA GPU (the local backend), the phase's peak
device memory in GiB, as verl's ``perf/max_memory_*`` (``torch.cuda.max_memory_allocated`` and
``max_memory_reserved``, their peaks reset as each phase begins):
``perf/max_memory_allocated_gib/<phase>``, ``perf/max_memory_reserved_gib/<phase>``, and the
step's (the highest of its phases) ``perf/max_memory_allocated_gib`` and
``perf/max_memory_reserved_gib``. A driver whose workers are Ray actors holds no device
memory: there each worker method that returns metrics (the updates: ``update_actor``,
``update_critic``, ``train_sft``, ...) reports its own peak on its ranks, the highest of them,
as ``perf/max_memory_*_gib/<method>`` (as verl's actor update reports its peak); the step's
keys and the other phases' are the local backend's. On a CPU there are none: a CPU process's
resident memory has no peak that can be reset per phase. Phases that overlap (the
asynchronous modes' generation beside the update) share the device, so each one's peak counts
the other's work in its window.

Messages. Unless ``trainer.verbose``, the console shows treadle's own lines only: the driver's
loggers of Ray, vLLM, torch, transformers and the trackers, and Python warnings, go to
``<output_dir>/logs/driver.log`` (:func:`route_logs`), and every Ray worker process writes its
stdout and stderr (C++ and CUDA messages included) to ``<output_dir>/logs/<role>-<pid>.log``
(:func:`redirect_output`, called as the worker starts; Ray does not forward them to the driver:
``ray.init(log_to_driver=False)``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from treadle.tracking.profiler import phase
from treadle.tracking.sinks import ConsoleLogger, open_loggers

log = logging.getLogger("treadle")


@contextmanager
def timed(metrics: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall time of the block to ``metrics['timing/<name>']``, and on a CUDA GPU its
    peak device memory to ``perf/max_memory_*_gib`` (see the module docstring); in a profiled
    step it is the range ``treadle/<name>`` (:mod:`treadle.tracking.profiler`)."""
    start = time.perf_counter()
    try:
        with peak_memory(metrics, name), phase(name):
            yield
    finally:
        metrics[f"timing/{name}"] = metrics.get(f"timing/{name}", 0.0) + (
            time.perf_counter() - start
        )


@contextmanager
def peak_memory(metrics: dict[str, float], name: str, step: bool = True) -> Iterator[None]:
    """On a CUDA GPU, the block's peak device memory to ``metrics``: ``perf/max_memory_*_gib/
    <name>`` and, with ``step``, the step's ``perf/max_memory_*_gib``; nothing elsewhere."""
    cuda = device_memory()
    if cuda is None:
        yield
        return
    _PEAKS.begin(cuda)
    try:
        yield
    finally:
        _PEAKS.end(cuda, metrics, name, step)


MEMORY_METRICS = ("perf/max_memory_allocated_gib", "perf/max_memory_reserved_gib")
"""The step's peak device memory; ``<name>/<phase>`` each phase's."""


def device_memory() -> Any:
    """``torch.cuda`` when this process has computed on a GPU, else None (torch not imported,
    no GPU, or CUDA never initialised here: a driver of Ray workers)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda


class _PhasePeaks(threading.local):
    """Peaks of nested phases: a phase that begins inside another first folds the peak so far
    into the outer one's, then resets the device's counters; the outer one's peak is the
    highest of what it folded and what the counters show at its end. One stack per thread."""

    def __init__(self) -> None:
        self.stack: list[list[int]] = []

    def begin(self, cuda: Any) -> None:
        if self.stack:
            self._fold(self.stack[-1], _now(cuda))
        cuda.reset_peak_memory_stats()
        self.stack.append([0, 0])

    def end(self, cuda: Any, metrics: dict[str, float], name: str, step: bool = True) -> None:
        peaks = self.stack.pop() if self.stack else [0, 0]
        self._fold(peaks, _now(cuda))
        if self.stack:
            self._fold(self.stack[-1], peaks)
        for key, value in zip(MEMORY_METRICS, peaks, strict=True):
            gib = value / (1 << 30)
            # the phase's (the most of its calls), the step's
            for k in (f"{key}/{name}", key) if step else (f"{key}/{name}",):
                metrics[k] = max(metrics.get(k, 0.0), gib)

    @staticmethod
    def _fold(into: list[int], peaks: Sequence[int]) -> None:
        into[0], into[1] = max(into[0], peaks[0]), max(into[1], peaks[1])


def _now(cuda: Any) -> tuple[int, int]:
    return cuda.max_memory_allocated(), cuda.max_memory_reserved()


_PEAKS = _PhasePeaks()


class Tracker:
    """The run's loggers (``trainer.loggers``, :mod:`treadle.tracking.sinks`), opened together and
    each called in turn. Use as a context manager."""

    def __init__(
        self,
        output_dir: str | Path,
        total_steps: int,
        start_step: int = 0,
        show_progress: bool = True,
        headline: str = "reward/mean",
        loggers: Sequence[str] = ("console", "jsonl"),
        config: dict[str, Any] | None = None,
        console: ConsoleLogger | None = None,
    ) -> None:
        self.out = Path(output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if console is None and "console" in loggers:
            console = ConsoleLogger(total_steps, start_step, headline, bar=None)
        if console is not None and not show_progress:
            console.bar = False
        self.console = console if "console" in loggers else None
        self.loggers = open_loggers(list(loggers), self.out, config or {}, start_step, console)
        if self.console is not None:
            self.console.begin(total_steps, start_step)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            try:
                logger.close()
            except Exception as e:  # a tracker that fails to close must not hide the run's end
                log.warning("closing %s failed: %s", type(logger).__name__, e)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        """``rows`` to every logger's table ``name`` (``samples.jsonl``, wandb.Table, ...)."""
        for logger in self.loggers:
            logger.log_table(step, name, rows)

    def print(self, message: str) -> None:
        if self.console is not None:
            self.console.print(message)


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Loggers of the libraries a command drives: off the console unless trainer.verbose.
NOISY = (
    "ray",
    "ray._private",  # keeps its handler while ray.init empties the "ray" logger's
    "vllm",
    "torch",
    "transformers",
    "datasets",
    "huggingface_hub",
    "accelerate",
    "gguf",
    "reasoning_gym",
    "PIL",
    "fsspec",
    "filelock",
    "urllib3",
    "httpx",  # a black-box agent's openai client (httpx2 in openai 3): a line per request
    "httpx2",
    "httpcore",
    "openai",
    "aiohttp.access",
    "py.warnings",
    "wandb",
    "mlflow",
    "alembic",
    "swanlab",
)
LOG_DIR_ENV = "TREADLE_LOG_DIR"  # set for the run's Ray workers: where they write
DRIVER_LOG = "driver.log"
_KEPT_MAX = 10_000  # records kept before a command knows its log file (the rest: dropped)


class _Kept(logging.Handler):
    """The library records of a command that does not know its log file yet (a run's comes
    with its directory, after the check): kept, and written there when it is known."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < _KEPT_MAX:
            self.records.append(record)


def _file_handler(path: Path) -> logging.FileHandler:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    return handler


class _Route:
    """The routing of the library loggers while a command (or a run) is on: the handler they
    write to (a file, ``path``, or the records kept until there is one) and what it replaced."""

    def __init__(self, handler: logging.Handler, path: Path | None) -> None:
        self.handler, self.path = handler, path
        self.last: Path | None = None  # the file it wrote to before (a run's, ended)
        self.fallback: Path | None = None  # the folder of its file if it needs one
        self.before: dict[str, tuple[bool, list[logging.Handler]]] = {}
        self.vllm_logging: str | None = None  # the user's VLLM_CONFIGURE_LOGGING
        self.restore: Callable[[], None] = lambda: None  # (set by quiet_console)

    def apply(self) -> None:
        """Route every noisy logger to the handler (again: a library imported since, such as
        Ray or torch, may have put its own console handler back, on a child logger too)."""
        for name in (*NOISY, *_children()):
            logger = logging.getLogger(name)
            if name not in self.before:
                self.before[name] = (logger.propagate, list(logger.handlers))
            for h in list(logger.handlers):  # vLLM's, Ray's and torch's own console handlers
                if isinstance(h, logging.StreamHandler) and h is not self.handler:
                    logger.removeHandler(h)
            if name in NOISY:
                if self.handler not in logger.handlers:
                    logger.addHandler(self.handler)
                logger.propagate = False

    def move(
        self, handler: logging.Handler, path: Path | None
    ) -> tuple[logging.Handler, Path | None]:
        """Write to ``handler`` from now on (the kept records first); what it wrote to."""
        old = self.handler, self.path
        self.last = self.path or self.last
        for name in NOISY:
            logger = logging.getLogger(name)
            logger.removeHandler(self.handler)
            logger.addHandler(handler)
        if isinstance(self.handler, _Kept):
            for record in self.handler.records:
                handler.handle(record)
            self.handler.records.clear()
        self.handler, self.path = handler, path
        return old

    def undo(self) -> None:
        for name, (propagate, handlers) in self.before.items():
            logger = logging.getLogger(name)
            logger.removeHandler(self.handler)
            logger.propagate = propagate
            for h in handlers:
                if h not in logger.handlers:
                    logger.addHandler(h)
        self.handler.close()


def _children() -> list[str]:
    """The loggers made so far below the noisy ones (torch's have console handlers of their
    own)."""
    prefixes = tuple(f"{name}." for name in NOISY)
    return [name for name in list(logging.root.manager.loggerDict) if name.startswith(prefixes)]


_route: _Route | None = None


def quiet_console(logs: Path | None = None, fallback: Path | None = None) -> Callable[[], None]:
    """A command's console from its start: its library messages to ``<logs>/driver.log``, or,
    ``logs`` None, kept until the command knows where its log goes (a run's, by
    :func:`route_logs`), or needs a file without one (:func:`log_file`): then
    ``<fallback>/driver.log``. Returns the function that puts things back."""
    global _route
    if logs is None:
        route = _route = _Route(_Kept(), None)
        route.fallback = fallback
        env: dict[str, str | None] = {LOG_DIR_ENV: None, "VLLM_CONFIGURE_LOGGING": "0"}
    else:
        route = _route = _Route(_file_handler(logs / DRIVER_LOG), logs / DRIVER_LOG)
        env = {LOG_DIR_ENV: str(logs.resolve()), "VLLM_CONFIGURE_LOGGING": "0"}
    route.apply()
    # VLLM_CONFIGURE_LOGGING=0: an in-process vLLM adds no console handler
    env_before = _put_env(env)
    route.vllm_logging = env_before["VLLM_CONFIGURE_LOGGING"]
    logging.captureWarnings(True)

    def restore() -> None:
        global _route
        if _route is not route:  # (put back already)
            return
        logging.captureWarnings(False)
        route.undo()
        _route = None
        _put_env(env_before)

    route.restore = restore
    return restore


def loud() -> None:
    """The console shows the library messages after all (``trainer.verbose``): the command's
    routing undone, what it kept shown."""
    route = _route
    if route is None:
        return
    kept = route.handler.records if isinstance(route.handler, _Kept) else []
    route.restore()
    for record in kept:
        logging.getLogger(record.name).handle(record)


def route_logs(out: Path, verbose: bool) -> Callable[[], None]:
    """Send the driver's library messages to ``<out>/logs/driver.log`` (unless ``verbose``);
    returns the function that puts things back as they were (a run ends, another starts).
    Within a command whose console is quiet already (:func:`quiet_console`), its routing
    moves there, with what it kept, and back after."""
    return route_into(out / "logs", verbose)


def route_into(logs: Path, verbose: bool) -> Callable[[], None]:
    """:func:`route_logs` into the folder ``logs`` itself (``<logs>/driver.log``)."""
    logs.mkdir(parents=True, exist_ok=True)
    if verbose:
        os.environ.pop(LOG_DIR_ENV, None)
        return lambda: None
    route = _route
    if route is None:
        return quiet_console(logs)
    old = route.move(_file_handler(logs / DRIVER_LOG), logs / DRIVER_LOG)
    env_before = _put_env({LOG_DIR_ENV: str(logs.resolve())})

    def restore() -> None:
        handler, _ = route.move(*old)
        handler.close()
        _put_env(env_before)

    return restore


def log_file() -> Path | None:
    """Where the library messages go (None: to the console). A command between files (before
    its run's, or after) writes what it kept to the last one it had, else to its fallback
    (:func:`quiet_console`), from now on."""
    route = _route
    if route is None:
        return None
    if route.path is None:
        fallback = route.fallback / DRIVER_LOG if route.fallback is not None else None
        path = route.last or fallback
        if path is not None:
            route.move(_file_handler(path), path)
            os.environ[LOG_DIR_ENV] = str(path.parent.resolve())  # the Ray workers' too
    return route.path


def worker_env() -> dict[str, str]:
    """What a Ray worker of the run needs to write where the driver's routing says (a Ray
    worker inherits the environment of the first run that started Ray: set both always)."""
    if _route is None or LOG_DIR_ENV not in os.environ:
        return {LOG_DIR_ENV: ""}
    # vLLM in a worker writes to the worker's log file, with its own format
    return {
        LOG_DIR_ENV: os.environ[LOG_DIR_ENV],
        "VLLM_CONFIGURE_LOGGING": _route.vllm_logging or "1",
    }


def reroute_logs() -> None:
    """After importing a library that configures its own logging (Ray): route it again."""
    if _route is not None:
        _route.apply()


def _put_env(values: dict[str, str | None]) -> dict[str, str | None]:
    """Set (or, for None, unset) environment variables; returns what they were."""
    before = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return before


@contextmanager
def quiet_start() -> Iterator[None]:
    """While the workers (or an engine) start, or a profiler starts and stops (kineto's lines):
    this process's stdout and stderr (file descriptors, so C++ warnings and progress bars of an
    in-process vLLM or torch too) to the command's log file, unless it has none (verbose).
    Put back before anything is raised to the caller, and the loggers routed again (a library
    imported meanwhile may have added its own console handler)."""
    path = log_file()
    if path is None:
        yield
        return
    import sys

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    # sys.stdout/sys.stderr too: they need not write to descriptors 1 and 2 (pytest, Jupyter)
    with open(path, "a", buffering=1) as text, _own_lines_shown(saved[1]):
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for f in (fd, *saved):
                os.close(f)
            reroute_logs()


@contextmanager
def _own_lines_shown(stderr: int) -> Iterator[None]:
    """treadle's own log lines (the root logger's console handlers: a library's are routed to
    the log file) still reach the console, a copy of ``stderr``, while the descriptors point
    at the log file (``started vLLM engine ... in 18.4 s``)."""
    import sys

    handlers = [
        h
        for h in logging.getLogger().handlers
        if type(h) is logging.StreamHandler and h.stream in (sys.stderr, sys.__stderr__)
    ]
    if not handlers:
        yield
        return
    with os.fdopen(os.dup(stderr), "w", buffering=1) as console:
        before = [h.setStream(console) for h in handlers]
        try:
            yield
        finally:
            for h, stream in zip(handlers, before, strict=True):
                h.setStream(stream)


def redirect_output(name: str) -> None:
    """In a Ray worker of a run that is not verbose: this process's stdout and stderr (file
    descriptors 1 and 2, so C++ and CUDA messages too) to ``<logs>/<name>-<pid>.log``."""
    logs = os.environ.get(LOG_DIR_ENV)
    if not logs:
        return
    import sys

    path = Path(logs) / f"{name.replace(' ', '_')}-{os.getpid()}.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
