"""``reward``: the reward function, model, service (``url``) or LLM judge (``judge``) and its
shaping."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from treadle.config.base import Key, Section, defaults
from treadle.config.judge import JudgeConfig


class RewardConfig(Section):
    function: Key = Field(
        "arithmetic",
        description="Built-in reward name or a user function as 'path/to/file.py:function' "
        "('python:...' names a function given to treadle.train(reward=...)). "
        "With reward.model_path set it no longer trains: it is logged as reward/rule_mean and "
        "still scores held-out evaluation.",
    )
    overlong_buffer_len: int = Field(
        0,
        ge=0,
        description="DAPO over-long shaping: a response longer than rollout.max_new_tokens minus "
        "this many tokens loses up to overlong_penalty, linearly; 0 disables.",
    )
    overlong_penalty: float = Field(
        1.0, ge=0, description="DAPO over-long shaping: the penalty at rollout.max_new_tokens."
    )
    model_path: str | None = Field(
        None,
        description="Reward model (a value-model folder, e.g. from `treadle rm`): its score at "
        "the last token of prompt+response replaces reward.function's as the RL reward.",
    )
    micro_batch_size: int = Field(16, gt=0, description="Reward model: sequences per forward.")
    num_workers: int = Field(
        2,
        ge=0,
        description="Worker processes that call the reward function, each call under "
        "reward.timeout_s; 0: call it in the trainer's process, without a time limit. Code "
        "rewards: sandboxed programs run at once.",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="Wall-clock seconds one reward call (a code reward: one graded program) may "
        "take.",
    )
    function_weight: float | None = Field(
        None,
        description="Weight of reward.function's score in the reward; null: 1 without "
        "reward.url and reward.judge, 0 with either (the function is then not called in "
        "training: set a weight to add both, e.g. a format rule beside a service's score).",
    )
    url: str | None = Field(
        None,
        description="A reward service: the samples are POSTed as "
        '{"samples": [{"prompt", "response", "ground_truth", "row"}, ...]} and it answers '
        '{"rewards": [...]}, one number (or dict of numbers) per sample '
        "(docs/data-and-rewards.md#a-reward-service). `treadle check` sends it an empty batch.",
    )
    url_weight: float = Field(
        1.0, description="Weight of the reward service's score in the reward."
    )
    url_batch_size: int = Field(32, gt=0, description="Reward service: samples per request.")
    url_concurrency: int = Field(
        4, gt=0, description="Reward service: requests in flight at once, at most."
    )
    url_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Reward service: seconds one request may take before it is tried again.",
    )
    url_retries: int = Field(
        3,
        ge=0,
        description="Reward service: tries after the first of a request that timed out, could "
        "not connect or was answered 429/5xx; then the run stops with one line.",
    )
    url_backoff_s: float = Field(
        1.0,
        ge=0,
        description="Reward service: seconds before the first retry, doubled for each next one.",
    )
    url_auth_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Reward service: the name of an environment variable whose value is sent as "
        "`Authorization: Bearer <value>` (the token itself never goes in the YAML).",
    )

    judge: JudgeConfig = Field(
        default_factory=defaults(JudgeConfig),
        description="An LLM judge (model_path set): its verdict on each training sample, "
        "weighed with the others (docs/data-and-rewards.md#an-llm-judge). Held-out "
        "evaluation is scored without it.",
    )

    @field_validator("url")
    @classmethod
    def _an_http_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http:// or https:// URL")
        return url

    @model_validator(mode="after")
    def _something_scores(self) -> RewardConfig:
        if self.url is not None and "@" in urlsplit(self.url).netloc:  # (not echoed: a secret)
            raise ValueError(
                "reward.url carries credentials (user:password@): give the token through "
                "reward.url_auth_env instead, the name of an environment variable holding it"
            )
        judged = self.judge.model_path is not None and self.judge.weight != 0
        if self.rule_weight == 0 and (self.url is None or self.url_weight == 0) and not judged:
            raise ValueError(
                "reward.function_weight is 0 and no reward.url or reward.judge scores instead: "
                "nothing would score the samples (give one, or a nonzero weight)"
            )
        if self.judge.model_path is not None and self.model_path is not None:
            raise ValueError(
                "reward.model_path's scores replace every other reward, reward.judge's too: "
                "set one of reward.model_path and reward.judge.model_path"
            )
        return self

    @property
    def rule_weight(self) -> float:
        """reward.function's weight: function_weight, or 1 alone and 0 beside a service or a
        judge."""
        if self.function_weight is not None:
            return self.function_weight
        return 0.0 if self.url is not None or self.judge.model_path is not None else 1.0

    @property
    def eval_rule_weight(self) -> float:
        """reward.function's weight in held-out evaluation, which the judge does not score:
        as without reward.judge, and 1 where that would leave nothing scoring."""
        served = self.url is not None and self.url_weight != 0
        if self.function_weight is not None:
            return self.function_weight if self.function_weight or served else 1.0
        return 0.0 if self.url is not None else 1.0
