"""``reward``: the reward function or model and its shaping."""

from __future__ import annotations

from pydantic import Field

from treadle.config.base import Key, Section


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
