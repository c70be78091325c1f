"""Rule-based reward functions: built-ins by name and user functions from a file.

A reward function has the signature `fn(prompt: str, response: str, ground_truth: str) -> float`.
`reward.function` names one:

- a built-in, by name (`arithmetic` -> `treadle.tasks.arithmetic.compute_score`);
- a user function, as `path/to/file.py:function`; the file is imported with importlib (it need
  not be on `sys.path` or in a package).

`load_reward_fn` returns a `RewardFn`, which pickles as its spec and loads the function again
on unpickling, so it can be shipped to Ray workers even when the user's file is not importable
there by module name. Problems with the spec are ConfigErrors at start-up.

`score_batch` calls the function on every sample and checks each result: a raised exception,
or a result that is not a finite number (None, a string, NaN), becomes one RewardError naming
the function, the sample index, a shortened prompt and response, and the cause (the first
failing sample's, in sample order). Booleans count as numbers (True -> 1.0).

Rewards that run programs (the built-in `code`) are marked `@sandboxed_reward`: they spend
their time waiting on a sandboxed process, not holding the GIL, and take a `timeout_s`
keyword. `score_batch(..., workers=N, timeout_s=T)` calls such a function from up to N threads
at once (N sandboxes at once: `reward.num_workers`) and passes it `timeout_s=T`
(`reward.timeout_s`); every other function is called one sample after another, as
before, and never receives `timeout_s`.
"""

from __future__ import annotations

import difflib
import importlib
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from treadle.errors import ConfigError, RewardError
from treadle.plugins import load_callable

# name -> "module:function", imported on first use
BUILTIN_REWARDS: dict[str, str] = {
    "arithmetic": "treadle.tasks.arithmetic:compute_score",
    "chat_arithmetic": "treadle.tasks.chat_arithmetic:compute_score",
    "calculator": "treadle.tasks.calculator:compute_score",
    "code": "treadle.tasks.code:compute_score",
}


SANDBOXED = "treadle_sandboxed"  # the attribute `sandboxed_reward` sets on a function
F = TypeVar("F", bound=Callable[..., Any])


def sandboxed_reward(fn: F) -> F:
    """Mark `fn(prompt, response, ground_truth, *, timeout_s)` as a reward that runs programs.

    `score_batch` then calls it from up to `workers` threads at once and passes `timeout_s`;
    it must be safe to call from several threads (waiting on a subprocess is).
    """
    setattr(fn, SANDBOXED, True)
    return fn


class RewardFn:
    """A reward function together with the spec it was loaded from."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._fn = _resolve(spec)

    def __call__(self, prompt: str, response: str, ground_truth: str, **options: Any) -> Any:
        return self._fn(prompt, response, ground_truth, **options)

    @property
    def treadle_sandboxed(self) -> bool:
        """Whether the function is a `sandboxed_reward` (see `score_batch`)."""
        return bool(getattr(self._fn, SANDBOXED, False))

    def __getstate__(self) -> dict[str, str]:
        return {"spec": self.spec}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.spec = state["spec"]
        self._fn = _resolve(self.spec)

    def __repr__(self) -> str:
        return f"RewardFn({self.spec!r})"


def load_reward_fn(spec: str) -> RewardFn:
    """The reward function named by `spec`: a built-in name or `path/to/file.py:function`."""
    return RewardFn(spec)


def _resolve(spec: str) -> Callable[..., Any]:
    if spec in BUILTIN_REWARDS:
        module_name, _, name = BUILTIN_REWARDS[spec].partition(":")
        fn: Callable[..., Any] = getattr(importlib.import_module(module_name), name)
        return fn
    if ":" not in spec:
        close = difflib.get_close_matches(spec, BUILTIN_REWARDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"reward.function: unknown reward '{spec}'{hint}; built-in rewards are "
            f"{', '.join(sorted(BUILTIN_REWARDS))}, or give a user function as "
            "'path/to/file.py:function'"
        )
    return load_callable(spec, "reward.function")


def _shorten(text: Any, limit: int = 80) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _fail(name: str, index: int, prompt: Any, response: Any, problem: str) -> RewardError:
    return RewardError(
        f"reward function '{name}' failed on sample {index}: {problem} "
        f"(prompt {_shorten(prompt)}, response {_shorten(response)})"
    )


def _as_score(value: Any) -> float | None:
    """`value` as a float when it is a finite number (bools included), else None."""
    if isinstance(value, numbers.Real):
        score = float(value)
        return score if math.isfinite(score) else None
    return None


def score_batch(
    fn: Callable[..., Any],
    prompts: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[str],
    *,
    spec: str | None = None,
    workers: int = 1,
    timeout_s: float | None = None,
) -> list[float]:
    """`fn` on every (prompt, response, ground truth); a failure raises one RewardError.

    `spec` names the function in errors; by default the RewardFn's own spec or the
    function's name. For a `sandboxed_reward`, `workers` calls run at once and `timeout_s`
    (when given) is passed on; other functions ignore both.
    """
    if not len(prompts) == len(responses) == len(ground_truths):
        raise ValueError(
            f"score_batch: {len(prompts)} prompts, {len(responses)} responses and "
            f"{len(ground_truths)} ground truths; they must match"
        )
    name = str(spec or getattr(fn, "spec", None) or getattr(fn, "__qualname__", repr(fn)))
    samples = list(zip(prompts, responses, ground_truths, strict=True))
    if getattr(fn, SANDBOXED, False):
        options = {} if timeout_s is None else {"timeout_s": timeout_s}
        outcomes = _outcomes_parallel(fn, samples, options, workers)
    else:
        outcomes = (_outcome(fn, sample, {}) for sample in samples)  # lazily: stop at a failure
    scores = []
    for i, ((prompt, response, _), (value, error)) in enumerate(
        zip(samples, outcomes, strict=True)
    ):
        if error is not None:
            cause = f"raised {type(error).__name__}: {error}"
            raise _fail(name, i, prompt, response, cause) from error
        score = _as_score(value)
        if score is None:
            raise _fail(name, i, prompt, response, f"returned {value!r}, not a finite number")
        scores.append(score)
    return scores


Outcome = tuple[Any, Exception | None]  # (returned value, raised exception)


def _outcome(
    fn: Callable[..., Any], sample: tuple[str, str, str], options: dict[str, Any]
) -> Outcome:
    try:
        return fn(*sample, **options), None
    except Exception as e:
        return None, e


def _outcomes_parallel(
    fn: Callable[..., Any],
    samples: list[tuple[str, str, str]],
    options: dict[str, Any],
    workers: int,
) -> Iterable[Outcome]:
    if workers <= 1 or len(samples) <= 1:
        return [_outcome(fn, sample, options) for sample in samples]
    with ThreadPoolExecutor(min(workers, len(samples)), thread_name_prefix="reward") as pool:
        return list(pool.map(lambda sample: _outcome(fn, sample, options), samples))
