"""``reward.judge``: an LLM judge, a causal LM served beside the actors whose answer about each
sample is read as a reward (:mod:`treadle.rollout.judge`)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from treadle.config.base import Key
from treadle.config.frozen import FrozenModelConfig
from treadle.runtime.errors import ConfigError

Verdict = Literal["number", "choice", "prob"]

DEFAULT_TEMPLATE = (
    "Question: {prompt}\n\nResponse: {response}\n\nIs the response correct? Answer yes or no."
)

# the settings each verdict reads (the others' are errors when set away from their defaults)
VERDICT_KNOBS: dict[str, tuple[Verdict, ...]] = {
    "scale": ("number",),
    "choices": ("choice",),
    "token": ("prob",),
    "against": ("prob",),
    "max_new_tokens": ("number", "choice"),
    "temperature": ("number", "choice"),
}


class JudgeConfig(FrozenModelConfig):
    """An LLM judge (verl's generative reward model, TRL's judges): any Hugging Face causal-LM
    folder, served by replicas as the distillation teacher is, reads each sample through
    ``template`` and answers; its verdict, read from the answer, is a score weighed with the
    reward function's."""

    role: ClassVar[str] = "judge"
    key: ClassVar[str] = "reward.judge"

    model_path: str | None = Field(
        None,
        description="The judge's model folder (any causal LM, its own tokenizer); null: no judge.",
    )
    template: str = Field(
        DEFAULT_TEMPLATE,
        min_length=1,
        description="The judge's prompt, a Python format string over {prompt} (the prompt as "
        "written in the data), {response}, {ground_truth} and any column of the data rows "
        "({answer}, ...); {{ and }} are braces.",
    )
    chat_template: bool = Field(
        True,
        description="Give the filled template as the user message of the judge's chat template "
        "(false: the text as it is).",
    )
    verdict: Verdict = Field(
        "choice",
        description="How the answer is read: 'number', its first number, within scale, mapped "
        "to 0..1; 'choice', the first of choices' labels it says (a word, case ignored), "
        "scored as choices says; 'prob', the probability the judge gives token as its answer "
        "(from its log-probs, no generation), over token's and against's when against is set.",
    )
    scale: tuple[float, float] = Field(
        (0.0, 10.0), description="number: the lowest and highest number (scored 0 and 1)."
    )
    choices: dict[Key, float] = Field(
        default_factory=lambda: {"yes": 1.0, "no": 0.0},
        description="choice: each label and its score.",
    )
    token: Key = Field(
        "Yes",
        description="prob: the answer whose probability is the score (one token or more); like "
        "template it may name fields: '{answer}' scores the reference's probability after the "
        "response.",
    )
    against: str | None = Field(
        None,
        min_length=1,
        description="prob: the opposite answer (fields as in template); the score is then "
        "p(token) / (p(token) + p(against)).",
    )
    unparsed: float | None = Field(
        None,
        description="The score of an answer without a verdict (or a judge prompt over "
        "max_length); null: such an answer stops the run with a RewardError naming the sample.",
    )
    weight: float = Field(1.0, description="Weight of the judge's score in the reward.")
    max_new_tokens: int = Field(
        16, gt=0, description="number, choice: tokens the judge may answer with."
    )
    temperature: float = Field(
        0.0, ge=0, description="number, choice: the judge's sampling temperature (0: greedy)."
    )
    max_length: int | None = Field(
        None,
        gt=0,
        description="Tokens of a judge prompt plus its answer, at most (null: the judge's "
        "max_position_embeddings less one).",
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Seconds the judge may take over one batch's verdicts before the run stops "
        "with a RewardError.",
    )

    @field_validator("token", "against", "choices", mode="before")
    @classmethod
    def _quoted(cls, value: Any) -> Any:
        labels = value if isinstance(value, dict) else [value]
        if any(isinstance(label, bool) for label in labels):
            raise ValueError(
                "an unquoted yes/no (true/false, on/off) is a boolean in YAML: quote the "
                'answer, e.g. "Yes"'
            )
        return value

    @model_validator(mode="after")
    def _verdict_settings(self) -> JudgeConfig:
        low, high = self.scale
        if low >= high:
            raise ValueError(f"reward.judge.scale={list(self.scale)}: give [lowest, highest]")
        if not self.choices:
            raise ValueError("reward.judge.choices is empty: give each label its score")
        fields = type(self).model_fields
        for key, kinds in VERDICT_KNOBS.items():
            default = fields[key].get_default(call_default_factory=True)
            if self.verdict not in kinds and getattr(self, key) != default:
                raise ValueError(
                    f"reward.judge.{key} is read by reward.judge.verdict={' or '.join(kinds)}, "
                    f"not by verdict={self.verdict}: remove it, or change the verdict"
                )
        return self

    def length(self, context: int | None) -> int:
        """Tokens of a judge prompt plus its answer, at most: ``max_length``, or ``context``
        (the judge's ``max_position_embeddings``) less one, since a scored sequence is followed
        by one sampled token."""
        if self.max_length is not None:
            return self.max_length
        if not isinstance(context, int) or context < 2:
            raise ConfigError(
                f"reward.judge.model_path: '{self.model_path}' gives no max_position_embeddings: "
                "set reward.judge.max_length"
            )
        return context - 1
