"""Arithmetic problems phrased for a chat model: the GRPO task for SmolLM2-135M-Instruct.

The built-in `arithmetic` task trains a tiny model from nothing; this one asks a pretrained
instruction-tuned model (`treadle.models.hub.fetch_model("smollm2-135m-instruct")`) the same kind of
problem in words, so RL starts from some skill and climbs. The default prompt:

    Example:
    Question: What is 23 + 19?
    Solution: 23 + 19 = 42. Answer: 42

    Question: What is 47 + 38?
    Solution:

- Problems come from `treadle.tasks.arithmetic.generate_problems` (distinct, deterministic from
  a seed, subtraction never negative) and are re-phrased by a template of `PHRASINGS`; the
  whole instruction lives in the prompt column (the data loader renders it as one user message
  with the tokenizer's chat template, SmolLM2's default system message included).
- `prepare_chat` writes held-out `train.jsonl`/`test.jsonl` (`prompt`, `answer`); it reuses a
  directory whose manifest records the same arguments.
- `compute_score` is the reward: 1.0 when the final number of the response equals the answer.
  `extract_final_number` reads it the way a chat model writes it: the last `Answer: <number>`,
  else the last number, after removing markdown emphasis (`**85**`), `$`, LaTeX `\\boxed{}`,
  thousands separators (`1,234`) and a zero fraction (`85.0`).

Default difficulty and phrasing were chosen by measuring the starting greedy accuracy of
SmolLM2-135M-Instruct (float32, transformers `generate`, 100 held-out problems, up to 96 new
tokens, the prompt rendered as the data loader does). The aim is a start well above zero and
far below one, so GRPO groups hold both right and wrong answers:

    phrasing      operands  ops  correct  writes "Answer:"  mean reply tokens
    answer_tag    0-99      +-   15%       0%               16
    answer_tag    0-99      +    19%       0%               16
    answer_tag    0-50      +-   20%       0%               13
    answer_tag    0-20      +-   39%       0%               14
    bare          0-99      +-   16%       0%               53 (14% hit the limit)
    only_number   0-99      +-   25%       0%               14
    one_shot      0-99      +-   23%      73%               15
    one_shot_qa   0-99      +-   26%      99%               17
    one_shot_qa   0-50      +-   41%      98%               16
    one_shot_qa   0-20      +-   57%      95%               15

The default is `one_shot_qa` over 0-99 with both operators: 26% correct, the answer line
almost always present (so the reward reads what the model meant, not a stray number), short
replies (cheap rollouts), and 15,050 distinct problems. The model ignores "Think briefly" and
"Answer: <number>" instructions without an example; it copies the example's format instead.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from treadle.tasks.arithmetic import OPS, expected_integer, generate_problems, write_held_out

logger = logging.getLogger(__name__)

# Templates over `{a}`, `{op}`, `{b}`.
PHRASINGS: dict[str, str] = {
    "answer_tag": (
        "What is {a} {op} {b}? Think briefly, then give the final answer as 'Answer: <number>'."
    ),
    "bare": "What is {a} {op} {b}?",
    "only_number": "Compute {a} {op} {b}. Reply with only the number.",
    "one_shot": (
        "Solve the arithmetic problem. End with 'Answer: <number>'.\n\n"
        "Example: What is 23 + 19?\n23 + 19 = 42. Answer: 42\n\n"
        "Now: What is {a} {op} {b}?"
    ),
    "one_shot_qa": (
        "Example:\nQuestion: What is 23 + 19?\nSolution: 23 + 19 = 42. Answer: 42\n\n"
        "Question: What is {a} {op} {b}?\nSolution:"
    ),
}
DEFAULT_PHRASING = "one_shot_qa"
# Bump when the files prepare_chat writes change meaning, so old directories are rebuilt.
PREPARE_FORMAT = 2  # 2: the `solution` column

_PROBLEM_RE = re.compile(r"What is (\d+)([+-])(\d+)\?")
_EMPHASIS_RE = re.compile(r"\*\*|__|[*`$]")
_BOXED_RE = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_ZERO_FRACTION_RE = re.compile(r"(?<=\d)\.0+(?!\d)")
# A number, with its minus sign only when the minus is not an operator between two numbers.
_NUMBER = r"(?<![\d.])-?\d+(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_ANSWER_RE = re.compile(r"Answer\s*:\s*(" + _NUMBER + ")", re.IGNORECASE)


# --- problems --------------------------------------------------------------------------------


def phrase(a: int, op: str, b: int, phrasing: str = DEFAULT_PHRASING) -> str:
    """The chat prompt for `a op b` in the named phrasing."""
    if phrasing not in PHRASINGS:
        raise ValueError(f"unknown phrasing {phrasing!r}: use one of {', '.join(PHRASINGS)}")
    return PHRASINGS[phrasing].format(a=a, op=op, b=b)


def generate_chat_problems(
    n: int,
    seed: int,
    *,
    phrasing: str = DEFAULT_PHRASING,
    min_value: int = 0,
    max_value: int = 99,
    ops: str = OPS,
) -> list[dict[str, str]]:
    """`n` distinct problems as `{"prompt": <chat phrasing>, "answer": "85", "solution": ...}`
    rows (:func:`solution`).

    The same problems, in the same order, as `arithmetic.generate_problems` with these
    arguments; only the wording differs.
    """
    rows = []
    for row in generate_problems(n, seed, min_value=min_value, max_value=max_value, ops=ops):
        match = _PROBLEM_RE.fullmatch(row["prompt"])
        if match is None:  # the generator's format changed
            raise AssertionError(f"unexpected problem text {row['prompt']!r}")
        a, op, b = (int(match[1]), match[2], int(match[3]))
        rows.append(
            {
                "prompt": phrase(a, op, b, phrasing),
                "answer": row["answer"],
                "solution": solution(a, op, b),
            }
        )
    return rows


def solution(a: int, op: str, b: int) -> str:
    """The SFT target of `a op b`: the second number's tens first, then its units, in the
    one-shot example's words, e.g. `97 - 53: 97 - 50 = 47, 47 - 3 = 44. Answer: 44` (one
    step, `97 - 50 = 47. Answer: 47`, when `b` is a multiple of ten or below ten).

    Two small steps a 135M model gets right far more often than the sum in one: SmolLM2-135M-
    Instruct fine-tuned on these reached 72% held-out after 40 SFT steps, on the one-step form
    (`97 - 53 = 44. Answer: 44`) 45% (examples/smollm2/README.md has the sweep).
    """
    apply = (lambda x, y: x + y) if op == "+" else (lambda x, y: x - y)
    tens, units = b - b % 10, b % 10
    if tens == 0 or units == 0:
        return f"{a} {op} {b} = {apply(a, b)}. Answer: {apply(a, b)}"
    half, whole = apply(a, tens), apply(a, b)
    return f"{a} {op} {b}: {a} {op} {tens} = {half}, {half} {op} {units} = {whole}. Answer: {whole}"


def prepare_chat(
    out_dir: str | Path,
    *,
    seed: int = 0,
    n_train: int = 2000,
    n_test: int = 200,
    phrasing: str = DEFAULT_PHRASING,
    min_value: int = 0,
    max_value: int = 99,
    ops: str = OPS,
) -> dict[str, Path]:
    """Write held-out `train.jsonl` and `test.jsonl` (`prompt`, `answer`, `solution`: the
    SFT target) with :func:`write_phrased`."""
    return write_phrased(
        out_dir,
        "chat_arithmetic",
        PREPARE_FORMAT,
        generate_chat_problems,
        PHRASINGS,
        dict(seed=seed, n_train=n_train, n_test=n_test, phrasing=phrasing),
        dict(min_value=min_value, max_value=max_value, ops=ops),
    )


def write_phrased(
    out_dir: str | Path,
    task: str,
    version: int,
    generate: Callable[..., list[dict[str, str]]],
    phrasings: Mapping[str, str],
    split: dict[str, Any],
    ranges: dict[str, Any],
) -> dict[str, Path]:
    """Write held-out `train.jsonl` and `test.jsonl` (`prompt`, `answer`) of ``task`` under
    `out_dir`: ``split`` holds seed, n_train, n_test and phrasing, ``ranges`` the rest of what
    ``generate(n, seed, phrasing=..., **ranges)`` takes.

    Returns `{"train": ..., "test": ...}`. Test rows come first from one stream of distinct
    problems, so the test set does not change with `n_train` and no test problem is in train.
    When `out_dir/prepare.json` records the same arguments and both files exist, nothing is
    rewritten; the manifest is written last, so an interrupted run is redone.
    """
    seed, n_train, n_test, phrasing = (split[k] for k in ("seed", "n_train", "n_test", "phrasing"))
    manifest = {
        "task": task,
        "format": version,
        **split,
        "template": phrasings.get(phrasing),
        **ranges,
    }
    return write_held_out(
        out_dir,
        manifest,
        lambda: generate(n_test + n_train, seed, phrasing=phrasing, **ranges),
        n_test,
    )


# --- verifier --------------------------------------------------------------------------------


def extract_final_number(text: str) -> str | None:
    """The number after the last `Answer:`, else the last number in `text`, else None.

    Markdown emphasis, `$`, `\\boxed{...}`, thousands separators and zero fractions are removed
    first, so `**Answer:** $1,234.00$` reads as `1234`. An integer is returned normalised
    (`"085"` -> `"85"`, `"-0"` -> `"0"`); a number with a non-zero fraction is returned as
    written (`"7.5"`), so it equals no integer answer.
    """
    text = _BOXED_RE.sub(r"\1", text)
    text = _EMPHASIS_RE.sub("", text)
    text = _THOUSANDS_RE.sub("", text)
    text = _ZERO_FRACTION_RE.sub("", text)
    matches = _ANSWER_RE.findall(text) or _NUMBER_RE.findall(text)
    if not matches:
        return None
    number = matches[-1]
    if "." in number:
        return number
    # Normalised as a string: int() refuses more than 4300 digits, which a policy can emit.
    digits = number.lstrip("-").lstrip("0") or "0"
    return "-" + digits if number.startswith("-") and digits != "0" else digits


def compute_score(prompt: str, response: str, ground_truth: str) -> float:
    """1.0 if the response's final number equals `ground_truth`, else 0.0.

    A ground truth that is not an integer raises ValueError (``arithmetic.expected_integer``).
    """
    del prompt  # the answer alone decides
    return 1.0 if extract_final_number(response) == expected_integer(ground_truth) else 0.0


def answer_of(response: str, row: Mapping[str, Any]) -> str | None:
    """The answer ``compute_score`` reads in ``response`` (what maj@k votes on)."""
    del row
    return extract_final_number(response)
