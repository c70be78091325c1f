"""What a reward function returned, checked: a finite float32 number, or a dict of named ones
(its components, summed); anything else is a RewardError that names the function, the sample,
a shortened prompt and response, and the cause."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from treadle.runtime.errors import RewardError


def shorten(text: Any, limit: int = 80) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def fail(
    name: str, index: int, prompt: Any, response: Any, problem: str, what: str = "reward function"
) -> RewardError:
    error = RewardError(
        f"{what} '{name}' failed on sample {index}: {problem} "
        f"(prompt {shorten(prompt)}, response {shorten(response)})"
    )
    error.sample = index
    return error


FLOAT32_MAX = 3.4028234663852886e38


def as_score(value: Any) -> float | None:
    """`value` as a float when it is a finite number that fits float32 (bools too), else None."""
    if isinstance(value, numbers.Real):
        score = float(value)
        return score if math.isfinite(score) and abs(score) <= FLOAT32_MAX else None
    return None


def as_result(value: Any) -> tuple[float, dict[str, float] | None] | str:
    """`(score, components)` of what a reward returned (components: a dict's, else None), or
    what is wrong with it, in words."""
    if isinstance(value, Mapping):
        if not value:
            return "returned an empty dict: give at least one named component"
        parts: dict[str, float] = {}
        for key, part in value.items():
            number = as_score(part)
            if not isinstance(key, str) or number is None:
                return f"returned component {key!r}: {part!r}, not a finite number (float32)"
            parts[key] = number
        total = sum(parts.values())
        if abs(total) > FLOAT32_MAX:
            return f"returned components whose sum {total!r} does not fit float32"
        return total, parts
    score = as_score(value)
    if score is None:
        return f"returned {value!r}, not a finite number (float32)"
    return score, None


Sample = tuple[str, str, str]  # (prompt, response, ground truth)
RowSample = tuple[str, str, str, Mapping[str, Any]]  # (prompt, response, ground truth, data row)


def with_rows(
    prompts: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[str],
    rows: Sequence[Mapping[str, Any]] | None,
) -> list[RowSample]:
    """Each sample's prompt, response, ground truth and data row (``{}`` without ``rows``)."""
    rows = rows if rows is not None else [{}] * len(prompts)
    return list(zip(prompts, responses, ground_truths, rows, strict=True))


# (returned value, None) or (None, the exception it raised or what happened to its process)
Outcome = tuple[Any, BaseException | str | None]


def outcome(fn: Callable[..., Any], sample: Sample, options: dict[str, Any]) -> Outcome:
    try:
        return fn(*sample, **options), None
    except (Exception, SystemExit) as e:
        return None, e
