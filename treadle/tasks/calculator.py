"""Arithmetic the model cannot do in its head, with a `calculator` tool: the agent-loop task.

Products of two three-digit numbers (`What is 347 * 812?`) are out of reach for a small chat
model's mental arithmetic, and one call of :func:`calculator` solves them exactly, so the reward
rises only as far as the policy learns to call the tool and state its result.

- :func:`calculator` is the tool (`rollout.tools: [treadle.tasks.calculator:calculator]`): it
  evaluates an arithmetic expression through :mod:`ast`, never ``eval``, with bounds on size;
  bad input raises ValueError with a message the model reads as `Error: ...`.
- :func:`prepare` writes held-out `train.jsonl`/`test.jsonl` (`prompt`, `answer`); it reuses a
  directory whose manifest records the same arguments.
- :func:`compute_score` is the reward (`reward.function: calculator`): 1.0 when the last number
  the model wrote after its last tool call equals the answer (see :func:`final_text`).

The default phrasing, `one_shot_call`, shows one call in the user message and ends on `Call:`.
It was chosen by a probe of SmolLM2-135M-Instruct (float32, vLLM on CPU, the Hermes tool block
in the system message as `treadle.agents.tools.tool_messages` renders it for SmolLM2's template,
up to 96 new tokens in the first turn and 64 after the tool's result; held-out problems, 60
greedy, 30 x 4 sampled). Columns: a `<tool_call>` tag written, a well-formed call of
`calculator`, a call whose result is the answer, the two-turn episode correct:

    phrasing (+ system sentence)        sampling     tag    call   right  correct
    no tools, SmolLM2's system prompt   greedy        -      -      -       0%
    what_is                             greedy        0%     0%     0%      0%
    what_is                             T=1.0         2%     0%     0%      0%
    what_is + "Use the calculator..."   greedy        0%     0%     0%      0%
    "Use the calculator tool to ..."    greedy        0%     0%     0%      0%  (writes Python)
    one-shot transcript in the system   greedy        0%     0%     0%      0%
    one-shot as earlier chat turns      greedy        0%     0%     0%      0%  (answers 12*34)
    one_shot_call                       greedy       77%    77%    62%     62%
    one_shot_call                       T=0.3        18%    13%     8%      8%  (27% pass@4)
    one_shot_call                       T=0.5         5%     5%     3%      3%
    one_shot_call                       T=0.7         8%     3%     2%      2%
    one_shot_call                       T=1.0         8%     0%     0%      0%
    one_shot_call                       T=1.0 p=0.7  11%     5%     4%      3%
    one_shot_call + "Use the calculator
      tool for arithmetic. When the
      tool responds, reply with the
      answer."                          greedy       75%    75%    75%     75%
      (same)                            T=0.3        14%     9%     8%      7%
    two-shot variant of one_shot_call   greedy        0%     0%     0%      0%

Without an example in the user message the model never writes a call; with an example that
also shows the tool's response and a final `Answer:` line, it answers in its head (0 of 24).
The greedy path parrots the Hermes sentence (`... arguments within <tool_call></tool_call> XML
tags:`) before the call: a long path with little probability under sampling, hence the gap
between greedy and sampled rates. Greedy failures are the example's expression copied
(`12 * 34`, 15%) and answers in the head (23%). Given a right result, the model always restates
it in its next turn, most often as an echoed `<tool_response>` block, which counts as its
answer.
"""

from __future__ import annotations

import ast
import logging
import math
import operator
import random
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from treadle.tasks.arithmetic import expected_integer
from treadle.tasks.chat_arithmetic import extract_final_number, write_phrased

logger = logging.getLogger(__name__)

# --- the tool --------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 100
MAX_DIGITS = 100  # |any intermediate integer| < 10**MAX_DIGITS

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
# What models write for operators Python spells otherwise, and thousands separators.
_REWRITES = (
    (re.compile(r"[×✕⋅·]"), "*"),
    (re.compile(r"÷"), "/"),
    (re.compile(r"[−–]"), "-"),
    (re.compile(r"\^"), "**"),
    (re.compile(r"(?<=\d),(?=\d{3}(?!\d))"), ""),
    (re.compile(r"\s*=\s*$"), ""),
)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the exact result.

    Args:
        expression: The arithmetic expression to evaluate, for example "347 * 812" or
            "(12 + 7) ** 2 / 5". Numbers, parentheses and the operators + - * / // % ** only.
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, not {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    shown = expression if len(expression) <= 80 else expression[:77] + "..."
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {shown!r} as arithmetic ({e.msg})") from None
    except (RecursionError, MemoryError):
        raise ValueError(f"{shown!r} is nested too deeply") from None
    try:
        return _format(_evaluate(tree.body))
    except RecursionError:
        raise ValueError(f"{shown!r} is nested too deeply") from None


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"only numbers are allowed, not {value!r}")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
        if isinstance(result, complex):  # a negative number to a fractional power
            raise ValueError("the result is not a real number")
        return _bounded(result)
    raise ValueError(
        f"unsupported syntax {_describe(node)!r}: use numbers, ( ) and + - * / // % **"
    )


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponents are limited to {MAX_EXPONENT} in absolute value")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) >= MAX_DIGITS:
        raise ValueError(f"the result is too large (more than {MAX_DIGITS} digits)")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large")
    if abs(value) >= 10**MAX_DIGITS:
        raise ValueError(f"the result is too large (more than {MAX_DIGITS} digits)")
    return value


def _format(value: int | float) -> str:
    """Integers exactly; a float with an integral value as an integer (`10 / 2` -> `5`)."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def _describe(node: ast.expr) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # pragma: no cover - unparse handles every parsed expression
        return type(node).__name__


# --- problems --------------------------------------------------------------------------------

# Templates over `{a}`, `{b}` (JSON braces doubled). See the module docstring for the probe.
PHRASINGS: dict[str, str] = {
    "one_shot_call": (
        "Use the calculator tool. Example:\n"
        "Question: What is 12 * 34?\n"
        "Call: <tool_call>\n"
        '{{"name": "calculator", "arguments": {{"expression": "12 * 34"}}}}\n'
        "</tool_call>\n\n"
        "Question: What is {a} * {b}?\n"
        "Call:"
    ),
    "what_is": "What is {a} * {b}?",
}
DEFAULT_PHRASING = "one_shot_call"
# Bump when the files prepare writes change meaning, so old directories are rebuilt.
PREPARE_FORMAT = 1


def generate_problems(
    n: int,
    seed: int,
    *,
    phrasing: str = DEFAULT_PHRASING,
    min_value: int = 100,
    max_value: int = 999,
) -> list[dict[str, str]]:
    """`n` distinct products `a * b` (`min_value <= a, b <= max_value`) as `prompt`/`answer`."""
    if phrasing not in PHRASINGS:
        raise ValueError(f"unknown phrasing {phrasing!r}: use one of {', '.join(PHRASINGS)}")
    if not 0 <= min_value <= max_value:
        raise ValueError(f"need 0 <= min_value <= max_value, got {min_value}, {max_value}")
    span = max_value - min_value + 1
    if n > span * span:
        raise ValueError(f"only {span * span} distinct problems in [{min_value}, {max_value}]")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        a, b = rng.randint(min_value, max_value), rng.randint(min_value, max_value)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({"prompt": PHRASINGS[phrasing].format(a=a, b=b), "answer": str(a * b)})
    return rows


def prepare(
    out_dir: str | Path,
    *,
    seed: int = 0,
    n_train: int = 2000,
    n_test: int = 200,
    phrasing: str = DEFAULT_PHRASING,
    min_value: int = 100,
    max_value: int = 999,
) -> dict[str, Path]:
    """Write held-out `train.jsonl` and `test.jsonl` (`prompt`, `answer`) under `out_dir`, as
    `chat_arithmetic.write_phrased` does."""
    return write_phrased(
        out_dir,
        "calculator",
        PREPARE_FORMAT,
        generate_problems,
        PHRASINGS,
        dict(seed=seed, n_train=n_train, n_test=n_test, phrasing=phrasing),
        dict(min_value=min_value, max_value=max_value),
    )


# --- verifier --------------------------------------------------------------------------------

# A tool's output in an episode: a <tool_response> block right after a call, with only chat
# markers, role names and whitespace between (a model's own echo of a result follows prose).
_RESULT_AFTER_CALL_RE = re.compile(
    r"</tool_call>(?:\s|<\|im_end\|>|<\|im_start\|>|<\|endoftext\|>|user|tool)*"
    r"<tool_response>.*?(?:</tool_response>|$)",
    re.DOTALL,
)
_OPEN_CALL_RE = re.compile(r"<tool_call>.*", re.DOTALL)
_SPECIAL_RE = re.compile(r"<\|im_start\|>(?:assistant\n)?|<\|im_end\|>|<\|endoftext\|>")


def final_text(response: str) -> str:
    """What the model wrote after its last tool call in `response`, without chat markers.

    `response` may be the model's final turn alone or a whole episode (calls, the tools'
    `<tool_response>` blocks and chat markers, decoded with or without special tokens). The
    tools' outputs (a `<tool_response>` block right after a `</tool_call>`) are dropped, so
    they never count as the model's answer; a result the model echoes itself, tags included,
    does count. The text before the last call, an unclosed call at the end and the chat markers
    are dropped too.
    """
    text = _RESULT_AFTER_CALL_RE.sub("</tool_call>", response)
    text = text.rsplit("</tool_call>", 1)[-1]
    text = _OPEN_CALL_RE.sub("", text)
    return _SPECIAL_RE.sub("", text).strip()


def compute_score(prompt: str, response: str, ground_truth: str) -> float:
    """1.0 if the final number the model wrote after its last call equals `ground_truth`.

    The number is read by `chat_arithmetic.extract_final_number` from :func:`final_text`: the
    last `Answer: <number>`, else the last number, with markdown, `$`, `\\boxed{}`, thousands
    separators (`281,764`) and zero fractions removed. A response that ends with a call, or
    with the tool's output, scores 0: the model must state the answer. A ground truth that is
    not an integer raises ValueError (a data bug, not a wrong answer:
    ``arithmetic.expected_integer``).
    """
    del prompt  # the answer alone decides
    expected = expected_integer(ground_truth)
    return 1.0 if extract_final_number(final_text(response)) == expected else 0.0


def answer_of(response: str, row: Mapping[str, Any]) -> str | None:
    """The answer ``compute_score`` reads in ``response`` (what maj@k votes on)."""
    del row
    return extract_final_number(final_text(response))
