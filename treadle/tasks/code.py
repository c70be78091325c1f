"""The built-in code task: write a small Python function, graded by its tests in the sandbox.

Problems are generated here, from nothing: each of a score of families (sum the numbers
divisible by k, Caesar-shift by k, the digit sum in base b, FizzBuzz with other words and
divisors, ...) has a reference implementation written once with its parameters, and every
setting of the parameters is one problem (~250 in all, `problems()`). A problem's prompt asks
for the function, with one worked example; its tests are five top-level asserts on random
inputs whose expected values the reference implementation computes; its SFT target is the
reference in a ```python block.

- `prepare(out_dir, seed=0)` writes `train.jsonl` and `test.jsonl` (columns `prompt`, `answer`
  = the tests file, `solution`, `family`); no problem is in both.
- `compute_score(prompt, response, ground_truth)` is the reward `code`: it extracts the program
  (`extract_program`: the last ```python block, else the last bare ``` block, else the whole
  text) and returns the fraction of the tests' asserts it passes in the sandbox
  (`treadle.sandbox.grade`). It is a `sandboxed_reward`: `score_batch` runs
  `reward.num_workers` of them at once, each with `reward.timeout_s`.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.rewards import sandboxed_reward
from treadle.sandbox import grade

N_TESTS = 5  # asserts per problem
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "python3", "py"}
_WORDS = (
    "apple",
    "banana",
    "cherry",
    "delta",
    "echo",
    "fox",
    "grape",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lemon",
    "mango",
    "night",
    "oscar",
    "papa",
    "queen",
    "river",
    "sierra",
    "tango",
    "umbrella",
    "violet",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "a",
    "an",
    "of",
    "to",
    "Level",
    "Noon",
    "racecar",
    "Stats",
    "wow",
    "Anna",
    "civic",
)


@dataclass(frozen=True)
class Problem:
    """One generated problem: the text shown, the reference solution, the tests file."""

    family: str
    prompt: str
    solution: str  # the reference implementation's source
    tests: str  # top-level asserts, one per test input


@dataclass(frozen=True)
class Family:
    """Problems that differ only in their parameters (`variants`)."""

    name: str  # the function's name; its signature is `name(arg)`
    arg: str
    text: str  # what the function returns, formatted with a variant
    source: str  # the reference implementation's body, formatted with a variant
    variants: list[dict[str, Any]]
    inputs: Callable[[random.Random], Any]  # one random argument


def _int_list(rng: random.Random) -> list[int]:
    return [rng.randint(-20, 20) for _ in range(rng.choice((0, 3, 5, 6, 8)))]


def _natural(rng: random.Random) -> int:
    return rng.choice((0, 1, rng.randint(2, 30), rng.randint(31, 500)))


def _text(rng: random.Random) -> str:
    words = (rng.choice(_WORDS) + rng.choice(("", "", "", ",", "!")) for _ in range(7))
    return " ".join(list(words)[: rng.randint(0, 7)])


def _word(rng: random.Random) -> str:
    word = rng.choice(_WORDS)
    return rng.choice((word, word + word[::-1], word.upper(), f"{word}, {word[::-1]}!"))


FAMILIES = [
    Family(
        "sum_divisible",
        "xs",
        "the sum of the numbers in the list `xs` that are {rel} divisible by {k}",
        "return sum(x for x in xs if x % {k} {op} 0)",
        [
            {"k": k, "rel": rel, "op": op}
            for k in range(2, 10)
            for rel, op in (("", "=="), ("not", "!="))
        ],
        _int_list,
    ),
    Family(
        "count_chars",
        "s",
        "how many characters of the string `s` are one of {chars!r}{case_text}",
        "return sum(1 for c in s{lower} if c in {chars!r})",
        [
            {"chars": chars, "lower": lower, "case_text": text}
            for chars in ("aeiou", "xyz", "abc", "nrst", "lmn", "e", "!,", " ", "aei", "ou")
            for lower, text in (("", ""), (".lower()", ", ignoring case"))
        ],
        _text,
    ),
    Family(
        "nth_term",
        "n",
        "the n-th term (counting from n = 0) of the sequence that starts at {a} and {step}",
        "return {formula}",
        [
            {"a": a, "step": f"adds {d} at each step", "formula": f"{a} + {d} * n"}
            for a in (-2, 0, 1, 3, 5)
            for d in (2, 3, 4, 7)
        ]
        + [
            {"a": a, "step": f"multiplies by {r} at each step", "formula": f"{a} * {r} ** n"}
            for a in (1, 2, 3)
            for r in (2, 3)
        ],
        lambda rng: rng.randint(0, 15),
    ),
    Family(
        "rotate",
        "xs",
        "the list `xs` rotated {way} by {k} places (an empty list stays empty)",
        "return xs[{sign}{k} % len(xs):] + xs[:{sign}{k} % len(xs)] if xs else []",
        [
            {"k": k, "way": way, "sign": sign}
            for k in range(1, 8)
            for way, sign in (("left", ""), ("right", "-"))
        ],
        _int_list,
    ),
    Family(
        "clamp_all",
        "xs",
        "the list `xs` with every number below {lo} raised to {lo} and every number above {hi}"
        " lowered to {hi}",
        "return [min(max(x, {lo}), {hi}) for x in xs]",
        [
            {"lo": lo, "hi": hi}
            for lo, hi in ((0, 10), (-5, 5), (1, 100), (10, 20), (-3, 3), (0, 1))
        ],
        _int_list,
    ),
    Family(
        "caesar",
        "s",
        "the string `s` with every letter moved {k} places forward in the alphabet, wrapping from"
        " z to a and keeping its case; other characters stay as they are",
        "return ''.join(chr((ord(c) - b + {k}) % 26 + b) if c.isascii() and c.isalpha() else c"
        " for c in s for b in [ord('a') if c.islower() else ord('A')])",
        [{"k": k} for k in range(1, 26)],
        _text,
    ),
    Family(
        "digit_sum",
        "n",
        "the sum of the digits of the non-negative integer `n` written in base {b}",
        "total = 0\n    while n:\n        n, digit = divmod(n, {b})\n        total += digit\n"
        "    return total",
        [{"b": b} for b in range(2, 17)],
        _natural,
    ),
    Family(
        "fizz",
        "n",
        "'{w1}{w2}' if the positive integer `n` is divisible by both {p} and {q}, '{w1}' if only"
        " by {p}, '{w2}' if only by {q}, and otherwise `n` as a string",
        "return ('{w1}' if n % {p} == 0 else '') + ('{w2}' if n % {q} == 0 else '') or str(n)",
        [
            {"p": p, "q": q, "w1": w1, "w2": w2}
            for p, q in ((3, 5), (2, 7), (4, 6), (3, 4), (5, 7), (2, 3))
            for w1, w2 in (("Fizz", "Buzz"), ("Foo", "Bar"), ("Ping", "Pong"))
        ],
        lambda rng: rng.randint(1, 120),
    ),
    Family(
        "count_words",
        "s",
        "how many of the space-separated words of the string `s` have {rel} {k} characters",
        "return sum(1 for w in s.split() if len(w) {op} {k})",
        [
            {"k": k, "rel": rel, "op": op}
            for k in range(2, 9)
            for rel, op in (("more than", ">"), ("at most", "<="))
            if (k, op) != (8, ">")
        ],
        _text,
    ),
    Family(
        "every_kth",
        "xs",
        "every {k}-th element of the list `xs`, starting with its {end} element and going {way}",
        "return xs[{start}::{sign}{k}]",
        [
            {"k": k, "end": end, "way": way, "start": start, "sign": sign}
            for k in range(2, 7)
            for end, way, start, sign in (
                ("first", "forward", "", ""),
                ("last", "backward", "", "-"),
            )
        ],
        _int_list,
    ),
    Family(
        "running",
        "xs",
        "the list of running {what} of the list `xs` (element i is the {what} of xs[0..i])",
        "out, acc = [], None\n    for x in xs:\n        acc = x if acc is None else {step}\n"
        "        out.append(acc)\n    return out",
        [
            {"what": "sums", "step": "acc + x"},
            {"what": "maxima", "step": "max(acc, x)"},
            {"what": "minima", "step": "min(acc, x)"},
            {"what": "products", "step": "acc * x"},
        ]
        + [{"what": f"sums modulo {m}", "step": f"(acc + x) % {m}"} for m in (5, 7, 10)],
        _int_list,
    ),
    Family(
        "divisible_not",
        "n",
        "True if the integer `n` is divisible by {a} but not by {b}, and False otherwise",
        "return n % {a} == 0 and n % {b} != 0",
        [
            {"a": a, "b": b}
            for a, bs in ((2, (4, 6, 10, 3)), (3, (6, 9, 2, 5)), (5, (10, 25, 3, 2)))
            for b in bs
        ],
        lambda rng: rng.randint(-60, 200),
    ),
    Family(
        "replace_letters",
        "s",
        "the string `s` with every {which} (a letter {rel} 'aeiouAEIOU') replaced by '{c}'",
        "return ''.join('{c}' if c.isascii() and c.isalpha() and {neg}(c in 'aeiouAEIOU')"
        " else c for c in s)",
        [
            {"c": c, "which": which, "rel": rel, "neg": neg}
            for c in "*#_-+@"
            for which, rel, neg in (("vowel", "in", ""), ("consonant", "not in", "not "))
        ],
        _text,
    ),
    Family(
        "count_pairs",
        "xs",
        "the number of index pairs i < j of the list `xs` with xs[i] {rel} xs[j] equal to {t}",
        "return sum(1 for i in range(len(xs)) for j in range(i + 1, len(xs)) if {expr} == {t})",
        [
            {"t": t, "rel": rel, "expr": expr}
            for t in (0, 5, 7, 10, 12, 15, 20)
            for rel, expr in (("+", "xs[i] + xs[j]"), ("-", "xs[i] - xs[j]"))
        ],
        _int_list,
    ),
    Family(
        "to_base",
        "n",
        "the non-negative integer `n` written in base {b} as a string of digits ('0' for 0)",
        "digits = ''\n    while n:\n        n, d = divmod(n, {b})\n"
        "        digits = str(d) + digits\n    return digits or '0'",
        [{"b": b} for b in range(2, 10)],
        _natural,
    ),
    Family(
        "chunk",
        "xs",
        "the {what} of each consecutive chunk of {k} elements of the list `xs` (the last chunk"
        " may be shorter; an empty list gives [])",
        "return [{fn}(xs[i:i + {k}]) for i in range(0, len(xs), {k})]",
        [
            {"k": k, "what": what, "fn": fn}
            for k in range(2, 7)
            for what, fn in (("sum", "sum"), ("largest element", "max"))
        ],
        _int_list,
    ),
    Family(
        "is_palindrome",
        "s",
        "True if the string `s` reads the same backwards {how}, and False otherwise",
        "t = {clean}\n    return t == t[::-1]",
        [
            {"how": "exactly", "clean": "s"},
            {"how": "ignoring case", "clean": "s.lower()"},
            {"how": "ignoring spaces and case", "clean": "s.replace(' ', '').lower()"},
            {
                "how": "looking only at its letters, ignoring case",
                "clean": "''.join(c for c in s.lower() if c.isalpha())",
            },
        ],
        _word,
    ),
    Family(
        "kth_distinct",
        "xs",
        "the {k}-th {way} distinct value of the list `xs`, or None when it has fewer distinct"
        " values",
        "values = sorted(set(xs), reverse={rev})\n    return values[{k} - 1] if len(values) >= {k}"
        " else None",
        [
            {"k": k, "way": way, "rev": rev}
            for k in range(1, 5)
            for way, rev in (("largest", True), ("smallest", False))
        ],
        _int_list,
    ),
    Family(
        "power_sum",
        "n",
        "the sum of i ** {p} for i = 1, 2, ..., n (0 when n is 0)",
        "return sum(i ** {p} for i in range(1, n + 1))",
        [{"p": p} for p in range(1, 6)],
        lambda rng: rng.randint(0, 40),
    ),
]


def _reference(family: Family, variant: dict[str, Any]) -> str:
    body = family.source.format(**variant)
    return f"def {family.name}({family.arg}):\n    {body}\n"


def _call(name: str, argument: Any) -> str:
    return f"{name}({argument!r})"


def _spread_inputs(family: Family, fn: Callable[[Any], Any], rng: random.Random) -> list[Any]:
    """`N_TESTS + 1` distinct inputs whose outputs are as varied as can be: round-robin over
    the distinct outputs of many random inputs (so `return False` does not pass a test of a
    predicate that is mostly false)."""
    by_output: dict[str, list[Any]] = {}
    seen: set[str] = set()
    for _ in range(120):
        value = family.inputs(rng)
        if repr(value) not in seen:
            seen.add(repr(value))
            by_output.setdefault(repr(fn(value)), []).append(value)
    chosen: list[Any] = []
    while len(chosen) < N_TESTS + 1 and any(by_output.values()):
        for group in by_output.values():
            if group and len(chosen) < N_TESTS + 1:
                chosen.append(group.pop(0))
    return chosen


def _problem(family: Family, variant: dict[str, Any], rng: random.Random) -> Problem:
    solution = _reference(family, variant)
    namespace: dict[str, Any] = {}
    exec(solution, namespace)  # our own reference code, not a model's
    fn = namespace[family.name]
    example, *inputs = _spread_inputs(family, fn, rng)
    description = " ".join(family.text.format(**variant).split())
    prompt = (
        f"Write a Python function `{family.name}({family.arg})` that returns {description}. "
        f"For example, `{_call(family.name, example)}` returns `{fn(example)!r}`.\n"
        "Reply with the complete function in a ```python code block."
    )
    tests = "".join(f"assert {_call(family.name, x)} == {fn(x)!r}\n" for x in inputs)
    return Problem(family.name, prompt, solution, tests)


def problems(seed: int = 0) -> list[Problem]:
    """Every problem of every family, in a seeded random order."""
    return list(_problems(seed))


@functools.cache
def _problems(seed: int) -> tuple[Problem, ...]:
    rng = random.Random(f"code:{seed}")
    out = [_problem(f, v, rng) for f in FAMILIES for v in f.variants]
    rng.shuffle(out)
    return tuple(out)


def _rows(items: list[Problem]) -> Iterator[dict[str, str]]:
    for p in items:
        yield {
            "prompt": p.prompt,
            "answer": p.tests,
            "solution": f"```python\n{p.solution}```",
            "family": p.family,
        }


def prepare(out_dir: str | Path, *, seed: int = 0, n_test: int = 50) -> dict[str, Path]:
    """Write `train.jsonl` and `test.jsonl` (`n_test` problems, the rest in train)."""
    items = problems(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.jsonl", "test": out / "test.jsonl"}
    for split, chunk in (("test", items[:n_test]), ("train", items[n_test:])):
        with paths[split].open("w") as f:
            f.writelines(json.dumps(row) + "\n" for row in _rows(chunk))
    return paths


def extract_program(response: str) -> str:
    """The last ```python block of `response`, else its last bare ``` block, else all of it."""
    blocks = _FENCE.findall(response)
    for wanted in (lambda tag: tag.lower() in _PYTHON_TAGS, lambda tag: tag == ""):
        chosen = [code for tag, code in blocks if wanted(tag)]
        if chosen:
            return str(chosen[-1])
    return response


@sandboxed_reward
def compute_score(
    prompt: str, response: str, ground_truth: str, *, timeout_s: float = 10.0
) -> float:
    """The fraction of `ground_truth`'s asserts the response's program passes, sandboxed."""
    return grade(extract_program(response), ground_truth, timeout_s=timeout_s).reward
