"""reasoning-gym, unchanged: its procedural datasets as prompt rows, its scorers as the reward.

``data.source=reasoning_gym`` draws rows with reasoning-gym's own composite dataset
(``create_dataset("composite", size=, seed=, datasets=[DatasetSpec(name, weight, config)])``):
the training rows with ``data.reasoning_gym.seed``, the held-out rows with ``val_seed``. Each
row is reasoning-gym's entry as it made it (``question``, ``answer``, ``metadata``) plus two
columns of ours: ``answer_format`` (how the model is asked to answer, so the reward reads the
answer the same way) and ``solution`` (the SFT target: the answer written in that format,
after the working that ``reasoning``, a function of the user's, writes when set);
with ``shots`` a third, ``prompt``: the worked examples as chat turns, then the question. The
rows then go through the same prompt pipeline as a file's rows (``question``, or ``prompt``, is
the prompt, ``answer`` the ground truth, the whole row kept in ``row``), so nothing downstream
changes.

``reward.function=reasoning_gym`` (``compute_score``, a batched reward: it reads the rows'
columns) extracts each response's answer as the row's ``answer_format`` says and scores it with
the dataset's own ``score_answer(answer, entry)`` (``reasoning_gym.get_score_answer_fn`` of
``metadata.source_dataset``): partial credit where the dataset gives it; an answer that cannot
be extracted is scored as reasoning-gym scores ``None``.

Answer formats (``data.reasoning_gym.answer_format``):

- ``answer_tag``: the text inside the last ``<answer>...</answer>``
  (``reasoning_gym.utils.extract_answer``); none: no answer;
- ``last_line``: the last non-empty line, stripped;
- ``full``: the whole response, stripped.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, Literal

from treadle.data.options import TextOptions
from treadle.data.readers import Record
from treadle.runtime.errors import ConfigError

if TYPE_CHECKING:
    from treadle.config.data import AnswerFormat, ReasoningGymConfig

KEY = "data.reasoning_gym"
Split = Literal["train", "val"]

# The instruction each format gives the model (the system prompt unless data.system_prompt).
INSTRUCTIONS: dict[str, str] = {
    "answer_tag": "Answer the question directly. Provide your answer between <answer> and "
    "</answer> tags. Do not return any preamble, explanation, or reasoning.",
    "last_line": "Answer the question. Give the final answer alone on the last line.",
    "full": "Answer the question with the answer only: no preamble, explanation, or reasoning.",
}


def gym_records(spec: ReasoningGymConfig, split: Split, key: str = KEY) -> list[Record]:
    """The rows of ``split`` (train: ``size`` rows from ``seed``; val: ``val_size`` rows from
    ``val_seed``) as records; a ConfigError naming the key (``key``: where ``spec`` is) of a
    bad dataset name or config."""
    size, seed = (spec.size, spec.seed) if split == "train" else (spec.val_size, spec.val_seed)
    dataset = _composite(spec, size, seed, key)
    target = _target_writer(spec, key)
    shown = _shots(spec, key, target)
    records = []
    for i in range(size):
        entry = dataset[i]
        row = {
            "question": entry["question"],
            "answer": entry["answer"],
            "metadata": entry["metadata"],
            "answer_format": spec.answer_format,
            "solution": target(entry, f"{key} ({split}) row {i + 1}"),
        }
        if shown:
            row["prompt"] = [*shown, {"role": "user", "content": entry["question"]}]
        records.append(Record(f"{key} ({split}) row {i + 1}", f"reasoning_gym-{split}:{i}", row))
    return records


Target = Callable[[Mapping[str, Any], str], str]


def _target_writer(spec: ReasoningGymConfig, key: str) -> Target:
    """What writes an entry's SFT target: the answer in ``answer_format``, after the working
    ``spec.reasoning`` writes when set. Its second argument names the row in errors."""
    from treadle.runtime.plugins import load_callable

    where_key = f"{key}.reasoning"
    working = load_callable(spec.reasoning, where_key) if spec.reasoning else None

    def target(entry: Mapping[str, Any], where: str) -> str:
        answer = format_answer(str(entry["answer"]), spec.answer_format)
        if working is None:
            return answer
        try:
            text = working(dict(entry))
        except Exception as e:  # the user's function: name it and the row
            raise ConfigError(
                f"{where_key}: {spec.reasoning} raised {type(e).__name__} for {where}: {e}"
            ) from e
        if not isinstance(text, str):
            raise ConfigError(
                f"{where_key}: {spec.reasoning} returned {type(text).__name__} for {where}; "
                "it must return the working as text (str)"
            )
        return f"{text.rstrip()}\n{answer}" if text.strip() else answer

    return target


def _shots(spec: ReasoningGymConfig, key: str, target: Target) -> list[dict[str, str]]:
    """The ``shots`` worked examples as chat turns: the first rows of ``seed`` (reasoning-gym
    draws entry i from its own seeds, so they are the training rows' first ones), each
    answered as an SFT target is written."""
    if not spec.shots:
        return []
    examples = _composite(spec, spec.shots, spec.seed, key)
    turns = []
    for i in range(spec.shots):
        turns += [
            {"role": "user", "content": examples[i]["question"]},
            {"role": "assistant", "content": target(examples[i], f"{key} shot {i + 1}")},
        ]
    return turns


def _composite(spec: ReasoningGymConfig, size: int, seed: int, key: str) -> Any:
    from reasoning_gym.composite import DatasetSpec
    from reasoning_gym.factory import DATASETS, create_dataset

    specs = []
    for i, d in enumerate(spec.datasets):
        where = f"{key}.datasets[{i}]"
        if d.name not in DATASETS or d.name == "composite":
            names = sorted(n for n in DATASETS if n != "composite")
            close = difflib.get_close_matches(d.name, names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(
                f"{where}.name: reasoning-gym has no dataset '{d.name}'{hint}; it has "
                f"{len(names)}, e.g. {', '.join(names[:6])}, ..."
            )
        _check_config(where, d.name, d.config, DATASETS[d.name][1])
        specs.append(DatasetSpec(name=d.name, weight=d.weight, config=dict(d.config)))
    try:
        return create_dataset("composite", size=size, seed=seed, datasets=specs)
    except (AssertionError, ValueError, TypeError) as e:  # a config its validate() refuses
        raise ConfigError(f"{key}.datasets: reasoning-gym refuses the config: {e}") from None


def _check_config(key: str, name: str, config: dict[str, Any], config_cls: type) -> None:
    """The dataset's config builds and validates (reasoning-gym asserts in ``validate``)."""
    taken = {f.name for f in fields(config_cls)} - {"seed", "size"}
    for field in config:
        if field in ("seed", "size"):
            raise ConfigError(
                f"{key}.config.{field}: set data.reasoning_gym.{field} (and val_{field}) "
                "instead, so the held-out rows get their own"
            )
        if field not in taken:
            close = difflib.get_close_matches(field, sorted(taken), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(
                f"{key}.config.{field}: {name} has no setting '{field}'{hint}; its settings: "
                f"{', '.join(sorted(taken))}"
            )
    try:
        made = config_cls(**config)
        if hasattr(made, "validate"):
            made.validate()
    except (AssertionError, ValueError, TypeError) as e:
        raise ConfigError(f"{key}.config: invalid for {name}: {e or type(e).__name__}") from None


def instruction(answer_format: AnswerFormat) -> str:
    """The system prompt that asks for ``answer_format``."""
    return INSTRUCTIONS[answer_format]


def format_answer(answer: str, answer_format: AnswerFormat | str) -> str:
    """``answer`` written as a response in ``answer_format`` (an SFT target)."""
    return f"<answer>{answer}</answer>" if answer_format == "answer_tag" else answer


def extract_answer(response: str, answer_format: AnswerFormat | str) -> str | None:
    """The answer in ``response`` as ``answer_format`` reads it; None when there is none."""
    if answer_format == "answer_tag":
        from reasoning_gym.utils import extract_answer as tagged

        answer: str | None = tagged(response)
        return answer
    if answer_format == "last_line":
        lines = [line.strip() for line in response.splitlines() if line.strip()]
        return lines[-1] if lines else None
    if answer_format == "full":
        return response.strip()
    raise ValueError(f"unknown answer format {answer_format!r}: answer_tag, last_line or full")


def answer_of(response: str, row: Mapping[str, Any]) -> str | None:
    """The answer ``compute_score`` reads in ``response``, as the row's ``answer_format``
    says (what maj@k votes on)."""
    return extract_answer(response, row.get("answer_format") or "answer_tag")


@functools.cache
def _scorer(name: str) -> Callable[[str | None, dict[str, Any]], float]:
    from reasoning_gym import get_score_answer_fn

    fn: Callable[[str | None, dict[str, Any]], float] = get_score_answer_fn(name)
    return fn


def compute_score(
    completions: Sequence[str],
    question: Sequence[str],
    answer: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    answer_format: Sequence[str | None] | None = None,
) -> list[float]:
    """Each completion scored by its dataset's own ``score_answer(extracted, entry)``."""
    formats = answer_format or [None] * len(completions)
    scores = []
    for response, q, a, meta, how in zip(
        completions, question, answer, metadata, formats, strict=True
    ):
        if not isinstance(meta, dict) or "source_dataset" not in meta:
            raise ValueError(
                "reward.function=reasoning_gym reads reasoning-gym rows (question, answer, "
                "metadata with source_dataset): use data.source=reasoning_gym"
            )
        entry = {"question": q, "answer": a, "metadata": meta}
        extracted = extract_answer(response, how or "answer_tag")
        scores.append(float(_scorer(meta["source_dataset"])(extracted, entry)))
    return scores


def gym_rows(
    spec: ReasoningGymConfig, split: Split, options: TextOptions, key: str
) -> tuple[list[Record], TextOptions]:
    """reasoning-gym's rows of ``split`` as ``spec`` (the config key ``key``) draws them: the
    prompt is the ``question``, the ground truth the ``answer``, the SFT target the
    ``solution``, and the answer format's instruction the system prompt unless
    ``data.system_prompt`` is set. With ``shots`` the prompt is the chat ``prompt``: the worked
    examples, then the question."""
    system = options.system_prompt
    gym = replace(
        options,
        prompt_key="prompt" if spec.shots else "question",
        answer_key="answer",
        response_key="solution",
        system_prompt=instruction(spec.answer_format) if system is None else system,
        config_key=f"{key} ({split})",
    )
    return gym_records(spec, split, key), gym
