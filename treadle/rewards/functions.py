"""Reward functions by name: the built-ins, a user's from ``path/to/file.py:function``, and
functions registered from Python (``python:<module>.<name>``); each one's signature checked
when it is loaded, so that a wrong one is a ConfigError before the first rollout."""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from treadle.runtime.errors import ConfigError
from treadle.runtime.plugins import load_callable

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
REGISTERED: dict[str, Callable[..., Any]] = {}


def register_reward(fn: Callable[..., Any]) -> str:
    """Keep `fn` (a Python reward function) in this process; the spec that names it.

    A ConfigError if its signature fits neither form (see the module's docstring)."""
    if not callable(fn):
        raise ConfigError(f"reward: a {type(fn).__name__} is not a function")
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    spec = f"{PYTHON}{getattr(fn, '__module__', None) or 'main'}.{name}"
    if not is_batched(fn):
        _check_signature(fn, spec, bool(getattr(fn, SANDBOXED, False)))
    REGISTERED[spec] = fn
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
        self._fn = resolve(spec, key)
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
        self._fn = cloudpickle.loads(state["fn"]) if "fn" in state else resolve(self.spec)

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


def resolve(spec: str, key: str = "reward.function") -> Callable[..., Any]:
    if spec in REGISTERED:
        return REGISTERED[spec]
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
