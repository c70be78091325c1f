"""Rule-based reward functions: built-ins by name and user functions from a file.

A reward function has the signature `fn(prompt: str, response: str, ground_truth: str) -> float`.
`reward.function` names one:

- a built-in, by name (`arithmetic` -> `treadle.tasks.arithmetic.compute_score`);
- a user function, as `path/to/file.py:function`; the file is imported with importlib (it need
  not be on `sys.path` or in a package);
- a Python function passed to `treadle.train(reward=fn)`: `register_reward(fn)` keeps it in
  this process under the spec `python:<module>.<name>`, which is what `config.yaml` shows.

A Python function comes in one of two forms, told apart by its signature: per sample,
`fn(prompt, response, ground_truth) -> float`, or TRL's batched form,
`fn(completions, **columns) -> list[float]` (a parameter named `completions`), called once
per batch with `prompts`, `completions` and every column of the data rows but the prompt
(`answer`, ...) as lists, keyword arguments the function does not take left out. A per-sample
function runs in the `RewardPool` like a file's, sent to its processes with cloudpickle, so
the same time limit and crash isolation hold (a closure that cannot be pickled is a
ConfigError that says to set `reward.num_workers: 0`); a batched one is called in the
trainer's process, as TRL does, without a time limit.

`load_reward_fn` returns a `RewardFn`, which pickles as its spec and loads the function again
on unpickling, so it can be shipped to Ray workers even when the user's file is not importable
there by module name. Problems with the spec are ConfigErrors at start-up.

A reward may also return a dict of named numbers, its components (`{"format": 1.0,
"accuracy": 0.0}`): the sample's score is their sum, and the components are kept
(`Scores.components`) for estimators that read them one by one (GDPO,
`algorithm.gdpo_reward_keys`); `component_matrix` lays them out as a [B, K] tensor. Every
sample of a batch returns a number, or every one a dict.

A function whose signature cannot take `(prompt, response, ground_truth)` is a ConfigError
when it is loaded, before the first rollout.

`score_batch` calls the function on every sample and checks each result: a raised exception
(`SystemExit` included), or a result that is not a finite float32 (None, a string, NaN, 1e39),
or a dict with a component that is not one, becomes one RewardError naming the function,
the sample index, a shortened prompt and response, and the cause (the first failing
sample's, in sample order). Booleans count as numbers.

Rewards that run programs (the built-in `code`) are marked `@sandboxed_reward`: they spend
their time waiting on a sandboxed process, not holding the GIL, and take a `timeout_s`
keyword. `score_batch(..., workers=N, timeout_s=T)` calls such a function from up to N threads
at once (N sandboxes at once) and passes it `timeout_s=T`; every other function is called one
sample after another and never receives `timeout_s`.

A run scores through a `Scorer` (`reward.num_workers`, `reward.timeout_s`): any other function
is called in a `RewardPool` of `num_workers` processes, each call under `timeout_s`, so a reward
that hangs, crashes its process, calls `sys.exit` or `os._exit` cannot stall the run or end it
silently: the sample's process is killed (on a timeout) or found dead, a new one takes its place,
and the RewardError says what happened. A process that ends while scoring (a crash, the OOM
killer) is started again and the sample scored once more; only a second end is the error
(`Scorer.restarts` counts them, logged as `reward/worker_restarts`). `num_workers: 0` calls it
in the trainer's process, without a time limit (the fastest; for functions you trust).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import math
import numbers
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from treadle.errors import ConfigError, RewardError
from treadle.plugins import load_callable

# name -> "module:function", imported on first use
BUILTIN_REWARDS: dict[str, str] = {
    "arithmetic": "treadle.tasks.arithmetic:compute_score",
    "chat_arithmetic": "treadle.tasks.chat_arithmetic:compute_score",
    "calculator": "treadle.tasks.calculator:compute_score",
    "shapes": "treadle.tasks.shapes:compute_score",
    "code": "treadle.tasks.code:compute_score",
    "reasoning_gym": "treadle.data.gym:compute_score",  # batched: reads the rows' columns
}


# name -> "module:function" of a built-in's answer reader, fn(response, row) -> str | None:
# the answer that sampled evaluation's majority vote (maj@k) counts
ANSWER_READERS: dict[str, str] = {
    "arithmetic": "treadle.tasks.arithmetic:answer_of",
    "chat_arithmetic": "treadle.tasks.chat_arithmetic:answer_of",
    "calculator": "treadle.tasks.calculator:answer_of",
    "shapes": "treadle.tasks.shapes:answer_of",
    "reasoning_gym": "treadle.data.gym:answer_of",
}


# name -> "module:function" of a built-in's ground-truth rule, fn(ground_truth) -> str | None:
# what the reward would refuse in a row's ground truth ("is not an integer"; None: nothing),
# which `treadle check` asks of every row before a run starts
GROUND_TRUTH_RULES: dict[str, str] = {
    "arithmetic": "treadle.tasks.arithmetic:ground_truth_problem",
    "chat_arithmetic": "treadle.tasks.arithmetic:ground_truth_problem",
    "calculator": "treadle.tasks.arithmetic:ground_truth_problem",
    "shapes": "treadle.tasks.arithmetic:ground_truth_problem",
}


def ground_truth_rule(spec: str) -> Callable[[str], str | None] | None:
    """The built-in reward ``spec``'s ground-truth rule (see ``GROUND_TRUTH_RULES``); None for
    a reward without one (a user function's rule is its own)."""
    if spec not in GROUND_TRUTH_RULES:
        return None
    module_name, _, name = GROUND_TRUTH_RULES[spec].partition(":")
    rule: Callable[[str], str | None] = getattr(importlib.import_module(module_name), name)
    return rule


def answer_reader(spec: str) -> Callable[[str, Mapping[str, Any]], str]:
    """The answer maj@k votes on for the reward ``spec``: what a built-in reward reads in the
    response ("" when it finds none), else the whole response, stripped (a user function's
    reading of it is not known: a reward's dict may hold numbers only)."""
    if spec not in ANSWER_READERS:
        return lambda response, row: response.strip()
    module_name, _, name = ANSWER_READERS[spec].partition(":")
    read = getattr(importlib.import_module(module_name), name)
    return lambda response, row: read(response, row) or ""


SANDBOXED = "treadle_sandboxed"  # the attribute `sandboxed_reward` sets on a function
F = TypeVar("F", bound=Callable[..., Any])

PYTHON = "python:"  # the spec prefix of a function registered in this process
_REGISTERED: dict[str, Callable[..., Any]] = {}


def register_reward(fn: Callable[..., Any]) -> str:
    """Keep `fn` (a Python reward function) in this process; the spec that names it.

    A ConfigError if its signature fits neither form (see the module's docstring)."""
    if not callable(fn):
        raise ConfigError(f"reward: a {type(fn).__name__} is not a function")
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    spec = f"{PYTHON}{getattr(fn, '__module__', None) or 'main'}.{name}"
    if not is_batched(fn):
        _check_signature(fn, spec, bool(getattr(fn, SANDBOXED, False)))
    _REGISTERED[spec] = fn
    return spec


def is_batched(fn: Callable[..., Any]) -> bool:
    """Whether `fn` is a batched reward, TRL's `fn(completions, **columns) -> list[float]`."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def sandboxed_reward(fn: F) -> F:
    """Mark `fn(prompt, response, ground_truth, *, timeout_s)` as a reward that runs programs.

    `score_batch` then calls it from up to `workers` threads at once and passes `timeout_s`;
    it must be safe to call from several threads (waiting on a subprocess is).
    """
    setattr(fn, SANDBOXED, True)
    return fn


class RewardFn:
    """A reward function together with the spec it was loaded from."""

    def __init__(self, spec: str, key: str = "reward.function") -> None:
        self.spec = spec
        self._fn = _resolve(spec, key)
        _check_plain(self._fn, spec, key)
        if not self.batched:
            _check_signature(self._fn, spec, self.treadle_sandboxed, key)

    def __call__(self, prompt: str, response: str, ground_truth: str, **options: Any) -> Any:
        return self._fn(prompt, response, ground_truth, **options)

    @property
    def treadle_sandboxed(self) -> bool:
        """Whether the function is a `sandboxed_reward` (see `score_batch`)."""
        return bool(getattr(self._fn, SANDBOXED, False))

    @property
    def batched(self) -> bool:
        """Whether it is TRL's batched form (see `score_batched`)."""
        return is_batched(self._fn)

    def __getstate__(self) -> dict[str, Any]:
        if self.spec.startswith(PYTHON):  # not importable elsewhere: the function itself
            return {"spec": self.spec, "fn": pickled(self._fn, self.spec)}
        return {"spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        import cloudpickle

        self.spec = state["spec"]
        self._fn = cloudpickle.loads(state["fn"]) if "fn" in state else _resolve(self.spec)

    def __repr__(self) -> str:
        return f"RewardFn({self.spec!r})"


def load_reward_fn(spec: str, key: str = "reward.function") -> RewardFn:
    """The reward function named by `spec`: a built-in name or `path/to/file.py:function`
    (a ConfigError names the config key `key` that gave it)."""
    return RewardFn(spec, key)


def pickled(fn: Callable[..., Any], spec: str) -> bytes:
    """`fn` by cloudpickle (by value when defined in a script), or a ConfigError saying why not."""
    import cloudpickle

    try:
        return bytes(cloudpickle.dumps(fn))
    except Exception as e:  # a closure over a lock, a model on a device, an open file ...
        raise ConfigError(
            f"reward.function: {spec} cannot be sent to the reward worker processes "
            f"({type(e).__name__}: {e}); set reward.num_workers=0 to call it in the trainer's "
            "process"
        ) from None


def _resolve(spec: str, key: str = "reward.function") -> Callable[..., Any]:
    if spec in _REGISTERED:
        return _REGISTERED[spec]
    if spec.startswith(PYTHON):
        raise ConfigError(
            f"{key}: {spec!r} names a Python function given to treadle.train(reward="
            "...) in another process; from the command line give it as "
            "'path/to/file.py:function'"
        )
    if spec in BUILTIN_REWARDS:
        module_name, _, name = BUILTIN_REWARDS[spec].partition(":")
        fn: Callable[..., Any] = getattr(importlib.import_module(module_name), name)
        return fn
    if ":" not in spec:
        close = difflib.get_close_matches(spec, BUILTIN_REWARDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"{key}: unknown reward '{spec}'{hint}; built-in rewards are "
            f"{', '.join(sorted(BUILTIN_REWARDS))}, or give a user function as "
            "'path/to/file.py:function'"
        )
    return load_callable(spec, key)


def _check_plain(fn: Callable[..., Any], spec: str, key: str) -> None:
    """A reward is a plain function that returns its score: not a coroutine or generator
    function (its call would return a coroutine or generator, not a number)."""
    kinds = (
        (inspect.iscoroutinefunction, "a coroutine function (async def)"),
        (inspect.isasyncgenfunction, "an async generator function"),
        (inspect.isgeneratorfunction, "a generator function (it yields)"),
    )
    for test, what in kinds:
        if test(fn):
            raise ConfigError(
                f"{key}: '{spec}' is {what}, but a reward function returns its score: make it "
                "a plain `def` that returns a float (or a dict of them)"
            )


def _check_signature(
    fn: Callable[..., Any], spec: str, sandboxed: bool, key: str = "reward.function"
) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: found out when called
        return
    options = {"timeout_s": 1.0} if sandboxed else {}
    try:
        sig.bind("prompt", "response", "ground_truth", **options)
    except TypeError:
        call = "fn(prompt, response, ground_truth" + (", timeout_s=...)" if sandboxed else ")")
        if spec.startswith(PYTHON):
            call += " or, batched, fn(completions, **columns) -> list[float]"
        raise ConfigError(
            f"{key}: '{spec}' has the signature {sig}, but a reward function is called as {call}"
        ) from None


def _shorten(text: Any, limit: int = 80) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _fail(name: str, index: int, prompt: Any, response: Any, problem: str) -> RewardError:
    error = RewardError(
        f"reward function '{name}' failed on sample {index}: {problem} "
        f"(prompt {_shorten(prompt)}, response {_shorten(response)})"
    )
    error.sample = index
    return error


FLOAT32_MAX = 3.4028234663852886e38


def _as_score(value: Any) -> float | None:
    """`value` as a float when it is a finite number that fits float32 (bools too), else None."""
    if isinstance(value, numbers.Real):
        score = float(value)
        return score if math.isfinite(score) and abs(score) <= FLOAT32_MAX else None
    return None


def _as_result(value: Any) -> tuple[float, dict[str, float] | None] | str:
    """`(score, components)` of what a reward returned (components: a dict's, else None), or
    what is wrong with it, in words."""
    if isinstance(value, Mapping):
        if not value:
            return "returned an empty dict: give at least one named component"
        parts: dict[str, float] = {}
        for key, part in value.items():
            number = _as_score(part)
            if not isinstance(key, str) or number is None:
                return f"returned component {key!r}: {part!r}, not a finite number (float32)"
            parts[key] = number
        total = sum(parts.values())
        if abs(total) > FLOAT32_MAX:
            return f"returned components whose sum {total!r} does not fit float32"
        return total, parts
    score = _as_score(value)
    if score is None:
        return f"returned {value!r}, not a finite number (float32)"
    return score, None


class Scores(list[float]):
    """The score of each sample; ``components``: each sample's dict of named components
    when the reward function returns dicts, else None."""

    components: list[dict[str, float]] | None = None


def component_matrix(scores: Sequence[float], keys: Sequence[str], spec: str) -> Any:
    """The components ``keys`` of every sample as a float32 tensor [B, len(keys)]; a RewardError
    if the function returned numbers, or a sample's dict lacks a key."""
    import torch

    components = getattr(scores, "components", None)
    if components is None:
        raise RewardError(
            f"reward function '{spec}' returned numbers, but algorithm.gdpo_reward_keys "
            f"{list(keys)} needs it to return a dict of named components per sample (e.g. "
            '{"format": 1.0, "accuracy": 0.0})'
        )
    for i, parts in enumerate(components):
        missing = [k for k in keys if k not in parts]
        if missing:
            raise RewardError(
                f"reward function '{spec}' returned the components {sorted(parts)} for sample "
                f"{i}, without {missing} of algorithm.gdpo_reward_keys"
            )
    return torch.tensor([[parts[k] for k in keys] for parts in components], dtype=torch.float32)


Sample = tuple[str, str, str]  # (prompt, response, ground truth)
# (returned value, None) or (None, the exception it raised or what happened to its process)
Outcome = tuple[Any, BaseException | str | None]


def score_batch(
    fn: Callable[..., Any],
    prompts: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[str],
    *,
    spec: str | None = None,
    workers: int = 1,
    timeout_s: float | None = None,
) -> Scores:
    """`fn` on every (prompt, response, ground truth) in this process; a failure raises one
    RewardError.

    `spec` names the function in errors; by default the RewardFn's own spec or the
    function's name. For a `sandboxed_reward`, `workers` calls run at once and `timeout_s`
    (when given) is passed on; other functions ignore both.
    """
    name = str(spec or getattr(fn, "spec", None) or getattr(fn, "__qualname__", repr(fn)))
    samples = _samples(prompts, responses, ground_truths)
    if getattr(fn, SANDBOXED, False):
        options = {} if timeout_s is None else {"timeout_s": timeout_s}
        outcomes: Iterable[Outcome] = _outcomes_parallel(fn, samples, options, workers)
    else:
        outcomes = (_outcome(fn, sample, {}) for sample in samples)  # lazily: stop at a failure
    return _judge(name, samples, outcomes)


def score_batched(
    fn: Callable[..., Any],
    prompts: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[str],
    rows: Sequence[Mapping[str, Any]] | None = None,
    *,
    spec: str,
) -> Scores:
    """A batched reward (TRL's form) called once on the batch; a failure is one RewardError.

    It gets ``prompts``, ``completions`` and, as lists, every column of ``rows`` except those
    two names and ``prompt`` (without ``rows``: ``ground_truth``); keywords it does not take are
    left out unless it takes ``**kwargs``."""
    samples = _samples(prompts, responses, ground_truths)
    columns: dict[str, list[Any]] = {"prompts": list(prompts), "completions": list(responses)}
    if rows is None:
        columns["ground_truth"] = list(ground_truths)
    else:
        for key in dict.fromkeys(k for row in rows for k in row):
            if key not in ("prompt", "prompts", "completions"):
                columns[key] = [row.get(key) for row in rows]
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        columns = {k: v for k, v in columns.items() if k in params}
    try:
        values = fn(**columns)
    except (Exception, SystemExit) as e:
        raise RewardError(
            f"reward function '{spec}' raised {type(e).__name__}: {e} (on a batch of "
            f"{len(samples)} samples)"
        ) from e
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != len(samples):
        got = f"{len(values)} values" if isinstance(values, Sequence) else repr(values)[:60]
        raise RewardError(
            f"reward function '{spec}' returned {got} for {len(samples)} completions: a batched "
            "reward returns one number per completion"
        )
    return _judge(spec, samples, ((value, None) for value in values))


def _samples(
    prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[str]
) -> list[Sample]:
    if not len(prompts) == len(responses) == len(ground_truths):
        raise ValueError(
            f"score_batch: {len(prompts)} prompts, {len(responses)} responses and "
            f"{len(ground_truths)} ground truths; they must match"
        )
    return list(zip(prompts, responses, ground_truths, strict=True))


def _judge(name: str, samples: list[Sample], outcomes: Iterable[Outcome]) -> Scores:
    """The scores, or the RewardError of the first sample (in order) that failed."""
    scores = Scores()
    components: list[dict[str, float] | None] = []
    for i, ((prompt, response, _), (value, error)) in enumerate(
        zip(samples, outcomes, strict=False)
    ):
        if isinstance(error, str):
            raise _fail(name, i, prompt, response, error)
        if error is not None:
            cause = f"raised {type(error).__name__}: {error}"
            raise _fail(name, i, prompt, response, cause) from error
        result = _as_result(value)
        if isinstance(result, str):
            raise _fail(name, i, prompt, response, result)
        if components and (components[0] is None) != (result[1] is None):
            first = "a number" if components[0] is None else "a dict"
            problem = f"returned {value!r}, but sample 0 returned {first}: return one kind"
            raise _fail(name, i, prompt, response, problem)
        scores.append(result[0])
        components.append(result[1])
    if len(scores) != len(samples):
        raise AssertionError(f"{len(scores)} outcomes for {len(samples)} samples")
    if components and components[0] is not None:
        scores.components = [c for c in components if c is not None]
    return scores


def _outcome(fn: Callable[..., Any], sample: Sample, options: dict[str, Any]) -> Outcome:
    try:
        return fn(*sample, **options), None
    except (Exception, SystemExit) as e:
        return None, e


def _outcomes_parallel(
    fn: Callable[..., Any],
    samples: list[Sample],
    options: dict[str, Any],
    workers: int,
) -> list[Outcome]:
    if workers <= 1 or len(samples) <= 1:
        return [_outcome(fn, sample, options) for sample in samples]
    with ThreadPoolExecutor(min(workers, len(samples)), thread_name_prefix="reward") as pool:
        return list(pool.map(lambda sample: _outcome(fn, sample, options), samples))


class Scorer:
    """Scores batches with the function ``reward.function`` names, as ``reward.num_workers``
    and ``reward.timeout_s`` say (see the module's docstring). Close it (or use ``with``)."""

    def __init__(
        self, spec: str, num_workers: int = 0, timeout_s: float = 10.0, key: str = "reward.function"
    ) -> None:
        self.fn = load_reward_fn(spec, key)
        self.spec, self.num_workers, self.timeout_s = spec, num_workers, timeout_s
        use_pool = num_workers > 0 and not self.fn.treadle_sandboxed and not self.fn.batched
        self.pool = RewardPool(spec, num_workers, timeout_s) if use_pool else None

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[str],
        rows: Sequence[Mapping[str, Any]] | None = None,
    ) -> Scores:
        """The scores; ``rows`` (the data rows, for a batched reward's columns) is optional."""
        if self.fn.batched:
            return score_batched(
                self.fn._fn, prompts, responses, ground_truths, rows, spec=self.spec
            )
        if self.pool is None:
            workers = max(1, self.num_workers)
            return score_batch(
                self.fn, prompts, responses, ground_truths, spec=self.spec, workers=workers,
                timeout_s=self.timeout_s,
            )  # fmt: skip
        samples = _samples(prompts, responses, ground_truths)
        return _judge(self.spec, samples, self.pool.map(samples))

    @property
    def restarts(self) -> int:
        """How many worker processes ended while scoring and were started again, so far."""
        return 0 if self.pool is None else self.pool.restarts

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


STARTUP_TIMEOUT_S = 120.0  # a worker that has not loaded the function by then is an error


_CHILD = (
    "import sys; from treadle.rewards import _serve_fd; _serve_fd(int(sys.argv[1]), sys.argv[2])"
)


class _Worker:
    """One process of a RewardPool and the sample it is scoring.

    A fresh interpreter (not multiprocessing's spawn, which re-runs the parent's ``__main__``:
    a user's script, or nothing at all under ``python -c``), joined by a socket pair."""

    def __init__(self, spec: str, payload: bytes | None = None) -> None:
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parent.parent)
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
        registered = _REGISTERED.get(spec) if spec.startswith(PYTHON) else None
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
        return error is not None or isinstance(_as_result(value), str)

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
            fn = _resolve(spec)
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
        value, error = _outcome(fn, sample, {})
        if error is not None:
            sent: tuple[Any, str | None] = (None, f"raised {type(error).__name__}: {error}")
        elif isinstance(value, numbers.Real):
            sent = (float(value), None)
        elif isinstance(value, Mapping):  # components: as floats, or what is wrong, in words
            result = _as_result(value)
            sent = (None, result) if isinstance(result, str) else (result[1], None)
        else:  # sent as text: it may not pickle, and it is an error either way
            sent = (None, f"returned {value!r}, not a finite number (float32)")
        conn.send((index, sent))
