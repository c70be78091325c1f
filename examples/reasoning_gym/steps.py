"""Worked steps for reasoning-gym's arithmetic tasks, as SFT targets: one operation a line.

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
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

_OPS: dict[type[ast.operator], tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
}


def steps(entry: dict[str, Any]) -> str:
    """The operations of ``entry["metadata"]["expression"]``, one a line (``a op b = c``)."""
    expression = entry["metadata"]["expression"]
    lines: list[str] = []
    _evaluate(ast.parse(expression, mode="eval").body, lines)
    return "\n".join(lines)


def _evaluate(node: ast.expr, lines: list[str]) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand, lines)
        if isinstance(node.op, ast.UAdd):
            return value
        if not isinstance(node.operand, ast.Constant):  # -( ... ): a step of its own
            lines.append(f"-({_number(value)}) = {_number(-value)}")
        return -value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, lines), _evaluate(node.right, lines)
        symbol, apply = _OPS[type(node.op)]
        value = apply(left, right)
        lines.append(f"{_number(left)} {symbol} {_number(right)} = {_number(value)}")
        return value
    raise ValueError(f"not an arithmetic expression of + - * /: {ast.unparse(node)!r}")


def _number(value: Any) -> str:
    """An integral value without a decimal point (``-33 / 11`` is ``-3``, not ``-3.0``)."""
    return str(int(value)) if float(value).is_integer() else repr(value)
