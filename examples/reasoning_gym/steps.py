"""Worked steps for reasoning-gym's arithmetic tasks: SFT targets, and a reward that credits them.

``data.reasoning_gym.reasoning=examples/reasoning_gym/steps.py:steps`` (with
``answer_format: last_line``) writes each SFT target as the operations of the row's
``metadata.expression`` in the order they are evaluated, each with its result, then the answer
alone on the last line::

    Calculate -33 / 11 + -22.    ->    -33 / 11 = -3
                                        -3 + -22 = -25
                                        -25

A model that answers in one token per digit writes the whole result of a 3-term expression at
once; with the steps it writes one operation at a time, each result from the line before. Any
task whose rows carry an arithmetic ``expression`` (``basic_arithmetic``, ``chain_sum``,
``products``) takes it unchanged.

``reward.function=examples/reasoning_gym/steps.py:step_credit`` scores an exact answer 1.0 and
a wrong one ``PARTIAL`` times the share of the expression's operations that its leading lines
do right: each line's operands are numbers of the question or results of the lines before it,
each used once (as in a derivation), and its result is right. The check reads the question's
expression, never the reference working: a line earns credit for being right, not for
matching a solution. Under GRPO's per-group normalisation this gives a group whose samples are
all wrong (which exact answers leave with no advantage) an order: the sample that multiplied
right and added wrong ranks above the one that multiplied wrong.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from treadle.data.gym import compute_score

_OPS: dict[type[ast.operator], tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
}
PARTIAL = 0.5  # the most a wrong answer can score (all its steps right)

_APPLY = dict(_OPS.values())  # "+" -> operator.add, ...
_NUMBER = r"-?\d+(?:\.\d+)?"
_BINARY = re.compile(rf"({_NUMBER}) ([-+*/]) ({_NUMBER}) = ({_NUMBER})")
_NEGATE = re.compile(rf"-\(({_NUMBER})\) = ({_NUMBER})")


def steps(entry: dict[str, Any]) -> str:
    """The operations of ``entry["metadata"]["expression"]``, one a line (``a op b = c``)."""
    return "\n".join(_worked(entry["metadata"]["expression"])[0])


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
    """The share of ``expression``'s operations (the lines :func:`steps` writes) that the
    leading lines of ``response`` do right (0.0 to 1.0; the last line, the answer, is not a
    step)."""
    lines, numbers = _worked(expression)
    left = Counter(numbers)  # the values a step may still use: each is used once
    right = 0
    for line in [s.strip() for s in response.strip().splitlines()][:-1][: len(lines)]:
        step = _step(line)
        if step is None or any(left[x] < n for x, n in Counter(step[0]).items()):
            break
        left -= Counter(step[0])
        left[step[1]] += 1
        right += 1
    return right / len(lines) if lines else 0.0


def _worked(expression: str) -> tuple[list[str], list[Any]]:
    """The steps of ``expression``, one a line, and its numbers (``-33`` one number)."""
    lines: list[str] = []
    numbers: list[Any] = []
    _evaluate(ast.parse(expression, mode="eval").body, lines, numbers)
    return lines, numbers


def _evaluate(node: ast.expr, lines: list[str], numbers: list[Any]) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        numbers.append(node.value)
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand, lines, numbers)
        if isinstance(node.op, ast.UAdd):
            return value
        if isinstance(node.operand, ast.Constant):  # -33: a number of the question
            numbers[-1] = -value
        else:  # -( ... ): a step of its own
            lines.append(f"-({_number(value)}) = {_number(-value)}")
        return -value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left = _evaluate(node.left, lines, numbers)
        right = _evaluate(node.right, lines, numbers)
        symbol, apply = _OPS[type(node.op)]
        value = apply(left, right)
        lines.append(f"{_number(left)} {symbol} {_number(right)} = {_number(value)}")
        return value
    raise ValueError(f"not an arithmetic expression of + - * /: {ast.unparse(node)!r}")


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


def _number(value: Any) -> str:
    """An integral value without a decimal point (``-33 / 11`` is ``-3``, not ``-3.0``)."""
    return str(int(value)) if float(value).is_integer() else repr(value)
