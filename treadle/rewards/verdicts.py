"""An LLM judge's prompt and verdict, as text: the prompt filled from a sample, the answer read
as a score. Pure functions; the judge's replicas and what they are asked are
:mod:`treadle.rollout.judge`'s, which hands the scores to the :class:`~treadle.rewards.Scorer`.

- **The prompt** is ``reward.judge.template``, a Python format string whose fields are plain
  names: ``{prompt}`` (the prompt as written in the data), ``{response}``, ``{ground_truth}``
  and any column of the sample's data row (``{answer}``, ``{level}``); treadle's three names win
  over a column of the same name. A value that is not text is written as JSON (as Python
  writes it when JSON cannot). Attribute and index fields (``{row.x}``, ``{x[0]}``) are refused:
  a template names columns, nothing else.
- **A verdict** (:class:`Verdict`) is read from the judge's answer: ``number``, the answer's
  first number, which must lie within ``scale``, mapped linearly to 0..1 (0 at the lowest, 1 at
  the highest); ``choice``, the earliest of the ``choices`` labels the answer says as a word
  (case ignored; at one place the longest label), scored as ``choices`` says. An answer without
  one is a :class:`NoVerdict` with what it said. ``prob`` generates nothing: the score is the
  probability the judge gives ``token`` as its whole answer, ``exp`` of the summed log-probs of
  its tokens, or with ``against`` the share of the two, ``p / (p + q)`` (:func:`prob_score`).
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from treadle.config.judge import JudgeConfig
from treadle.rewards.results import shorten
from treadle.runtime.errors import ConfigError

NAMES = ("prompt", "response", "ground_truth")  # a template's own fields, beside the columns
NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def template_fields(template: str) -> list[str]:
    """The names ``template``'s fields use, in order (repeats kept); ValueError for a template
    ``str.format`` cannot read or a field that is not a plain name."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{e} (write {{{{ and }}}} for braces)") from None
    names = []
    for _, name, spec, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier() or (spec and "{" in spec):
            raise ValueError(
                f"the field {{{name}}} is not a column name: a template's fields are plain "
                "names ({prompt}, {response}, {ground_truth} or a column of the rows)"
            )
        names.append(name)
    return names


def check_prompting(judge: JudgeConfig, tokenizer: Any) -> list[str]:
    """The fields ``judge``'s template, ``token`` and ``against`` name (beside
    :data:`NAMES`), after checking they read as templates and that ``tokenizer`` (the judge's)
    has a chat template when one is used; a ConfigError naming the key."""
    if judge.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"reward.judge.model_path: '{judge.model_path}' has no chat template: set "
            "reward.judge.chat_template=false to give it the filled template as it is"
        )
    fields: list[str] = []
    for key in ("template", "token", "against"):
        try:
            fields += template_fields(getattr(judge, key) or "")
        except ValueError as e:
            raise ConfigError(f"reward.judge.{key}: {e}") from None
    return [name for name in dict.fromkeys(fields) if name not in NAMES]


def fill(
    template: str, prompt: str, response: str, ground_truth: Any, row: Mapping[str, Any]
) -> tuple[str, list[str]]:
    """The judge's prompt for one sample, and the values put in it in the order they appear
    (the text a tokenizer must not read special tokens in); KeyError names a missing column."""
    values = {key: _text(value) for key, value in row.items()}
    values.update(prompt=prompt, response=response, ground_truth=_text(ground_truth))
    names = template_fields(template)
    missing = [name for name in names if name not in values]
    if missing:
        raise KeyError(missing[0])
    return template.format_map(values), [values[name] for name in names]


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


@dataclass(frozen=True)
class NoVerdict:
    """An answer (or a sample) without a verdict: what is wrong, in words."""

    problem: str


@dataclass(frozen=True)
class Verdict:
    """How an answer is read (``reward.judge.verdict`` and its settings)."""

    kind: Literal["number", "choice", "prob"]
    scale: tuple[float, float] = (0.0, 10.0)
    choices: Mapping[str, float] = field(default_factory=lambda: {"yes": 1.0, "no": 0.0})

    def read(self, answer: str) -> float | NoVerdict:
        """The score ``answer`` gives, or what is wrong with it."""
        if self.kind == "number":
            return self._number(answer)
        if self.kind == "choice":
            return self._choice(answer)
        raise ValueError("a prob verdict is read from log-probs (prob_score), not an answer")

    def _number(self, answer: str) -> float | NoVerdict:
        low, high = self.scale
        found = NUMBER.search(answer)
        if found is None:
            return NoVerdict(f"answered {shorten(answer)}: no number in [{low:g}, {high:g}]")
        value = float(found.group())
        if not low <= value <= high:
            return NoVerdict(
                f"answered {shorten(answer)}: {value:g} is outside [{low:g}, {high:g}]"
            )
        return (value - low) / (high - low)

    def _choice(self, answer: str) -> float | NoVerdict:
        best: tuple[int, int, str] | None = None  # (position, -length, label)
        for label in self.choices:
            pattern = rf"(?<!\w){re.escape(label)}(?!\w)"
            found = re.search(pattern, answer, flags=re.IGNORECASE)
            if found is not None and (best is None or (found.start(), -len(label)) < best[:2]):
                best = (found.start(), -len(label), label)
        if best is None:
            labels = ", ".join(repr(label) for label in self.choices)
            return NoVerdict(f"answered {shorten(answer)}: none of {labels}")
        return float(self.choices[best[2]])


def prob_score(token_log_prob: float, against_log_prob: float | None = None) -> float:
    """``p(token)`` from its summed log-prob, or with ``against`` ``p / (p + q)`` (a sigmoid of
    the difference: finite however small both are)."""
    if against_log_prob is None:
        return math.exp(token_log_prob)
    gap = token_log_prob - against_log_prob
    return 1.0 / (1.0 + math.exp(-gap)) if gap >= 0 else math.exp(gap) / (1.0 + math.exp(gap))
