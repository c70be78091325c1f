"""reasoning-gym's score without its partial credit: 1.0 for an exact answer, else 0.0.

reasoning-gym gives a wrong answer that contains the right one part of the score (``-7`` for
``7``: 0.5). Under GRPO's per-group normalisation such an answer, in a group with no right
one, gets as large an advantage as a right answer would: the policy learns the near miss.
``reward.function=examples/reasoning_gym/exact.py:exact_score`` counts what held-out accuracy
counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from treadle.data.gym import compute_score


def exact_score(
    completions: Sequence[str],
    question: Sequence[str],
    answer: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    answer_format: Sequence[str | None] | None = None,
) -> list[float]:
    scores = compute_score(completions, question, answer, metadata, answer_format)
    return [1.0 if s >= 1.0 else 0.0 for s in scores]
