"""Exact answers score 1.0; a wrong one earns credit for the worked steps it got right.

For responses written as :mod:`steps` writes them (one operation a line, ``a op b = c``, the
answer on the last line). A wrong answer scores ``PARTIAL`` times the share of the
expression's operations that its leading lines do right: each line's operands are numbers of
the question or results of the lines before it, each used once (as in a derivation), and its
result is right. The check reads the question's expression, never the reference working: a
line earns credit for being right, not for matching a solution. Under GRPO's per-group
normalisation this gives a group whose samples are all wrong (which exact answers leave with
no advantage) an order: the sample that multiplied right and added wrong ranks above the one
that multiplied wrong.

``reward.function=examples/reasoning_gym/step_credit.py:step_credit``
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from treadle.data.gym import compute_score

PARTIAL = 0.5  # the most a wrong answer can score (all its steps right)

_APPLY: dict[str, Callable[[float, float], float]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
}
_NUMBER = r"-?\d+(?:\.\d+)?"
_BINARY = re.compile(rf"({_NUMBER}) ([-+*/]) ({_NUMBER}) = ({_NUMBER})")
_NEGATE = re.compile(rf"-\(({_NUMBER})\) = ({_NUMBER})")


def step_credit(
    completions: Sequence[str],
    question: Sequence[str],
    answer: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    answer_format: Sequence[str | None] | None = None,
) -> list[float]:
    scores = compute_score(completions, question, answer, metadata, answer_format)
    return [
        1.0 if score >= 1.0 else PARTIAL * steps_right(text, meta["expression"])
        for text, score, meta in zip(completions, scores, metadata, strict=True)
    ]


def steps_right(response: str, expression: str) -> float:
    """The share of ``expression``'s operations that the leading lines of ``response`` do
    right (0.0 to 1.0; the last line, the answer, is not a step)."""
    numbers, needed = _operands(ast.parse(expression, mode="eval").body)
    left = Counter(numbers)  # the values a step may still use: each is used once
    right = 0
    for line in [s.strip() for s in response.strip().splitlines()][:-1][:needed]:
        step = _step(line)
        if step is None or any(left[x] < n for x, n in Counter(step[0]).items()):
            break
        left -= Counter(step[0])
        left[step[1]] += 1
        right += 1
    return right / needed if needed else 0.0


def _step(line: str) -> tuple[tuple[float, ...], float] | None:
    """A right step as (its operands, its result); None if the line is not one."""
    if m := _BINARY.fullmatch(line):
        a, op, b, c = float(m[1]), m[2], float(m[3]), float(m[4])
        if op == "/" and b == 0:
            return None
        return ((a, b), c) if abs(_APPLY[op](a, b) - c) < 1e-6 else None
    if m := _NEGATE.fullmatch(line):
        a, c = float(m[1]), float(m[2])
        return ((a,), c) if c == -a else None
    return None


def _operands(node: ast.expr) -> tuple[list[float], int]:
    """The expression's numbers (``-33`` one number) and how many steps it takes (as
    :mod:`steps` counts them: each binary operation, each negated bracket)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return [float(node.value)], 0
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        sign = -1.0 if isinstance(node.op, ast.USub) else 1.0
        if isinstance(node.operand, ast.Constant) and isinstance(node.operand.value, int | float):
            return [sign * node.operand.value], 0
        numbers, needed = _operands(node.operand)
        return numbers, needed + (sign < 0)
    if isinstance(node, ast.BinOp):
        left, n_left = _operands(node.left)
        right, n_right = _operands(node.right)
        return left + right, n_left + n_right + 1
    raise ValueError(f"not an arithmetic expression of + - * /: {ast.unparse(node)!r}")
