"""An exact answer scores 1.0; a wrong number scores up to 0.5 by how close it is.

With exact rewards only, a group whose samples are all wrong has nothing to learn from (every
advantage is 0), and on the harder tasks most groups are so. Here a wrong answer that is a
number scores ``0.5 x max(0, 1 - |answer - truth| / max(|truth|, 1))``: 0.46 for 52 when the
answer is 57, 0 for anything off by the truth's size or more, 0 for no number. Unlike
reasoning-gym's partial credit (``-7`` for ``7``: 0.5), padding an answer with digits moves it
away. Held-out accuracy counts exact answers only (a score of 1.0).
``reward.function=examples/reasoning_gym/close.py:close_score``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from treadle.data.gym import answer_of, compute_score


def _number(text: str | None) -> float | None:
    try:
        return float(str(text).strip().replace(",", ""))
    except ValueError:
        return None


def close_score(
    completions: Sequence[str],
    question: Sequence[str],
    answer: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    answer_format: Sequence[str | None] | None = None,
) -> list[float]:
    exact = compute_score(completions, question, answer, metadata, answer_format)
    formats = answer_format or [None] * len(completions)
    scores = []
    for score, response, truth, how in zip(exact, completions, answer, formats, strict=True):
        got, want = _number(answer_of(response, {"answer_format": how})), _number(truth)
        if score >= 1.0:
            scores.append(1.0)
        elif got is None or want is None:
            scores.append(0.0)
        else:
            scores.append(0.5 * max(0.0, 1.0 - abs(got - want) / max(abs(want), 1.0)))
    return scores
